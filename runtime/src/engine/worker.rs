//! What a job sees on the engine thread: the [`Worker`] (the context, the measured stage rates,
//! the thread tuner and the KV accounting).

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::llama::{Batch, Context};
use crate::threads::{CoreMeter, ThreadTuner, thread_cpu_ms};

/// A stage of work whose cost the placer estimates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Prefill, per token (frames, replayed history, question suffixes).
    Prefill,
    /// One batched decode step.
    DecodeStep,
    /// Snapshot export, per token of history.
    Export,
    /// Snapshot import, per token of history.
    Import,
}

/// Stage costs measured on one engine, as exponentially weighted means (ms per unit). They start
/// from a short calibration run when the engine starts, so nothing is assumed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageRates {
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_step: f64,
    pub export_ms_per_token: f64,
    pub import_ms_per_token: f64,
}

impl StageRates {
    fn slot(&mut self, stage: Stage) -> &mut f64 {
        match stage {
            Stage::Prefill => &mut self.prefill_ms_per_token,
            Stage::DecodeStep => &mut self.decode_ms_per_step,
            Stage::Export => &mut self.export_ms_per_token,
            Stage::Import => &mut self.import_ms_per_token,
        }
    }
}

/// What a job sees on the engine thread.
pub struct Worker {
    pub ctx: Context,
    /// Free answer sequences, highest first: the lowest is taken, so active branches stay
    /// adjacent (llama.cpp batches only consecutive sequence ids into one micro-batch when each
    /// sequence has its own KV).
    pub(super) free_branches: Vec<i32>,
    pub(super) rates: Arc<Mutex<StageRates>>,
    /// Stages whose rate is still a seed (the calibration run's, or one set with `set_rate`),
    /// one bit per stage: a first measurement of real work that is faster replaces a seed
    /// instead of blending with it, so a calibration taken while other processes had the cores
    /// (seconds instead of milliseconds) does not mislead the placer for the rest of the run. A
    /// slower one blends as any later one does (the calibration takes the fastest of its runs,
    /// and real work pays graph rebuilds between streams: replacing would make an engine that
    /// has done real work look dearer than an idle one that has not).
    pub(super) seeded: std::cell::Cell<u8>,
    /// The thread counts decode steps and prefill chunks use (see `crate::threads`).
    pub(super) tuner: ThreadTuner,
    pub(super) prefill_tuner: ThreadTuner,
    /// What the cores deliver to the computations: caps both tuners (see `crate::threads`).
    pub(super) meter: CoreMeter,
    /// The thread count the context was last set to.
    pub(super) threads_set: i32,
    /// Bytes one KV cell takes (K and V rows of every layer), measured by the calibration run.
    pub(super) cell_bytes: usize,
    /// Frames go as one batch of rows (the engine's policy, and the model's rows agree).
    pub(super) merge_frames: bool,
    /// The batch of embedding rows chunks of prefill are decoded from, kept between them.
    pub(super) rows_batch: Option<Batch>,
    /// Unified-pool cells an ingestion beginning now may take beside those the answers
    /// decoding may still take (`None`: not counted, as with per-sequence KV or no answer
    /// decoding): a prefix-cache restore, which takes a whole history's cells at once, goes
    /// only where it fits.
    pub entry_room: Option<usize>,
}

/// An engine's KV memory: what its context allocated and what is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvMemory {
    /// Bytes of the cells in use, each counted once however many sequences share it.
    pub in_use_bytes: usize,
    /// Bytes of one cell (0 before the calibration run measured it).
    pub cell_bytes: usize,
    /// Cells the context allocated, for all its sequences.
    pub cells: usize,
}

impl KvMemory {
    pub fn allocated_bytes(&self) -> usize {
        self.cells * self.cell_bytes
    }

    pub fn cells_in_use(&self) -> usize {
        self.in_use_bytes.checked_div(self.cell_bytes).unwrap_or(0)
    }
}

impl Worker {
    /// Run the next computations on `threads` threads.
    pub(super) fn use_threads(&mut self, threads: i32) {
        if threads != self.threads_set {
            self.ctx.set_threads(threads);
            self.threads_set = threads;
        }
    }

    /// Run computation `f` on `threads` threads; returns its result and wall time (ms). The
    /// meter reads the share of it this thread was on a core, and caps the thread counts of
    /// both tuners when a reading says the cores deliver fewer (or more again).
    pub(super) fn compute<T>(&mut self, threads: i32, f: impl FnOnce(&mut Context) -> T) -> (T, f64) {
        self.use_threads(threads);
        let (started, cpu) = (Instant::now(), thread_cpu_ms());
        let out = f(&mut self.ctx);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        if let Some(cap) = self.meter.observe(threads, ms, thread_cpu_ms() - cpu) {
            self.set_thread_cap(cap);
        }
        (out, ms)
    }

    /// At most `cap` threads for every computation from now on.
    pub(super) fn set_thread_cap(&mut self, cap: i32) {
        self.tuner.set_cap(cap);
        self.prefill_tuner.set_cap(cap);
    }

    pub fn kv_memory(&mut self) -> KvMemory {
        KvMemory { in_use_bytes: self.ctx.kv_bytes_in_use(), cell_bytes: self.cell_bytes, cells: self.ctx.n_ctx() }
    }

    /// Record that `units` of `stage` took `ms`.
    pub fn record(&self, stage: Stage, units: usize, ms: f64) {
        if units > 0 {
            let bit = 1 << stage as u8;
            let seed = self.seeded.get() & bit != 0;
            self.seeded.set(self.seeded.get() & !bit);
            let mut rates = self.rates.lock();
            let slot = rates.slot(stage);
            let sample = ms / units as f64;
            *slot = if *slot <= 0.0 || (seed && sample < *slot) { sample } else { 0.8 * *slot + 0.2 * sample };
        }
    }

    /// Seed a stage's rate (ms per unit): used until the first measurement of that stage's real
    /// work replaces it. The calibration run seeds every stage; tests and callers that know an
    /// engine's rates better may too.
    pub fn set_rate(&self, stage: Stage, ms_per_unit: f64) {
        *self.rates.lock().slot(stage) = ms_per_unit;
        self.seeded.set(self.seeded.get() | 1 << stage as u8);
    }

    /// Seed a stage's rate from a calibration measurement.
    pub(super) fn seed(&self, stage: Stage, units: usize, ms: f64) {
        self.set_rate(stage, ms / units as f64);
    }

    pub(super) fn prefill_ms_per_token(&self) -> f64 {
        self.rates.lock().prefill_ms_per_token.max(0.01)
    }

    /// The model, when frames go as one batch of rows here (for [`crate::prefill::Prefill::new`]).
    pub(crate) fn frame_rows(&self) -> Option<&crate::llama::Model> {
        self.merge_frames.then(|| &**self.ctx.model())
    }

    pub(super) fn take_branch(&mut self) -> Option<i32> {
        self.free_branches.pop()
    }

    /// Clear a branch's cells and make it free again.
    pub(super) fn release(&mut self, seq: i32) {
        self.ctx.seq_clear(seq);
        let at = self.free_branches.partition_point(|&s| s > seq);
        self.free_branches.insert(at, seq);
    }
}
