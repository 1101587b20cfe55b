//! Vision encoding on a Rockchip NPU through rknn-rs (the `rknn` cargo feature).
//!
//! The `.rknn` model takes one uint8 NHWC picture of a fixed size and returns the projected
//! embeddings, `[1, rows, width]` floats, `width` being the language model's input width. They
//! are decoded as plain rows on 1-D positions (LLaVA-style projectors), so no libmtmd projector
//! is needed. A model that needs other positions or attention for an image (M-RoPE: Qwen2-VL;
//! non-causal: Gemma 3) is refused when paired with the NPU ([`crate::encoder::open_encoder`])
//! and when such rows reach it ([`crate::llama::Model::plain_embeddings_refusal`]). On machines without an NPU the tests link `rknn-standin/librknnrt.c` instead of
//! the vendor's runtime: NPU execution itself is unverified on hardware.

use std::path::Path;

use parking_lot::Mutex;
use rknn_rs::prelude::{Rknn, RknnTensorFormat, RknnTensorType};

use super::{Rgb, VisionEncoder};
use crate::error::{Error, Result};
use crate::llama::{ImageEmbeddings, Segment, check_readable};

pub struct RknnEncoder {
    rknn: Mutex<Rknn>,
    id: String,
    input: (u32, u32),
    rows: usize,
    width: usize,
}

impl RknnEncoder {
    /// Load `model` on the NPU; its output must be `width` wide (the language model's input).
    pub fn new(model: &Path, width: usize) -> Result<RknnEncoder> {
        check_readable(model, "rknn model")?;
        let bad = |reason: String| Error::File { path: model.to_path_buf(), reason };
        let rknn = Rknn::new(model).map_err(|e| bad(format!("the NPU runtime could not load it: {e:?}")))?;
        let info = rknn.model_info().map_err(|e| bad(format!("cannot query it: {e:?}")))?;
        let (input, output) = match (info.input_attrs.first(), info.output_attrs.first()) {
            (Some(i), Some(o)) => (i, o),
            _ => return Err(bad("it has no input or no output".into())),
        };
        let (in_dims, out_dims) = (&input.dims[..input.n_dims as usize], &output.dims[..output.n_dims as usize]);
        let [1, h, w, 3] = in_dims else {
            return Err(bad(format!("input {in_dims:?} is not one NHWC RGB picture")));
        };
        let (rows, out_width) = match out_dims {
            [1, rows, w] | [rows, w] => (*rows as usize, *w as usize),
            _ => return Err(bad(format!("output {out_dims:?} is not [1, rows, width]"))),
        };
        if out_width != width {
            return Err(bad(format!("it makes embeddings {out_width} wide but the language model takes {width}")));
        }
        let id = format!("rknn:{}:{w}x{h}", model.display());
        Ok(RknnEncoder { rknn: Mutex::new(rknn), id, input: (*w, *h), rows, width })
    }
}

impl VisionEncoder for RknnEncoder {
    fn id(&self) -> &str {
        &self.id
    }

    fn encode_rgb(&self, rgb: &Rgb) -> Result<Vec<Segment>> {
        let picture = rgb.resize(self.input.0, self.input.1);
        let rknn = self.rknn.lock();
        let npu = |e: rknn_rs::prelude::Error| Error::Engine(format!("NPU: {e:?}"));
        rknn.input_set_slice(0, &picture.data, false, RknnTensorType::Uint8, RknnTensorFormat::NHWC).map_err(npu)?;
        rknn.run().map_err(npu)?;
        let output = rknn.outputs_get::<f32>().map_err(npu)?;
        let data: Box<[f32]> = output.iter().copied().collect();
        Ok(vec![Segment::Image(ImageEmbeddings::plain(data, self.rows, self.width)?)])
    }
}
