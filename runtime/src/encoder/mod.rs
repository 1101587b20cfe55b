//! Vision encoding: a frame's pixels become the projected embeddings the language model takes.
//!
//! Preprocessing turns any supported raw picture (packed RGB-family, NV12, I420; any stride)
//! into packed RGB; the encoder backend (behind [`VisionEncoder`]; this build has libmtmd's)
//! resizes and normalises as the projector declares. A [`FrameEncoder`] adds the embedding
//! cache: the key is the encoder's identity plus the preprocessed pixels, so a repeated frame
//! costs a hash, not an encode.

use std::sync::Arc;
use std::time::Duration;

use xxhash_rust::xxh3::Xxh3;

use crate::cache::{BoundedCache, CacheStats, Weighted};
use crate::error::{Error, Result};
use crate::llama::{Projector, Segment, Tile, TileCount, Turn};
use crate::stream::Frame;
use parking_lot::Mutex;

/// The change gate: whether a frame changed enough since the last encoded one to encode it.
pub mod gate;
pub use crate::threads::CpuEncode;
/// The Rockchip NPU backend (the `rknn` cargo feature).
#[cfg(feature = "rknn")]
pub mod rknn;

/// Byte order of a packed 8-bit RGB-family pixel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PixelLayout {
    Rgb,
    Bgr,
    /// 4 bytes: R, G, B, then alpha or padding.
    Rgbx,
    /// 4 bytes: B, G, R, then alpha or padding.
    Bgrx,
    /// 4 bytes: alpha or padding, then R, G, B.
    Xrgb,
    /// 4 bytes: alpha or padding, then B, G, R.
    Xbgr,
}

impl PixelLayout {
    pub fn bytes_per_pixel(self) -> usize {
        match self {
            PixelLayout::Rgb | PixelLayout::Bgr => 3,
            _ => 4,
        }
    }

    /// Offsets of R, G and B inside a pixel.
    fn rgb_offsets(self) -> [usize; 3] {
        match self {
            PixelLayout::Rgb | PixelLayout::Rgbx => [0, 1, 2],
            PixelLayout::Bgr | PixelLayout::Bgrx => [2, 1, 0],
            PixelLayout::Xrgb => [1, 2, 3],
            PixelLayout::Xbgr => [3, 2, 1],
        }
    }
}

/// YUV to RGB conversion: matrix and range, as the video's colorimetry says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum YuvMatrix {
    Bt601Limited,
    Bt601Full,
    Bt709Limited,
    Bt709Full,
}

impl YuvMatrix {
    /// (kr, kb, limited range)
    fn params(self) -> (f32, f32, bool) {
        match self {
            YuvMatrix::Bt601Limited => (0.299, 0.114, true),
            YuvMatrix::Bt601Full => (0.299, 0.114, false),
            YuvMatrix::Bt709Limited => (0.2126, 0.0722, true),
            YuvMatrix::Bt709Full => (0.2126, 0.0722, false),
        }
    }
}

/// How a picture's pixels are laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PixelFormat {
    /// One plane of packed pixels.
    Packed(PixelLayout),
    /// Y plane, then one plane of interleaved U,V at half resolution.
    Nv12(YuvMatrix),
    /// Y, U and V planes, U and V at half resolution.
    I420(YuvMatrix),
}

/// A borrowed raw picture: up to three planes with their strides.
#[derive(Debug, Clone, Copy)]
pub struct Picture<'a> {
    pub planes: [&'a [u8]; 3],
    pub strides: [usize; 3],
    pub width: u32,
    pub height: u32,
    pub format: PixelFormat,
}

/// A preprocessed picture: packed RGB, width × height × 3 bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Rgb {
    pub data: Vec<u8>,
    pub width: u32,
    pub height: u32,
}

impl Rgb {
    /// Bilinear resize to `width` × `height` (for encoders with a fixed input size).
    pub fn resize(&self, width: u32, height: u32) -> Rgb {
        let (sw, sh, dw, dh) = (self.width as usize, self.height as usize, width as usize, height as usize);
        let mut data = Vec::with_capacity(dw * dh * 3);
        let src = |x: usize, y: usize, c: usize| self.data[(y * sw + x) * 3 + c] as f32;
        for y in 0..dh {
            let fy = ((y as f32 + 0.5) * sh as f32 / dh as f32 - 0.5).clamp(0.0, (sh - 1) as f32);
            let (y0, ty) = (fy as usize, fy.fract());
            let y1 = (y0 + 1).min(sh - 1);
            for x in 0..dw {
                let fx = ((x as f32 + 0.5) * sw as f32 / dw as f32 - 0.5).clamp(0.0, (sw - 1) as f32);
                let (x0, tx) = (fx as usize, fx.fract());
                let x1 = (x0 + 1).min(sw - 1);
                for c in 0..3 {
                    let top = src(x0, y0, c) * (1.0 - tx) + src(x1, y0, c) * tx;
                    let bottom = src(x0, y1, c) * (1.0 - tx) + src(x1, y1, c) * tx;
                    data.push((top * (1.0 - ty) + bottom * ty).round() as u8);
                }
            }
        }
        Rgb { data, width, height }
    }
}

fn plane_fits(data: &[u8], stride: usize, row_bytes: usize, rows: usize) -> bool {
    stride >= row_bytes && (rows == 0 || data.len() >= stride * (rows - 1) + row_bytes)
}

impl<'a> Picture<'a> {
    /// A picture of one packed plane.
    pub fn packed(data: &'a [u8], width: u32, height: u32, stride: usize, layout: PixelLayout) -> Self {
        Picture {
            planes: [data, &[], &[]],
            strides: [stride, 0, 0],
            width,
            height,
            format: PixelFormat::Packed(layout),
        }
    }

    /// Identity of this picture as `encoder_id` sees it: the encoder (with its preprocessing),
    /// the pixel format (with its YUV matrix), the size and the visible pixels (stride padding
    /// excluded). Cheaper than preprocessing, so an embedding-cache hit costs a hash only.
    pub fn identity(&self, encoder_id: &str) -> u64 {
        let mut hash = Xxh3::new();
        hash.update(encoder_id.as_bytes());
        hash.update(format!("{:?}", self.format).as_bytes());
        hash.update(&self.width.to_le_bytes());
        hash.update(&self.height.to_le_bytes());
        let (w, h) = (self.width as usize, self.height as usize);
        let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
        let visible: [(usize, usize); 3] = match self.format {
            PixelFormat::Packed(l) => [(w * l.bytes_per_pixel(), h), (0, 0), (0, 0)],
            PixelFormat::Nv12(_) => [(w, h), (cw * 2, ch), (0, 0)],
            PixelFormat::I420(_) => [(w, h), (cw, ch), (cw, ch)],
        };
        for ((plane, stride), (row_bytes, rows)) in self.planes.iter().zip(self.strides).zip(visible) {
            for row in plane.chunks(stride.max(1)).take(rows) {
                hash.update(&row[..row_bytes.min(row.len())]);
            }
        }
        hash.digest()
    }

    /// Preprocess into packed RGB, honouring strides.
    pub fn to_rgb(&self) -> Result<Rgb> {
        let (w, h) = (self.width as usize, self.height as usize);
        if w == 0 || h == 0 {
            return Err(Error::BadInput(format!("zero-size frame ({w}x{h})")));
        }
        let too_small =
            |plane: usize| Error::BadInput(format!("plane {plane} of a {w}x{h} {:?} frame is too small", self.format));
        let mut rgb = Vec::with_capacity(w * h * 3);
        match self.format {
            PixelFormat::Packed(layout) => {
                let bpp = layout.bytes_per_pixel();
                if !plane_fits(self.planes[0], self.strides[0], w * bpp, h) {
                    return Err(too_small(0));
                }
                let [r, g, b] = layout.rgb_offsets();
                for row in self.planes[0].chunks(self.strides[0]).take(h) {
                    for px in row[..w * bpp].chunks_exact(bpp) {
                        rgb.extend_from_slice(&[px[r], px[g], px[b]]);
                    }
                }
            }
            PixelFormat::Nv12(m) | PixelFormat::I420(m) => {
                let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
                let nv12 = matches!(self.format, PixelFormat::Nv12(_));
                if !plane_fits(self.planes[0], self.strides[0], w, h) {
                    return Err(too_small(0));
                }
                if !plane_fits(self.planes[1], self.strides[1], if nv12 { cw * 2 } else { cw }, ch) {
                    return Err(too_small(1));
                }
                if !nv12 && !plane_fits(self.planes[2], self.strides[2], cw, ch) {
                    return Err(too_small(2));
                }
                let (kr, kb, limited) = m.params();
                let kg = 1.0 - kr - kb;
                let (y0, ys, cs) = if limited { (16.0, 255.0 / 219.0, 255.0 / 224.0) } else { (0.0, 1.0, 1.0) };
                for y in 0..h {
                    let yrow = &self.planes[0][y * self.strides[0]..][..w];
                    for (x, &luma) in yrow.iter().enumerate() {
                        let (u, v) = if nv12 {
                            let uv = &self.planes[1][(y / 2) * self.strides[1] + (x / 2) * 2..];
                            (uv[0], uv[1])
                        } else {
                            (
                                self.planes[1][(y / 2) * self.strides[1] + x / 2],
                                self.planes[2][(y / 2) * self.strides[2] + x / 2],
                            )
                        };
                        let luma = (luma as f32 - y0) * ys;
                        let (pb, pr) = ((u as f32 - 128.0) * cs, (v as f32 - 128.0) * cs);
                        let r = luma + 2.0 * (1.0 - kr) * pr;
                        let b = luma + 2.0 * (1.0 - kb) * pb;
                        let g = (luma - kr * r - kb * b) / kg;
                        rgb.extend_from_slice(&[
                            r.round().clamp(0.0, 255.0) as u8,
                            g.round().clamp(0.0, 255.0) as u8,
                            b.round().clamp(0.0, 255.0) as u8,
                        ]);
                    }
                }
            }
        }
        Ok(Rgb { data: rgb, width: self.width, height: self.height })
    }
}

/// A vision encoder backend.
pub trait VisionEncoder: Send + Sync {
    /// Identity of the encoder (model, backend, its own preprocessing): part of every
    /// embedding's identity.
    fn id(&self) -> &str;
    /// Encode a preprocessed picture into the segments it becomes in the language sequence.
    fn encode_rgb(&self, rgb: &Rgb) -> Result<Vec<Segment>>;

    /// [`VisionEncoder::encode_rgb`], asking `reuse` for each image (its tile and rows) before
    /// encoding it; `turn`: the stream's demand puts it before other streams' encodes while a
    /// reader waits on the stream, and a cancelled turn gives up waiting for the encoder
    /// ([`Turn`]). An encoder without separate tiles encodes the picture whole.
    fn encode_rgb_tiles(
        &self,
        rgb: &Rgb,
        _reuse: &mut dyn FnMut(Tile, usize) -> Option<Box<[f32]>>,
        _turn: Turn<'_>,
    ) -> Result<(Vec<Segment>, TileCount)> {
        let segments = self.encode_rgb(rgb)?;
        let images = segments.iter().filter(|s| matches!(s, Segment::Image(_))).count();
        Ok((
            segments,
            TileCount {
                encoded: images,
                contexts: usize::from(images > 0),
                tiles: vec![None; images],
                ..TileCount::default()
            },
        ))
    }

    /// How many encodes can run side by side (libmtmd's encoder contexts loaded now).
    fn contexts(&self) -> usize {
        1
    }

    /// Preprocess and encode one picture.
    fn encode(&self, picture: &Picture<'_>) -> Result<Frame> {
        self.encode_for(picture, Turn::default())
    }

    /// [`VisionEncoder::encode`] in `turn` (see [`VisionEncoder::encode_rgb_tiles`]).
    fn encode_for(&self, picture: &Picture<'_>, turn: Turn<'_>) -> Result<Frame> {
        let (segments, _) = self.encode_rgb_tiles(&picture.to_rgb()?, &mut |_, _| None, turn)?;
        Ok(Frame { content_hash: picture.identity(self.id()), segments })
    }
}

/// libmtmd (llama.cpp's multimodal library) on the CPU or the GPU.
pub struct MtmdEncoder {
    projector: Arc<Projector>,
    id: String,
    /// Automatic encoder contexts ([`MtmdEncoder::for_stream`]): the threads new ones share.
    automatic: Option<i32>,
}

impl MtmdEncoder {
    pub fn new(projector: Arc<Projector>) -> MtmdEncoder {
        // (The file's version: a projector file replaced on disk encodes other rows.)
        let id = format!(
            "mtmd:{}@{}:{}",
            projector.path().display(),
            projector.file().version(),
            projector.model().identity()
        );
        MtmdEncoder { projector, id, automatic: None }
    }

    /// The encoder of one more stream of the process on `projector`, whose encoder contexts are
    /// automatic: loaded now up to [`encoder_contexts`]'s start, then following the load
    /// ([`grow_with_load`]). A context that cannot load (no GPU memory left) leaves the encoder
    /// with those loaded, and says so in the log.
    pub fn for_stream(projector: Arc<Projector>, threads: i32) -> MtmdEncoder {
        let mut encoder = MtmdEncoder::new(projector);
        encoder.automatic = Some(threads);
        let wanted = encoder_contexts(0, encoder.projector.uses_gpu());
        if let Err(e) = encoder.projector.ensure_contexts(wanted, threads) {
            let loaded = encoder.projector.contexts();
            crate::llama::log(
                crate::llama::LogLevel::Warn,
                &format!("{loaded} encoder contexts loaded of {wanted}: {e}"),
            );
        }
        encoder
    }
}

impl VisionEncoder for MtmdEncoder {
    fn id(&self) -> &str {
        &self.id
    }

    fn encode_rgb(&self, rgb: &Rgb) -> Result<Vec<Segment>> {
        self.projector.encode(&rgb.data, rgb.width, rgb.height)
    }

    fn contexts(&self) -> usize {
        self.projector.contexts()
    }

    fn encode_rgb_tiles(
        &self,
        rgb: &Rgb,
        reuse: &mut dyn FnMut(Tile, usize) -> Option<Box<[f32]>>,
        turn: Turn<'_>,
    ) -> Result<(Vec<Segment>, TileCount)> {
        let encoded = self.projector.encode_tiles(&rgb.data, rgb.width, rgb.height, reuse, turn);
        if let Some(threads) = self.automatic {
            grow_with_load(&self.projector, threads);
        }
        encoded
    }
}

impl Weighted for Frame {
    fn bytes(&self) -> usize {
        self.segments
            .iter()
            .map(|s| match s {
                Segment::Text(t) => t.len() * 4,
                Segment::Image(i) => i.data.len() * 4,
            })
            .sum()
    }
}

/// Which vision encoder to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderBackend {
    /// The NPU when this build has it and an RKNN model is given, else the GPU when llama.cpp
    /// has one, else the CPU.
    Auto,
    Cpu,
    Gpu,
    /// The Rockchip NPU (the `rknn` cargo feature).
    Rknn,
}

/// The encoder `open_encoder` chose, and why it did not take the NPU when `auto` could have.
pub struct EncoderChoice {
    pub encoder: Arc<dyn VisionEncoder>,
    pub backend: &'static str,
    pub fallback: Option<String>,
}

#[cfg(feature = "rknn")]
fn open_rknn(model: &std::path::Path, width: usize) -> Result<Arc<dyn VisionEncoder>> {
    Ok(Arc::new(rknn::RknnEncoder::new(model, width)?))
}

#[cfg(not(feature = "rknn"))]
fn open_rknn(model: &std::path::Path, _width: usize) -> Result<Arc<dyn VisionEncoder>> {
    Err(Error::Config(format!(
        "cannot run {}: this build has no RKNN backend (build with the rknn cargo feature on a Rockchip board)",
        model.display()
    )))
}

/// Encoder contexts a projector on a GPU starts with when their number is automatic. Each holds
/// its compute buffers and reads the one copy of the projector's weights the process loaded
/// (libmtmd as built here, scripts/llama/mtmd-edits.cmake; until session 34 each context held a
/// copy: ~320 MiB of GPU memory a context for SmolVLM-500M, 190 of them weights). Measured on an
/// H200 (`vlm-bench encoders`, SmolVLM-500M's shapes, docs/benchmarks.md,
/// "Vision encoding that scales"): 2 contexts encode 7.9 frames/s for one stream and 21.2 for
/// four, against 8.5 and 21.6 on 4 (5.2 and 15.1 on one); W1 on an H100, TTFT from capture 149 ms
/// mean against 143 on 4 and 196 on 1, at 642 MiB less GPU memory than 4. At 16 live streams of
/// one frame a second they also answer sooner than 4 (H100: p95 from capture 287-388 ms against
/// 350-616 over six rounds: encodes that the encoder's throughput does not need take the GPU
/// from the engines' ingestion; "Encoder contexts that follow the load").
pub const START_ENCODER_CONTEXTS: usize = 2;
/// The most encoder contexts automatic ones grow to ([`grow_with_load`]): 30.3 frames/s at 16
/// streams against 24.5 on 2; more add nothing (29.7 on 8).
pub const MOST_ENCODER_CONTEXTS: usize = 4;
/// How long the contexts' busy share is measured over before automatic contexts grow.
pub const LOAD_WINDOW: Duration = Duration::from_secs(5);
/// The busy share of the loaded contexts over [`LOAD_WINDOW`] from which automatic ones grow by
/// one: the due frames then need about all the encoder gives, and frames wait for contexts.
pub const GROW_AT: f64 = 0.9;

/// How many libmtmd encoder contexts `contexts` means at the start (0: automatic): on a GPU
/// several, so that the tiles of a frame and the frames of several streams are encoded side by
/// side (a small vision tower leaves most of a GPU idle while one context launches its kernels),
/// [`START_ENCODER_CONTEXTS`], growing with the load ([`grow_with_load`]); on the CPU one, whose
/// threads already take every core given.
pub fn encoder_contexts(contexts: usize, gpu: bool) -> usize {
    match contexts {
        0 if gpu => START_ENCODER_CONTEXTS,
        0 => 1,
        n => n.min(crate::llama::MAX_ENCODER_CONTEXTS),
    }
}

/// Automatic encoder contexts on a GPU follow the load: one more, up to
/// [`MOST_ENCODER_CONTEXTS`], once the loaded ones were leased at least [`GROW_AT`] of their
/// time over a [`LOAD_WINDOW`]; called after each encode (one of the encodes that ends a window
/// measures it). A context that cannot load (no GPU memory left) ends the growth, said in the log.
pub fn grow_with_load(projector: &Projector, threads: i32) {
    let loaded = projector.contexts();
    if !projector.uses_gpu() || loaded >= MOST_ENCODER_CONTEXTS || projector.load_failed() {
        return;
    }
    let Some(busy) = projector.busy_share(LOAD_WINDOW).filter(|&b| b >= GROW_AT) else {
        return;
    };
    let (level, message) = match projector.ensure_contexts(loaded + 1, threads) {
        Ok(()) => (crate::llama::LogLevel::Info, format!("{} encoder contexts now", projector.contexts())),
        Err(e) => (crate::llama::LogLevel::Warn, format!("no more encoder contexts: {e}")),
    };
    let window = LOAD_WINDOW.as_secs();
    crate::llama::log(level, &format!("{loaded} encoder contexts busy {:.0}% of {window} s: {message}", busy * 100.0));
}

/// Open the vision encoder for `backend`: libmtmd with `mmproj` on the CPU or GPU (`contexts`
/// encoder contexts, 0: [`encoder_contexts`] chooses, sharing `threads`), or the NPU with
/// `rknn_model`, feeding `model`.
pub fn open_encoder(
    backend: EncoderBackend,
    mmproj: &std::path::Path,
    rknn_model: Option<&std::path::Path>,
    model: &Arc<crate::llama::Model>,
    threads: i32,
    contexts: usize,
) -> Result<EncoderChoice> {
    let mtmd = |gpu: bool| -> Result<Arc<dyn VisionEncoder>> {
        let projector = crate::models::projector(mmproj, model, gpu, threads, encoder_contexts(contexts, gpu))?;
        Ok(Arc::new(match contexts {
            0 => MtmdEncoder::for_stream(projector, threads),
            _ => MtmdEncoder::new(projector),
        }))
    };
    let rknn = || match rknn_model {
        Some(m) => match model.plain_embeddings_refusal() {
            // The NPU's rows are plain 1-D, causal embeddings: refuse the pairing up front.
            Some(why) => Err(Error::Config(format!("cannot pair the NPU model {} with it: {why}", m.display()))),
            None => open_rknn(m, model.n_embd()),
        },
        None => Err(Error::Config("backend rknn needs an RKNN model (rknn-model)".into())),
    };
    let gpu = crate::llama::gpu_available;
    Ok(match backend {
        EncoderBackend::Cpu => EncoderChoice { encoder: mtmd(false)?, backend: "cpu", fallback: None },
        EncoderBackend::Gpu if !gpu() => return Err(Error::Config("backend gpu: llama.cpp has no GPU device".into())),
        EncoderBackend::Gpu => EncoderChoice { encoder: mtmd(true)?, backend: "gpu", fallback: None },
        EncoderBackend::Rknn => EncoderChoice { encoder: rknn()?, backend: "rknn", fallback: None },
        EncoderBackend::Auto => {
            let fallback = match rknn_model.map(|_| rknn()) {
                Some(Ok(encoder)) => return Ok(EncoderChoice { encoder, backend: "rknn", fallback: None }),
                Some(Err(e)) => Some(e.to_string()),
                None => None,
            };
            let on_gpu = gpu();
            EncoderChoice { encoder: mtmd(on_gpu)?, backend: if on_gpu { "gpu" } else { "cpu" }, fallback }
        }
    })
}

/// Which tiles of a frame may be taken from the frame encoded before it (tiled projectors,
/// such as SmolVLM's idefics3, encode every tile on its own).
#[derive(Debug, Clone, Copy)]
pub enum TileReuse<'a> {
    /// Encode every tile.
    Off,
    /// A tile whose pixels (and the pixels around it that the resize blends in) are identical:
    /// its rows are exactly what an encode would give.
    Exact,
    /// A tile (a cell of the grid, not the whole picture or its overview) where the change gate
    /// sees no change beyond noise between these pixels (their sampling) and those its rows
    /// were encoded from: the rows differ from an encode of these pixels by what the noise
    /// makes.
    Unchanged(&'a Arc<gate::Luma>),
}

/// Pixels around a tile that the resize to the projector's grid may blend into it (each axis):
/// Lanczos-3 reaches 3 source pixels when it enlarges and 3 x the reduction when it reduces, in
/// up to two steps (to the longest edge, then to whole tiles). For longest edges of 384 px and
/// more, 1/64 of the picture's longer side covers a reduction, and 6 pixels an enlargement.
fn tile_margin(width: u32, height: u32) -> u32 {
    (width.max(height) / 64).max(6)
}

/// A sampling of the pixels a tile's rows were encoded from (`TileReuse::Unchanged`).
type Origin = Option<Arc<gate::Luma>>;

/// The frame encoded last, for tile reuse.
struct LastFrame {
    rgb: Rgb,
    frame: Arc<Frame>,
    /// Per image segment: its tile, (`TileReuse::Unchanged`) the sampling of the pixels its
    /// rows were encoded from (an earlier frame's, where they were reused), and whether they are
    /// what an encode of this frame's own pixels gives (encoded now, or taken exactly from such
    /// rows): only those are taken again as exact.
    tiles: Vec<(Option<Tile>, Origin, bool)>,
}

impl LastFrame {
    /// The rows of `tile` in this frame, if it has them, where they were encoded from, and
    /// whether from this frame's own pixels.
    fn rows_of(&self, tile: Tile, rows: usize) -> Option<(Box<[f32]>, &Origin, bool)> {
        let images = self.frame.segments.iter().filter_map(|s| match s {
            Segment::Image(i) => Some(i),
            Segment::Text(_) => None,
        });
        images
            .zip(&self.tiles)
            .find(|(i, (t, ..))| *t == Some(tile) && i.rows == rows)
            .map(|(i, (_, origin, own))| (i.data.clone(), origin, *own))
    }
}

impl Rgb {
    /// Whether pixels (x0, y0)..(x1, y1), widened by `margin`, are identical in `other` (of the
    /// same size).
    fn same_region(&self, other: &Rgb, (x0, y0, x1, y1): (u32, u32, u32, u32), margin: u32) -> bool {
        let (w, h) = (self.width as usize, self.height as usize);
        let (x0, y0) = (x0.saturating_sub(margin) as usize, y0.saturating_sub(margin) as usize);
        let (x1, y1) = (((x1 + margin) as usize).min(w), ((y1 + margin) as usize).min(h));
        (y0..y1).all(|y| {
            let row = y * w * 3;
            self.data[row + x0 * 3..row + x1 * 3] == other.data[row + x0 * 3..row + x1 * 3]
        })
    }
}

/// A frame from [`FrameEncoder::encode_reusing`].
pub struct Encoded {
    pub frame: Arc<Frame>,
    /// From the embedding cache (nothing encoded).
    pub hit: bool,
    pub tiles: TileCount,
}

/// An encoder with an embedding cache in front of it, and the frame it encoded last for tile
/// reuse.
pub struct FrameEncoder {
    encoder: Arc<dyn VisionEncoder>,
    cache: BoundedCache<u64, Frame>,
    last: Mutex<Option<LastFrame>>,
}

impl FrameEncoder {
    pub fn new(encoder: Arc<dyn VisionEncoder>, max_entries: usize, max_bytes: usize) -> Self {
        FrameEncoder { encoder, cache: BoundedCache::new(max_entries, max_bytes), last: Mutex::new(None) }
    }

    pub fn encoder(&self) -> &Arc<dyn VisionEncoder> {
        &self.encoder
    }

    /// The frame's embeddings, from the cache when the same picture was encoded before (then
    /// the same shared handle is returned). The flag says whether it was a cache hit.
    pub fn encode(&self, picture: &Picture<'_>) -> Result<(Arc<Frame>, bool)> {
        let e = self.encode_reusing(picture, TileReuse::Off, Turn::default())?;
        Ok((e.frame, e.hit))
    }

    /// [`FrameEncoder::encode`], taking the tiles `reuse` allows from the frame this encoder
    /// encoded last (same size; the caller says when the stream starts afresh:
    /// [`FrameEncoder::forget_last`]), in `turn` (see [`VisionEncoder::encode_rgb_tiles`]).
    pub fn encode_reusing(&self, picture: &Picture<'_>, reuse: TileReuse<'_>, turn: Turn<'_>) -> Result<Encoded> {
        let content_hash = picture.identity(self.encoder.id());
        let mut last = self.last.lock();
        if let Some(frame) = self.cache.get(&content_hash) {
            // (Its pixels are not at hand to compare tiles with: the next frame starts afresh.)
            *last = None;
            return Ok(Encoded { frame, hit: true, tiles: TileCount::default() });
        }
        let rgb = picture.to_rgb()?;
        let previous = last.take().filter(|l| (l.rgb.width, l.rgb.height) == (rgb.width, rgb.height));
        let margin = tile_margin(rgb.width, rgb.height);
        // The change since each earlier sampling a tile's rows came from (few: computed once).
        let mut changes: Vec<(Arc<gate::Luma>, Option<gate::Change>)> = vec![];
        // Where the reused tiles' rows were encoded from, and whether they are exact.
        let mut reused_from: Vec<(Tile, Origin, bool)> = vec![];
        let mut lookup = |tile: Tile, rows: usize| -> Option<Box<[f32]>> {
            let previous = previous.as_ref()?;
            let (data, origin, own) = previous.rows_of(tile, rows)?;
            let region = tile.region(rgb.width, rgb.height);
            let unchanged = match reuse {
                TileReuse::Off => false,
                TileReuse::Exact => own && previous.rgb.same_region(&rgb, region, margin),
                // (A whole picture is the change gate's to hold, not reused on a threshold.)
                TileReuse::Unchanged(_) if tile == Tile::Whole => false,
                TileReuse::Unchanged(now) => {
                    let origin = origin.as_ref()?;
                    let at = match changes.iter().position(|(l, _)| Arc::ptr_eq(l, origin)) {
                        Some(at) => at,
                        None => {
                            changes.push((Arc::clone(origin), gate::compare(origin, now)));
                            changes.len() - 1
                        }
                    };
                    changes[at].1.as_ref().is_some_and(|c| !c.changed_in(region, margin))
                }
            };
            unchanged.then(|| {
                reused_from.push((tile, origin.clone(), matches!(reuse, TileReuse::Exact)));
                data
            })
        };
        let (segments, tiles) = self.encoder.encode_rgb_tiles(&rgb, &mut lookup, turn)?;
        let now = match reuse {
            TileReuse::Unchanged(now) => Some(now),
            _ => None,
        };
        let origins = tiles
            .tiles
            .iter()
            .map(|t| match t.and_then(|t| reused_from.iter().find(|(r, ..)| *r == t)) {
                Some((_, origin, exact)) => (*t, origin.clone(), *exact),
                None => (*t, now.cloned(), true),
            })
            .collect();
        let frame = Arc::new(Frame { content_hash, segments });
        // Cached only as a full encode of these pixels: a reused tile's rows may come from other
        // pixels (within the threshold), which a later identical picture must not be handed
        // (after a flush, or with reuse off).
        if tiles.reused == 0 {
            self.cache.insert(content_hash, Arc::clone(&frame));
        }
        *last = Some(LastFrame { rgb, frame: Arc::clone(&frame), tiles: origins });
        Ok(Encoded { frame, hit: false, tiles })
    }

    /// The stream starts afresh (new caps, a flush, a seek): no tile of the frame before is
    /// reused.
    pub fn forget_last(&self) {
        *self.last.lock() = None;
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn automatic_encoder_contexts_start_at_two_on_a_gpu_and_stay_one_on_the_cpu() {
        assert_eq!((encoder_contexts(0, true), encoder_contexts(0, false)), (START_ENCODER_CONTEXTS, 1));
        // A number given is kept, up to the most a projector loads.
        assert_eq!((encoder_contexts(3, true), encoder_contexts(3, false)), (3, 3));
        assert_eq!(encoder_contexts(1000, true), crate::llama::MAX_ENCODER_CONTEXTS);
    }

    #[test]
    fn strided_layouts_pack_to_the_same_rgb() {
        // 2x2 picture, rows padded to 12 bytes.
        let px = [[10u8, 20, 30], [40, 50, 60], [70, 80, 90], [100, 110, 120]];
        let expected: Vec<u8> = px.iter().flatten().copied().collect();
        for layout in [
            PixelLayout::Rgb,
            PixelLayout::Bgr,
            PixelLayout::Rgbx,
            PixelLayout::Bgrx,
            PixelLayout::Xrgb,
            PixelLayout::Xbgr,
        ] {
            let mut data = vec![0u8; 24];
            for (i, [r, g, b]) in px.iter().enumerate() {
                let at = (i / 2) * 12 + (i % 2) * layout.bytes_per_pixel();
                let [or, og, ob] = layout.rgb_offsets();
                data[at + or] = *r;
                data[at + og] = *g;
                data[at + ob] = *b;
            }
            let pic = Picture::packed(&data, 2, 2, 12, layout);
            assert_eq!(pic.to_rgb().unwrap().data, expected, "{layout:?}");
        }
    }

    #[test]
    fn yuv_grey_and_primaries_convert() {
        // 2x2 NV12 / I420 with one chroma sample: limited-range BT.601 white, and pure red.
        for (y, u, v, rgb) in
            [(235u8, 128u8, 128u8, [255u8, 255, 255]), (81, 90, 240, [255, 0, 0]), (16, 128, 128, [0, 0, 0])]
        {
            let luma = [y; 4];
            let nv12 = Picture {
                planes: [&luma, &[u, v], &[]],
                strides: [2, 2, 0],
                width: 2,
                height: 2,
                format: PixelFormat::Nv12(YuvMatrix::Bt601Limited),
            };
            let i420 = Picture {
                planes: [&luma, &[u], &[v]],
                strides: [2, 1, 1],
                width: 2,
                height: 2,
                format: PixelFormat::I420(YuvMatrix::Bt601Limited),
            };
            let (a, b) = (nv12.to_rgb().unwrap().data, i420.to_rgb().unwrap().data);
            assert_eq!(a, b);
            for px in a.chunks(3) {
                for c in 0..3 {
                    assert!((px[c] as i32 - rgb[c] as i32).abs() <= 2, "{y},{u},{v} -> {px:?}, expected {rgb:?}");
                }
            }
        }
    }

    #[test]
    fn identity_ignores_stride_padding_but_not_pixels_or_format() {
        let tight = [1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        let padded = [1u8, 2, 3, 4, 5, 6, 0, 0, 7, 8, 9, 10, 11, 12, 9, 9];
        let a = Picture::packed(&tight, 2, 2, 6, PixelLayout::Rgb);
        let b = Picture::packed(&padded, 2, 2, 8, PixelLayout::Rgb);
        assert_eq!(a.identity("e"), b.identity("e"));
        assert_ne!(a.identity("e"), a.identity("other encoder"));
        assert_ne!(a.identity("e"), Picture::packed(&tight, 2, 2, 6, PixelLayout::Bgr).identity("e"));
        let mut changed = tight;
        changed[11] = 0;
        assert_ne!(a.identity("e"), Picture::packed(&changed, 2, 2, 6, PixelLayout::Rgb).identity("e"));
    }

    #[test]
    fn resize_keeps_flat_colours_and_corners() {
        let flat = Rgb { data: [10u8, 20, 30].repeat(6 * 4), width: 6, height: 4 };
        let small = flat.resize(3, 2);
        assert_eq!((small.width, small.height), (3, 2));
        assert!(small.data.chunks(3).all(|p| p == [10, 20, 30]));
        let grad = Rgb { data: (0..4).flat_map(|x| [x as u8 * 80; 3]).collect(), width: 4, height: 1 };
        let up = grad.resize(8, 1);
        assert_eq!((up.data[0], up.data[21]), (0, 240));
    }

    #[test]
    fn bad_geometry_is_an_error() {
        let data = [0u8; 10];
        assert!(matches!(Picture::packed(&data, 0, 2, 3, PixelLayout::Rgb).to_rgb(), Err(Error::BadInput(_))));
        assert!(matches!(Picture::packed(&data, 2, 2, 6, PixelLayout::Rgb).to_rgb(), Err(Error::BadInput(_))));
        let nv12 = Picture {
            planes: [&data[..4], &data[..1], &[]],
            strides: [2, 2, 0],
            width: 2,
            height: 2,
            format: PixelFormat::Nv12(YuvMatrix::Bt601Limited),
        };
        assert!(matches!(nv12.to_rgb(), Err(Error::BadInput(_))), "short chroma plane");
    }
}
