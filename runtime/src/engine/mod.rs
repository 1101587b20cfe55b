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
//!    and runs the next chunk once the credit covers what it costs (a budget's worth at most),
//!    so answers keep `1 - ingest_share` of their idle decode rate; while a question waits for
//!    frames still being ingested, ingestion gets a budget every step (that question is an
//!    answer starting), as many of them as fit in it; with no answer active, ingestion runs
//!    back to back; while every answer is paused for a CPU vision encode
//!    (`EngineConfig::encode_first`), only frames a question waits for are ingested;
//! 4. background evaluations (standing alerts) and ingestion take turns: after a step that
//!    started evaluations, the next chunk of ingestion goes before the next ones, so a history
//!    keeps up with its camera (the alerts thin out, newest frame first, when the engine cannot
//!    evaluate them all) and a source never short of frames does not starve the alerts.
//!
//! Ingestion that cannot keep up shows as lag on its stream, where the overload policy applies.
//!
//! An engine on RPC servers (`Device::Rpc`) can fail for good when a server goes away; the
//! watchdog (`rpc_watch`) then declares it failed: the placer passes it over, what waits on it
//! gets the reason, and the engine reports the failure to the handlers registered with
//! [`on_failure`] (the stream registry moves the streams resident on it to other engines).

mod calibrate;
mod config;
mod jobs;
mod rpc_watch;
pub use rpc_watch::{set_stall_limit as set_rpc_stall_limit, stall_limit as rpc_stall_limit};
mod scheduler;
mod worker;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

pub use config::{
    DEFAULT_ENCODE_FIRST, DEFAULT_INGEST_SHARE, DEFAULT_STEP_BUDGET_MS, EngineConfig, KvLayout, default_threads,
};
use jobs::Job;
pub(crate) use jobs::{Begun, Generation, Ingestion, Progress};
use scheduler::run;
pub use worker::{KvMemory, Stage, StageRates, Worker};

use crate::error::{Error, Result};
use crate::llama::{Context, ContextParams, Device, Model};
use crate::models;
use crate::prefix::CompatTag;
use crate::threads::{CoreMeter, Kind, ThreadTuner};

pub struct Engine {
    config: EngineConfig,
    model: Arc<Model>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    shared: Arc<Shared>,
    free_streams: Mutex<VecDeque<i32>>,
    n_ctx_per_seq: u32,
    /// Why a history cannot slide (`HistoryPolicy::Slide`) by shifting in place here, if it cannot.
    shift_refusal: Option<String>,
    /// Where a slide may leave a gap of positions instead, the largest position (M-RoPE).
    position_gap_limit: Option<i32>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Releases the engine thread's registration (`llama::WorkerThread`) when the thread is
    /// abandoned (failed for good).
    release_thread: Box<dyn Fn() + Send + Sync>,
}

/// What the engine thread and the engine's handles share.
struct Shared {
    /// Set by the caller of `start_cancellable` to abandon the calibration run.
    cancel: Arc<AtomicBool>,
    /// Set by `Engine::stop`, with the same effect.
    stopping: AtomicBool,
    /// Set when the engine thread's loop has returned.
    exited: AtomicBool,
    /// The thread count computations use now.
    threads: std::sync::atomic::AtomicI32,
    widest: AtomicUsize,
    /// Most answer starts prefilled together in one decode (`Scheduler::prefill_together`).
    widest_start: AtomicUsize,
    /// Inputs those decodes took once for several answers (a shared prefix: `batch_together`).
    shared_inputs: AtomicUsize,
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
    /// Where the engine thread's time went since calibration.
    time_split: Mutex<TimeSplit>,
    /// The KV memory as last refreshed (while busy, at most 50 ms old or 50 times what the last
    /// refresh cost; current when idle).
    kv: Mutex<KvMemory>,
    /// Turns of the engine thread's loop (it turns at least every 200 ms while alive): what the
    /// RPC watchdog reads to tell a busy engine from one stuck on a failed server.
    turns: std::sync::atomic::AtomicU64,
    /// Why the engine failed for good, once it has.
    failure: Mutex<Option<String>>,
    /// Frames go as one batch of rows (`Worker::merge_frames`, known after calibration).
    merge_frames: AtomicBool,
}

/// Told when an engine fails for good (after it stopped taking jobs), with the engine and why.
pub(crate) type FailureHandler = fn(&Arc<Engine>, &Error);

static FAILURE_HANDLERS: Mutex<Vec<FailureHandler>> = Mutex::new(Vec::new());

/// Have `handler` called whenever an engine fails for good, on the thread that declares it failed
/// (the RPC watchdog), in the order handlers were registered. What lives above the engines and
/// must leave a failed one registers here (the stream registry, which moves the streams resident
/// on it), so that the engine names none of it. Register each handler once.
pub(crate) fn on_failure(handler: FailureHandler) {
    FAILURE_HANDLERS.lock().push(handler);
}

/// Where an engine thread's time went since its calibration run (ms, summed), and what its
/// ingestion prefilled: what tells an engine that cannot keep up with its streams' frames
/// because it is busy answering (`decode_ms`, `start_ms`) from one that spends its time
/// elsewhere (`other_ms`: the loop's own work, KV accounting, jobs' bookkeeping).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TimeSplit {
    /// Decode steps of answers.
    pub decode_ms: f64,
    /// Answers starting: their branches taken (a per-sequence branch copies its version's
    /// cells) and their history replay and question prefilled.
    pub start_ms: f64,
    /// Frame ingestion (prefill of frames and committed text).
    pub ingest_ms: f64,
    /// Inputs (tokens and embedding rows) ingestion prefilled.
    pub ingest_inputs: u64,
    /// Plain jobs: imports, exports, branch copies, slides.
    pub jobs_ms: f64,
    /// Waiting for work.
    pub idle_ms: f64,
    /// Everything since calibration, the above included.
    pub wall_ms: f64,
}

impl TimeSplit {
    /// The time not in any of the above.
    pub fn other_ms(&self) -> f64 {
        (self.wall_ms - self.decode_ms - self.start_ms - self.ingest_ms - self.jobs_ms - self.idle_ms).max(0.0)
    }

    /// Inputs ingestion prefilled per second of the time it ran (0 before any).
    pub fn ingest_inputs_per_s(&self) -> f64 {
        if self.ingest_ms > 0.0 { self.ingest_inputs as f64 * 1e3 / self.ingest_ms } else { 0.0 }
    }
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
        // Cores the process may not run on (another machine's list, a container's cpuset) would
        // leave the engine unpinned without a word: refused, naming them.
        let allowed = crate::llama::current_thread_cores();
        let outside: Vec<String> = config
            .cores
            .iter()
            .filter(|c| !allowed.is_empty() && !allowed.contains(c))
            .map(|c| c.to_string())
            .collect();
        if !outside.is_empty() {
            return Err(Error::Config(format!(
                "engine {}: cores {} are not among the {} this process may run on",
                config.name,
                outside.join(", "),
                allowed.len()
            )));
        }
        let params = ContextParams {
            n_ctx_per_seq: config.context_per_sequence,
            n_seq: config.max_streams + config.max_branches,
            n_batch: config::decode_batch(&config.device, config.max_streams),
            threads: config.threads,
            kv_unified: config.unified_cells(),
            flash_attention: config.flash_attention,
            kv_type: config.kv_type,
        };
        let (model, ctx) = match &config.device {
            // A copy of its own (not shared through `models`: a load stuck on a failed server
            // must not hold the registry), loaded where a failure cannot hang the caller.
            Device::Rpc(endpoints) => {
                let (path, device) = (model_path.to_path_buf(), config.device.clone());
                crate::llama::rpc::guarded(endpoints, move || {
                    let model = Arc::new(Model::load(&path, &device)?);
                    let ctx = Context::new(Arc::clone(&model), &params)?;
                    Ok((model, ctx))
                })?
            }
            _ => {
                let model = models::model(model_path, &config.device)?;
                let ctx = Context::new(Arc::clone(&model), &params)?;
                (model, ctx)
            }
        };
        let n_ctx_per_seq = ctx.n_ctx_per_seq();
        let (shift_refusal, position_gap_limit) = (ctx.shift_refusal(), ctx.position_gap_limit());
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
            tuner: ThreadTuner::new(Kind::Decode, config.threads, config.device == Device::Cpu),
            prefill_tuner: ThreadTuner::new(Kind::Prefill, config.threads, config.device == Device::Cpu),
            meter: CoreMeter::new(config.threads, config.device == Device::Cpu),
            threads_set: config.threads,
            cell_bytes: 0,
            merge_frames: false,
            rows_batch: None,
            entry_room: None,
        };
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared {
            cancel: Arc::clone(cancel),
            stopping: AtomicBool::new(false),
            exited: AtomicBool::new(false),
            threads: std::sync::atomic::AtomicI32::new(config.threads),
            widest: AtomicUsize::new(0),
            widest_start: AtomicUsize::new(0),
            shared_inputs: AtomicUsize::new(0),
            rates,
            ingest_backlog: Mutex::new((0, 0.0)),
            start_backlog: Mutex::new(0.0),
            busy_steps: Mutex::new((0, 0.0)),
            idle_steps: Mutex::new((0, 0.0)),
            time_split: Mutex::new(TimeSplit::default()),
            kv: Mutex::new(KvMemory::default()),
            turns: Default::default(),
            failure: Mutex::new(None),
            merge_frames: AtomicBool::new(false),
        });
        let thread_shared = Arc::clone(&shared);
        let thread_config = config.clone();
        let registration = crate::llama::WorkerThread::register();
        let release = registration.releaser();
        let thread = std::thread::Builder::new()
            .name(format!("vlm-engine-{}", config.name))
            .spawn(move || {
                if matches!(thread_config.device, Device::Rpc(_)) {
                    crate::llama::rpc::block_sigpipe();
                }
                if !thread_config.cores.is_empty()
                    && let Err(e) = crate::llama::pin_current_thread(&thread_config.cores)
                {
                    crate::llama::log(crate::llama::LogLevel::Warn, &format!("engine: {e}"));
                }
                run(worker, rx, Arc::clone(&thread_shared), &thread_config);
                thread_shared.exited.store(true, Ordering::Release);
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
            position_gap_limit,
            thread: Mutex::new(Some(thread)),
            release_thread: Box::new(release),
        });
        if matches!(engine.config.device, Device::Rpc(_)) {
            rpc_watch::watch(&engine);
        }
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

    /// Whether frames of several segments go as one batch of rows on this engine
    /// ([`EngineConfig::merge_frames`], and the model's rows decode as its tokens); known once
    /// the engine has started.
    pub fn merges_frames(&self) -> bool {
        self.shared.merge_frames.load(Ordering::Acquire)
    }

    /// The model, when frames go as one batch of rows here (for `Prefill::new`).
    pub(crate) fn frame_rows(&self) -> Option<&Model> {
        self.merges_frames().then_some(&*self.model)
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

    /// Where a history that cannot shift may slide by dropping its oldest frames and leaving a
    /// gap of positions (M-RoPE models), the largest position it may reach (the model's trained
    /// context): past it, the kept frames are prefilled from position 0 again.
    pub fn position_gap_limit(&self) -> Option<i32> {
        self.position_gap_limit
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

    /// The KV memory, shared cells counted once: refreshed while the engine is busy every 50 ms,
    /// or less often where the count itself costs more than 1 ms (it walks every cell in use),
    /// and whenever it goes idle.
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

    /// Where the engine thread's time went since its calibration run.
    pub fn time_split(&self) -> TimeSplit {
        *self.shared.time_split.lock()
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

    /// Queue ingestion; its cost counts in the ingestion backlog until it is done. Refused (a
    /// failed or stopped engine), it is dropped without calling its completion: the caller
    /// learns of it from the error (and may hold the lock the completion takes).
    pub(crate) fn ingest(&self, ingestion: Ingestion) -> Result<()> {
        let cost = ingestion.cost_ms;
        let queue = |n: isize, ms: f64| {
            let mut backlog = self.shared.ingest_backlog.lock();
            backlog.0 = backlog.0.saturating_add_signed(n);
            backlog.1 += ms;
        };
        queue(1, cost);
        self.try_send(Job::Ingest(ingestion)).map_err(|refused| {
            let (e, job) = *refused;
            queue(-1, -cost);
            if let Job::Ingest(mut refused) = job {
                refused.done = None;
            }
            e
        })
    }

    /// Run `job` on the engine thread ahead of queued prefill and wait for its result.
    pub fn call<R: Send + 'static>(&self, job: impl FnOnce(&mut Worker) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Job::Urgent(Box::new(move |w| {
            let _ = tx.send(job(w));
        })))?;
        self.wait(&rx)?.ok_or_else(|| Error::Engine(format!("engine {} dropped a job", self.name())))
    }

    /// The next message on `rx` (`None` when its senders are gone), or the engine's failure: a
    /// failed engine's thread never returns what it holds.
    pub(crate) fn wait<T>(&self, rx: &mpsc::Receiver<T>) -> Result<Option<T>> {
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(100)) {
                Ok(message) => return Ok(Some(message)),
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(None),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(why) = self.failure() {
                        return Err(Error::Engine(why));
                    }
                }
            }
        }
    }

    /// Why this engine failed for good (an RPC server went away), if it has.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().clone()
    }

    /// Declare the engine failed for good: no more jobs, its thread (stuck on a failed server)
    /// and what it holds abandoned; then report it to the [`on_failure`] handlers (the stream
    /// registry moves its resident streams to other engines).
    fn fail(self: &Arc<Self>, why: String) {
        crate::llama::log(crate::llama::LogLevel::Error, &why);
        *self.shared.failure.lock() = Some(why.clone());
        crate::llama::rpc::mark_failed(self.config.device.endpoints());
        self.jobs.lock().take();
        self.thread.lock().take();
        (self.release_thread)();
        let error = Error::Engine(why);
        let handlers = FAILURE_HANDLERS.lock().clone();
        for handler in handlers {
            handler(self, &error);
        }
    }

    /// Most answers decoded together in one step so far.
    pub fn widest_step(&self) -> usize {
        self.shared.widest.load(Ordering::Relaxed)
    }

    /// Most background evaluations (alerts) whose question suffixes were prefilled together in
    /// one decode so far.
    pub fn widest_start(&self) -> usize {
        self.shared.widest_start.load(Ordering::Relaxed)
    }

    /// Inputs that answers starting together did not decode again because they share them
    /// with another of the same version (their question's first tokens) so far.
    pub fn shared_inputs(&self) -> usize {
        self.shared.shared_inputs.load(Ordering::Relaxed)
    }

    fn send(&self, job: Job) -> Result<()> {
        self.try_send(job).map_err(|refused| refused.0)
    }

    /// Queue `job`, or hand it back with the reason this engine takes no more jobs.
    fn try_send(&self, job: Job) -> std::result::Result<(), Box<(Error, Job)>> {
        let jobs = self.jobs.lock();
        let Some(tx) = jobs.as_ref() else {
            let failure = self.failure().unwrap_or_else(|| format!("engine {} is stopped", self.name()));
            return Err(Box::new((Error::Engine(failure), job)));
        };
        tx.send(job)
            .map_err(|e| Box::new((Error::Engine(format!("engine {} thread has exited", self.config.name)), e.0)))
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
    /// is abandoned; so is the thread of an engine that failed for good meanwhile).
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.jobs.lock().take();
        // The last owner may be a job on the engine thread itself: it cannot join itself; the
        // thread then ends on its own once the queue is drained.
        let Some(t) = self.thread.lock().take().filter(|t| t.thread().id() != std::thread::current().id()) else {
            return;
        };
        if !matches!(self.config.device, Device::Rpc(_)) {
            let _ = t.join();
            return;
        }
        // An RPC server that went away while the engine was idle is found out only now, when
        // the thread frees its context there: the watchdog then declares the engine failed.
        while !t.is_finished() && self.failure().is_none() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if t.is_finished() {
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
