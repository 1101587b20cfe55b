//! Chunked prefill: the inputs one sequence still has to take in (a frame being ingested, a
//! replayed history, a question's suffix), consumed a chunk at a time by the engine's step
//! scheduler, so that no decode step waits behind a whole prefill (chunked prefill, as in vLLM
//! and Sarathi-Serve).
//!
//! Where a chunk ends must not change the result, or a retained history would part from its
//! replay. Each input attends to its own sequence's earlier cells only and the per-sequence KV
//! keeps their order, but llama.cpp's CPU backend computes a batch of one input with other
//! kernels than a batch of several (llamafile's sgemm only takes n >= 2), so a one-input chunk
//! is only ever a whole one-input piece: [`chunk_len`] never cuts one off a longer piece, which
//! a replay (the same pieces, other cuts) then matches bit for bit.
//!
//! On engines that merge frames ([`Prefill::new`]'s `rows`), a frame of several segments
//! (image rows with wrapper text between them) is one piece of embedding rows, its text as the
//! tokens' input embedding rows, so that it takes one `llama_decode` instead of one a segment.

use std::sync::Arc;

use crate::entry::{Entry, Frame};
use crate::error::Result;
use crate::llama::{Batch, Context, Model, Segment, Token};

/// One homogeneous run of inputs.
enum Piece {
    Tokens(Arc<[Token]>),
    /// One segment (by index) of a frame.
    Segment(Arc<Frame>, usize),
    /// A whole frame as embedding rows (`width` floats each), its text included.
    Rows(Arc<[f32]>, usize),
}

/// A frame of several segments as one run of embedding rows, when every image in it is causal
/// 1-D rows of the model's width; `None` otherwise (or when a token's row cannot be read: the
/// frame then goes segment by segment).
fn frame_rows(frame: &Frame, model: &Model) -> Option<Piece> {
    let width = model.n_embd();
    if frame.segments.len() < 2 {
        return None;
    }
    let mut data = Vec::new();
    for segment in &frame.segments {
        match segment {
            Segment::Text(tokens) => model.token_rows(tokens, &mut data).ok()?,
            Segment::Image(image) if image.causal_rows && image.width == width => data.extend_from_slice(&image.data),
            Segment::Image(_) => return None,
        }
    }
    Some(Piece::Rows(data.into(), width))
}

/// What the next chunk of a prefill is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Up to this many tokens.
    Tokens(usize),
    /// Up to this many embedding rows of one causal image.
    Rows(usize),
    /// An image decoded whole by libmtmd (M-RoPE positions or non-causal attention).
    Whole,
}

/// How many of `available` inputs to take when about `want` fit: at least two, and never
/// leaving exactly one behind (see the module's note).
pub(crate) fn chunk_len(available: usize, want: usize) -> usize {
    let n = want.max(2).min(available);
    match available - n {
        1 if n > 2 => n - 1,
        1 => available,
        _ => n,
    }
}

/// The inputs a sequence still has to prefill, from position `pos` on.
pub(crate) struct Prefill {
    pub seq: i32,
    pieces: Vec<Piece>,
    index: usize,
    offset: usize,
    /// Position of the next input.
    pub pos: i32,
    /// Keep the logits of the last input (an answer samples its first token from them).
    logits_last: bool,
    remaining: usize,
}

impl Prefill {
    /// The prefill of `entries` into `seq` from `pos`; with `rows` (the engine's model, on
    /// engines that merge frames) a frame of several segments goes as one piece of rows.
    pub(crate) fn new(
        seq: i32,
        pos: i32,
        entries: impl IntoIterator<Item = Entry>,
        logits_last: bool,
        rows: Option<&Model>,
    ) -> Prefill {
        let mut pieces = vec![];
        for entry in entries {
            match entry {
                Entry::Text(t) => pieces.push(Piece::Tokens(t)),
                Entry::Frame(f) => match rows.and_then(|m| frame_rows(&f, m)) {
                    Some(merged) => pieces.push(merged),
                    None => pieces.extend((0..f.segments.len()).map(|i| Piece::Segment(Arc::clone(&f), i))),
                },
            }
        }
        pieces.retain(|p| Self::len(p) > 0);
        let remaining = pieces.iter().map(Self::len).sum();
        Prefill { seq, pieces, index: 0, offset: 0, pos, logits_last, remaining }
    }

    /// Inputs (tokens or rows) in a piece.
    fn len(piece: &Piece) -> usize {
        match piece {
            Piece::Tokens(t) => t.len(),
            Piece::Segment(f, i) => match &f.segments[*i] {
                Segment::Text(t) => t.len(),
                Segment::Image(image) => image.rows,
            },
            Piece::Rows(data, width) => data.len() / width,
        }
    }

    /// Inputs still to decode (tokens and embedding rows).
    pub(crate) fn remaining(&self) -> usize {
        self.remaining
    }

    pub(crate) fn is_done(&self) -> bool {
        self.index == self.pieces.len()
    }

    pub(crate) fn next(&self) -> Option<Next> {
        let piece = self.pieces.get(self.index)?;
        let left = Self::len(piece) - self.offset;
        Some(match piece {
            Piece::Tokens(_) => Next::Tokens(left),
            Piece::Rows(..) => Next::Rows(left),
            Piece::Segment(f, i) => match &f.segments[*i] {
                Segment::Text(_) => Next::Tokens(left),
                Segment::Image(image) if image.causal_rows => Next::Rows(left),
                Segment::Image(_) => Next::Whole,
            },
        })
    }

    /// Add the next `n` inputs (of the kind [`Prefill::next`] said, at most as many) to `batch`.
    pub(crate) fn push(&self, batch: &mut Batch, n: usize) {
        let piece = &self.pieces[self.index];
        let last_piece = self.index + 1 == self.pieces.len();
        for j in 0..n {
            let k = self.offset + j;
            let logits = self.logits_last && last_piece && k + 1 == Self::len(piece);
            let pos = self.pos + j as i32;
            match piece {
                Piece::Tokens(t) => batch.push_token(t[k], pos, self.seq, logits),
                Piece::Segment(f, i) => match &f.segments[*i] {
                    Segment::Text(t) => batch.push_token(t[k], pos, self.seq, logits),
                    Segment::Image(image) => batch.push_row(image.row(k), pos, self.seq, logits),
                },
                Piece::Rows(data, width) => batch.push_row(&data[k * width..(k + 1) * width], pos, self.seq, logits),
            }
        }
    }

    /// The `n` inputs added by [`Prefill::push`] were decoded.
    pub(crate) fn advance(&mut self, n: usize) {
        self.offset += n;
        self.pos += n as i32;
        self.remaining -= n;
        if self.offset == Self::len(&self.pieces[self.index]) {
            self.index += 1;
            self.offset = 0;
        }
    }

    /// Decode the next piece, an image that must be decoded whole ([`Next::Whole`]).
    pub(crate) fn decode_whole(&mut self, ctx: &mut Context) -> Result<()> {
        let Piece::Segment(f, i) = &self.pieces[self.index] else { unreachable!("a whole piece is an image") };
        let Segment::Image(image) = &f.segments[*i] else { unreachable!("a whole piece is an image") };
        self.pos = ctx.decode_image(image, self.pos, self.seq)?;
        self.remaining -= image.rows;
        self.index += 1;
        self.offset = 0;
        Ok(())
    }
}
