//! A language engine: one loaded model on one device plus one llama.cpp context with several
//! sequences, owned by one thread that runs a step scheduler (llama.cpp's server model: tasks in
//! on one queue, results out on channels, one batch per decode step for every active sequence).
//!
//! Sequences `0..max_streams` hold streams' histories; the others are answer branches. Each step
//! of the thread's loop:
//! 1. decodes the next token of every active answer in one batch;
//! 2. prefills at most `step_budget_ms` of input: the next chunk of an answer that is starting
//!    (its replayed history and question suffix) or else the next chunk of frame ingestion (in
//!    arrival order, except that a stream whose frames a question waits for goes before streams
//!    nobody waits on: earliest deadline first), so a decode step never waits longer than the
//!    budget behind prefill (chunked prefill, as in vLLM and Sarathi-Serve); with no answer
//!    decoding, a chunk may take a few budgets (larger chunks cost less per input);
//! 3. while answers are decoding, ingestion earns credit at `ingest_share` of the engine's time
//!    and runs a chunk when it has a budget's worth, so answers keep `1 - ingest_share` of their
//!    idle decode rate; while a question waits for frames still being ingested, ingestion gets a
//!    budget every step (that question is an answer starting); with no answer active, ingestion
//!    runs back to back.
//!
//! Ingestion that cannot keep up shows as lag on its stream, where the overload policy applies.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::llama::{Batch, Context, ContextParams, Device, KvType, Model, Token};
use crate::models;
use crate::prefill::{Next, Prefill, chunk_len};
use crate::prefix::CompatTag;
use crate::threads::ThreadTuner;

/// How an engine is built.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The name questions and `placement` refer to (`cpu`, `gpu`, ...).
    pub name: String,
    pub device: Device,
    pub threads: i32,
    /// KV cells per sequence: the longest history (plus question and answer) a stream can hold.
    pub context_per_sequence: u32,
    pub max_streams: u32,
    /// Answers generated at once (each needs a sequence of its own).
    pub max_branches: u32,
    /// Flash attention: faster KV export on GPUs, but V is stored untransposed, so snapshots
    /// only move between engines that agree on it.
    pub flash_attention: bool,
    /// How the KV cells of streams and answers are laid out.
    pub kv_layout: KvLayout,
    /// Element type of K and V (quantized types need flash attention).
    pub kv_type: KvType,
    /// With [`KvLayout::Unified`]: the cells an answer may take beyond the version it reads
    /// (its question and its tokens).
    pub answer_cells: u32,
    /// CPU cores the engine's threads run on (none: wherever the OS puts them).
    pub cores: Vec<usize>,
    /// Most prefill (ms, from measured rates) run between two decode steps.
    pub step_budget_ms: f64,
    /// Share of the engine's time frame ingestion gets while answers are decoding.
    pub ingest_share: f64,
}

/// Default most prefill between two decode steps (ms). Measured on the 2-core CI machine
/// (`cargo run -p vlm-runtime --example chunks`): a 12-token chunk (~38 ms) costs 7% more per
/// token than a whole 36-token frame, a 6-token one 21% more; under a live load the switches
/// between decode steps, chunks and streams (graph rebuilds) cost more again: two streams'
/// frames took ~435 ms to ingest at 40 ms, ~350 ms at 100 ms and ~320 ms whole. At 150 ms a
/// 36-token frame goes whole even while an answer decodes (a split one cost ~165 ms against
/// ~130 ms): with 2 streams at 2 frames/s and 16-token answers, mean TTFT was 22% lower than at
/// 100 ms (4 alternating runs, lower in each), with 128-token answers level.
pub const DEFAULT_STEP_BUDGET_MS: f64 = 150.0;
/// Default share of the engine's time that ingestion gets while answers decode.
pub const DEFAULT_INGEST_SHARE: f64 = 0.25;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: "cpu".into(),
            device: Device::Cpu,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get() as i32),
            context_per_sequence: 2048,
            max_streams: 2,
            max_branches: 8,
            flash_attention: false,
            kv_layout: KvLayout::PerSequence,
            kv_type: KvType::F16,
            answer_cells: 256,
            cores: Vec::new(),
            step_budget_ms: DEFAULT_STEP_BUDGET_MS,
            ingest_share: DEFAULT_INGEST_SHARE,
        }
    }
}

/// How an engine's KV cells are laid out (llama.cpp's `kv_unified`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvLayout {
    /// A buffer of `context_per_sequence` cells for every stream and every answer: a branch
    /// copies its version's prefix; retained, branched and re-prefilled histories give
    /// bit-identical logits.
    #[default]
    PerSequence,
    /// One pool for all: a branch shares its version's prefix cells (it costs its suffix), the
    /// pool is sized from the streams and answers (`context_per_sequence` per stream and one
    /// more for versions held over a restart or an import, `answer_cells` per answer). Attention
    /// then runs over the pool's cells in pool order, so greedy tokens agree with a re-prefill
    /// closely but not bit for bit (docs/benchmarks.md, "Memory").
    Unified,
}

impl KvLayout {
    pub fn name(self) -> &'static str {
        match self {
            KvLayout::PerSequence => "per-sequence",
            KvLayout::Unified => "unified",
        }
    }

    pub fn parse(name: &str) -> Option<KvLayout> {
        [KvLayout::PerSequence, KvLayout::Unified].into_iter().find(|l| l.name() == name)
    }
}

impl EngineConfig {
    /// Cells of the unified pool (`None` for per-sequence buffers).
    pub fn unified_cells(&self) -> Option<u32> {
        (self.kv_layout == KvLayout::Unified)
            .then(|| (self.max_streams + 1) * self.context_per_sequence + self.max_branches * self.answer_cells)
    }
}

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

impl EngineConfig {
    /// Engines from a list such as `cpu`, `cpu,gpu` or `big:cpu:4:4-7,little:cpu:4:0-3`: each
    /// entry is `NAME[:DEVICE[:THREADS[:CORES]]]`, DEVICE `cpu` or `gpu` (default: `gpu` for a name
    /// starting with "gpu", else `cpu`), THREADS defaulting to `base.threads`, CORES a list of
    /// cores and ranges joined by `+` (`0-3`, `4+6`). Other fields come from `base`. The parsing
    /// itself is [`crate::engine_spec::parse_list`].
    pub fn parse_list(spec: &str, base: &EngineConfig) -> Result<Vec<EngineConfig>> {
        let specs = crate::engine_spec::parse_list(spec).map_err(Error::Config)?;
        Ok(specs
            .into_iter()
            .map(|e| EngineConfig {
                name: e.name,
                device: if e.gpu { Device::Gpu } else { Device::Cpu },
                threads: e.threads.unwrap_or(base.threads),
                cores: e.cores,
                ..base.clone()
            })
            .collect())
    }
}

/// What a job sees on the engine thread.
pub struct Worker {
    pub ctx: Context,
    /// Free answer sequences, highest first: the lowest is taken, so active branches stay
    /// adjacent (llama.cpp batches only consecutive sequence ids into one micro-batch when each
    /// sequence has its own KV).
    free_branches: Vec<i32>,
    rates: Arc<Mutex<StageRates>>,
    /// Stages whose rate is still a seed (the calibration run's, or one set with `set_rate`),
    /// one bit per stage: a first measurement of real work that is faster replaces a seed
    /// instead of blending with it, so a calibration taken while other processes had the cores
    /// (seconds instead of milliseconds) does not mislead the placer for the rest of the run. A
    /// slower one blends as any later one does (the calibration takes the fastest of its runs,
    /// and real work pays graph rebuilds between streams: replacing would make an engine that
    /// has done real work look dearer than an idle one that has not).
    seeded: std::cell::Cell<u8>,
    /// The thread count computations use (see `crate::threads`).
    tuner: ThreadTuner,
    /// Bytes one KV cell takes (K and V rows of every layer), measured by the calibration run.
    cell_bytes: usize,
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
    fn seed(&self, stage: Stage, units: usize, ms: f64) {
        self.set_rate(stage, ms / units as f64);
    }

    fn prefill_ms_per_token(&self) -> f64 {
        self.rates.lock().prefill_ms_per_token.max(0.01)
    }

    fn take_branch(&mut self) -> Option<i32> {
        self.free_branches.pop()
    }

    /// Clear a branch's cells and make it free again.
    fn release(&mut self, seq: i32) {
        self.ctx.seq_clear(seq);
        let at = self.free_branches.partition_point(|&s| s > seq);
        self.free_branches.insert(at, seq);
    }
}

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
}

type Work = Box<dyn FnOnce(&mut Worker) + Send>;
pub(crate) type Begin = Box<dyn FnOnce(&mut Worker) -> Option<Result<i32>> + Send>;
/// Gets the worker unless the engine is gone (then the result is an error).
pub(crate) type Done = Box<dyn FnOnce(Option<&mut Worker>, Result<i32>) + Send>;

/// Frame ingestion (or committed text) for a stream's sequence, prefilled chunk by chunk in the
/// order it was submitted.
pub(crate) struct Ingestion {
    pub prefill: Prefill,
    /// Runs before the first chunk (e.g. clearing the sequence for a new epoch); returning a
    /// result ends the ingestion without prefill (a prefix-cache hit).
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
}

impl Ingestion {
    fn finish(mut self, w: &mut Worker, result: Result<i32>) {
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

enum Job {
    /// Work in order with ingestion.
    Run(Work),
    /// Ingestion, chunk by chunk, in order.
    Ingest(Ingestion),
    /// Work an answer waits for (a snapshot export): at once, before any prefill.
    Urgent(Work),
    /// An answer, with the estimated cost of its start (history preparation + suffix).
    Generate(Box<dyn Generation>, f64),
}

/// Ordered work: ingestion and plain jobs, first come first served, except that a stream whose
/// frames a question waits for goes before other streams' ingestion (`Scheduler::promote_demanded`).
enum Ordered {
    Run(Work),
    Ingest(Ingestion),
}

/// An answer prefilling its history or question.
struct Starting {
    generation: Box<dyn Generation>,
    branch: i32,
    prefill: Prefill,
}

struct Active {
    generation: Box<dyn Generation>,
    branch: i32,
    next: (Token, i32),
}

/// What the engine thread and the engine's handles share.
struct Shared {
    /// Set by the caller of `start_cancellable` to abandon the calibration run.
    cancel: Arc<AtomicBool>,
    /// Set by `Engine::stop`, with the same effect.
    stopping: AtomicBool,
    /// The thread count computations use now.
    threads: std::sync::atomic::AtomicI32,
    widest: AtomicUsize,
    rates: Arc<Mutex<StageRates>>,
    /// Estimated milliseconds of queued ingestion (and other ordered work).
    /// (ingestions queued, their estimated milliseconds): the count says whether any is waiting,
    /// whatever rounding the sum of estimates leaves.
    ingest_backlog: Mutex<(usize, f64)>,
    /// Estimated milliseconds of answer starts queued or running, which go before ingestion.
    start_backlog: Mutex<f64>,
    /// Decode steps run while ingestion was waiting, and their total time (ms).
    busy_steps: Mutex<(u64, f64)>,
    /// Decode steps run with no ingestion waiting, and their total time (ms).
    idle_steps: Mutex<(u64, f64)>,
    /// The KV memory after the last step.
    kv: Mutex<KvMemory>,
}

/// The engine thread's state: the step scheduler.
struct Scheduler {
    budget_ms: f64,
    share: f64,
    waiting: VecDeque<(Box<dyn Generation>, f64)>,
    starting: VecDeque<Starting>,
    active: Vec<Active>,
    ordered: VecDeque<Ordered>,
    /// Milliseconds of prefill that ingestion has earned while answers decode.
    credit_ms: f64,
}

impl Scheduler {
    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.starting.is_empty() && self.active.is_empty() && self.ordered.is_empty()
    }

    fn take(&mut self, job: Job, w: &mut Worker) {
        match job {
            Job::Run(f) => self.ordered.push_back(Ordered::Run(f)),
            Job::Ingest(i) => self.ordered.push_back(Ordered::Ingest(i)),
            Job::Urgent(f) => f(w),
            Job::Generate(g, cost) => self.waiting.push_back((g, cost)),
        }
    }

    /// Start waiting answers while branches are free.
    fn start_answers(&mut self, w: &mut Worker, shared: &Shared) {
        while !self.waiting.is_empty() {
            let Some(branch) = w.take_branch() else { return };
            let (mut generation, cost) = self.waiting.pop_front().expect("not empty");
            *shared.start_backlog.lock() -= cost;
            match generation.start(w, branch) {
                Ok(prefill) => self.starting.push_back(Starting { generation, branch, prefill }),
                Err(e) => {
                    generation.fail(e);
                    w.release(branch);
                }
            }
        }
    }

    /// One decode step of every active answer; returns its duration in ms.
    fn decode_step(&mut self, w: &mut Worker, shared: &Shared) -> f64 {
        if self.active.is_empty() {
            return 0.0;
        }
        self.active.sort_by_key(|a| a.branch);
        let mut batch = Batch::tokens(self.active.len());
        for a in &self.active {
            batch.push_token(a.next.0, a.next.1, a.branch, true);
        }
        shared.widest.fetch_max(self.active.len(), Ordering::Relaxed);
        let started = Instant::now();
        let step = w.ctx.decode(&batch);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        w.record(Stage::DecodeStep, 1, ms);
        if let Some(threads) = w.tuner.observe(ms, self.active.len()) {
            w.ctx.set_threads(threads);
            shared.threads.store(threads, Ordering::Relaxed);
        }
        let steps = if self.ordered.is_empty() { &shared.idle_steps } else { &shared.busy_steps };
        let mut steps = steps.lock();
        steps.0 += 1;
        steps.1 += ms;
        drop(steps);
        let mut i = 0;
        self.active.retain_mut(|a| {
            let progress = match step.as_ref().map_err(Clone::clone).and_then(|()| w.ctx.logits(i)) {
                Ok(logits) => a.generation.advance(logits),
                Err(e) => {
                    a.generation.fail(e);
                    Progress::Done
                }
            };
            i += 1;
            match progress {
                Progress::Next { token, pos } => {
                    a.next = (token, pos);
                    true
                }
                Progress::Done => {
                    w.release(a.branch);
                    false
                }
            }
        });
        ms
    }

    /// Prefill up to `budget_ms` of the front starting answer; returns whether one was there.
    fn prefill_start(&mut self, w: &mut Worker) -> bool {
        let budget = self.chunk_budget_ms();
        let Some(s) = self.starting.front_mut() else { return false };
        let mut spent = 0.0;
        let result = loop {
            if s.generation.cancelled() {
                break Err(Error::Cancelled);
            }
            if s.prefill.is_done() {
                break Ok(());
            }
            if spent >= budget {
                return true;
            }
            let tokens = ((budget - spent) / w.prefill_ms_per_token()) as usize;
            let started = Instant::now();
            if let Err(e) = prefill_chunk(w, &mut s.prefill, tokens.max(MIN_CHUNK)) {
                break Err(e);
            }
            spent += started.elapsed().as_secs_f64() * 1e3;
        };
        let mut s = self.starting.pop_front().expect("front");
        let progress = match result.and_then(|()| w.ctx.last_logits()) {
            Ok(logits) => s.generation.advance(logits),
            Err(e) => {
                s.generation.fail(e);
                Progress::Done
            }
        };
        match progress {
            Progress::Next { token, pos } => {
                self.active.push(Active { generation: s.generation, branch: s.branch, next: (token, pos) })
            }
            Progress::Done => w.release(s.branch),
        }
        true
    }

    /// Run ordered work: a plain job, or up to `allowed_ms` of the front ingestion. Returns the
    /// time spent (ms).
    ///
    /// Frames of several streams are not put in one batch: measured here (CPU backend,
    /// per-sequence KV), a batch of two streams' chunks took several times as long as the two
    /// chunks one after the other, and whole frames even less.
    fn ingest(&mut self, w: &mut Worker, shared: &Shared, allowed_ms: f64) -> f64 {
        self.promote_demanded();
        let started = Instant::now();
        let elapsed = || started.elapsed().as_secs_f64() * 1e3;
        let ended = match self.ordered.front_mut() {
            None => return 0.0,
            Some(Ordered::Run(_)) => {
                if let Some(Ordered::Run(f)) = self.ordered.pop_front() {
                    f(w);
                }
                return elapsed();
            }
            // Begin it: a cache hit, a cancellation or nothing left to prefill ends it at once.
            Some(Ordered::Ingest(ing)) => ing
                .begin
                .take()
                .and_then(|begin| begin(w))
                .or_else(|| ing.cancel.load(Ordering::Acquire).then_some(Err(Error::Cancelled)))
                .or_else(|| ing.prefill.is_done().then_some(Ok(ing.prefill.pos))),
        };
        if let Some(result) = ended {
            self.finish(w, shared, 0, result);
            return elapsed();
        }
        let Some(Ordered::Ingest(ing)) = self.ordered.front_mut() else { unreachable!("checked above") };
        let tokens = (allowed_ms / w.prefill_ms_per_token()) as usize;
        let result = prefill_chunk(w, &mut ing.prefill, tokens.max(MIN_CHUNK));
        if result.is_err() || ing.prefill.is_done() {
            let end = ing.prefill.pos;
            self.finish(w, shared, 0, result.map(|()| end));
        }
        elapsed()
    }

    fn finish(&mut self, w: &mut Worker, shared: &Shared, index: usize, result: Result<i32>) {
        if let Some(Ordered::Ingest(ing)) = self.ordered.remove(index) {
            let mut backlog = shared.ingest_backlog.lock();
            backlog.0 -= 1;
            backlog.1 -= ing.cost_ms;
            drop(backlog);
            ing.finish(w, result);
        }
    }

    /// Most prefill in one step: the budget while answers decode; with none decoding, nothing
    /// waits on a chunk but a question that arrives meanwhile, and fewer, larger chunks cost less
    /// per input (measured: a 36-token frame in two chunks took ~165 ms under the live workload,
    /// whole ~130 ms), so the limit is `IDLE_CHUNK_FACTOR` budgets.
    fn chunk_budget_ms(&self) -> f64 {
        if self.active.is_empty() { self.budget_ms * IDLE_CHUNK_FACTOR } else { self.budget_ms }
    }

    /// Earliest deadline first among the ingestions at the front: the first ingestion of a stream
    /// whose frames a question waits for goes before those of streams nobody waits on. A stream's
    /// own ingestions keep their order (demand is per stream, so the first demanded one is that
    /// stream's earliest), and nothing passes a plain job.
    fn promote_demanded(&mut self) {
        let demanded = |o: &Ordered| matches!(o, Ordered::Ingest(i) if i.demand.load(Ordering::Acquire) > 0);
        let mut leading = self.ordered.iter().take_while(|o| matches!(o, Ordered::Ingest(_)));
        if let Some(index) = leading.position(demanded).filter(|&i| i > 0) {
            let ingestion = self.ordered.remove(index).expect("in range");
            self.ordered.push_front(ingestion);
        }
    }

    /// Whether a question waits for frames still being ingested.
    fn demanded(&self) -> bool {
        self.ordered.iter().any(|o| matches!(o, Ordered::Ingest(i) if i.demand.load(Ordering::Acquire) > 0))
    }

    /// One step: decode, then prefill within the budget.
    fn step(&mut self, w: &mut Worker, shared: &Shared) {
        self.start_answers(w, shared);
        let decode_ms = self.decode_step(w, shared);
        if self.prefill_start(w) || self.ordered.is_empty() {
            return;
        }
        if self.active.is_empty() {
            self.credit_ms = 0.0;
            self.ingest(w, shared, self.chunk_budget_ms());
            return;
        }
        // A question waiting for a frame is an answer starting: its frames get a budget every
        // step, like the prefill of an answer's question.
        if self.demanded() {
            self.ingest(w, shared, self.budget_ms);
            return;
        }
        let share = self.share;
        self.credit_ms = (self.credit_ms + decode_ms * share / (1.0 - share)).min(self.budget_ms);
        if self.credit_ms >= self.budget_ms {
            let spent = self.ingest(w, shared, self.budget_ms);
            self.credit_ms -= spent;
        }
    }
}

/// How many step budgets a chunk may take while no answer decodes (see
/// `Scheduler::chunk_budget_ms`): 4 made 2 streams x 2 frames/s with 16-token answers answer
/// 18% sooner on average than 1 (8 alternating runs on the 2-core machine).
const IDLE_CHUNK_FACTOR: f64 = 4.0;

/// Fewest inputs in a chunk of prefill. Each switch between a decode step, a chunk and
/// another sequence's chunk makes llama.cpp build its graph again, a cost that small chunks pay
/// per input and that would feed back into the measured rate (smaller chunks, dearer inputs).
const MIN_CHUNK: usize = 8;

/// Decode the next chunk of `prefill`: about `tokens` inputs (`chunk_len` decides), never more
/// than one `llama_decode` takes (`n_batch`: a fast measured rate asks for more), or an image
/// that must go whole.
fn prefill_chunk(w: &mut Worker, prefill: &mut Prefill, tokens: usize) -> Result<()> {
    let Some(next) = prefill.next() else { return Ok(()) };
    let started = Instant::now();
    let before = prefill.remaining();
    match next {
        Next::Whole => prefill.decode_whole(&mut w.ctx)?,
        Next::Tokens(available) | Next::Rows(available) => {
            let n = chunk_len(available, tokens.min(w.ctx.n_batch() as usize));
            let mut batch = match next {
                Next::Tokens(_) => Batch::tokens(n),
                _ => Batch::embeddings(n, w.ctx.model().n_embd()),
            };
            prefill.push(&mut batch, n);
            w.ctx.decode(&batch)?;
            prefill.advance(n);
        }
    }
    w.record(Stage::Prefill, before - prefill.remaining(), started.elapsed().as_secs_f64() * 1e3);
    Ok(())
}

pub struct Engine {
    config: EngineConfig,
    model: Arc<Model>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    shared: Arc<Shared>,
    free_streams: Mutex<VecDeque<i32>>,
    n_ctx_per_seq: u32,
    /// Why [`crate::stream::HistoryPolicy::Slide`] cannot shift in place here, if it cannot.
    shift_refusal: Option<String>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The engine thread's loop.
fn run(mut w: Worker, jobs: mpsc::Receiver<Job>, shared: Arc<Shared>, config: &EngineConfig) {
    calibrate(&mut w, &|| {
        shared.cancel.load(Ordering::Acquire) || shared.stopping.load(Ordering::Acquire) || crate::llama::exiting()
    });
    shared.threads.store(w.tuner.threads(), Ordering::Relaxed);
    *shared.kv.lock() = w.kv_memory();
    crate::llama::stop_workers_before_exit();
    let mut s = Scheduler {
        budget_ms: config.step_budget_ms,
        share: config.ingest_share,
        waiting: VecDeque::new(),
        starting: VecDeque::new(),
        active: Vec::new(),
        ordered: VecDeque::new(),
        credit_ms: 0.0,
    };
    loop {
        if crate::llama::exiting() {
            return; // the process is exiting: drop the work, free the context
        }
        let first = if s.idle() {
            match jobs.recv_timeout(std::time::Duration::from_millis(200)) {
                Ok(job) => Some(job),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return, // stopped, every job done
            }
        } else {
            jobs.try_recv().ok()
        };
        // A panic in a job or a step ends this engine only: dropping the scheduler fails every
        // answer and ingestion it holds (their callers get an error, nobody is left waiting),
        // later jobs are refused, and the other engines and streams go on.
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for job in first.into_iter().chain(std::iter::from_fn(|| jobs.try_recv().ok())) {
                s.take(job, &mut w);
            }
            s.step(&mut w, &shared);
            *shared.kv.lock() = w.kv_memory();
        }));
        if let Err(panic) = stepped {
            let what = crate::error::panic_message(panic.as_ref());
            crate::llama::log(crate::llama::LogLevel::Error, &format!("engine {}: panic: {what}", config.name));
            return;
        }
    }
}

/// Seed the stage rates with a short run on a scratch branch: 32 tokens of prefill (twice), 6
/// decode steps, one export and import. `cancelled` is asked before each computation: a stop,
/// an error elsewhere in the pipeline or the process's exit never waits for more than the one
/// running (seconds under heavy CPU contention, where the whole run took a minute).
fn calibrate(w: &mut Worker, cancelled: &dyn Fn() -> bool) {
    let Some(seq) = w.free_branches.last().copied() else { return };
    // First the thread count (`crate::threads`): the fastest of 4 decode steps with each
    // candidate, one thread first, so the rest (and the first prefill, which took seconds with
    // spinning threads under contention) runs with the faster. A candidate whose fastest of
    // two steps is three times slower than the best so far stops there: under contention a
    // step with spinning threads can take a second.
    let candidates = w.tuner.candidates().to_vec();
    if candidates.len() > 1 {
        let mut best = f64::INFINITY;
        for (i, &threads) in candidates.iter().enumerate().rev() {
            w.ctx.set_threads(threads);
            w.ctx.seq_clear(seq);
            if cancelled() {
                return;
            }
            let fastest = fastest_step(w, seq, 0..4, &|steps, ms| cancelled() || (steps >= 2 && ms > 3.0 * best));
            w.tuner.seed(i, fastest);
            best = best.min(fastest);
        }
        let threads = w.tuner.choose_best();
        w.ctx.set_threads(threads);
    }
    let tokens: Vec<Token> = (0..32).map(|i| 100 + i).collect();
    // The faster of two prefills: a GPU backend builds its pipelines on the first one.
    let mut fastest = f64::INFINITY;
    for _ in 0..2 {
        if cancelled() {
            return;
        }
        w.ctx.seq_clear(seq);
        let t = Instant::now();
        if w.ctx.decode_tokens(&tokens, 0, seq, true).is_err() {
            return;
        }
        fastest = fastest.min(t.elapsed().as_secs_f64() * 1e3);
    }
    w.seed(Stage::Prefill, tokens.len(), fastest);
    // The fastest of 6 steps: the first builds its graph, and engines starting together slow
    // each other's first steps; a slow seed would make an idle engine look busy to the placer.
    let fastest = fastest_step(w, seq, 32..38, &|_, _| cancelled());
    if fastest.is_finite() {
        w.seed(Stage::DecodeStep, 1, fastest);
    }
    let t = Instant::now();
    if let Some(snapshot) = (!cancelled()).then(|| w.ctx.seq_snapshot(seq).ok()).flatten() {
        w.seed(Stage::Export, 38, t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        if w.ctx.seq_restore(seq, &snapshot).is_ok() {
            w.seed(Stage::Import, 38, t.elapsed().as_secs_f64() * 1e3);
        }
    }
    // A cell's bytes: the difference between the cells held now and 16 fewer (the serialised
    // state also has a header per sequence stream and per layer).
    let (held, full) = (w.ctx.seq_pos_max(seq) + 1, w.ctx.kv_bytes_in_use());
    if held > 16 {
        w.ctx.seq_truncate(seq, held - 16);
        w.cell_bytes = full.saturating_sub(w.ctx.kv_bytes_in_use()) / 16;
    }
    w.ctx.seq_clear(seq);
}

/// The fastest (ms) of one-token decode steps of `seq` at `positions` (infinite when none ran);
/// `stop` is asked before each step with the steps run and their fastest so far.
fn fastest_step(w: &mut Worker, seq: i32, positions: std::ops::Range<i32>, stop: &dyn Fn(usize, f64) -> bool) -> f64 {
    let mut fastest = f64::INFINITY;
    for (steps, pos) in positions.enumerate() {
        if stop(steps, fastest) {
            break;
        }
        let t = Instant::now();
        if w.ctx.decode_tokens(&[100], pos, seq, true).is_err() {
            break;
        }
        fastest = fastest.min(t.elapsed().as_secs_f64() * 1e3);
    }
    fastest
}

/// Decode rates an engine observed (see [`Engine::decode_rates`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DecodeRates {
    /// Decode steps run while ingestion was waiting, and their mean duration (ms).
    pub busy_steps: u64,
    pub busy_ms_per_step: f64,
    /// Decode steps run with no ingestion waiting, and their mean duration (ms).
    pub idle_steps: u64,
    pub idle_ms_per_step: f64,
}

impl Engine {
    /// Load (or share) the model, start the engine thread and wait for its calibration run.
    pub fn start(model_path: &std::path::Path, config: EngineConfig) -> Result<Arc<Engine>> {
        Engine::start_cancellable(model_path, config, &Arc::new(AtomicBool::new(false)))
    }

    /// [`Engine::start`] that gives up with [`Error::Cancelled`] soon after `cancel` is set
    /// (during the calibration run: between two of its computations).
    pub fn start_cancellable(
        model_path: &std::path::Path,
        config: EngineConfig,
        cancel: &Arc<AtomicBool>,
    ) -> Result<Arc<Engine>> {
        if config.max_streams == 0 || config.max_branches == 0 || config.context_per_sequence < 64 {
            return Err(Error::Config(
                "an engine needs at least one stream, one branch and 64 cells per sequence".into(),
            ));
        }
        if config.step_budget_ms.is_nan() || config.step_budget_ms <= 0.0 || !(0.0..1.0).contains(&config.ingest_share)
        {
            return Err(Error::Config(format!(
                "step budget {} ms / ingest share {}: the budget must be positive and the share in [0, 1)",
                config.step_budget_ms, config.ingest_share
            )));
        }
        let model = models::model(model_path, &config.device)?;
        let ctx = Context::new(
            Arc::clone(&model),
            &ContextParams {
                n_ctx_per_seq: config.context_per_sequence,
                n_seq: config.max_streams + config.max_branches,
                n_batch: 512,
                threads: config.threads,
                kv_unified: config.unified_cells(),
                flash_attention: config.flash_attention,
                kv_type: config.kv_type,
            },
        )?;
        let n_ctx_per_seq = ctx.n_ctx_per_seq();
        let shift_refusal = ctx.shift_refusal();
        let streams = config.max_streams as i32;
        let rates = Arc::new(Mutex::new(StageRates {
            prefill_ms_per_token: 0.0,
            decode_ms_per_step: 0.0,
            export_ms_per_token: 0.0,
            import_ms_per_token: 0.0,
        }));
        let worker = Worker {
            ctx,
            free_branches: (streams..streams + config.max_branches as i32).rev().collect(),
            rates: Arc::clone(&rates),
            seeded: std::cell::Cell::new(0),
            tuner: ThreadTuner::new(config.threads, config.device == Device::Cpu),
            cell_bytes: 0,
        };
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared {
            cancel: Arc::clone(cancel),
            stopping: AtomicBool::new(false),
            threads: std::sync::atomic::AtomicI32::new(config.threads),
            widest: AtomicUsize::new(0),
            rates,
            ingest_backlog: Mutex::new((0, 0.0)),
            start_backlog: Mutex::new(0.0),
            busy_steps: Mutex::new((0, 0.0)),
            idle_steps: Mutex::new((0, 0.0)),
            kv: Mutex::new(KvMemory::default()),
        });
        let thread_shared = Arc::clone(&shared);
        let thread_config = config.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vlm-engine-{}", config.name))
            .spawn(move || {
                let registration = crate::llama::WorkerThread::register();
                if !thread_config.cores.is_empty()
                    && let Err(e) = crate::llama::pin_current_thread(&thread_config.cores)
                {
                    crate::llama::log(crate::llama::LogLevel::Warn, &format!("engine: {e}"));
                }
                run(worker, rx, thread_shared, &thread_config);
                drop(registration);
            })
            .map_err(|e| Error::Engine(format!("cannot start engine thread: {e}")))?;
        let engine = Arc::new(Engine {
            free_streams: Mutex::new((0..streams).collect()),
            config,
            model,
            jobs: Mutex::new(Some(tx)),
            shared,
            n_ctx_per_seq,
            shift_refusal,
            thread: Mutex::new(Some(thread)),
        });
        // Return once the calibration run has measured the stage rates: work queued or placed
        // before would be estimated at zero cost.
        engine.call(|_| ())?;
        if cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        Ok(engine)
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Which stored KV this engine can consume.
    pub fn compat_tag(&self) -> CompatTag {
        CompatTag {
            model: self.model.identity().to_owned(),
            backend: self.config.device.name().into(),
            kv_dtype: self.config.kv_type.name(),
            layout: format!(
                "{}, {}",
                if self.config.flash_attention {
                    "V untransposed (flash attention)"
                } else {
                    "V transposed (no flash attention)"
                },
                match self.config.kv_layout {
                    KvLayout::PerSequence =>
                        format!("{} sequence streams", self.config.max_streams + self.config.max_branches),
                    KvLayout::Unified => "one unified stream".into(),
                }
            ),
        }
    }

    pub fn n_ctx_per_seq(&self) -> u32 {
        self.n_ctx_per_seq
    }

    /// Why a history cannot slide (shift its positions in place) on this engine, if it cannot.
    pub fn shift_refusal(&self) -> Option<&str> {
        self.shift_refusal.as_deref()
    }

    /// Cells an answer reading a version of `version_cells` may reach (its question and tokens
    /// included): the sequence's cells, and in a unified pool at most `answer_cells` more.
    pub fn answer_limit(&self, version_cells: i32) -> i32 {
        let per_seq = self.n_ctx_per_seq as i32;
        match self.config.kv_layout {
            KvLayout::PerSequence => per_seq,
            KvLayout::Unified => per_seq.min(version_cells + self.config.answer_cells as i32),
        }
    }

    /// The KV memory as the engine's last step left it, shared cells counted once.
    pub fn kv_memory(&self) -> KvMemory {
        *self.shared.kv.lock()
    }

    /// The stage costs measured on this engine so far.
    pub fn rates(&self) -> StageRates {
        *self.shared.rates.lock()
    }

    /// The thread count its computations use now (the configured one, or 1 while that measured
    /// faster: see `crate::threads`).
    pub fn threads_now(&self) -> i32 {
        self.shared.threads.load(Ordering::Relaxed)
    }

    /// Decode steps observed with and without ingestion waiting.
    pub fn decode_rates(&self) -> DecodeRates {
        let (busy_steps, busy_ms) = *self.shared.busy_steps.lock();
        let (idle_steps, idle_ms) = *self.shared.idle_steps.lock();
        let mean = |n: u64, ms: f64| if n == 0 { 0.0 } else { ms / n as f64 };
        DecodeRates {
            busy_steps,
            busy_ms_per_step: mean(busy_steps, busy_ms),
            idle_steps,
            idle_ms_per_step: mean(idle_steps, idle_ms),
        }
    }

    /// Estimated milliseconds of queued ingestion on this engine (measured costs).
    pub fn ingest_backlog_ms(&self) -> f64 {
        match *self.shared.ingest_backlog.lock() {
            (0, _) => 0.0,
            (_, ms) => ms.max(0.0),
        }
    }

    /// Estimated milliseconds before a new answer starts here: the starts of the answers ahead
    /// of it (answers go before queued ingestion).
    pub fn start_backlog_ms(&self) -> f64 {
        self.shared.start_backlog.lock().max(0.0)
    }

    /// Queue ingestion; its cost counts in the ingestion backlog until it is done.
    pub(crate) fn ingest(&self, ingestion: Ingestion) -> Result<()> {
        let cost = ingestion.cost_ms;
        let queue = |n: isize, ms: f64| {
            let mut backlog = self.shared.ingest_backlog.lock();
            backlog.0 = backlog.0.saturating_add_signed(n);
            backlog.1 += ms;
        };
        queue(1, cost);
        self.send(Job::Ingest(ingestion)).inspect_err(|_| queue(-1, -cost))
    }

    /// Run `job` on the engine thread ahead of queued prefill and wait for its result.
    pub fn call<R: Send + 'static>(&self, job: impl FnOnce(&mut Worker) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Job::Urgent(Box::new(move |w| {
            let _ = tx.send(job(w));
        })))?;
        rx.recv().map_err(|_| Error::Engine(format!("engine {} dropped a job", self.name())))
    }

    /// Most answers decoded together in one step so far.
    pub fn widest_step(&self) -> usize {
        self.shared.widest.load(Ordering::Relaxed)
    }

    fn send(&self, job: Job) -> Result<()> {
        let jobs = self.jobs.lock();
        let tx = jobs.as_ref().ok_or_else(|| Error::Engine(format!("engine {} is stopped", self.name())))?;
        tx.send(job).map_err(|_| Error::Engine(format!("engine {} thread has exited", self.config.name)))
    }

    /// Run `job` on the engine thread after the ingestion and jobs already queued (and between
    /// two decode steps of the answers being generated).
    pub fn submit(&self, job: impl FnOnce(&mut Worker) + Send + 'static) -> Result<()> {
        self.send(Job::Run(Box::new(job)))
    }

    /// Queue a generation whose start costs about `start_ms`; it starts when a branch is free,
    /// before queued ingestion, and then shares every decode step.
    pub(crate) fn generate(&self, generation: Box<dyn Generation>, start_ms: f64) -> Result<()> {
        *self.shared.start_backlog.lock() += start_ms;
        self.send(Job::Generate(generation, start_ms)).inspect_err(|_| *self.shared.start_backlog.lock() -= start_ms)
    }

    /// Streams resident here now, and stream sequences still free.
    pub fn stream_slots(&self) -> (usize, usize) {
        let free = self.free_streams.lock().len();
        (self.config.max_streams as usize - free, free)
    }

    /// Reserve a stream sequence.
    pub(crate) fn take_stream_seq(&self) -> Result<i32> {
        self.free_streams.lock().pop_front().ok_or_else(|| {
            Error::Config(format!(
                "engine {} already holds its {} streams (raise max-streams)",
                self.name(),
                self.config.max_streams
            ))
        })
    }

    /// Return a stream sequence (its stream is gone: nothing queued refers to it). It is free at
    /// once; the job that clears its cells is queued before anything a new stream queues.
    pub(crate) fn give_stream_seq(&self, seq: i32) {
        // A stopping engine frees its context with its thread: nothing to clear then.
        let _ = self.submit(move |w| w.ctx.seq_clear(seq));
        self.free_streams.lock().push_back(seq);
    }

    /// Stop accepting jobs and wait for the queued ones to finish (a calibration run still going
    /// is abandoned).
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.jobs.lock().take();
        // The last owner may be a job on the engine thread itself: it cannot join itself; the
        // thread then ends on its own once the queue is drained.
        if let Some(t) = self.thread.lock().take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("name", &self.config.name).field("device", &self.config.device).finish()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_lists_parse_and_bad_ones_are_refused() {
        let base = EngineConfig { threads: 2, ..EngineConfig::default() };
        let e = EngineConfig::parse_list("cpu", &base).unwrap();
        assert_eq!((e.len(), e[0].name.as_str(), &e[0].device, e[0].threads), (1, "cpu", &Device::Cpu, 2));
        let e = EngineConfig::parse_list("big:cpu:1, little:cpu:1,gpu", &base).unwrap();
        assert_eq!(
            e.iter().map(|e| (e.name.as_str(), e.device.name(), e.threads)).collect::<Vec<_>>(),
            [("big", "cpu", 1), ("little", "cpu", 1), ("gpu", "gpu", 2)]
        );
        let e = EngineConfig::parse_list("big:cpu:2:2-3+6,little:cpu:1:0", &base).unwrap();
        assert_eq!((e[0].cores.clone(), e[1].cores.clone()), (vec![2, 3, 6], vec![0]));
        for bad in ["", "a:tpu", "a:cpu:0", "a,a", "auto", "a b", "a:cpu:1:3-2", "a:cpu:1:x", "a:cpu:1:0:9"] {
            assert!(EngineConfig::parse_list(bad, &base).is_err(), "{bad:?} must be refused");
        }
    }
}
