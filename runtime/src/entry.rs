//! The entries of a stream's history after its prompt: encoded frames and committed text. Plain
//! data that the stream's timeline, prefill and replay share (kept apart from `stream` so that
//! the engine's prefill does not reach into the stream).

use std::sync::Arc;

use crate::llama::{Segment, Token};
use crate::prefix::PrefixKey;

/// One encoded frame's inputs to the language model, retained for replay and the baseline.
#[derive(Debug)]
pub struct Frame {
    pub segments: Vec<Segment>,
    /// Identity of the picture (hash of its pixels, the encoder and its preprocessing).
    pub content_hash: u64,
}

/// One entry of a history after its prompt: a frame, or committed text (a question and its
/// answer, under the `commit-answers` policy).
#[derive(Debug, Clone)]
pub enum Entry {
    Frame(Arc<Frame>),
    Text(Arc<[Token]>),
}

impl Entry {
    /// Positions the entry occupies in the language sequence.
    pub fn n_pos(&self) -> i32 {
        match self {
            Entry::Frame(f) => f.n_pos(),
            Entry::Text(t) => t.len() as i32,
        }
    }

    /// KV cells the entry fills: one per text token and one per embedding row (more than its
    /// positions for an M-RoPE image).
    pub fn cells(&self) -> i32 {
        match self {
            Entry::Frame(f) => f.cells(),
            Entry::Text(t) => t.len() as i32,
        }
    }

    /// The prefix key of a history with this entry appended to `base`.
    pub(crate) fn extend(&self, base: PrefixKey) -> PrefixKey {
        match self {
            Entry::Frame(f) => base.then_frame(f.content_hash, f.n_pos()),
            Entry::Text(t) => base.then_text(t),
        }
    }
}

impl Frame {
    /// Positions the frame occupies in the language sequence.
    pub fn n_pos(&self) -> i32 {
        self.segments
            .iter()
            .map(|s| match s {
                Segment::Text(t) => t.len() as i32,
                Segment::Image(i) => i.n_pos,
            })
            .sum()
    }

    /// KV cells the frame fills: one per text token and one per embedding row. An M-RoPE image
    /// (Qwen2-VL) fills a cell per row but advances only `n_pos` positions, so a sequence's
    /// capacity is counted in cells, never in positions.
    pub fn cells(&self) -> i32 {
        self.segments
            .iter()
            .map(|s| match s {
                Segment::Text(t) => t.len() as i32,
                Segment::Image(i) => i.rows as i32,
            })
            .sum()
    }
}
