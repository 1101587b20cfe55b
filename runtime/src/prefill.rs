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
    Rows(Vec<f32>, usize),
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
    Some(Piece::Rows(data, width))
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

/// Where a branch's cells before its prefill's first position came from: a prefix of a stream's
/// sequence (its home sequence, epoch and end). Branches of one origin hold the same cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Origin {
    pub seq: i32,
    pub epoch: u32,
    pub end: i32,
}

/// The inputs a sequence still has to prefill, from position `pos` on.
pub(crate) struct Prefill {
    pub seq: i32,
    /// Set for a branch of a stream's sequence (see [`batch_together`]).
    pub origin: Option<Origin>,
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
        Prefill { seq, origin: None, pieces, index: 0, offset: 0, pos, logits_last, remaining }
    }

    /// This prefill continues a branch of `origin`.
    pub(crate) fn branched_from(self, origin: Origin) -> Prefill {
        Prefill { origin: Some(origin), ..self }
    }

    /// The tokens left, when all that is left is one run of tokens.
    pub(crate) fn tokens_left(&self) -> Option<&[Token]> {
        let tokens = match self.pieces.get(self.index..)? {
            [Piece::Tokens(t)] => &t[..],
            [Piece::Segment(f, i)] => match &f.segments[*i] {
                Segment::Text(t) => &t[..],
                Segment::Image(_) => return None,
            },
            _ => return None,
        };
        Some(&tokens[self.offset..])
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

    /// Inputs left in the piece [`Prefill::next`] describes (an image decoded whole takes them
    /// all at once).
    pub(crate) fn next_len(&self) -> usize {
        self.pieces.get(self.index).map_or(0, |p| Self::len(p) - self.offset)
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

/// The rest of several prefills, each one run of tokens ([`Prefill::tokens_left`]), in one
/// batch; returns it and, for each prefill, the entry of its last token (its logits). With
/// `share` (a unified KV pool, where one cell can belong to several sequences) the prefills of
/// one [`Origin`] decode the tokens they agree on once: each distinct prefix is one entry that
/// carries every sequence having it, a trie laid out level by level so that each sequence's
/// positions rise, as llama.cpp's shared system prompt is decoded. N alerts opening with the
/// same words ("<turn> User: Is there") pay for those words once. A prefill that shares with
/// none is its run of tokens, in order, as [`Prefill::push`] adds it.
pub(crate) fn batch_together(prefills: &[&Prefill], share: bool) -> (Batch, Vec<usize>) {
    struct Entry {
        token: Token,
        pos: i32,
        seqs: Vec<i32>,
        logits: bool,
    }
    // The groups of prefills that may share, in the order of their first prefill.
    let key = |p: &Prefill| share.then_some(p.origin.map(|o| (o, p.pos))).flatten();
    let mut groups: Vec<Vec<usize>> = vec![];
    for (i, p) in prefills.iter().enumerate() {
        match groups.iter_mut().find(|g| key(p).is_some() && key(prefills[g[0]]) == key(p)) {
            Some(group) => group.push(i),
            None => groups.push(vec![i]),
        }
    }
    let mut entries: Vec<Entry> = vec![];
    let mut last = vec![0; prefills.len()];
    for group in groups {
        let runs: Vec<&[Token]> =
            group.iter().map(|&i| prefills[i].tokens_left().expect("one run of tokens")).collect();
        // The entry each prefill's previous token went into: a trie node is (parent, token).
        let mut parent: Vec<Option<usize>> = vec![None; group.len()];
        for d in 0..runs.iter().map(|r| r.len()).max().unwrap_or(0) {
            let mut level = std::collections::HashMap::new();
            for (k, &i) in group.iter().enumerate() {
                let Some(&token) = runs[k].get(d) else { continue };
                let p = prefills[i];
                let at = *level.entry((parent[k], token)).or_insert_with(|| {
                    entries.push(Entry { token, pos: p.pos + d as i32, seqs: vec![], logits: false });
                    entries.len() - 1
                });
                entries[at].seqs.push(p.seq);
                if d + 1 == runs[k].len() {
                    entries[at].logits |= p.logits_last;
                    last[i] = at;
                }
                parent[k] = Some(at);
            }
        }
    }
    let mut batch = Batch::shared_tokens(entries.len(), prefills.len());
    for e in &entries {
        batch.push_shared_token(e.token, e.pos, &e.seqs, e.logits);
    }
    (batch, last)
}
