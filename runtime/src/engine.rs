//! A language engine: one loaded model on one device plus one llama.cpp context with several
//! sequences, owned by one thread (llama.cpp's server model: tasks in on one queue, results out
//! on channels, one batch per decode step for every active sequence).
//!
//! Sequences `0..max_streams` hold streams' histories; the others are answer branches. The thread
//! loops: run the jobs that arrived (frame prefills, in order), start waiting generations while
//! branches are free, then decode one token for every active generation in a single batch. So
//! ingestion interleaves with answers step by step, and several answers share each step.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::llama::{Context, ContextParams, Device, Model, Token};
use crate::models;
use crate::prefix::CompatTag;

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
    /// CPU cores the engine's threads run on (none: wherever the OS puts them).
    pub cores: Vec<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: "cpu".into(),
            device: Device::Cpu,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get() as i32),
            context_per_sequence: 2048,
            max_streams: 2,
            max_branches: 4,
            flash_attention: false,
            cores: Vec::new(),
        }
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
    /// cores and ranges joined by `+` (`0-3`, `4+6`). Other fields come from `base`.
    pub fn parse_list(spec: &str, base: &EngineConfig) -> Result<Vec<EngineConfig>> {
        let mut engines: Vec<EngineConfig> = vec![];
        for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = |why: &str| {
                Error::Config(format!("engine \"{entry}\": {why} (expected NAME[:cpu|gpu[:THREADS[:CORES]]])"))
            };
            let mut parts = entry.split(':');
            let name = parts.next().unwrap_or_default();
            if name.is_empty()
                || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                || name == "auto"
            {
                return Err(bad("invalid name"));
            }
            let device = match parts.next() {
                None if name.starts_with("gpu") => Device::Gpu,
                None | Some("cpu") => Device::Cpu,
                Some("gpu") => Device::Gpu,
                Some(_) => return Err(bad("unknown device")),
            };
            let threads = match parts.next() {
                None => base.threads,
                Some(t) => {
                    t.parse::<i32>().ok().filter(|t| (1..=256).contains(t)).ok_or_else(|| bad("bad thread count"))?
                }
            };
            let cores = match parts.next() {
                None => Vec::new(),
                Some(list) => parse_cores(list).ok_or_else(|| bad("bad core list"))?,
            };
            if parts.next().is_some() {
                return Err(bad("too many fields"));
            }
            if engines.iter().any(|e| e.name == name) {
                return Err(bad("duplicate name"));
            }
            engines.push(EngineConfig { name: name.into(), device, threads, cores, ..base.clone() });
        }
        if engines.is_empty() {
            return Err(Error::Config("no engine configured".into()));
        }
        Ok(engines)
    }
}

/// Cores such as `0-3`, `4+6` or `0-1+4`.
fn parse_cores(list: &str) -> Option<Vec<usize>> {
    let mut cores = vec![];
    for part in list.split('+') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                if a > b {
                    return None;
                }
                cores.extend(a..=b);
            }
            None => cores.push(part.parse().ok()?),
        }
    }
    Some(cores)
}

/// What a job sees on the engine thread.
pub struct Worker {
    pub ctx: Context,
    free_branches: Vec<i32>,
    rates: Arc<Mutex<StageRates>>,
}

impl Worker {
    /// Record that `units` of `stage` took `ms`.
    pub fn record(&self, stage: Stage, units: usize, ms: f64) {
        if units > 0 {
            let mut rates = self.rates.lock();
            let slot = rates.slot(stage);
            let sample = ms / units as f64;
            *slot = if *slot <= 0.0 { sample } else { 0.8 * *slot + 0.2 * sample };
        }
    }

    /// Clear a sequence's cells.
    fn release(&mut self, seq: i32) {
        self.ctx.seq_clear(seq);
        self.free_branches.push(seq);
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
    /// Make the history ready in `branch`, prefill the suffix and pick the first token.
    fn start(&mut self, w: &mut Worker, branch: i32) -> Progress;
    /// Pick the next token from this generation's logits of the last step.
    fn advance(&mut self, logits: &[f32]) -> Progress;
    /// The step failed: report `error` and stop.
    fn fail(&mut self, error: Error);
}

struct Active {
    generation: Box<dyn Generation>,
    branch: i32,
    next: (Token, i32),
}

type Work = Box<dyn FnOnce(&mut Worker) + Send>;

enum Job {
    /// Ingestion and other work, in order, after the answers that are starting.
    Run(Work),
    /// Work an answer waits for (a snapshot export): before ingestion.
    Urgent(Work),
    /// An answer, with the estimated cost of its start (history preparation + suffix).
    Generate(Box<dyn Generation>, f64),
}

pub struct Engine {
    config: EngineConfig,
    model: Arc<Model>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    widest: Arc<AtomicUsize>,
    rates: Arc<Mutex<StageRates>>,
    /// Estimated milliseconds of queued ingestion (and other ordered work).
    ingest_backlog: Arc<Mutex<f64>>,
    /// Estimated milliseconds of answer starts queued or running, which go before ingestion.
    start_backlog: Arc<Mutex<f64>>,
    free_streams: Mutex<VecDeque<i32>>,
    n_ctx_per_seq: u32,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The engine thread's loop.
fn run(mut w: Worker, jobs: mpsc::Receiver<Job>, widest: Arc<AtomicUsize>, start_backlog: Arc<Mutex<f64>>) {
    calibrate(&mut w);
    crate::llama::stop_workers_before_exit();
    let mut waiting: VecDeque<(Box<dyn Generation>, f64)> = VecDeque::new();
    let mut active: Vec<Active> = Vec::new();
    let mut runs: VecDeque<Work> = VecDeque::new();
    loop {
        if crate::llama::exiting() {
            return; // the process is exiting: drop the work, free the context
        }
        let idle = active.is_empty() && waiting.is_empty() && runs.is_empty();
        let first = if idle {
            match jobs.recv_timeout(std::time::Duration::from_millis(200)) {
                Ok(job) => Some(job),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return, // stopped, every job done
            }
        } else {
            jobs.try_recv().ok()
        };
        for job in first.into_iter().chain(std::iter::from_fn(|| jobs.try_recv().ok())) {
            match job {
                Job::Run(f) => runs.push_back(f),
                Job::Urgent(f) => f(&mut w),
                Job::Generate(g, cost) => waiting.push_back((g, cost)),
            }
        }
        // Answers start first: their versions are already published, so the frames queued
        // behind them must not delay their first token. Then one ingestion job, then one decode
        // step of every active answer: ingestion and answers alternate, and urgent work (a
        // snapshot export) waits for one job at most.
        while let Some(branch) = w.free_branches.pop() {
            let Some((mut g, cost)) = waiting.pop_front() else {
                w.free_branches.push(branch);
                break;
            };
            let progress = g.start(&mut w, branch);
            *start_backlog.lock() -= cost;
            match progress {
                Progress::Next { token, pos } => active.push(Active { generation: g, branch, next: (token, pos) }),
                Progress::Done => w.release(branch),
            }
        }
        if let Some(run) = runs.pop_front() {
            run(&mut w);
        }
        if active.is_empty() {
            continue;
        }
        let entries: Vec<_> = active.iter().map(|a| (a.next.0, a.next.1, a.branch)).collect();
        widest.fetch_max(entries.len(), Ordering::Relaxed);
        let started = std::time::Instant::now();
        let step = w.ctx.decode_step(&entries);
        w.record(Stage::DecodeStep, 1, started.elapsed().as_secs_f64() * 1e3);
        let mut i = 0;
        active.retain_mut(|a| {
            let progress = match &step {
                Ok(()) => a.generation.advance(w.ctx.logits(i)),
                Err(e) => {
                    a.generation.fail(e.clone());
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
    }
}

/// Seed the stage rates with a short run on a scratch branch: 32 tokens of prefill, 4 decode
/// steps, one export and import.
fn calibrate(w: &mut Worker) {
    let Some(seq) = w.free_branches.last().copied() else { return };
    let tokens: Vec<Token> = (0..32).map(|i| 100 + i).collect();
    let t = std::time::Instant::now();
    if w.ctx.decode_tokens(&tokens, 0, seq, true).is_err() {
        return;
    }
    w.record(Stage::Prefill, tokens.len(), t.elapsed().as_secs_f64() * 1e3);
    for pos in 32..36 {
        let t = std::time::Instant::now();
        if w.ctx.decode_step(&[(100, pos, seq)]).is_err() {
            break;
        }
        w.record(Stage::DecodeStep, 1, t.elapsed().as_secs_f64() * 1e3);
    }
    let t = std::time::Instant::now();
    if let Ok(snapshot) = w.ctx.seq_snapshot(seq) {
        w.record(Stage::Export, 36, t.elapsed().as_secs_f64() * 1e3);
        let t = std::time::Instant::now();
        if w.ctx.seq_restore(seq, &snapshot).is_ok() {
            w.record(Stage::Import, 36, t.elapsed().as_secs_f64() * 1e3);
        }
    }
    w.ctx.seq_clear(seq);
}

impl Engine {
    /// Load (or share) the model and start the engine thread.
    pub fn start(model_path: &std::path::Path, config: EngineConfig) -> Result<Arc<Engine>> {
        if config.max_streams == 0 || config.max_branches == 0 || config.context_per_sequence < 64 {
            return Err(Error::Config(
                "an engine needs at least one stream, one branch and 64 cells per sequence".into(),
            ));
        }
        let model = models::model(model_path, &config.device)?;
        let ctx = Context::new(
            Arc::clone(&model),
            &ContextParams {
                n_ctx_per_seq: config.context_per_sequence,
                n_seq: config.max_streams + config.max_branches,
                n_batch: 512,
                threads: config.threads,
                kv_unified: false,
                flash_attention: config.flash_attention,
            },
        )?;
        let n_ctx_per_seq = ctx.n_ctx_per_seq();
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
        };
        let (tx, rx) = mpsc::channel::<Job>();
        let widest = Arc::new(AtomicUsize::new(0));
        let wd = Arc::clone(&widest);
        let cores = config.cores.clone();
        let start_backlog = Arc::new(Mutex::new(0.0));
        let sb = Arc::clone(&start_backlog);
        let thread = std::thread::Builder::new()
            .name(format!("vlm-engine-{}", config.name))
            .spawn(move || {
                let registration = crate::llama::WorkerThread::register();
                if !cores.is_empty()
                    && let Err(e) = crate::llama::pin_current_thread(&cores)
                {
                    crate::llama::log(crate::llama::LogLevel::Warn, &format!("engine: {e}"));
                }
                run(worker, rx, wd, sb);
                drop(registration);
            })
            .map_err(|e| Error::Engine(format!("cannot start engine thread: {e}")))?;
        Ok(Arc::new(Engine {
            free_streams: Mutex::new((0..streams).collect()),
            config,
            model,
            jobs: Mutex::new(Some(tx)),
            widest,
            rates,
            ingest_backlog: Arc::new(Mutex::new(0.0)),
            start_backlog,
            n_ctx_per_seq,
            thread: Mutex::new(Some(thread)),
        }))
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Which stored KV this engine can consume.
    pub fn compat_tag(&self) -> CompatTag {
        CompatTag {
            model: self.model.identity(),
            backend: self.config.device.name().into(),
            kv_dtype: "f16",
            layout: format!(
                "{}, {} sequence streams",
                if self.config.flash_attention {
                    "V untransposed (flash attention)"
                } else {
                    "V transposed (no flash attention)"
                },
                self.config.max_streams + self.config.max_branches
            ),
        }
    }

    pub fn n_ctx_per_seq(&self) -> u32 {
        self.n_ctx_per_seq
    }

    /// The stage costs measured on this engine so far.
    pub fn rates(&self) -> StageRates {
        *self.rates.lock()
    }

    /// Estimated milliseconds of queued ingestion on this engine (measured costs).
    pub fn ingest_backlog_ms(&self) -> f64 {
        self.ingest_backlog.lock().max(0.0)
    }

    /// Estimated milliseconds before a new answer starts here: the starts of the answers ahead
    /// of it (answers go before queued ingestion).
    pub fn start_backlog_ms(&self) -> f64 {
        self.start_backlog.lock().max(0.0)
    }

    /// Run `job` (estimated to cost `cost_ms`) on the engine thread, in order with other ingestion;
    /// its cost counts in the ingestion backlog until it has run.
    pub fn submit_costed(&self, cost_ms: f64, job: impl FnOnce(&mut Worker) + Send + 'static) -> Result<()> {
        *self.ingest_backlog.lock() += cost_ms;
        let backlog = Arc::clone(&self.ingest_backlog);
        self.submit(move |w| {
            job(w);
            *backlog.lock() -= cost_ms;
        })
        .inspect_err(|_| *self.ingest_backlog.lock() -= cost_ms)
    }

    /// Run `job` on the engine thread ahead of queued ingestion and wait for its result.
    pub fn call<R: Send + 'static>(&self, job: impl FnOnce(&mut Worker) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Job::Urgent(Box::new(move |w| {
            let _ = tx.send(job(w));
        })))?;
        rx.recv().map_err(|_| Error::Engine(format!("engine {} dropped a job", self.name())))
    }

    /// Most answers decoded together in one step so far.
    pub fn widest_step(&self) -> usize {
        self.widest.load(Ordering::Relaxed)
    }

    fn send(&self, job: Job) -> Result<()> {
        let jobs = self.jobs.lock();
        let tx = jobs.as_ref().ok_or_else(|| Error::Engine(format!("engine {} is stopped", self.name())))?;
        tx.send(job).map_err(|_| Error::Engine(format!("engine {} thread has exited", self.config.name)))
    }

    /// Run `job` on the engine thread after the jobs already queued (and between two decode steps
    /// of the answers being generated).
    pub fn submit(&self, job: impl FnOnce(&mut Worker) + Send + 'static) -> Result<()> {
        self.send(Job::Run(Box::new(job)))
    }

    /// Queue a generation whose start costs about `start_ms`; it starts when a branch is free,
    /// before queued ingestion, and then shares every decode step.
    pub(crate) fn generate(&self, generation: Box<dyn Generation>, start_ms: f64) -> Result<()> {
        *self.start_backlog.lock() += start_ms;
        self.send(Job::Generate(generation, start_ms)).inspect_err(|_| *self.start_backlog.lock() -= start_ms)
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

    /// Return a stream sequence; its cells are cleared on the engine thread first.
    pub(crate) fn give_stream_seq(self: &Arc<Self>, seq: i32) {
        let engine = Arc::clone(self);
        let cleared = self.submit(move |w| {
            w.ctx.seq_clear(seq);
            engine.free_streams.lock().push_back(seq);
        });
        if cleared.is_err() {
            // The engine is stopping; its context goes away with its thread.
            self.free_streams.lock().push_back(seq);
        }
    }

    /// Stop accepting jobs and wait for the queued ones to finish.
    pub fn stop(&self) {
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
