//! The placer: for a question bound to a version, estimate every complete path on every engine
//! that may answer it, and pick the cheapest.
//!
//! A path's cost = queue delay (the starts of the answers ahead of it on that engine: answers go
//! before queued frame ingestion) + preparation of the history (nothing for a resident branch;
//! export and import for a snapshot; prefill of the whole history for a replay) + the question
//! suffix's prefill + the expected decode + the delay it imposes on frame ingestion (an answer
//! run on an engine with frames waiting delays them, and so the versions later questions need:
//! its start goes before them, and while it decodes ingestion keeps only its share of the engine),
//! all from stage rates measured online on each engine (so co-running slowdowns are in them),
//! not from a fixed CPU < GPU order.
//!
//! A question whose frame is still waiting for ingestion on a lagging resident engine may be
//! answered at once elsewhere, by replaying the retained history there, when that beats the
//! wait ([`before_publication`]).

use std::sync::Arc;

use crate::engine::Engine;
use crate::error::{Error, Result};
// The engine a new stream lives on: chosen below the streams, which choose again when theirs fails.
pub use crate::residence::resident_engine;
use crate::stream::Version;

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

/// The estimate of one complete path.
#[derive(Debug, Clone)]
pub struct PathEstimate {
    pub engine: Arc<Engine>,
    pub path: PreparePath,
    pub queue_ms: f64,
    pub prepare_ms: f64,
    pub suffix_ms: f64,
    pub decode_ms: f64,
    /// How much later the frames waiting on that engine are ingested because of this answer.
    pub ingest_delay_ms: f64,
}

impl PathEstimate {
    pub fn total_ms(&self) -> f64 {
        self.queue_ms + self.prepare_ms + self.suffix_ms + self.decode_ms + self.ingest_delay_ms
    }
}

/// Every complete path for answering over `version` with a suffix of `suffix_tokens` and
/// `expected_tokens` generated, cheapest first. `snapshot_cached` says whether a snapshot of the
/// version is already stored (then importing needs no export on the resident engine).
pub fn estimate(
    version: &Version,
    suffix_tokens: usize,
    expected_tokens: u32,
    snapshot_cached: bool,
) -> Vec<PathEstimate> {
    let stream = &version.stream;
    let resident = stream.engine();
    // Export, import and replay cost per KV cell of the history (tokens and embedding rows;
    // more than its positions after M-RoPE images).
    let history = version.cells as f64;
    let resident_usable = stream.retain() && stream.resident_epoch() == version.epoch;
    let export_ms = if snapshot_cached {
        0.0
    } else {
        resident.start_backlog_ms() + history * resident.rates().export_ms_per_token
    };
    let mut paths = vec![];
    // An engine that failed for good (its RPC server went away) is passed over.
    for engine in stream.peers().into_iter().filter(|e| e.failure().is_none()) {
        let rates = engine.rates();
        let run = |path, queue_ms: f64, prepare_ms: f64| {
            let suffix_ms = suffix_tokens as f64 * rates.prefill_ms_per_token;
            let decode_ms = expected_tokens as f64 * rates.decode_ms_per_step;
            // Frames waiting there are held back by the whole preparation and suffix (they go
            // first) and, while the answer decodes, ingestion keeps only its share of the engine.
            let ingest_delay_ms = if engine.ingest_backlog_ms() > 0.0 {
                prepare_ms + suffix_ms + decode_ms * (1.0 - engine.config().ingest_share)
            } else {
                0.0
            };
            PathEstimate {
                engine: Arc::clone(&engine),
                path,
                queue_ms,
                prepare_ms,
                suffix_ms,
                decode_ms,
                ingest_delay_ms,
            }
        };
        let here = Arc::ptr_eq(&engine, &resident);
        if here && resident_usable {
            paths.push(run(PreparePath::Resident, engine.start_backlog_ms(), 0.0));
        }
        if !here && resident_usable && engine.compat_tag().layout == resident.compat_tag().layout {
            let queue = export_ms.max(engine.start_backlog_ms());
            paths.push(run(PreparePath::Import, queue, history * rates.import_ms_per_token));
        }
        paths.push(run(PreparePath::Replay, engine.start_backlog_ms(), history * rates.prefill_ms_per_token));
    }
    paths.sort_by(|a, b| a.total_ms().total_cmp(&b.total_ms()));
    paths
}

/// Leave the resident engine only for a path this much cheaper: estimates are noisy, and a
/// resident answer moves nothing.
const MOVE_FACTOR: f64 = 0.8;

/// A path that answers over `pending` (registered, not yet published: its frames wait for
/// ingestion on the resident engine) at once, by replaying its history on another engine, when
/// that is cheaper than waiting for the resident engine to publish it and answering there.
pub fn before_publication(pending: &Version, suffix_tokens: usize, expected_tokens: u32) -> Option<PathEstimate> {
    let resident = pending.stream.engine();
    let rates = resident.rates();
    // The frame is the newest registered, so at worst the last of the resident's queue (the
    // engine takes a waited-for stream's frames first, but answers decoding there and other
    // streams' waited-for frames still go between); then the question's suffix and its decode.
    let there_ms = resident.ingest_backlog_ms()
        + suffix_tokens as f64 * rates.prefill_ms_per_token
        + expected_tokens as f64 * rates.decode_ms_per_step;
    estimate(pending, suffix_tokens, expected_tokens, false)
        .into_iter()
        .find(|p| p.path == PreparePath::Replay && !Arc::ptr_eq(&p.engine, &resident))
        .filter(|moved| moved.total_ms() < there_ms * MOVE_FACTOR)
}

/// The cheapest path, on any engine (`placement` = `auto`) or on the named one.
pub fn choose(
    version: &Version,
    suffix_tokens: usize,
    expected_tokens: u32,
    snapshot_cached: bool,
    placement: &str,
) -> Result<PathEstimate> {
    let paths: Vec<_> = estimate(version, suffix_tokens, expected_tokens, snapshot_cached)
        .into_iter()
        .filter(|p| placement == "auto" || p.engine.name() == placement)
        .collect();
    let resident = paths.iter().find(|p| p.path == PreparePath::Resident);
    match (paths.first(), resident) {
        (Some(best), Some(resident)) if best.total_ms() > resident.total_ms() * MOVE_FACTOR => Ok(resident.clone()),
        (Some(best), _) => Ok(best.clone()),
        (None, _) => {
            // The engine named, or with `auto` every engine, failed: that is the cause.
            let peers = version.stream.peers();
            let named = peers.iter().find(|e| e.name() == placement);
            let failed = match named {
                Some(e) => e.failure(),
                None if placement == "auto" => {
                    peers.iter().map(|e| e.failure()).collect::<Option<Vec<_>>>().map(|f| f.join("; "))
                }
                None => None,
            };
            if let Some(why) = failed {
                return Err(Error::Engine(why));
            }
            let names: Vec<String> = version.stream.peers().iter().map(|e| e.name().to_owned()).collect();
            Err(Error::Config(format!(
                "placement={placement} names no engine of this stream (engines: {})",
                names.join(", ")
            )))
        }
    }
}
