//! Standing questions (alerts): yes/no questions evaluated on every new version of a stream.
//!
//! An alert is parsed from a list `id:question;id:question` ([`parse_alerts`]). Each evaluation
//! is a question with one output token whose logits are read, not sampled: the answer path's
//! private branch of the version (a `seq_cp` of the stream's sequence, or a replay where the
//! history is not resident), the question suffix prefilled there with the logits of its last
//! input, and a forced choice between the model's "yes" and "no" tokens ([`YesNo`], found by
//! tokenizing the words, never hard-coded ids): `P(yes) = softmax(l_yes, l_no)[0]`, the state
//! `l_yes > l_no`. Evaluations share the engine's steps with answers but are background work:
//! a question a user asked starts before every evaluation still waiting
//! (`Generation::background`).
//!
//! [`Hysteresis`] turns the raw states into the reported ones: the first evaluation of a stream
//! sets its first state, and a change needs `hold` consecutive evaluations of the other state.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use crate::answer::{Preparation, start_cost_ms};
use crate::engine::{Engine, Generation, Progress, Worker};
use crate::error::{Error, Result};
use crate::llama::{Model, Token};
use crate::placer::PreparePath;
use crate::prefill::Prefill;
use crate::stream::Version;

/// One standing question: the user's name for it and the question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertSpec {
    pub id: String,
    pub question: String,
}

/// Parse an alert list `id:question;id:question` (blanks around ids and questions ignored, an
/// empty list or empty entries between `;` allowed: no alerts). The question is everything after
/// the first `:`, so it may hold more colons; it may not hold `;`. Refused with the entry at
/// fault: an empty id, a missing question (no `:`, or nothing after it), a duplicate id.
pub fn parse_alerts(list: &str) -> Result<Vec<AlertSpec>> {
    let mut alerts = Vec::new();
    let mut seen = HashSet::new();
    for (i, entry) in list.split(';').enumerate() {
        let entry = entry.trim();
        if entry.is_empty() {
            continue;
        }
        let n = i + 1;
        let Some((id, question)) = entry.split_once(':') else {
            return Err(Error::Config(format!(
                "alert {n} ({entry:?}) has no question: write id:question, alerts separated by ';'"
            )));
        };
        let (id, question) = (id.trim(), question.trim());
        if id.is_empty() {
            return Err(Error::Config(format!("alert {n} ({entry:?}) has an empty id: write id:question")));
        }
        if question.is_empty() {
            return Err(Error::Config(format!("alert {n} ({id:?}) has an empty question: write id:question")));
        }
        if !seen.insert(id.to_owned()) {
            return Err(Error::Config(format!("alert id {id:?} is used twice: each alert needs its own id")));
        }
        alerts.push(AlertSpec { id: id.into(), question: question.into() });
    }
    if alerts.is_empty() && !list.trim().is_empty() {
        return Err(Error::Config(format!(
            "{list:?} names no alert: write id:question, alerts separated by ';' (empty for none)"
        )));
    }
    Ok(alerts)
}

/// The list as [`parse_alerts`] reads it back (`id:question;id:question`).
pub fn format_alerts(alerts: &[AlertSpec]) -> String {
    alerts.iter().map(|a| format!("{}:{}", a.id, a.question)).collect::<Vec<_>>().join(";")
}

/// What is asked for an alert's question: the question and the instruction to answer with one
/// word, so the first token of the answer is the choice.
pub fn alert_prompt(question: &str) -> String {
    format!("{question} Answer yes or no.")
}

/// The model's "yes" and "no" tokens: the first spelling (as an answer starts, at the start of
/// the assistant's turn: `Yes`/`No`, then `yes`/`no`, then with a leading space) that is one
/// token for both words in the model's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct YesNo {
    pub yes: Token,
    pub no: Token,
}

impl YesNo {
    pub fn find(model: &Model) -> Result<YesNo> {
        let one = |word: &str| -> Result<Option<Token>> {
            let tokens = model.tokenize(word, false, false)?;
            Ok(match tokens[..] {
                [t] if !model.is_eog(t) => Some(t),
                _ => None,
            })
        };
        for (yes, no) in [("Yes", "No"), ("yes", "no"), (" Yes", " No"), (" yes", " no")] {
            if let (Some(yes), Some(no)) = (one(yes)?, one(no)?)
                && yes != no
            {
                return Ok(YesNo { yes, no });
            }
        }
        Err(Error::Config(format!(
            "model {} has no single-token \"yes\" and \"no\" answers: it cannot evaluate alerts",
            model.path().display()
        )))
    }

    /// The forced choice from a row of logits.
    pub fn choose(&self, logits: &[f32]) -> Choice {
        Choice { yes_logit: logits[self.yes as usize], no_logit: logits[self.no as usize] }
    }
}

/// The forced choice between the two tokens: their logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub yes_logit: f32,
    pub no_logit: f32,
}

impl Choice {
    /// P(yes) from the softmax over the two logits.
    pub fn probability(&self) -> f64 {
        1.0 / (1.0 + (f64::from(self.no_logit) - f64::from(self.yes_logit)).exp())
    }

    /// Yes when its logit is the greater one (a tie is no).
    pub fn state(&self) -> bool {
        self.yes_logit > self.no_logit
    }
}

/// One alert evaluated on one version.
#[derive(Debug, Clone)]
pub struct Evaluation {
    pub id: String,
    pub choice: Choice,
    pub engine: String,
    pub path: PreparePath,
    /// Number of the newest frame of the version.
    pub frame: u64,
    /// History length (frames) of the version.
    pub frames: u64,
    /// Submission to the choice (ms).
    pub total_ms: f64,
}

/// Evaluate every alert on `version` on the stream's resident engine (its branch, or a replay
/// where the stream keeps no history), all queued at once so they share the engine's steps.
/// One result per alert, in order; `cancel` ends those not yet done (then `Stream::wake`).
pub fn evaluate(
    version: &Version,
    alerts: &[AlertSpec],
    yes_no: YesNo,
    cancel: &Arc<AtomicBool>,
) -> Result<Vec<Result<Evaluation>>> {
    let path = if version.stream.retain() { PreparePath::Resident } else { PreparePath::Replay };
    evaluate_on(version, alerts, yes_no, &version.stream.engine(), path, cancel)
}

/// [`evaluate`] on `engine` by `path` (the placer's paths; a replay re-prefills the version's
/// whole history in the branch).
pub fn evaluate_on(
    version: &Version,
    alerts: &[AlertSpec],
    yes_no: YesNo,
    engine: &Arc<Engine>,
    path: PreparePath,
    cancel: &Arc<AtomicBool>,
) -> Result<Vec<Result<Evaluation>>> {
    let resident = Arc::ptr_eq(engine, &version.stream.engine());
    let (tx, rx) = mpsc::channel();
    let mut queued = 0;
    let mut results: Vec<Option<Result<Evaluation>>> = vec![None; alerts.len()];
    for (index, alert) in alerts.iter().enumerate() {
        let prepared = version
            .stream
            .prompt()
            .question_tokens(engine.model(), &alert_prompt(&alert.question))
            .and_then(|suffix| Ok((Preparation::choose(version, engine, path, resident)?, suffix)));
        let (preparation, suffix) = match prepared {
            Ok(p) => p,
            Err(e) => {
                results[index] = Some(Err(e));
                continue;
            }
        };
        let cost = start_cost_ms(version, engine, path, suffix.len());
        let evaluation = AlertEvaluation {
            index,
            id: alert.id.clone(),
            version: version.clone(),
            suffix: Some(suffix),
            preparation,
            yes_no,
            engine: engine.name().to_owned(),
            limit: engine.answer_limit(version.cells),
            cancel: Arc::clone(cancel),
            submitted: Instant::now(),
            path,
            tx: tx.clone(),
            sent: false,
        };
        match engine.generate(Box::new(evaluation), cost) {
            Ok(()) => queued += 1,
            Err(e) => results[index] = Some(Err(e)),
        }
    }
    drop(tx);
    while queued > 0 {
        match engine.wait(&rx)? {
            Some((index, result)) => {
                results[index] = Some(result);
                queued -= 1;
            }
            None => break,
        }
    }
    Ok(results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Engine("the engine stopped before the alert was evaluated".into()))))
        .collect())
}

/// One alert's evaluation on the engine thread: a generation that ends at its first logits.
struct AlertEvaluation {
    index: usize,
    id: String,
    version: Version,
    /// Taken by `start`.
    suffix: Option<Vec<Token>>,
    preparation: Preparation,
    yes_no: YesNo,
    engine: String,
    limit: i32,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
    path: PreparePath,
    tx: mpsc::Sender<(usize, Result<Evaluation>)>,
    sent: bool,
}

impl AlertEvaluation {
    fn send(&mut self, result: Result<Evaluation>) {
        if !self.sent {
            self.sent = true;
            let _ = self.tx.send((self.index, result));
        }
    }
}

impl Generation for AlertEvaluation {
    fn start(&mut self, w: &mut Worker, branch: i32) -> Result<Prefill> {
        let suffix = self.suffix.take().unwrap_or_default();
        if suffix.is_empty() {
            return Err(Error::BadInput(format!("alert {} has no tokens", self.id)));
        }
        if self.version.cells + suffix.len() as i32 + 1 > self.limit {
            return Err(Error::BadInput(format!(
                "alert {} of {} tokens does not fit after a history of {} KV cells (of {})",
                self.id,
                suffix.len(),
                self.version.cells,
                self.limit
            )));
        }
        let (path, prefill) = self.preparation.prepare(w, &self.version, branch, suffix)?;
        self.path = path;
        Ok(prefill)
    }

    fn advance(&mut self, logits: &[f32]) -> Progress {
        let result = if self.cancel.load(Ordering::Acquire) {
            Err(Error::Cancelled)
        } else {
            Ok(Evaluation {
                id: self.id.clone(),
                choice: self.yes_no.choose(logits),
                engine: self.engine.clone(),
                path: self.path,
                frame: self.version.number,
                frames: self.version.frames(),
                total_ms: self.submitted.elapsed().as_secs_f64() * 1e3,
            })
        };
        self.send(result);
        Progress::Done
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    fn fail(&mut self, error: Error) {
        self.send(Err(error));
    }

    fn start_cells(&self) -> usize {
        self.preparation.start_cells(&self.version)
    }

    fn background(&self) -> bool {
        true
    }
}

impl Drop for AlertEvaluation {
    fn drop(&mut self) {
        self.send(Err(Error::Engine("the engine stopped before the alert was evaluated".into())));
    }
}

/// A reported state change of one alert on one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub state: bool,
    /// The stream's first state of this alert (not a change).
    pub first: bool,
}

/// Hysteresis of one alert on one stream: the first evaluation sets the first state; a change
/// needs `hold` consecutive evaluations of the other state (1: every change at once).
#[derive(Debug, Clone, Default)]
pub struct Hysteresis {
    hold: u32,
    state: Option<bool>,
    /// Consecutive evaluations of the other state so far.
    against: u32,
    evaluations: u64,
}

impl Hysteresis {
    pub fn new(hold: u32) -> Hysteresis {
        Hysteresis { hold: hold.max(1), ..Hysteresis::default() }
    }

    /// Count one evaluation whose raw state is `raw`; returns the transition it makes, if any.
    pub fn observe(&mut self, raw: bool) -> Option<Transition> {
        self.evaluations += 1;
        match self.state {
            None => {
                self.state = Some(raw);
                Some(Transition { state: raw, first: true })
            }
            Some(s) if s == raw => {
                self.against = 0;
                None
            }
            Some(_) => {
                self.against += 1;
                if self.against < self.hold {
                    return None;
                }
                self.against = 0;
                self.state = Some(raw);
                Some(Transition { state: raw, first: false })
            }
        }
    }

    /// The reported state (none before the first evaluation).
    pub fn state(&self) -> Option<bool> {
        self.state
    }

    pub fn evaluations(&self) -> u64 {
        self.evaluations
    }

    /// A new `hold` for the changes to come.
    pub fn set_hold(&mut self, hold: u32) {
        self.hold = hold.max(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(list: &str) -> String {
        parse_alerts(list).unwrap_err().to_string()
    }

    #[test]
    fn an_alert_list_parses_into_ids_and_questions() {
        let a = parse_alerts(" door : Is the door open? ; person:Is there a person: a human?;").unwrap();
        assert_eq!(
            a,
            vec![
                AlertSpec { id: "door".into(), question: "Is the door open?".into() },
                AlertSpec { id: "person".into(), question: "Is there a person: a human?".into() },
            ]
        );
        assert_eq!(format_alerts(&a), "door:Is the door open?;person:Is there a person: a human?");
        assert_eq!(parse_alerts(&format_alerts(&a)).unwrap(), a);
        assert!(parse_alerts("").unwrap().is_empty());
    }

    #[test]
    fn a_malformed_alert_list_is_refused_naming_the_fault() {
        assert!(msg(":Is it?").contains("empty id"), "{}", msg(":Is it?"));
        assert!(msg("a:x;  :y").contains("alert 2"), "{}", msg("a:x;  :y"));
        assert!(msg("a:x;a:y").contains("\"a\" is used twice"), "{}", msg("a:x;a:y"));
        assert!(msg("a").contains("has no question"), "{}", msg("a"));
        assert!(msg("a:  ").contains("empty question"), "{}", msg("a:  "));
        assert!(msg(" ;; ").contains("names no alert"), "{}", msg(" ;; "));
    }

    #[test]
    fn the_choice_is_the_softmax_over_the_two_logits() {
        let c = Choice { yes_logit: 2.0, no_logit: 0.0 };
        assert!((c.probability() - 1.0 / (1.0 + (-2.0f64).exp())).abs() < 1e-12);
        assert!(c.state());
        let tie = Choice { yes_logit: 1.5, no_logit: 1.5 };
        assert_eq!(tie.probability(), 0.5);
        assert!(!tie.state());
        let yn = YesNo { yes: 1, no: 3 };
        assert_eq!(yn.choose(&[9.0, -1.0, 9.0, 0.5]), Choice { yes_logit: -1.0, no_logit: 0.5 });
    }

    /// The transitions of a run of raw states, as (evaluation index, state, first).
    fn run(hold: u32, raw: &[u8]) -> Vec<(usize, bool, bool)> {
        let mut h = Hysteresis::new(hold);
        raw.iter().enumerate().filter_map(|(i, &r)| h.observe(r == 1).map(|t| (i, t.state, t.first))).collect()
    }

    #[test]
    fn the_first_state_and_each_change_are_reported_once() {
        assert_eq!(
            run(1, &[0, 0, 1, 1, 1, 0, 1]),
            vec![(0, false, true), (2, true, false), (5, false, false), (6, true, false)]
        );
        let mut h = Hysteresis::new(1);
        for _ in 0..5 {
            h.observe(true);
        }
        assert_eq!(h.evaluations(), 5);
        assert_eq!(h.state(), Some(true));
    }

    #[test]
    fn hold_suppresses_flapping() {
        // Noise that never holds for 3 evaluations changes nothing after the first state.
        assert_eq!(run(3, &[1, 0, 1, 0, 0, 1, 0, 0, 1, 1]), vec![(0, true, true)]);
        // Three in a row change it; the run counts from zero again after a change.
        assert_eq!(run(3, &[1, 0, 0, 0, 1, 1, 0, 1, 1, 1]), vec![(0, true, true), (3, false, false), (9, true, false)]);
        // A run broken by the current state starts again.
        assert_eq!(run(2, &[0, 1, 0, 1, 1]), vec![(0, false, true), (4, true, false)]);
        // 0 behaves as 1.
        assert_eq!(run(0, &[0, 1]), vec![(0, false, true), (1, true, false)]);
    }
}
