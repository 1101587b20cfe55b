//! `vlmquery`'s question statistics (read-only properties): questions accepted and refused,
//! answers failed and cancelled, and the mean TTFT of the answered ones. Atomics, so that reading
//! them takes none of the element's locks; reset at PAUSED→READY with the rest of its state.

use std::sync::atomic::{AtomicU64, Ordering};

use glib::prelude::*;

use super::Outcome;

/// The property names, in the order `properties` lists them.
pub(super) const NAMES: [&str; 5] =
    ["questions-accepted", "questions-refused", "answers-failed", "answers-cancelled", "mean-ttft-ms"];

#[derive(Default)]
pub(super) struct Counters {
    accepted: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    answered: AtomicU64,
    /// TTFT of the answered questions, summed (µs).
    ttft_us: AtomicU64,
}

impl Counters {
    pub(super) fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a question's end; the names of the properties it changed.
    pub(super) fn ended(&self, outcome: &Outcome) -> &'static [&'static str] {
        match outcome {
            Outcome::Answered(r) => {
                self.answered.fetch_add(1, Ordering::Relaxed);
                self.ttft_us.fetch_add((r.ttft_ms.max(0.0) * 1e3) as u64, Ordering::Relaxed);
                &["mean-ttft-ms"]
            }
            Outcome::Failed(_) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                &["answers-failed"]
            }
            Outcome::Cancelled(_) => {
                self.cancelled.fetch_add(1, Ordering::Relaxed);
                &["answers-cancelled"]
            }
        }
    }

    pub(super) fn reset(&self) {
        for c in [&self.accepted, &self.refused, &self.failed, &self.cancelled, &self.answered, &self.ttft_us] {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// The value of property `name`, if it is one of these.
    pub(super) fn value(&self, name: &str) -> Option<glib::Value> {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Some(match name {
            "questions-accepted" => get(&self.accepted).to_value(),
            "questions-refused" => get(&self.refused).to_value(),
            "answers-failed" => get(&self.failed).to_value(),
            "answers-cancelled" => get(&self.cancelled).to_value(),
            "mean-ttft-ms" => {
                let n = get(&self.answered);
                (if n == 0 { 0.0 } else { get(&self.ttft_us) as f64 / 1e3 / n as f64 }).to_value()
            }
            _ => return None,
        })
    }
}

/// The read-only properties.
pub(super) fn properties() -> Vec<glib::ParamSpec> {
    let count = |name: &str, nick: &str, blurb: &str| {
        glib::ParamSpecUInt64::builder(name).nick(nick).blurb(blurb).read_only().build()
    };
    vec![
        count(NAMES[0], "Questions accepted", "Questions accepted so far (each ends in one vlm-answer)"),
        count(NAMES[1], "Questions refused", "Questions refused with a warning (max-questions, flushing, after EOS, a repeated id)"),
        count(NAMES[2], "Answers failed", "Accepted questions whose vlm-answer is failed"),
        count(NAMES[3], "Answers cancelled", "Accepted questions whose vlm-answer is cancelled (flush, stop)"),
        glib::ParamSpecDouble::builder(NAMES[4])
            .nick("Mean TTFT")
            .blurb("Mean time to first token of the answered questions, from each question's arrival (ms; 0 before the first)")
            .read_only()
            .build(),
    ]
}
