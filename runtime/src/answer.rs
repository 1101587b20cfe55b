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

use crate::engine::Worker;
use crate::error::{Error, Result};
use crate::llama::Token;
use crate::stream::{Version, prefill_history};
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

fn argmax(logits: &[f32]) -> Token {
    // First maximum on ties, like llama.cpp's greedy sampler.
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as Token
}

/// How a question's history was made ready on the engine that answered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreparePath {
    /// Continued from the stream's resident KV (a branch of its sequence).
    Resident,
    /// Imported a KV snapshot from another engine.
    Import,
    /// Rebuilt from retained embeddings and text.
    Replay,
}

impl PreparePath {
    pub fn name(self) -> &'static str {
        match self {
            PreparePath::Resident => "resident",
            PreparePath::Import => "import",
            PreparePath::Replay => "replay",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Question {
    pub id: String,
    pub text: String,
    pub max_tokens: u32,
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
    pub engine: String,
    pub path: PreparePath,
    /// History length (frames) of the bound version.
    pub frames: u64,
    /// Number of the newest frame of the bound version.
    pub frame: u64,
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
}

enum Event {
    Text(String),
    Done(Result<AnswerReport>),
}

/// Answer `question` over `version`, calling `on_text` with each complete piece of text as it
/// is generated. Blocks until the answer ends; `cancel` stops it at the next decode step.
pub fn answer(
    version: &Version,
    question: &Question,
    cancel: &Arc<AtomicBool>,
    mut on_text: impl FnMut(&str),
) -> Result<AnswerReport> {
    let wait_ms = ms(question.arrival.elapsed());
    let stream = Arc::clone(&version.stream);
    let engine = Arc::clone(stream.engine());
    let (tx, rx) = mpsc::channel();
    let (version, question, cancel) = (version.clone(), question.clone(), Arc::clone(cancel));
    let submitted = Instant::now();
    engine.submit(move |w| {
        let queue_ms = ms(submitted.elapsed());
        let branch = match w.take_branch() {
            Ok(b) => b,
            Err(e) => {
                let _ = tx.send(Event::Done(Err(e)));
                return;
            }
        };
        let result = run_answer(w, &version, &question, &cancel, branch, &tx).map(|mut r| {
            r.wait_ms = wait_ms;
            r.queue_ms = queue_ms;
            r
        });
        w.give_branch(branch);
        let _ = tx.send(Event::Done(result));
    })?;
    for event in rx {
        match event {
            Event::Text(t) => on_text(&t),
            Event::Done(r) => return r,
        }
    }
    Err(Error::Engine("the engine stopped before the answer finished".into()))
}

fn run_answer(
    w: &mut Worker,
    version: &Version,
    q: &Question,
    cancel: &AtomicBool,
    branch: i32,
    tx: &mpsc::Sender<Event>,
) -> Result<AnswerReport> {
    let stream = &version.stream;
    let model = Arc::clone(w.ctx.model());
    let prep = Instant::now();
    let path = if stream.retain() && stream.resident_epoch() == version.epoch {
        w.ctx.seq_copy_prefix(stream.seq(), branch, version.end);
        PreparePath::Resident
    } else {
        // The baseline, or a version of an older epoch: rebuild the history from its frames.
        let end = prefill_history(w, stream.prompt(), &version.history, branch, cancel)?;
        debug_assert_eq!(end, version.end);
        PreparePath::Replay
    };
    let prepare_ms = ms(prep.elapsed());

    let suffix = stream.prompt().question_tokens(&model, &q.text)?;
    let limit = w.ctx.n_ctx_per_seq() as i32;
    if version.end + suffix.len() as i32 + 1 > limit {
        return Err(Error::BadInput(format!(
            "question of {} tokens does not fit after a history of {} positions",
            suffix.len(),
            version.end
        )));
    }
    w.ctx.decode_tokens(&suffix, version.end, branch, true)?;
    let mut pos = version.end + suffix.len() as i32;

    let mut sampler = q.sampling.sampler();
    let mut utf8 = Utf8Stream::default();
    let mut text = String::new();
    let (mut tokens, mut ttft_ms, mut cancelled) = (0u32, None, false);
    while tokens < q.max_tokens && pos < limit {
        if cancel.load(Ordering::Acquire) {
            cancelled = true;
            break;
        }
        let logits = w.ctx.last_logits();
        let token = match sampler.as_mut() {
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
        ttft_ms.get_or_insert_with(|| ms(q.arrival.elapsed()));
        if model.is_eog(token) {
            break;
        }
        tokens += 1;
        let piece = utf8.push(&model.token_bytes(token));
        if !piece.is_empty() {
            text.push_str(&piece);
            let _ = tx.send(Event::Text(piece));
        }
        if tokens < q.max_tokens {
            w.ctx.decode_tokens(&[token], pos, branch, true)?;
            pos += 1;
        }
    }
    let tail = utf8.finish();
    if !tail.is_empty() {
        text.push_str(&tail);
        let _ = tx.send(Event::Text(tail));
    }
    let total_ms = ms(q.arrival.elapsed());
    Ok(AnswerReport {
        text,
        tokens,
        engine: stream.engine().name().to_owned(),
        path,
        frames: version.frames(),
        frame: version.number,
        wait_ms: 0.0,
        queue_ms: 0.0,
        prepare_ms,
        ttft_ms: ttft_ms.unwrap_or(total_ms),
        total_ms,
        cancelled,
    })
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
