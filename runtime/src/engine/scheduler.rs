//! The engine thread's step scheduler and its loop (see the module doc of [`crate::engine`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use super::calibrate::calibrate;
use super::jobs::{Begun, Generation, Ingestion, Job, Progress, Work};
use super::{EngineConfig, Shared, Stage, TimeSplit, Worker};
use crate::error::{Error, Result};
use crate::llama::{Batch, Token};
use crate::prefill::{Next, Prefill, batch_together, chunk_len};

/// Ordered work: ingestion and plain jobs, first come first served, except that a stream whose
/// frames a question waits for goes before other streams' ingestion (`Scheduler::promote_demanded`)
/// and that an ingestion that cannot begin yet lets other streams' pass (`Scheduler::pass_waiting`).
enum Ordered {
    Run(Work),
    Ingest(Ingestion),
}

/// What [`Scheduler::run_ordered`] ran (its time is counted under it).
enum Ran {
    Job,
    Ingestion,
}

/// Milliseconds since `t`.
fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
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
    pause: Pause,
}

impl Active {
    fn paused(&self) -> bool {
        matches!(self.pause, Pause::Until(_))
    }
}

/// An answer's pause for the vision encoder (`EngineConfig::encode_first`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    Never,
    /// Paused until more CPU encodes have ended than this count.
    Until(u64),
    /// Paused once: never again.
    Done,
}

impl Pause {
    /// The pause after a step that read whether CPU encodes contend for the cores
    /// ([`crate::threads::encoder_contends`]) with `ended` of them ended so far.
    fn next(self, contends: bool, ended: u64) -> Pause {
        match self {
            Pause::Never if contends => Pause::Until(ended),
            Pause::Until(at) if ended > at || !contends => Pause::Done,
            pause => pause,
        }
    }
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
    /// Where the time went (published to `Shared::time_split` after every turn).
    split: TimeSplit,
    /// The last step started background evaluations: frames waiting go next.
    frames_turn: bool,
    /// Unified-pool cells the front ingestion waits for (`pool_room`): answers starting leave
    /// them free, so that answers overlapping without end cannot hold a frame back for good.
    entry_waits: usize,
    /// A CPU engine with `EngineConfig::encode_first`.
    encode_first: bool,
}

impl Scheduler {
    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.starting.is_empty() && self.active.is_empty() && self.ordered.is_empty()
    }

    fn take(&mut self, job: Job, w: &mut Worker) {
        match job {
            Job::Run(f) => self.ordered.push_back(Ordered::Run(f)),
            Job::Ingest(i) => self.ordered.push_back(Ordered::Ingest(i)),
            Job::Urgent(f) => {
                let started = Instant::now();
                f(w);
                self.split.jobs_ms += ms_since(started);
            }
            // A user's question goes before the background evaluations still waiting.
            Job::Generate(g, cost) if !g.background() => {
                let at = self.waiting.iter().position(|(w, _)| w.background()).unwrap_or(self.waiting.len());
                self.waiting.insert(at, (g, cost));
            }
            Job::Generate(g, cost) => self.waiting.push_back((g, cost)),
        }
    }

    /// Start waiting answers while branches are free. (One whose start imports a snapshot waits
    /// where the unified pool lacks the cells beside the answers decoding and a waiting entry:
    /// they end and free theirs.)
    fn start_answers(&mut self, w: &mut Worker, shared: &Shared) {
        // A question cancelled while it waits ends now, not once a branch or the pool's room
        // lets it start (a flush or a stop waits for its answer).
        let mut cancelled = 0.0;
        self.waiting.retain_mut(|(generation, cost)| {
            let keep = !generation.cancelled();
            if !keep {
                generation.fail(Error::Cancelled);
                cancelled += *cost;
            }
            keep
        });
        if cancelled > 0.0 {
            *shared.start_backlog.lock() -= cancelled;
        }
        // So does one cancelled while it starts behind another's start (a long replay, one
        // waiting for the pool's room).
        self.starting.retain_mut(|s| {
            let keep = !s.generation.cancelled();
            if !keep {
                s.generation.fail(Error::Cancelled);
                w.release(s.branch);
            }
            keep
        });
        while let Some((next, _)) = self.waiting.front() {
            // (Counted while answers decode or start: an import started before this one holds
            // its cells from its start on, and they end and free them; the answers starting
            // will still take the rest of their prefill and their decoding's.)
            let cells = next.start_cells();
            let others = !self.active.is_empty() || !self.starting.is_empty();
            let starting: usize =
                self.starting.iter().map(|s| s.prefill.remaining() + s.generation.cells_to_end()).sum();
            if cells > 0
                && others
                && pool_free(w, &self.active, self.entry_waits + starting).is_some_and(|room| room < cells)
            {
                return;
            }
            let Some(branch) = w.take_branch() else { return };
            let (mut generation, cost) = self.waiting.pop_front().expect("not empty");
            *shared.start_backlog.lock() -= cost;
            match generation.start(w, branch) {
                // (A user's question also passes background evaluations starting.)
                Ok(prefill) => {
                    let at = match generation.background() {
                        true => self.starting.len(),
                        false => {
                            self.starting.iter().position(|s| s.generation.background()).unwrap_or(self.starting.len())
                        }
                    };
                    self.starting.insert(at, Starting { generation, branch, prefill })
                }
                Err(e) => {
                    generation.fail(e);
                    w.release(branch);
                }
            }
        }
    }

    /// Whether an answer decodes at the next step (one is active and not paused).
    fn decoding(&self) -> bool {
        self.active.iter().any(|a| !a.paused())
    }

    /// Whether every answer is paused for the encoder: between steps the thread waits a little
    /// for a job instead of spinning (what it may do meanwhile, a frame a question waits for or
    /// an answer's start, can wait on the room paused answers hold).
    fn resting(&self) -> bool {
        !self.active.is_empty() && !self.decoding()
    }

    /// While CPU vision encodes need the cores this engine's decode steps would take, the
    /// answers that have their first token pause until the next encode ends, each at most once
    /// (`EngineConfig::encode_first`).
    fn pause_for_encoder(&mut self, threads: i32) {
        if !self.encode_first || self.active.is_empty() {
            return;
        }
        let (contends, ended) = (crate::threads::encoder_contends(threads), crate::threads::encodes_ended());
        for a in &mut self.active {
            a.pause = a.pause.next(contends, ended);
        }
    }

    /// One decode step of every active answer not paused; returns its duration in ms (0 when
    /// none decoded). A paused answer that was cancelled ends now.
    fn decode_step(&mut self, w: &mut Worker, shared: &Shared) -> f64 {
        self.pause_for_encoder(w.tuner.threads());
        self.active.retain_mut(|a| {
            let keep = !(a.paused() && a.generation.cancelled());
            if !keep {
                a.generation.fail(Error::Cancelled);
                w.release(a.branch);
            }
            keep
        });
        if !self.decoding() {
            return 0.0;
        }
        self.active.sort_by_key(|a| a.branch);
        let decoded = self.active.iter().filter(|a| !a.paused()).count();
        let mut batch = Batch::tokens(decoded);
        for a in self.active.iter().filter(|a| !a.paused()) {
            batch.push_token(a.next.0, a.next.1, a.branch, true);
        }
        shared.widest.fetch_max(decoded, Ordering::Relaxed);
        let (step, ms) = w.compute(w.tuner.threads(), |ctx| ctx.decode(&batch));
        w.record(Stage::DecodeStep, 1, ms);
        w.tuner.observe(ms, decoded);
        shared.threads.store(w.tuner.threads(), Ordering::Relaxed);
        let steps = if self.ordered.is_empty() { &shared.idle_steps } else { &shared.busy_steps };
        let mut steps = steps.lock();
        steps.0 += 1;
        steps.1 += ms;
        drop(steps);
        let mut i = 0;
        self.active.retain_mut(|a| {
            if a.paused() {
                return true;
            }
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

    /// The question suffixes of the background evaluations at the front, in one decode: each on
    /// its own branch with the logits of its last token kept, so N alerts on a frame cost one
    /// step, not N (measured on the test pair, 4 alerts on a frame: 10-15% less time in all, both
    /// KV layouts; per-sequence KV gives each the logits it gets alone, bit for bit). Only the
    /// rest of a prefill that is one run of tokens (a resident branch's suffix, not a replay's
    /// history); with answers decoding, within the step's budget. Returns whether it ran.
    fn prefill_together(&mut self, w: &mut Worker, shared: &Shared) -> bool {
        let limit = match self.active.is_empty() {
            true => w.ctx.n_batch() as usize,
            false => ((self.budget_ms / w.prefill_ms_per_token()) as usize).clamp(MIN_CHUNK, w.ctx.n_batch() as usize),
        };
        let mut tails = vec![];
        for s in &self.starting {
            let Some(Next::Tokens(tail)) = s.prefill.next() else { break };
            let total: usize = tails.iter().sum();
            if !s.generation.background()
                || s.generation.cancelled()
                || tail != s.prefill.remaining()
                || total + tail > limit
            {
                break;
            }
            tails.push(tail);
        }
        // (As a single prefill chunk: not the cells the answers decoding or a waiting entry need;
        // counted only where there is a batch to cut.)
        if tails.len() >= 2
            && let Some(room) = free_cells(w, &self.active, self.entry_waits)
        {
            while tails.iter().sum::<usize>() > room && tails.pop().is_some() {}
        }
        if tails.len() < 2 {
            return false;
        }
        let prefills: Vec<&Prefill> = self.starting.iter().take(tails.len()).map(|s| &s.prefill).collect();
        let (batch, last) = batch_together(&prefills, w.ctx.is_unified());
        let (decoded, ms) = w.compute(w.prefill_tuner.waited_threads(), |ctx| ctx.decode(&batch));
        w.record(Stage::Prefill, batch.len(), ms);
        w.prefill_tuner.observe_waited(ms, batch.len());
        shared.widest_start.fetch_max(tails.len(), Ordering::Relaxed);
        shared.shared_inputs.fetch_add(tails.iter().sum::<usize>() - batch.len(), Ordering::Relaxed);
        for (tail, last) in tails.into_iter().zip(last) {
            let mut s = self.starting.pop_front().expect("counted above");
            s.prefill.advance(tail);
            let progress = Self::first_token(&mut s, decoded.clone().and_then(|()| w.ctx.logits(last)));
            self.started(w, s, progress);
        }
        true
    }

    /// A starting answer whose prefill has ended: its first token from the logits of its last
    /// input (or the failure that left none).
    fn first_token(s: &mut Starting, logits: Result<&[f32]>) -> Progress {
        match logits {
            Ok(logits) => s.generation.advance(logits),
            Err(e) => {
                s.generation.fail(e);
                Progress::Done
            }
        }
    }

    /// A starting answer after its first token: it decodes from the next step, or has ended.
    fn started(&mut self, w: &mut Worker, s: Starting, progress: Progress) {
        match progress {
            Progress::Next { token, pos } => self.active.push(Active {
                generation: s.generation,
                branch: s.branch,
                next: (token, pos),
                pause: Pause::Never,
            }),
            Progress::Done => w.release(s.branch),
        }
    }

    /// Prefill up to `budget_ms` of the front starting answer; returns whether one was there.
    fn prefill_start(&mut self, w: &mut Worker, shared: &Shared) -> bool {
        if self.prefill_together(w, shared) {
            return true;
        }
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
            // (A replay or a question must not take the cells the answers decoding still need,
            // its own decoding's, nor those an entry waits for.)
            let keep = s.generation.cells_to_end() + self.entry_waits;
            let Ok(tokens) = pool_room(w, &self.active, keep, &s.prefill, tokens.max(MIN_CHUNK)) else { return true };
            let started = Instant::now();
            match prefill_chunk(w, &mut s.prefill, tokens, true) {
                // No room in the unified pool while other answers decode: they free cells as
                // they end (or fail for want of one), so this one waits for them.
                Err(Error::PoolFull(_)) if !self.active.is_empty() => return true,
                Err(e) => break Err(e),
                Ok(()) => (),
            }
            spent += ms_since(started);
        };
        let mut s = self.starting.pop_front().expect("front");
        let progress = Self::first_token(&mut s, result.and_then(|()| w.ctx.last_logits()));
        self.started(w, s, progress);
        true
    }

    /// Run ordered work: a plain job, or up to `allowed_ms` of the front ingestion. Returns the
    /// time spent (ms).
    ///
    /// Frames of several streams are not put in one batch: measured here (CPU backend,
    /// per-sequence KV), a batch of two streams' chunks took several times as long as the two
    /// chunks one after the other, and whole frames even less.
    fn ingest(&mut self, w: &mut Worker, shared: &Shared, allowed_ms: f64) -> f64 {
        let started = Instant::now();
        let ran = self.run_ordered(w, shared, allowed_ms);
        let ms = ms_since(started);
        match ran {
            Some(Ran::Job) => self.split.jobs_ms += ms,
            Some(Ran::Ingestion) => self.split.ingest_ms += ms,
            None => (),
        }
        ms
    }

    /// The body of [`Scheduler::ingest`]: what ran, if anything.
    fn run_ordered(&mut self, w: &mut Worker, shared: &Shared, allowed_ms: f64) -> Option<Ran> {
        self.promote_demanded();
        let ended = match self.ordered.front_mut() {
            None => return None,
            Some(Ordered::Run(_)) => {
                if let Some(Ordered::Run(f)) = self.ordered.pop_front() {
                    f(w);
                }
                return Some(Ran::Job);
            }
            // Begin it: a cache hit, a cancellation or nothing left to prefill ends it at once;
            // one that cannot begin yet stays in front, asked again at the next step.
            Some(Ordered::Ingest(ing)) => {
                let cancelled = ing.cancel.load(Ordering::Acquire);
                let begun = match ing.begin.as_mut() {
                    Some(_) if cancelled => Begun::Ended(Err(Error::Cancelled)),
                    Some(begin) => {
                        w.entry_room = free_cells(w, &self.active, 0);
                        begin(w, &mut ing.prefill)
                    }
                    None => Begun::Prefill,
                };
                ing.waiting = matches!(begun, Begun::NotYet);
                match begun {
                    Begun::NotYet => {
                        self.pass_waiting();
                        return Some(Ran::Ingestion);
                    }
                    Begun::Ended(result) => Some(result),
                    Begun::Prefill => {
                        ing.begin = None;
                        cancelled
                            .then_some(Err(Error::Cancelled))
                            .or_else(|| ing.prefill.is_done().then_some(Ok(ing.prefill.pos)))
                    }
                }
            }
        };
        if let Some(result) = ended {
            self.finish(w, shared, 0, result);
            return Some(Ran::Ingestion);
        }
        let Some(Ordered::Ingest(ing)) = self.ordered.front_mut() else { unreachable!("checked above") };
        let tokens = (allowed_ms / w.prefill_ms_per_token()) as usize;
        let tokens = match pool_room(w, &self.active, 0, &ing.prefill, tokens.max(MIN_CHUNK)) {
            Ok(tokens) => tokens,
            Err(needed) => {
                self.entry_waits = needed;
                return Some(Ran::Ingestion);
            }
        };
        self.entry_waits = 0;
        let waited = ing.demand.load(Ordering::Acquire) > 0;
        let before = ing.prefill.remaining();
        let result = prefill_chunk(w, &mut ing.prefill, tokens, waited);
        self.split.ingest_inputs += (before - ing.prefill.remaining()) as u64;
        // No room in the unified pool while answers hold cells: they free them as they end, so
        // the chunk is tried again after them instead of failing the stream for good.
        if matches!(result, Err(Error::PoolFull(_))) && (!self.active.is_empty() || !self.starting.is_empty()) {
            return Some(Ran::Ingestion);
        }
        if result.is_err() || ing.prefill.is_done() {
            let end = ing.prefill.pos;
            self.finish(w, shared, 0, result.map(|()| end));
        }
        Some(Ran::Ingestion)
    }

    fn finish(&mut self, w: &mut Worker, shared: &Shared, index: usize, result: Result<i32>) {
        self.entry_waits = 0; // (what the front ingestion waited for: it has ended)
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
    /// own ingestions keep their order, and nothing passes a plain job.
    ///
    /// Questions change a stream's demand from other threads at any moment, so the first
    /// ingestion read as demanded only names the stream (its demand counter): what moves is that
    /// stream's earliest ingestion. (Moving the one read, when the demand rose between reading an
    /// earlier frame of the same stream and it, put a frame before the one it follows: llama.cpp
    /// refused its positions and the stream failed.)
    ///
    /// A stream whose earliest ingestion waits to begin is not promoted: it would only go back in
    /// front of the ingestion that passed it.
    fn promote_demanded(&mut self) {
        let leading = self.leading();
        let stream_waits = |d: &Arc<AtomicUsize>| leading.iter().any(|i| i.waiting && Arc::ptr_eq(&i.demand, d));
        let Some(demanded) = leading.iter().find(|i| i.demand.load(Ordering::Acquire) > 0 && !stream_waits(&i.demand))
        else {
            return;
        };
        let earliest = leading.iter().position(|i| Arc::ptr_eq(&i.demand, &demanded.demand)).expect("found above");
        if earliest > 0 {
            let ingestion = self.ordered.remove(earliest).expect("in range");
            self.ordered.push_front(ingestion);
        }
    }

    /// The front ingestion cannot begin yet (a slide waiting for its stream's readers): the
    /// earliest ingestion of another stream goes in front of it, so one stream's wait never holds
    /// up the others' frames (it is asked again once it is at the front again).
    fn pass_waiting(&mut self) {
        let leading = self.leading();
        let Some(waiting) = leading.first().map(|i| Arc::clone(&i.demand)) else { return };
        if let Some(other) = leading.iter().position(|i| !Arc::ptr_eq(&i.demand, &waiting)) {
            let ingestion = self.ordered.remove(other).expect("in range");
            self.ordered.push_front(ingestion);
        }
    }

    /// The ingestions at the front of the ordered work, up to the first plain job (which nothing
    /// passes).
    fn leading(&self) -> Vec<&Ingestion> {
        self.ordered
            .iter()
            .map_while(|o| match o {
                Ordered::Ingest(i) => Some(i),
                Ordered::Run(_) => None,
            })
            .collect()
    }

    /// Whether the front of the ordered work can run now: a plain job, or an ingestion not found
    /// waiting to begin (a slide waiting for its readers, which may be the evaluations starting).
    fn ordered_ready(&self) -> bool {
        match self.ordered.front() {
            Some(Ordered::Run(_)) => true,
            Some(Ordered::Ingest(i)) => !i.waiting,
            None => false,
        }
    }

    /// Whether a question waits for frames still being ingested.
    fn demanded(&self) -> bool {
        self.ordered.iter().any(|o| matches!(o, Ordered::Ingest(i) if i.demand.load(Ordering::Acquire) > 0))
    }

    /// One step: decode, then prefill within the budget.
    fn step(&mut self, w: &mut Worker, shared: &Shared) {
        let started = Instant::now();
        self.start_answers(w, shared);
        self.split.start_ms += ms_since(started);
        let decode_ms = self.decode_step(w, shared);
        self.split.decode_ms += decode_ms;
        // Background evaluations and frames take turns: a history keeps up with its camera for
        // the standing alerts read from it (they thin out instead, newest frame first), and a
        // source that is never short of frames (a file) does not starve the alerts either.
        let background_next = self.starting.front().is_some_and(|s| s.generation.background());
        if background_next && self.frames_turn && self.ordered_ready() {
            self.frames_turn = false;
            self.ingest(w, shared, self.chunk_budget_ms());
            return;
        }
        let started = Instant::now();
        let prefilled = self.prefill_start(w, shared);
        self.split.start_ms += ms_since(started);
        if prefilled {
            self.frames_turn = background_next;
            return;
        }
        if self.ordered.is_empty() {
            return;
        }
        if self.active.is_empty() {
            self.credit_ms = 0.0;
            self.ingest(w, shared, self.chunk_budget_ms());
            return;
        }
        // A question waiting for a frame is an answer starting: its frames get a budget every
        // step, like the prefill of an answer's question; within it the next stream's frame a
        // question waits for, where one takes less (a GPU ingests a frame in a fraction of the
        // budget, and a burst of questions, each waiting for its own stream's frame, took a step
        // a frame).
        if self.demanded() {
            self.ingest_demanded(w, shared, self.budget_ms);
            return;
        }
        // Answers paused for the encoder leave the cores to it: frames nobody waits for wait too.
        if !self.decoding() {
            return;
        }
        // Otherwise ingestion runs on its credit: the front chunk once the credit covers what
        // it costs (a budget's worth at most), as long as it does.
        let share = self.share;
        self.credit_ms = (self.credit_ms + decode_ms * share / (1.0 - share)).min(self.budget_ms);
        while self.credit_ms >= self.front_cost_ms(w) {
            let Some(ms) = self.ingest_progress(w, shared, self.credit_ms) else { break };
            self.credit_ms -= ms;
        }
    }

    /// Ingest frames questions wait for within `allowed_ms`: the front chunk, then the next
    /// while it is also a frame a question waits for and its cost fits in what is left.
    fn ingest_demanded(&mut self, w: &mut Worker, shared: &Shared, allowed_ms: f64) {
        let mut spent = 0.0;
        while let Some(ms) = self.ingest_progress(w, shared, allowed_ms - spent) {
            spent += ms;
            self.promote_demanded();
            let demanded_front = matches!(self.ordered.front(),
                Some(Ordered::Ingest(i)) if i.demand.load(Ordering::Acquire) > 0);
            if !demanded_front || spent + self.front_cost_ms(w) > allowed_ms {
                break;
            }
        }
    }

    /// What the front of the ordered work is expected to cost (ms), at most a budget: the rest
    /// of an ingestion at the measured rate; a plain job, or nothing ready, a whole budget.
    fn front_cost_ms(&self, w: &Worker) -> f64 {
        match self.ordered.front() {
            Some(Ordered::Ingest(i)) if self.ordered_ready() => {
                (i.prefill.remaining() as f64 * w.prefill_ms_per_token()).min(self.budget_ms)
            }
            _ => self.budget_ms,
        }
    }

    /// [`Scheduler::ingest`] within `allowed_ms`: the time it took, or `None` where it made no
    /// progress (nothing there, an ingestion that cannot begin yet or waits for the unified
    /// pool's room).
    fn ingest_progress(&mut self, w: &mut Worker, shared: &Shared, allowed_ms: f64) -> Option<f64> {
        let before = (self.ordered.len(), self.split.ingest_inputs);
        let ms = self.ingest(w, shared, allowed_ms);
        (before != (self.ordered.len(), self.split.ingest_inputs)).then_some(ms)
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

/// With the unified pool and answers decoding, how many of `prefill`'s next inputs to decode now
/// (`want` or fewer) so that each answer decoding keeps a cell for every token it may still
/// generate (`Generation::cells_to_end`), and `keep` more stay free; `Err(needed)`: not even the
/// fewest (`MIN_CHUNK`, or an image that goes whole) fit beside them, and the prefill waits for
/// answers to end and free their cells. Without it an entry could take the last free cells and
/// fail every answer of the next decode step for want of one (`Error::PoolFull`). With
/// per-sequence KV (each sequence has a block of its own) or no answer decoding: `want`. It
/// walks the cells in use (measured ~60 ns a cell, `KV_REFRESH_COST_FACTOR`: about 1 ms for 16
/// CPU streams' histories), only while answers decode in the unified pool.
fn pool_room(w: &mut Worker, active: &[Active], keep: usize, prefill: &Prefill, want: usize) -> Result<usize, usize> {
    let Some(room) = free_cells(w, active, keep) else { return Ok(want) };
    let fewest = match prefill.next() {
        Some(Next::Whole) => prefill.next_len(),
        _ => MIN_CHUNK.min(prefill.next_len()),
    };
    if room >= fewest { Ok(want.min(room)) } else { Err(fewest) }
}

/// With the unified pool and answers decoding, the free cells beyond those the answers may still
/// take and `keep` more ([`pool_room`]); `None` where nothing is counted (per-sequence KV, no
/// answer decoding, an engine not calibrated yet).
fn free_cells(w: &mut Worker, active: &[Active], keep: usize) -> Option<usize> {
    if active.is_empty() {
        return None;
    }
    pool_free(w, active, keep)
}

/// [`free_cells`], counted with no answer decoding too.
fn pool_free(w: &mut Worker, active: &[Active], keep: usize) -> Option<usize> {
    if !w.ctx.is_unified() {
        return None;
    }
    let kv = w.kv_memory();
    if kv.cell_bytes == 0 {
        return None;
    }
    let kept = keep + active.iter().map(|a| a.generation.cells_to_end()).sum::<usize>();
    Some(kv.cells.saturating_sub(kv.in_use_bytes.div_ceil(kv.cell_bytes)).saturating_sub(kept))
}

/// Decode the next chunk of `prefill`: about `tokens` inputs (`chunk_len` decides), never more
/// than one `llama_decode` takes (`n_batch`: a fast measured rate asks for more), or an image
/// that must go whole. `waited`: a question waits on it (no thread probe runs on it).
fn prefill_chunk(w: &mut Worker, prefill: &mut Prefill, tokens: usize, waited: bool) -> Result<()> {
    let Some(next) = prefill.next() else { return Ok(()) };
    let before = prefill.remaining();
    let threads = if waited { w.prefill_tuner.waited_threads() } else { w.prefill_tuner.threads() };
    let mut rows = w.rows_batch.take();
    let (decoded, ms) = w.compute(threads, |ctx| match next {
        Next::Whole => prefill.decode_whole(ctx),
        Next::Tokens(available) | Next::Rows(available) => {
            let n_batch = ctx.n_batch() as usize;
            let n = chunk_len(available, tokens.min(n_batch));
            let mut batch = match next {
                Next::Tokens(_) => Batch::tokens(n),
                _ => Batch::reusing(rows.take(), n, n_batch, ctx.model().n_embd()),
            };
            prefill.push(&mut batch, n);
            let decoded = ctx.decode(&batch).map(|()| prefill.advance(n));
            if matches!(next, Next::Rows(_)) {
                rows = Some(batch);
            }
            decoded
        }
    });
    w.rows_batch = rows;
    decoded?;
    let inputs = before - prefill.remaining();
    w.record(Stage::Prefill, inputs, ms);
    if waited {
        w.prefill_tuner.observe_waited(ms, inputs);
    } else {
        w.prefill_tuner.observe(ms, inputs);
    }
    Ok(())
}

/// Least time between two refreshes of the published KV account while the engine is busy; an
/// engine going idle always refreshes it.
const KV_REFRESH: std::time::Duration = std::time::Duration::from_millis(50);

/// The account walks every cell in use (measured here with `examples/ingest_rate.rs`: 0.21 ms
/// at 2,000 cells in use, 0.56 ms at 8,000, 1.93 ms at 32,000: about 60 ns a cell, so some 16 ms
/// for 32 streams of 8,192, a third of the engine's time at one refresh every 50 ms), so while
/// busy it is refreshed at most once per this many times its last cost: at most 2% of it.
const KV_REFRESH_COST_FACTOR: u32 = 50;

/// How long after a refresh that took `cost` the next one may run while the engine is busy.
fn kv_refresh_interval(cost: std::time::Duration) -> std::time::Duration {
    KV_REFRESH.max(cost * KV_REFRESH_COST_FACTOR)
}

/// How often an engine whose answers are all paused for the encoder looks whether the pause
/// has ended.
const PAUSE_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// The engine thread's loop.
pub(super) fn run(mut w: Worker, jobs: mpsc::Receiver<Job>, shared: Arc<Shared>, config: &EngineConfig) {
    calibrate(&mut w, config.merges_frames(), &|| {
        shared.cancel.load(Ordering::Acquire) || shared.stopping.load(Ordering::Acquire) || crate::llama::exiting()
    });
    shared.merge_frames.store(w.merge_frames, Ordering::Release);
    shared.threads.store(w.tuner.threads(), Ordering::Relaxed);
    *shared.kv.lock() = w.kv_memory();
    let (mut kv_refreshed, mut kv_cost) = (Instant::now(), std::time::Duration::ZERO);
    crate::llama::stop_workers_before_exit(config.device.name());
    let mut s = Scheduler {
        budget_ms: config.step_budget_ms,
        share: config.ingest_share,
        waiting: VecDeque::new(),
        starting: VecDeque::new(),
        active: Vec::new(),
        ordered: VecDeque::new(),
        credit_ms: 0.0,
        split: TimeSplit::default(),
        frames_turn: false,
        entry_waits: 0,
        encode_first: config.encode_first && matches!(config.device, crate::llama::Device::Cpu),
    };
    let began = Instant::now();
    loop {
        shared.turns.fetch_add(1, Ordering::Relaxed);
        if crate::llama::exiting() {
            return; // the process is exiting: drop the work, free the context
        }
        let first = if s.idle() {
            let waited = Instant::now();
            let job = jobs.recv_timeout(std::time::Duration::from_millis(200));
            s.split.idle_ms += ms_since(waited);
            match job {
                Ok(job) => Some(job),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return, // stopped, every job done
            }
        } else if s.resting() {
            let waited = Instant::now();
            let job = jobs.recv_timeout(PAUSE_POLL);
            if matches!(job, Err(mpsc::RecvTimeoutError::Disconnected)) {
                std::thread::sleep(PAUSE_POLL); // stopped: the paused answers still end
            }
            s.split.idle_ms += ms_since(waited);
            job.ok()
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
            if s.idle() || kv_refreshed.elapsed() >= kv_refresh_interval(kv_cost) {
                let started = Instant::now();
                let kv = w.kv_memory();
                *shared.kv.lock() = kv;
                kv_refreshed = Instant::now();
                kv_cost = kv_refreshed - started;
                if s.idle() && kv.in_use_bytes == 0 {
                    w.ctx.release_all_pages(); // every stream and answer has ended
                }
            }
            s.split.wall_ms = ms_since(began);
            *shared.time_split.lock() = s.split;
        }));
        if let Err(panic) = stepped {
            let what = crate::error::panic_message(panic.as_ref());
            let why = format!("engine {}: panic: {what}", config.name);
            crate::llama::log(crate::llama::LogLevel::Error, &why);
            // Failed for good, as the placer and stream placement read it: no new stream,
            // import or replay is sent to an engine whose thread has ended.
            *shared.failure.lock() = Some(why);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A cheap account is refreshed every 50 ms; a dear one (many long histories) so that it
    /// takes at most 2% of the engine's time.
    #[test]
    fn the_kv_account_is_refreshed_less_often_the_more_it_costs() {
        assert_eq!(kv_refresh_interval(Duration::from_micros(200)), Duration::from_millis(50));
        assert_eq!(kv_refresh_interval(Duration::from_millis(18)), Duration::from_millis(900));
    }

    #[test]
    fn a_pause_begins_with_an_encode_that_contends_and_ends_with_the_next_encode_to_end() {
        assert_eq!(Pause::Never.next(false, 3), Pause::Never);
        assert_eq!(Pause::Never.next(true, 3), Pause::Until(3));
        assert_eq!(Pause::Until(3).next(true, 3), Pause::Until(3));
        assert_eq!(Pause::Until(3).next(true, 4), Pause::Done); // an encode ended, another runs
        assert_eq!(Pause::Until(3).next(false, 3), Pause::Done); // no encode contends now
        assert_eq!(Pause::Done.next(true, 9), Pause::Done); // once only
    }
}
