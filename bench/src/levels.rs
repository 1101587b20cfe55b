//! What `vlm-bench capacity` finds, per configuration: a level of live streams judged, and a
//! point of the history curve. Below both the capacity run and its plots.

use serde::{Deserialize, Serialize};

use crate::record::Config;
use crate::report::{self, Summary};

/// One configuration at one level, judged.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Level {
    pub streams: usize,
    pub config: Config,
    /// Questions not answered (failed or never reported).
    pub lost: usize,
    /// Frames the sources produced (streams x frames x rounds).
    pub frames_offered: usize,
    /// Frames in the histories the answers were given over, their mean.
    #[serde(deserialize_with = "report::nan_if_null")]
    pub history_frames_mean: f64,
    /// Questions asked per second (the offered load).
    pub offered_per_s: f64,
    pub sustained: bool,
    /// Why not, or "sustained".
    pub verdict: String,
    /// Unsustained by a margin (no further level ran).
    pub stopped: bool,
    /// CPU other processes used during the level's runs, at most (percent of all cores).
    #[serde(default)]
    pub foreign_cpu_pct: Option<f64>,
    pub summary: Summary,
}

/// One configuration at one point of the history curve.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HistoryPoint {
    pub config: Config,
    /// Frames in the history when the questions were asked.
    pub frames: usize,
    pub answered: usize,
    /// From the question's arrival (the history is made ready before it; no live source).
    #[serde(alias = "ttft_ms")]
    pub ttft_from_question_ms: Vec<f64>,
    #[serde(alias = "ttft_median_ms", deserialize_with = "report::nan_if_null")]
    pub ttft_from_question_median_ms: f64,
    /// Decode rate of the answers after their first token (tokens/s per answer).
    #[serde(deserialize_with = "report::nan_if_null")]
    pub decode_tok_s: f64,
    /// Time to bring the history to this point from the previous one (see `prime_ms`).
    #[serde(deserialize_with = "report::nan_if_null")]
    pub prime_ms: f64,
    pub errors: Vec<String>,
}
