//! Answering a question from a pinned version: the answer branches from the version's history
//! (a copy of the stream's prefix into a private answer sequence), prefills its own suffix and
//! decodes; the stream's sequence keeps growing meanwhile and the branch is released at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;

use crate::engine::{Engine, Generation, Progress, Stage, Worker};
use crate::error::{Error, Result};
use crate::llama::{Token, argmax};
use crate::placer::{self, PreparePath};
use crate::prefill::{Origin, Prefill};
use crate::snapshot::Snapshot;
use crate::stream::{Entry, Stream, Version};
use crate::text::Utf8Stream;

/// Token sampling; greedy (temperature 0) by default so answers reproduce.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u32,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 0 }
    }
}

impl Sampling {
    fn sampler(&self) -> Option<LlamaSampler> {
        (self.temperature > 0.0).then(|| {
            LlamaSampler::chain_simple([
                LlamaSampler::top_k(self.top_k),
                LlamaSampler::top_p(self.top_p, 1),
                LlamaSampler::min_p(self.min_p, 1),
                LlamaSampler::temp(self.temperature),
                LlamaSampler::dist(self.seed),
            ])
        })
    }
}

#[derive(Debug, Clone)]
pub struct Question {
    pub id: String,
    pub text: String,
    pub max_tokens: u32,
    /// Generate exactly `max_tokens` tokens, going on past end-of-generation tokens (equal work
    /// for measurements).
    pub ignore_eos: bool,
    pub sampling: Sampling,
    /// When the question arrived: every latency is measured from here.
    pub arrival: Instant,
}

/// What an answer reports beside its text.
#[derive(Debug, Clone)]
pub struct AnswerReport {
    pub text: String,
    /// Tokens actually generated.
    pub tokens: u32,
    /// Their ids (what `Stream::commit` takes).
    pub token_ids: Vec<Token>,
    pub engine: String,
    pub path: PreparePath,
    /// History length (frames) of the bound version.
    pub frames: u64,
    /// Number of the newest frame of the bound version.
    pub frame: u64,
    /// KV cells of the bound version's history after the prompt (its frames' rows and any
    /// committed questions and answers).
    pub history_cells: u32,
    /// Waiting for the bound version to be published.
    pub wait_ms: f64,
    /// Waiting in the engine's queue.
    pub queue_ms: f64,
    /// Making the history ready (branch copy or replay).
    pub prepare_ms: f64,
    /// Arrival to first token.
    pub ttft_ms: f64,
    /// Arrival to last token.
    pub total_ms: f64,
    pub cancelled: bool,
    /// The placer's estimate of the path's total time, when the placer chose it.
    pub estimate_ms: Option<f64>,
}

enum Event {
    Text(String),
    Done(Result<AnswerReport>),
}

/// Answer `question` over `version` on the stream's resident engine, calling `on_text` with
/// each complete piece of text as it is generated. Blocks until the answer ends; `cancel` stops
/// it at the next decode step. The answer shares the engine's decode steps with every other
/// answer being generated there.
pub fn answer(
    version: &Version,
    question: &Question,
    cancel: &Arc<AtomicBool>,
    on_text: impl FnMut(&str),
) -> Result<AnswerReport> {
    let resident = version.stream.engine();
    let path = if version.stream.retain() { PreparePath::Resident } else { PreparePath::Replay };
    answer_on(version, question, &resident, path, cancel, on_text)
}

/// Let the placer choose the engine and path (`placement` = `auto` or an engine's name), then
/// answer there. The report carries the estimate beside the measured times.
pub fn answer_placed(
    version: &Version,
    question: &Question,
    placement: &str,
    cancel: &Arc<AtomicBool>,
    on_text: impl FnMut(&str),
) -> Result<AnswerReport> {
    let stream = &version.stream;
    let suffix = stream.prompt().question_tokens(stream.engine().model(), &question.text)?.len();
    let cached = cached_snapshot(version).is_some();
    let plan = placer::choose(version, suffix, question.max_tokens, cached, placement)?;
    let mut report = answer_on(version, question, &plan.engine, plan.path, cancel, on_text)?;
    report.estimate_ms = Some(plan.total_ms());
    Ok(report)
}

/// Answer `question` over frame `number` of `stream`: with `placement` = `auto`, a frame still
/// waiting for ingestion on a lagging resident engine is answered at once by replaying its
/// history on another engine when the placer finds that sooner
/// ([`placer::before_publication`]); otherwise this waits for the version and places it
/// ([`answer_placed`]).
pub fn answer_frame(
    stream: &Arc<Stream>,
    number: u64,
    question: &Question,
    placement: &str,
    cancel: &Arc<AtomicBool>,
    on_text: impl FnMut(&str),
) -> Result<AnswerReport> {
    if placement == "auto"
        && let Some(pending) = stream.pending_version(number)
    {
        let suffix = stream.prompt().question_tokens(stream.engine().model(), &question.text)?.len();
        if let Some(plan) = placer::before_publication(&pending, suffix, question.max_tokens) {
            let mut report = answer_on(&pending, question, &plan.engine, plan.path, cancel, on_text)?;
            report.estimate_ms = Some(plan.total_ms());
            return Ok(report);
        }
    }
    let version = stream.wait_version(number, cancel)?;
    answer_placed(&version, question, placement, cancel, on_text)
}

/// A stored snapshot of exactly `version`, if the prefix cache has one.
fn cached_snapshot(version: &Version) -> Option<Arc<Snapshot>> {
    let stream = &version.stream;
    // (Not counted: the cache's hits and misses are its frames'.)
    stream.prefix_cache()?.peek(&(version.key, stream.engine().compat_tag()))
}

/// A snapshot holding `version`: from the prefix cache, or exported from the resident engine
/// (after the jobs queued there; the stream's sequence may then hold more than the version,
/// which the importer trims).
pub fn snapshot(version: &Version) -> Result<Arc<Snapshot>> {
    if let Some(s) = cached_snapshot(version) {
        return Ok(s);
    }
    let stream = Arc::clone(&version.stream);
    let (epoch, end, key, tag) = (version.epoch, version.end, version.key, stream.engine().compat_tag());
    let cells = version.cells as usize;
    let (engine, seq) = stream.home();
    engine.call(move |w| {
        // (A closed stream gave its sequence back: -1 would export every sequence.)
        if !stream.retain() || stream.resident_epoch() != epoch || seq < 0 {
            return Err(Error::Engine("the version is no longer resident: replay it instead".into()));
        }
        let started = Instant::now();
        let bytes = w.ctx.seq_snapshot(seq)?;
        w.record(Stage::Export, cells, ms(started.elapsed()));
        Ok(Arc::new(Snapshot { key, tag, bytes, end }))
    })?
}

/// Answer on `engine`, preparing the history by `path`.
pub fn answer_on(
    version: &Version,
    question: &Question,
    engine: &Arc<Engine>,
    path: PreparePath,
    cancel: &Arc<AtomicBool>,
    mut on_text: impl FnMut(&str),
) -> Result<AnswerReport> {
    let resident = Arc::ptr_eq(engine, &version.stream.engine());
    let suffix = version.stream.prompt().question_tokens(engine.model(), &question.text)?.len();
    let start_ms = start_cost_ms(version, engine, path, suffix);
    let preparation = Preparation::choose(version, engine, path, resident)?;
    let (tx, rx) = mpsc::channel();
    engine.generate(
        Box::new(Answer {
            version: version.clone(),
            question: question.clone(),
            cancel: Arc::clone(cancel),
            tx,
            wait_ms: ms(question.arrival.elapsed()),
            submitted: Instant::now(),
            sampler: question.sampling.sampler(),
            model: Arc::clone(engine.model()),
            engine: engine.name().to_owned(),
            preparation,
            report: None,
            utf8: Utf8Stream::default(),
            limit: engine.answer_limit(version.cells),
            next_pos: 0,
            next_cell: 0,
            started: None,
        }),
        start_ms,
    )?;
    while let Some(event) = engine.wait(&rx)? {
        match event {
            Event::Text(t) => on_text(&t),
            Event::Done(r) => return r,
        }
    }
    Err(Error::Engine("the engine stopped before the answer finished".into()))
}

/// Estimated milliseconds of an answer's start on `engine`: preparing `version`'s history by
/// `path` and prefilling a suffix of `suffix` tokens.
pub(crate) fn start_cost_ms(version: &Version, engine: &Engine, path: PreparePath, suffix: usize) -> f64 {
    let rates = engine.rates();
    // Moving the history costs per KV cell (token or embedding row), not per position.
    let history = version.cells as f64;
    suffix as f64 * rates.prefill_ms_per_token
        + match path {
            PreparePath::Resident => 0.0,
            PreparePath::Import => history * rates.import_ms_per_token,
            PreparePath::Replay => history * rates.prefill_ms_per_token,
        }
}

/// How the answering engine gets the version's history.
pub(crate) enum Preparation {
    /// Copy the stream's sequence (same engine).
    Branch,
    Import(Arc<Snapshot>),
    Replay,
}

impl Preparation {
    /// KV cells its start takes at once: an import's history.
    pub(crate) fn start_cells(&self, version: &Version) -> usize {
        match self {
            Preparation::Import(_) => version.cells.max(0) as usize,
            _ => 0,
        }
    }

    /// How `engine` gets `version`'s history by `path` (`resident`: it is the stream's engine).
    pub(crate) fn choose(version: &Version, engine: &Engine, path: PreparePath, resident: bool) -> Result<Preparation> {
        Ok(match path {
            PreparePath::Resident if resident && version.stream.retain() => Preparation::Branch,
            PreparePath::Resident => {
                return Err(Error::Config(format!("the history is not resident on engine {}", engine.name())));
            }
            PreparePath::Import => match snapshot(version) {
                Ok(snapshot) => {
                    if let Some(why) = snapshot.tag.incompatibility(&engine.compat_tag()) {
                        return Err(Error::Incompatible(why));
                    }
                    Preparation::Import(snapshot)
                }
                // A slide, restart or move began since the placer chose: the history replays,
                // as a resident branch's does then.
                Err(_) if version.stream.resident_epoch() != version.epoch => Preparation::Replay,
                Err(e) => return Err(e),
            },
            PreparePath::Replay => Preparation::Replay,
        })
    }

    /// Make `version`'s history ready in `branch` as far as that needs no prefill (a branch
    /// copy, an import) and return the path taken and the prefill left: the replayed history
    /// (when not resident or imported) and `suffix`, with the logits of its last input.
    pub(crate) fn prepare(
        &self,
        w: &mut Worker,
        version: &Version,
        branch: i32,
        suffix: Vec<Token>,
    ) -> Result<(PreparePath, Prefill)> {
        let stream = &version.stream;
        let prep = Instant::now();
        let suffix = Entry::Text(suffix.into());
        // (None where the stream was closed: its sequence is given back, -1 until the job that
        // ends its residence runs.)
        let resident = (stream.resident_epoch() == version.epoch).then(|| stream.home().1).filter(|&seq| seq >= 0);
        let (path, entries) = match (self, resident) {
            (Preparation::Branch, Some(seq)) => {
                w.ctx.seq_copy_prefix(seq, branch, version.end);
                let origin = Origin { seq, epoch: version.epoch, end: version.end };
                let prefill = Prefill::new(branch, version.end, [suffix], true, w.frame_rows());
                return Ok((PreparePath::Resident, prefill.branched_from(origin)));
            }
            // (Not while a per-sequence copy waits for the next decode: it would land on the
            // imported cells. Replayed instead.)
            (Preparation::Import(snapshot), _) if !w.ctx.copy_pending(branch) => {
                w.ctx.seq_restore(branch, &snapshot.bytes)?;
                w.ctx.seq_truncate(branch, version.end);
                w.record(Stage::Import, version.cells as usize, ms(prep.elapsed()));
                (PreparePath::Import, vec![suffix])
            }
            // The baseline, a replay on another engine, or a version of an older epoch:
            // rebuild the history from its frames.
            (Preparation::Branch | Preparation::Replay | Preparation::Import(_), _) => {
                w.ctx.seq_clear(branch);
                let mut entries = stream.replay_entries(&version.history);
                entries.push(suffix);
                return Ok((PreparePath::Replay, Prefill::new(branch, 0, entries, true, w.frame_rows())));
            }
        };
        Ok((path, Prefill::new(branch, version.end, entries, true, w.frame_rows())))
    }
}

/// One answer being generated on the engine thread.
struct Answer {
    version: Version,
    question: Question,
    cancel: Arc<AtomicBool>,
    tx: mpsc::Sender<Event>,
    wait_ms: f64,
    submitted: Instant,
    sampler: Option<LlamaSampler>,
    model: Arc<crate::llama::Model>,
    engine: String,
    preparation: Preparation,
    /// Filled in by `start`; sent when the answer ends.
    report: Option<AnswerReport>,
    utf8: Utf8Stream,
    /// KV cells of the answer's sequence.
    limit: i32,
    /// Position of the next token to decode.
    next_pos: i32,
    /// KV cell the next token fills (history cells + suffix + tokens generated; ahead of
    /// `next_pos` after M-RoPE images).
    next_cell: i32,
    /// When `start` ran (preparation is measured from here to the first token).
    started: Option<Instant>,
}

impl Answer {
    fn finish(&mut self, result: Result<()>) -> Progress {
        let tail = self.utf8.finish();
        self.emit(tail);
        let q = &self.question;
        let result = result.and_then(|()| self.report.take().ok_or(Error::Cancelled)).map(|mut r| {
            r.total_ms = ms(q.arrival.elapsed());
            if r.tokens == 0 {
                r.ttft_ms = r.total_ms;
            }
            r
        });
        let _ = self.tx.send(Event::Done(result));
        Progress::Done
    }

    fn emit(&mut self, piece: String) {
        if !piece.is_empty() {
            if let Some(r) = self.report.as_mut() {
                r.text.push_str(&piece);
            }
            let _ = self.tx.send(Event::Text(piece));
        }
    }

    /// Make the bound version's history ready in `branch` as far as that needs no prefill, and
    /// return the prefill left: the replayed history (when not resident or imported) and the
    /// question suffix.
    fn prepare(&mut self, w: &mut Worker, branch: i32) -> Result<Prefill> {
        let (version, stream) = (&self.version, &self.version.stream);
        let prep = Instant::now();
        self.started = Some(prep);
        let suffix = stream.prompt().question_tokens(&self.model, &self.question.text)?;
        if version.cells + suffix.len() as i32 + 1 > self.limit {
            return Err(Error::BadInput(format!(
                "question of {} tokens does not fit after a history of {} KV cells (of {})",
                suffix.len(),
                version.cells,
                self.limit
            )));
        }
        if suffix.is_empty() {
            return Err(Error::BadInput("the question has no tokens".into()));
        }
        let (n_suffix, n_cells) = (suffix.len() as i32, version.cells);
        let (path, prefill) = self.preparation.prepare(w, version, branch, suffix)?;
        // A replay rebuilds the history from position 0, without a gap a slide may have left.
        let end = if path == PreparePath::Replay { version.stream.replay_end(&version.history) } else { version.end };
        self.next_pos = end + n_suffix;
        self.next_cell = n_cells + n_suffix;
        self.report = Some(self.new_report(path));
        Ok(prefill)
    }

    fn new_report(&self, path: PreparePath) -> AnswerReport {
        let version = &self.version;
        AnswerReport {
            text: String::new(),
            tokens: 0,
            token_ids: Vec::new(),
            engine: self.engine.clone(),
            path,
            frames: version.frames(),
            frame: version.number,
            history_cells: version.history.iter().map(Entry::cells).sum::<i32>() as u32,
            wait_ms: self.wait_ms,
            queue_ms: ms(self.submitted.elapsed()),
            prepare_ms: 0.0,
            ttft_ms: 0.0,
            total_ms: 0.0,
            cancelled: false,
            estimate_ms: None,
        }
    }

    /// Sample the next token from `logits`, emit its text, and say what comes next.
    fn sample(&mut self, logits: &[f32]) -> Progress {
        let (pos, cell) = (self.next_pos, self.next_cell);
        let report = self.report.as_mut().expect("prepared");
        if self.cancel.load(Ordering::Acquire) {
            report.cancelled = true;
            return self.finish(Ok(()));
        }
        let token = match self.sampler.as_mut() {
            None => argmax(logits),
            Some(s) => {
                let mut candidates = LlamaTokenDataArray::from_iter(
                    logits.iter().enumerate().map(|(i, &l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)),
                    false,
                );
                candidates.apply_sampler(s);
                let t = candidates.selected_token().map_or(argmax(logits), |t| t.0);
                s.accept(LlamaToken(t));
                t
            }
        };
        if report.tokens == 0 {
            report.ttft_ms = ms(self.question.arrival.elapsed());
            report.prepare_ms = self.started.map_or(0.0, |s| ms(s.elapsed()));
        }
        if self.model.is_eog(token) && !self.question.ignore_eos {
            return self.finish(Ok(()));
        }
        report.tokens += 1;
        report.token_ids.push(token);
        // No cell left to decode this token into: it is the last one.
        let done = report.tokens >= self.question.max_tokens || cell >= self.limit;
        let piece = self.utf8.push(&self.model.token_bytes(token));
        self.emit(piece);
        if done {
            return self.finish(Ok(()));
        }
        self.next_pos = pos + 1;
        self.next_cell = cell + 1;
        Progress::Next { token, pos }
    }
}

impl Generation for Answer {
    fn start(&mut self, w: &mut Worker, branch: i32) -> Result<Prefill> {
        self.prepare(w, branch)
    }

    fn advance(&mut self, logits: &[f32]) -> Progress {
        self.sample(logits)
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    fn fail(&mut self, error: Error) {
        self.finish(Err(error));
    }

    fn start_cells(&self) -> usize {
        self.preparation.start_cells(&self.version)
    }

    fn cells_to_end(&self) -> usize {
        let tokens = self.report.as_ref().map_or(0, |r| r.tokens);
        let left = self.question.max_tokens.saturating_sub(tokens) as usize;
        left.min((self.limit - self.next_cell + 1).max(0) as usize)
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
