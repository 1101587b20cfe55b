//! A language engine: one loaded model on one device plus one llama.cpp context with several
//! sequences, owned by one thread that runs jobs in arrival order (llama.cpp's server model:
//! tasks in on one queue, results out on another).
//!
//! Sequences `0..max_streams` hold streams' histories; the rest are answer branches.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::llama::{Context, ContextParams, Device, Model};
use crate::models;

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
            max_branches: 2,
        }
    }
}

/// What a job sees on the engine thread.
pub struct Worker {
    pub ctx: Context,
    free_branches: Vec<i32>,
}

impl Worker {
    /// Take a free answer sequence (jobs run one at a time, so one is always free when a job
    /// returns every branch it took).
    pub fn take_branch(&mut self) -> Result<i32> {
        self.free_branches.pop().ok_or_else(|| Error::Engine("no free answer sequence".into()))
    }

    pub fn give_branch(&mut self, seq: i32) {
        self.ctx.seq_clear(seq);
        self.free_branches.push(seq);
    }
}

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

pub struct Engine {
    config: EngineConfig,
    model: Arc<Model>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    queued: Arc<AtomicUsize>,
    free_streams: Mutex<VecDeque<i32>>,
    n_ctx_per_seq: u32,
    thread: Mutex<Option<JoinHandle<()>>>,
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
            },
        )?;
        let n_ctx_per_seq = ctx.n_ctx_per_seq();
        let streams = config.max_streams as i32;
        let mut worker = Worker { ctx, free_branches: (streams..streams + config.max_branches as i32).rev().collect() };
        let (tx, rx) = mpsc::channel::<Job>();
        let queued = Arc::new(AtomicUsize::new(0));
        let q = Arc::clone(&queued);
        let thread = std::thread::Builder::new()
            .name(format!("vlm-engine-{}", config.name))
            .spawn(move || {
                for job in rx {
                    job(&mut worker);
                    q.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .map_err(|e| Error::Engine(format!("cannot start engine thread: {e}")))?;
        Ok(Arc::new(Engine {
            free_streams: Mutex::new((0..streams).collect()),
            config,
            model,
            jobs: Mutex::new(Some(tx)),
            queued,
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

    pub fn n_ctx_per_seq(&self) -> u32 {
        self.n_ctx_per_seq
    }

    /// Jobs waiting or running on this engine.
    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Run `job` on the engine thread after the jobs already queued.
    pub fn submit(&self, job: impl FnOnce(&mut Worker) + Send + 'static) -> Result<()> {
        let jobs = self.jobs.lock();
        let tx = jobs.as_ref().ok_or_else(|| Error::Engine(format!("engine {} is stopped", self.name())))?;
        self.queued.fetch_add(1, Ordering::AcqRel);
        tx.send(Box::new(job)).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            Error::Engine(format!("engine {} thread has exited", self.config.name))
        })
    }

    /// Run `job` on the engine thread and wait for its result.
    pub fn call<R: Send + 'static>(&self, job: impl FnOnce(&mut Worker) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(move |w| {
            let _ = tx.send(job(w));
        })?;
        rx.recv().map_err(|_| Error::Engine(format!("engine {} dropped a job", self.config.name)))
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
