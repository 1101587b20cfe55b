//! A tiled (idefics3/SmolVLM) picture cut into its tiles here, each tile prepared by libmtmd on
//! its own, on several threads.
//!
//! libmtmd prepares a tiled frame in one call on one thread: after the resizes that
//! [`resample`](super::resample) now does first, it still resizes the overview from the whole
//! picture and normalises every tile, one after another: most of a 13-tile SmolVLM frame's
//! preparation (measured: docs/benchmarks.md, "A SmolVLM picture cut into its tiles here"). No
//! libmtmd call takes a prepared tile, but a context whose image token limit is one tile's
//! prepares a picture of one tile's size as that tile alone (copies and a normalisation), and
//! `mtmd_tokenize` may run on several threads at once. So once libmtmd has tokenized a picture
//! of some size (its [`Layout`]: the wrapper text, and where each image is in the picture and
//! how it is decoded), a later picture of that size is cut here: each tile cropped, the overview
//! resized (bit for bit as libmtmd resizes it), and each handed on its own to the projector's
//! second encoder context, loaded with that limit, the images spread over threads. Their chunks
//! hold the pixels libmtmd would have cut, normalised by the same code, so the encoder contexts
//! encode what libmtmd's own preparation would have given them (tested against it:
//! `tests/tiles.rs`). A projector with one encoder context (the CPU default) prepares pictures
//! whole: the second context would cost the vision tower's weights again.

use std::collections::VecDeque;
use std::ffi::CStr;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;
use parking_lot::Mutex;

use super::Token;
use super::mtmd::{
    ChunkPtr, DecodeView, ImageEmbeddings, ImageSource, OwnedChunks, Projector, Segment, Tile, tokenize,
};
use crate::error::{Error, Result};

type Size = (u32, u32);

/// Picture sizes whose layout is kept (a camera has one; a caps change brings another).
const LAYOUTS: usize = 4;

/// One image of a frame as libmtmd tokenized it: where it is in the picture, and what decoding it
/// needs.
pub(super) struct Place {
    pub tile: Option<Tile>,
    pub rows: usize,
    pub n_pos: i32,
    /// `mtmd_input_chunk_save`'s description of the image's chunk (no pixels).
    pub chunk: Vec<u8>,
    pub non_causal: bool,
    pub causal_rows: bool,
}

pub(super) enum Piece {
    Text(Vec<Token>),
    Image(Place),
}

/// A frame's chunks as libmtmd tokenized a picture of its size: the same for every picture of
/// that size, since the wrapper text and the images' descriptions depend on the grid alone.
pub(super) struct Layout {
    pub pieces: Vec<Piece>,
}

impl Layout {
    /// The layout of libmtmd's chunks `all` (text and images) for `projector`.
    ///
    /// # Safety
    /// The chunks are valid chunks of the projector's tokenization, alive for the call.
    pub unsafe fn of(all: &[ChunkPtr], projector: &Projector) -> Result<Layout> {
        let view = projector.decode_view.0.as_ptr();
        let model = projector.model();
        let mut pieces = vec![];
        // The wrapper text before each image says where it is in the picture.
        let mut markers = vec![];
        let mut text = String::new();
        for &c in all {
            // SAFETY: valid chunks (the caller's); the saved description is copied out.
            unsafe {
                if sys::mtmd_input_chunk_get_type(c.0) == sys::MTMD_INPUT_CHUNK_TYPE_TEXT {
                    let mut n = 0usize;
                    let p = sys::mtmd_input_chunk_get_tokens_text(c.0, &mut n);
                    let tokens = if n == 0 { &[][..] } else { std::slice::from_raw_parts(p, n) };
                    // (libmtmd puts -1 where the projector's wrapper text names a token the
                    // language model lacks: a projector made for another model.)
                    if let Some(t) = tokens.iter().find(|&&t| t < 0 || t as usize >= model.n_vocab()) {
                        return Err(Error::BadInput(format!(
                            "the projector wraps its images in text with a token the language model {} does not have (token {t}): give vlmencode the language model the projector was made for",
                            model.path().display()
                        )));
                    }
                    for &t in tokens {
                        text.push_str(&String::from_utf8_lossy(&model.token_piece(t, true)));
                    }
                    if !tokens.is_empty() {
                        pieces.push(Piece::Text(tokens.to_vec()));
                    }
                    continue;
                }
                markers.push(std::mem::take(&mut text));
                let rows = sys::mtmd_input_chunk_get_n_tokens(c.0);
                let mut len = 0usize;
                sys::mtmd_input_chunk_save(c.0, std::ptr::null_mut(), 0, &mut len);
                let mut chunk = vec![0u8; len];
                if sys::mtmd_input_chunk_save(c.0, chunk.as_mut_ptr().cast(), len, &mut len) != 0 {
                    return Err(Error::Engine("mtmd_input_chunk_save failed".into()));
                }
                let n_pos = sys::mtmd_input_chunk_get_n_pos(c.0);
                let non_causal = sys::mtmd_decode_use_non_causal(view, c.0);
                let causal_rows = n_pos == rows as i32 && !sys::mtmd_decode_use_mrope(view) && !non_causal;
                pieces.push(Piece::Image(Place { tile: None, rows, n_pos, chunk, non_causal, causal_rows }));
            }
        }
        let mut tiles = super::mtmd::tiles(&markers).into_iter();
        for piece in &mut pieces {
            if let Piece::Image(place) = piece {
                place.tile = tiles.next().flatten();
            }
        }
        Ok(Layout { pieces })
    }

    pub fn places(&self) -> impl Iterator<Item = &Place> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Image(place) => Some(place),
            Piece::Text(_) => None,
        })
    }

    /// The frame's segments: the layout with each image's rows (`rows`, in order).
    pub fn segments(&self, rows: Vec<Box<[f32]>>, projector: &Arc<Projector>) -> Vec<Segment> {
        let mut rows = rows.into_iter();
        let width = projector.model().n_embd();
        self.pieces
            .iter()
            .map(|piece| match piece {
                Piece::Text(tokens) => Segment::Text(tokens.clone()),
                Piece::Image(place) => Segment::Image(ImageEmbeddings {
                    data: rows.next().expect("rows for every image"),
                    rows: place.rows,
                    width,
                    n_pos: place.n_pos,
                    causal_rows: place.causal_rows,
                    source: ImageSource::Mtmd {
                        chunk: place.chunk.clone(),
                        projector: Arc::clone(projector),
                        non_causal: place.non_causal,
                    },
                }),
            })
            .collect()
    }
}

/// libmtmd's chunks of one image prepared on its own, and the image among them.
pub(super) struct Prepared {
    _chunks: OwnedChunks,
    pub image: ChunkPtr,
}

/// Prepares a tiled picture's images one by one: on the projector's second encoder context,
/// whose image token limit is one tile's (`tokens` rows), and the layouts of the picture sizes
/// seen.
pub(super) struct Cutter {
    view: DecodeView,
    tile: u32,
    tokens: usize,
    /// The newest layouts, by picture size (width, height).
    layouts: Mutex<VecDeque<(Size, Arc<Layout>)>>,
}

impl Cutter {
    /// `view`: the tile-limited context, only passed to `mtmd_tokenize` here, which libmtmd
    /// documents as safe on a shared context and which reads only what loading fixed (see
    /// [`DecodeView`]), so it may encode for another frame meanwhile.
    pub fn new(view: DecodeView, tile: u32, tokens: usize) -> Cutter {
        Cutter { view, tile, tokens, layouts: Mutex::new(VecDeque::new()) }
    }

    /// The layout of pictures of `width` × `height` (the tiled size), if one was kept.
    pub fn layout(&self, width: u32, height: u32) -> Option<Arc<Layout>> {
        self.layouts.lock().iter().find(|(size, _)| *size == (width, height)).map(|(_, l)| Arc::clone(l))
    }

    /// Keep `layout` for pictures of `width` × `height` where they can be cut here: whole tiles,
    /// and each image one tile's rows, a tile of the grid or the overview. (Two first pictures
    /// of a size prepared at once keep it once.)
    pub fn keep(&self, width: u32, height: u32, layout: &Arc<Layout>) {
        let cuttable = width.is_multiple_of(self.tile)
            && height.is_multiple_of(self.tile)
            && layout.places().count() > 1
            && layout.places().all(|p| {
                p.rows == self.tokens
                    && match p.tile {
                        Some(Tile::Cell { rows, cols, .. }) => cols * self.tile == width && rows * self.tile == height,
                        Some(Tile::Whole) => true,
                        None => false,
                    }
            });
        let mut layouts = self.layouts.lock();
        if cuttable && !layouts.iter().any(|(size, _)| *size == (width, height)) {
            if layouts.len() == LAYOUTS {
                layouts.pop_front();
            }
            layouts.push_back(((width, height), Arc::clone(layout)));
        }
    }

    /// Prepare the image at `place` of `picture` (packed RGB, `width` × `height`, a kept layout's
    /// size) on its own: the tile cropped, or the overview resized, and tokenized on the tile
    /// context with `marker` as its text.
    pub fn prepare(&self, picture: &[u8], width: u32, height: u32, place: &Place, marker: &CStr) -> Result<Prepared> {
        let t = self.tile as usize;
        let pixels = match place.tile {
            Some(Tile::Cell { row, col, .. }) => {
                let (x0, y0, w) = ((col as usize - 1) * t, (row as usize - 1) * t, width as usize);
                let mut out = Vec::with_capacity(t * t * 3);
                for y in y0..y0 + t {
                    out.extend_from_slice(&picture[(y * w + x0) * 3..(y * w + x0 + t) * 3]);
                }
                out
            }
            _ => super::resample::resize_lanczos(picture, width as usize, height as usize, t, t, 1),
        };
        let chunks = tokenize(&self.view, marker, &pixels, self.tile, self.tile)?;
        let image = chunks
            .images()
            .into_iter()
            // SAFETY: valid chunks, owned above.
            .find(|c| unsafe { sys::mtmd_input_chunk_get_n_tokens(c.0) } == place.rows)
            .ok_or_else(|| {
                Error::Engine(format!("a tile prepared on its own is not an image of {} rows", place.rows))
            })?;
        Ok(Prepared { _chunks: chunks, image })
    }
}
