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
        }
    }
}

/// What a job sees on the engine thread.
pub struct Worker {
    pub ctx: Context,
    free_branches: Vec<i32>,
}

impl Worker {
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

enum Job {
    Run(Box<dyn FnOnce(&mut Worker) + Send>),
    Generate(Box<dyn Generation>),
}

pub struct Engine {
    config: EngineConfig,
    model: Arc<Model>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    queued: Arc<AtomicUsize>,
    widest: Arc<AtomicUsize>,
    free_streams: Mutex<VecDeque<i32>>,
    n_ctx_per_seq: u32,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The engine thread's loop.
fn run(mut w: Worker, jobs: mpsc::Receiver<Job>, queued: Arc<AtomicUsize>, widest: Arc<AtomicUsize>) {
    let mut waiting: VecDeque<Box<dyn Generation>> = VecDeque::new();
    let mut active: Vec<Active> = Vec::new();
    let done = |n: usize| {
        queued.fetch_sub(n, Ordering::AcqRel);
    };
    loop {
        let idle = active.is_empty() && waiting.is_empty();
        let first = if idle { jobs.recv().ok() } else { jobs.try_recv().ok() };
        if idle && first.is_none() {
            return; // the engine stopped and every job is done
        }
        for job in first.into_iter().chain(std::iter::from_fn(|| jobs.try_recv().ok())) {
            match job {
                Job::Run(f) => {
                    f(&mut w);
                    done(1);
                }
                Job::Generate(g) => waiting.push_back(g),
            }
        }
        while let Some(branch) = w.free_branches.pop() {
            let Some(mut g) = waiting.pop_front() else {
                w.free_branches.push(branch);
                break;
            };
            match g.start(&mut w, branch) {
                Progress::Next { token, pos } => active.push(Active { generation: g, branch, next: (token, pos) }),
                Progress::Done => {
                    w.release(branch);
                    done(1);
                }
            }
        }
        if active.is_empty() {
            continue;
        }
        let entries: Vec<_> = active.iter().map(|a| (a.next.0, a.next.1, a.branch)).collect();
        widest.fetch_max(entries.len(), Ordering::Relaxed);
        let step = w.ctx.decode_step(&entries);
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
                    done(1);
                    false
                }
            }
        });
    }
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
            },
        )?;
        let n_ctx_per_seq = ctx.n_ctx_per_seq();
        let streams = config.max_streams as i32;
        let worker = Worker { ctx, free_branches: (streams..streams + config.max_branches as i32).rev().collect() };
        let (tx, rx) = mpsc::channel::<Job>();
        let queued = Arc::new(AtomicUsize::new(0));
        let widest = Arc::new(AtomicUsize::new(0));
        let (q, wd) = (Arc::clone(&queued), Arc::clone(&widest));
        let thread = std::thread::Builder::new()
            .name(format!("vlm-engine-{}", config.name))
            .spawn(move || run(worker, rx, q, wd))
            .map_err(|e| Error::Engine(format!("cannot start engine thread: {e}")))?;
        Ok(Arc::new(Engine {
            free_streams: Mutex::new((0..streams).collect()),
            config,
            model,
            jobs: Mutex::new(Some(tx)),
            queued,
            widest,
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
            backend: self.config.device.name().into(),
            kv_dtype: "f16",
            layout: "per-sequence streams, V transposed",
        }
    }

    pub fn n_ctx_per_seq(&self) -> u32 {
        self.n_ctx_per_seq
    }

    /// Jobs and generations waiting or running on this engine.
    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Most answers decoded together in one step so far.
    pub fn widest_step(&self) -> usize {
        self.widest.load(Ordering::Relaxed)
    }

    fn send(&self, job: Job) -> Result<()> {
        let jobs = self.jobs.lock();
        let tx = jobs.as_ref().ok_or_else(|| Error::Engine(format!("engine {} is stopped", self.name())))?;
        self.queued.fetch_add(1, Ordering::AcqRel);
        tx.send(job).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            Error::Engine(format!("engine {} thread has exited", self.config.name))
        })
    }

    /// Run `job` on the engine thread after the jobs already queued (and between two decode steps
    /// of the answers being generated).
    pub fn submit(&self, job: impl FnOnce(&mut Worker) + Send + 'static) -> Result<()> {
        self.send(Job::Run(Box::new(job)))
    }

    /// Queue a generation; it starts when a branch is free and then shares every decode step.
    pub(crate) fn generate(&self, generation: Box<dyn Generation>) -> Result<()> {
        self.send(Job::Generate(generation))
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
        // The last owner may be a job on the engine thread itself: it cannot join itself.
        if let Some(t) = self.thread.lock().take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}
