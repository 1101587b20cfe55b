//! Vision encoding: a frame's pixels become the projected embeddings the language model takes.
//!
//! Backends sit behind [`VisionEncoder`]; this build has libmtmd's (CPU, or GPU when asked).

use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3;

use crate::error::{Error, Result};
use crate::llama::Projector;
use crate::stream::Frame;

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

/// A borrowed picture: one plane of packed pixels with a row stride.
#[derive(Debug, Clone, Copy)]
pub struct Picture<'a> {
    pub data: &'a [u8],
    pub width: u32,
    pub height: u32,
    pub stride: usize,
    pub layout: PixelLayout,
}

impl Picture<'_> {
    /// Packed RGB (width × height × 3), honouring the stride.
    pub fn to_rgb(&self) -> Result<Vec<u8>> {
        let (w, h, bpp) = (self.width as usize, self.height as usize, self.layout.bytes_per_pixel());
        if w == 0 || h == 0 {
            return Err(Error::BadInput(format!("zero-size frame ({w}x{h})")));
        }
        if self.stride < w * bpp || self.data.len() < self.stride * (h - 1) + w * bpp {
            return Err(Error::BadInput(format!(
                "frame of {w}x{h} with stride {} does not fit in {} bytes",
                self.stride,
                self.data.len()
            )));
        }
        let [r, g, b] = self.layout.rgb_offsets();
        let mut rgb = Vec::with_capacity(w * h * 3);
        for row in self.data.chunks(self.stride).take(h) {
            for px in row[..w * bpp].chunks_exact(bpp) {
                rgb.extend_from_slice(&[px[r], px[g], px[b]]);
            }
        }
        Ok(rgb)
    }
}

/// A vision encoder backend.
pub trait VisionEncoder: Send + Sync {
    /// Identity of the encoder and its preprocessing: part of every embedding's identity.
    fn id(&self) -> &str;
    /// Encode one picture into the frame the language model will take.
    fn encode(&self, picture: &Picture<'_>) -> Result<Frame>;
}

/// libmtmd (llama.cpp's multimodal library) on the CPU or the GPU.
pub struct MtmdEncoder {
    projector: Arc<Projector>,
    id: String,
}

impl MtmdEncoder {
    pub fn new(projector: Arc<Projector>) -> MtmdEncoder {
        let id = format!("mtmd:{}", projector.path().display());
        MtmdEncoder { projector, id }
    }
}

impl VisionEncoder for MtmdEncoder {
    fn id(&self) -> &str {
        &self.id
    }

    fn encode(&self, picture: &Picture<'_>) -> Result<Frame> {
        let rgb = picture.to_rgb()?;
        let mut hash = Xxh3::new();
        hash.update(self.id.as_bytes());
        hash.update(&picture.width.to_le_bytes());
        hash.update(&picture.height.to_le_bytes());
        hash.update(&rgb);
        let segments = self.projector.encode(&rgb, picture.width, picture.height)?;
        Ok(Frame { segments, content_hash: hash.digest() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let pic = Picture { data: &data, width: 2, height: 2, stride: 12, layout };
            assert_eq!(pic.to_rgb().unwrap(), expected, "{layout:?}");
        }
    }

    #[test]
    fn bad_geometry_is_an_error() {
        let data = [0u8; 10];
        let zero = Picture { data: &data, width: 0, height: 2, stride: 3, layout: PixelLayout::Rgb };
        assert!(matches!(zero.to_rgb(), Err(Error::BadInput(_))));
        let short = Picture { data: &data, width: 2, height: 2, stride: 6, layout: PixelLayout::Rgb };
        assert!(matches!(short.to_rgb(), Err(Error::BadInput(_))));
    }
}
