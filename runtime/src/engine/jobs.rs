//! What the engine thread is given: generations (answers), frame ingestion and plain jobs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use super::Worker;
use crate::error::{Error, Result};
use crate::llama::Token;
use crate::prefill::Prefill;

/// Whether a generation goes on after a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Decode `token` at `pos` in its branch next step.
    Next {
        token: Token,
        pos: i32,
    },
    Done,
}

/// A generation (an answer) driven by the engine thread step by step.
pub(crate) trait Generation: Send {
    /// Make the history ready in `branch` as far as that needs no prefill (a branch copy, a
    /// snapshot import) and return the prefill still needed (a replayed history, the question
    /// suffix); the logits of its last input give the first token.
    fn start(&mut self, w: &mut Worker, branch: i32) -> Result<Prefill>;
    /// Pick the next token from this generation's logits (the first one after its prefill).
    fn advance(&mut self, logits: &[f32]) -> Progress;
    /// Whether it was cancelled (checked between prefill chunks).
    fn cancelled(&self) -> bool;
    /// Report `error` and stop.
    fn fail(&mut self, error: Error);
    /// Background work (a standing alert's evaluation): every generation a user asked for that
    /// is still waiting starts before it.
    fn background(&self) -> bool {
        false
    }
    /// KV cells it may still take while it decodes (a token each), which the unified pool keeps
    /// for it: a generation that ends at its first token takes none.
    fn cells_to_end(&self) -> usize {
        0
    }
    /// KV cells its start takes at once (a snapshot import), before any prefill.
    fn start_cells(&self) -> usize {
        0
    }
}

pub(super) type Work = Box<dyn FnOnce(&mut Worker) + Send>;
pub(crate) type Begin = Box<dyn FnMut(&mut Worker, &mut Prefill) -> Begun + Send>;

/// What an ingestion's [`Begin`] decided.
pub(crate) enum Begun {
    /// Prefill now.
    Prefill,
    /// Nothing to prefill: the ingestion ended (a prefix-cache hit, or a failure).
    Ended(Result<i32>),
    /// Not yet (a slide waiting for readers of the stream's cells): asked again when it is at
    /// the front again; the stream's later ingestion waits behind it, other streams' passes it.
    NotYet,
}
/// Gets the worker unless the engine is gone (then the result is an error).
pub(crate) type Done = Box<dyn FnOnce(Option<&mut Worker>, Result<i32>) + Send>;

/// Frame ingestion (or committed text) for a stream's sequence, prefilled chunk by chunk in the
/// order it was submitted.
pub(crate) struct Ingestion {
    pub prefill: Prefill,
    /// Runs before the first chunk (e.g. clearing the sequence for a new epoch, or replacing the
    /// prefill when the sequence cannot be shifted); it may end the ingestion without prefill
    /// (a prefix-cache hit) or ask to be run again later.
    pub begin: Option<Begin>,
    /// Runs with the end position once everything is prefilled, or with the error; also when
    /// the ingestion is dropped unfinished (the engine stopped or failed), so nobody waits on it.
    pub done: Option<Done>,
    /// Set when the stream closes: the rest is dropped.
    pub cancel: Arc<AtomicBool>,
    /// Questions waiting for this stream's frames: ingestion earns more time while there are.
    pub demand: Arc<AtomicUsize>,
    /// Estimated cost, counted in the engine's ingestion backlog until done.
    pub cost_ms: f64,
    /// Its `begin` said [`Begun::NotYet`] (set by the scheduler; false when submitted).
    pub waiting: bool,
}

impl Ingestion {
    pub(super) fn finish(mut self, w: &mut Worker, result: Result<i32>) {
        if let Some(done) = self.done.take() {
            done(Some(w), result);
        }
    }
}

impl Drop for Ingestion {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done(None, Err(Error::Engine("the engine stopped before this frame was ingested".into())));
        }
    }
}

pub(super) enum Job {
    /// Work in order with ingestion.
    Run(Work),
    /// Ingestion, chunk by chunk, in order.
    Ingest(Ingestion),
    /// Work an answer waits for (a snapshot export): at once, before any prefill.
    Urgent(Work),
    /// An answer, with the estimated cost of its start (history preparation + suffix).
    Generate(Box<dyn Generation>, f64),
}
