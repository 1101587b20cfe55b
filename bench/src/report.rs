//! Per-configuration summaries, the ratios the issue asks for, and the printed table.

use serde::{Deserialize, Serialize};

use crate::record::{AnswerRecord, Config, RunRecord};

/// Everything measured for one configuration, over all its rounds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub config: Config,
    pub description: String,
    pub rounds: usize,
    pub answered: usize,
    pub expected: usize,
    pub failed: usize,
    /// Answers per second over each round's window (first frame to last answer), their mean.
    #[serde(deserialize_with = "nan_if_null")]
    pub throughput: f64,
    pub throughput_rounds: Vec<f64>,
    /// The headline: TTFT from the capture of the question's frame (its due time on the live
    /// source), encoding included (ms; NaN in reports made before this clock existed).
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub ttft_from_capture_mean_ms: f64,
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub ttft_from_capture_p50_ms: f64,
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub ttft_from_capture_p95_ms: f64,
    /// Mean TTFT from capture of each round, so a round hit by outside load shows.
    #[serde(default, deserialize_with = "nans_if_null")]
    pub ttft_from_capture_mean_rounds: Vec<f64>,
    /// TTFT from the question's arrival (the runtime asks right after the frame's registration,
    /// the peers at its due time): the only clock of older reports.
    #[serde(alias = "ttft_mean_ms", deserialize_with = "nan_if_null")]
    pub ttft_from_question_mean_ms: f64,
    #[serde(alias = "ttft_p50_ms", deserialize_with = "nan_if_null")]
    pub ttft_from_question_p50_ms: f64,
    #[serde(alias = "ttft_p95_ms", deserialize_with = "nan_if_null")]
    pub ttft_from_question_p95_ms: f64,
    #[serde(default, alias = "ttft_mean_rounds", deserialize_with = "nans_if_null")]
    pub ttft_from_question_mean_rounds: Vec<f64>,
    /// The question's arrival minus the capture of the newest frame its answer read, mean and
    /// most (ms).
    #[serde(default)]
    pub staleness_mean_ms: Option<f64>,
    #[serde(default)]
    pub staleness_max_ms: Option<f64>,
    /// Feed lateness: a frame's registration (runtime, after its encoding) or its 1-token
    /// request answered (warm peer) minus its due time, mean and most over the frames (ms).
    #[serde(default)]
    pub feed_late_mean_ms: Option<f64>,
    #[serde(default)]
    pub feed_late_max_ms: Option<f64>,
    /// Frames the runtime's vision encoder encoded per second of its busy time.
    #[serde(default)]
    pub encoder_fps: Option<f64>,
    /// Where the frames' time went from capture to published version, per stream (runtime
    /// configurations).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frame_stages: Vec<StreamStages>,
    /// Arrival until the bound version was published and the answer started (runtime only).
    pub wait_mean_ms: Option<f64>,
    /// Per-answer decode rate after the first token: sum of (tokens - 1) / sum of decode time.
    #[serde(deserialize_with = "nan_if_null")]
    pub decode_tok_s: f64,
    /// Per-answer decode rate from the engines' step times while frames waited for ingestion,
    /// and with none waiting (runtime only: the server does not expose it).
    pub decode_ingesting_tok_s: Option<f64>,
    pub decode_idle_tok_s: Option<f64>,
    pub decode_ingesting_steps: Option<u64>,
    pub decode_idle_steps: Option<u64>,
    /// All tokens generated over the windows, per second.
    #[serde(deserialize_with = "nan_if_null")]
    pub generated_tok_s: f64,
    pub length_min: u32,
    #[serde(deserialize_with = "nan_if_null")]
    pub length_mean: f64,
    pub length_max: u32,
    pub path_resident: usize,
    pub path_import: usize,
    pub path_replay: usize,
    /// Ingestion lag (frames registered, not yet published), sampled after each registration.
    pub lag_max_frames: Option<u64>,
    pub lag_max_ms: Option<f64>,
    pub lag_mean_ms: Option<f64>,
    pub frames_skipped: Option<u64>,
    /// Most peak RSS over the rounds (MiB; B3: summed over its processes).
    #[serde(deserialize_with = "nan_if_null")]
    pub peak_rss_mib: f64,
    /// Most peak GPU memory over the rounds (MiB), where `nvidia-smi` saw it.
    #[serde(default)]
    pub peak_gpu_mib: Option<f64>,
    /// The engines' KV memory (runtime configurations): allocated, and the most in use at once
    /// (MiB, most over the rounds).
    #[serde(default)]
    pub kv_allocated_mib: Option<f64>,
    #[serde(default)]
    pub kv_peak_in_use_mib: Option<f64>,
    /// Model load and warm-up, outside the window (mean over rounds, ms).
    #[serde(deserialize_with = "nan_if_null")]
    pub load_ms: f64,
    pub errors: Vec<String>,
}

fn nan() -> f64 {
    f64::NAN
}

/// One stream's frames from capture to published version, means over its frames (ms).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StreamStages {
    pub stream: usize,
    pub frames: usize,
    pub skipped: usize,
    /// Frames whose version was published in the window.
    pub published: usize,
    /// Due time to the encode call's start (the feeder behind its source).
    pub start_late_ms: f64,
    /// The encode call, any wait for an encoder busy with another stream's frame included.
    pub encode_ms: f64,
    /// Encoded to registered (backpressure when the overload policy blocks).
    pub register_ms: f64,
    /// Registered to published: the wait for the engine and the frame's prefill (published
    /// frames only).
    #[serde(deserialize_with = "nan_if_null")]
    pub ingest_ms: f64,
    /// Due time to published (published frames only).
    #[serde(deserialize_with = "nan_if_null")]
    pub capture_to_published_ms: f64,
}

/// Per-stream stage means over `timings`.
pub fn frame_stages(timings: &[crate::record::FrameTiming]) -> Vec<StreamStages> {
    let mut streams: Vec<usize> = timings.iter().map(|t| t.stream).collect();
    streams.sort_unstable();
    streams.dedup();
    streams
        .into_iter()
        .map(|stream| {
            let mine: Vec<_> = timings.iter().filter(|t| t.stream == stream).collect();
            let of = |f: &dyn Fn(&crate::record::FrameTiming) -> Option<f64>| {
                mean(&mine.iter().filter_map(|t| f(t)).collect::<Vec<_>>())
            };
            StreamStages {
                stream,
                frames: mine.len(),
                skipped: mine.iter().filter(|t| t.skipped).count(),
                published: mine.iter().filter(|t| t.published_ms.is_some()).count(),
                start_late_ms: of(&|t| Some(t.encode_start_ms - t.due_ms)),
                encode_ms: of(&|t| Some(t.encode_end_ms - t.encode_start_ms)),
                register_ms: of(&|t| Some(t.registered_ms - t.encode_end_ms)),
                ingest_ms: of(&|t| t.published_ms.map(|p| p - t.registered_ms)),
                capture_to_published_ms: of(&|t| t.published_ms.map(|p| p - t.due_ms)),
            }
        })
        .collect()
}

/// The frame stages as Markdown, one stream a row (item 4 of issue 28: where a frame's time goes).
pub fn stages_markdown(summaries: &[Summary]) -> String {
    let mut out = String::from(
        "| config | stream | frames (skipped) | due to encode start | encode call | encoded to registered | registered to published | capture to published |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in summaries {
        for st in &s.frame_stages {
            out.push_str(&format!(
                "| {} | {} | {} ({}) | {:.0} ms | {:.0} ms | {:.0} ms | {} | {} |\n",
                s.config.name(),
                st.stream,
                st.frames,
                st.skipped,
                st.start_late_ms,
                st.encode_ms,
                st.register_ms,
                ms_cell(st.ingest_ms),
                ms_cell(st.capture_to_published_ms),
            ));
        }
    }
    out
}

/// JSON has no NaN: serde_json writes it as null; read null back as NaN.
pub fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// The same for a list (a round with no answer on a clock has a NaN mean).
pub fn nans_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
    Ok(Vec::<Option<f64>>::deserialize(d)?.into_iter().map(|v| v.unwrap_or(f64::NAN)).collect())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// The mean of `value` over each round's answered questions.
fn per_round(runs: &[&RunRecord], value: impl Fn(&AnswerRecord) -> Option<f64>) -> Vec<f64> {
    runs.iter()
        .map(|r| mean(&r.answers.iter().filter(|a| a.error.is_none()).filter_map(&value).collect::<Vec<_>>()))
        .collect()
}

pub fn summarize(config: Config, runs: &[&RunRecord], expected_per_round: usize) -> Summary {
    let answers: Vec<_> = runs.iter().flat_map(|r| r.answers.iter()).collect();
    let ok: Vec<_> = answers.iter().filter(|a| a.error.is_none()).collect();
    let mut ttft: Vec<f64> = ok.iter().map(|a| a.ttft_from_question_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let mut from_capture: Vec<f64> = ok.iter().filter_map(|a| a.ttft_from_capture_ms).collect();
    from_capture.sort_by(f64::total_cmp);
    let staleness: Vec<f64> = ok.iter().filter_map(|a| a.staleness_ms).collect();
    let feeds: Vec<_> = runs.iter().filter_map(|r| r.feed).collect();
    let feed = feeds.iter().fold(crate::record::FeedStats::default(), |mut acc, f| {
        acc.add(f);
        acc
    });
    let waits: Vec<f64> = ok.iter().filter_map(|a| a.wait_ms).collect();
    let decode_tokens: f64 = ok.iter().map(|a| a.tokens.saturating_sub(1) as f64).sum();
    let decode_s: f64 = ok.iter().map(|a| a.decode_seconds()).sum();
    let window_s: f64 = runs.iter().map(|r| r.window_ms / 1e3).sum();
    let lengths: Vec<u32> = ok.iter().map(|a| a.tokens).collect();
    let path = |name: &str| ok.iter().filter(|a| a.path.as_deref() == Some(name)).count();
    let splits: Vec<_> = runs.iter().filter_map(|r| r.decode_split).collect();
    let split = splits.iter().fold(crate::record::DecodeSplit::default(), |mut acc, s| {
        acc.add(s);
        acc
    });
    let rate = |steps: u64, total_ms: f64| (steps > 0).then(|| 1e3 * steps as f64 / total_ms);
    let lags: Vec<_> = runs.iter().filter_map(|r| r.lag).collect();
    let lag = lags.iter().fold(crate::record::LagStats::default(), |mut acc, l| {
        acc.add(l);
        acc
    });
    let has_lag = !lags.is_empty();
    let throughput_rounds: Vec<f64> = runs
        .iter()
        .filter(|r| r.window_ms > 0.0)
        .map(|r| r.answers.iter().filter(|a| a.error.is_none()).count() as f64 / (r.window_ms / 1e3))
        .collect();
    let mut errors: Vec<String> = runs.iter().filter_map(|r| r.error.clone()).collect();
    errors.extend(answers.iter().filter_map(|a| a.error.clone()));
    errors.dedup();
    Summary {
        config,
        description: config.describe().into(),
        rounds: runs.len(),
        answered: ok.len(),
        expected: expected_per_round * runs.len(),
        failed: answers.len() - ok.len(),
        throughput: mean(&throughput_rounds),
        throughput_rounds,
        ttft_from_capture_mean_ms: mean(&from_capture),
        ttft_from_capture_p50_ms: percentile(&from_capture, 50.0),
        ttft_from_capture_p95_ms: percentile(&from_capture, 95.0),
        ttft_from_capture_mean_rounds: per_round(runs, |a| a.ttft_from_capture_ms),
        ttft_from_question_mean_ms: mean(&ttft),
        ttft_from_question_p50_ms: percentile(&ttft, 50.0),
        ttft_from_question_p95_ms: percentile(&ttft, 95.0),
        ttft_from_question_mean_rounds: per_round(runs, |a| Some(a.ttft_from_question_ms)),
        staleness_mean_ms: (!staleness.is_empty()).then(|| mean(&staleness)),
        staleness_max_ms: staleness.iter().copied().reduce(f64::max),
        feed_late_mean_ms: feed.late_mean_ms(),
        feed_late_max_ms: (feed.frames > 0).then_some(feed.late_max_ms),
        encoder_fps: feed.encoder_fps(),
        frame_stages: frame_stages(&runs.iter().flat_map(|r| r.frame_timings.iter().copied()).collect::<Vec<_>>()),
        wait_mean_ms: (!waits.is_empty()).then(|| mean(&waits)),
        decode_tok_s: if decode_s > 0.0 { decode_tokens / decode_s } else { f64::NAN },
        decode_ingesting_tok_s: rate(split.busy_steps, split.busy_ms),
        decode_idle_tok_s: rate(split.idle_steps, split.idle_ms),
        decode_ingesting_steps: (!splits.is_empty()).then_some(split.busy_steps),
        decode_idle_steps: (!splits.is_empty()).then_some(split.idle_steps),
        generated_tok_s: if window_s > 0.0 { lengths.iter().sum::<u32>() as f64 / window_s } else { f64::NAN },
        length_min: lengths.iter().copied().min().unwrap_or(0),
        length_mean: mean(&lengths.iter().map(|&l| l as f64).collect::<Vec<_>>()),
        length_max: lengths.iter().copied().max().unwrap_or(0),
        path_resident: path("resident"),
        path_import: path("import"),
        path_replay: path("replay"),
        lag_max_frames: has_lag.then_some(lag.max_frames),
        lag_max_ms: has_lag.then_some(lag.max_ms),
        lag_mean_ms: has_lag.then(|| lag.mean_ms()),
        frames_skipped: has_lag.then_some(lag.skipped),
        peak_rss_mib: runs.iter().map(|r| r.peak_rss_kib).max().unwrap_or(0) as f64 / 1024.0,
        peak_gpu_mib: runs.iter().filter_map(|r| r.peak_gpu_mib).max().map(|m| m as f64),
        kv_allocated_mib: runs.iter().filter_map(|r| r.kv).map(|k| k.allocated_bytes).max().map(mib),
        kv_peak_in_use_mib: runs.iter().filter_map(|r| r.kv).map(|k| k.peak_in_use_bytes).max().map(mib),
        load_ms: mean(&runs.iter().map(|r| r.load_ms).collect::<Vec<_>>()),
        errors,
    }
}

/// The ratios the note states, where both sides ran.
pub fn ratios(summaries: &[Summary]) -> serde_json::Value {
    let get = |c: Config| summaries.iter().find(|s| s.config == c && s.answered > 0);
    let mut out = serde_json::Map::new();
    let mut put = |name: &str, v: Option<f64>| {
        if let Some(v) = v.filter(|v| v.is_finite()) {
            out.insert(name.into(), serde_json::json!(v));
        }
    };
    let best_throughput = [Config::B1, Config::B2].into_iter().filter_map(get).map(|s| s.throughput).reduce(f64::max);
    let best_ttft =
        [Config::B1, Config::B2].into_iter().filter_map(get).map(|s| s.ttft_from_capture_mean_ms).reduce(f64::min);
    put("P_over_best_B1_B2_throughput", get(Config::P).zip(best_throughput).map(|(p, b)| p.throughput / b));
    put(
        "P_over_best_B1_B2_ttft_from_capture_mean",
        get(Config::P).zip(best_ttft).map(|(p, b)| p.ttft_from_capture_mean_ms / b),
    );
    let by = |a: Config, b: Config, f: fn(&Summary) -> f64| get(a).zip(get(b)).map(|(a, b)| f(a) / f(b));
    put("B1_over_B0_ttft_from_capture_mean", by(Config::B1, Config::B0, |s| s.ttft_from_capture_mean_ms));
    // The peers: warm (the headline comparison) and naive, on both clocks.
    for (x, peer) in [
        (Config::B1, Config::PeerWarm),
        (Config::P, Config::PeerWarm),
        (Config::B1, Config::Peer),
        (Config::P, Config::Peer),
    ] {
        let (x_name, p_name) = (x.name(), peer.name().replace('-', "_"));
        put(&format!("{x_name}_over_{p_name}_ttft_from_capture_mean"), by(x, peer, |s| s.ttft_from_capture_mean_ms));
        put(&format!("{x_name}_over_{p_name}_ttft_from_capture_p95"), by(x, peer, |s| s.ttft_from_capture_p95_ms));
        put(&format!("{x_name}_over_{p_name}_ttft_from_question_mean"), by(x, peer, |s| s.ttft_from_question_mean_ms));
    }
    put(
        "PEER_WARM_over_PEER_ttft_from_capture_mean",
        by(Config::PeerWarm, Config::Peer, |s| s.ttft_from_capture_mean_ms),
    );
    let rss = |a: Config, b: Config| get(a).zip(get(b)).map(|(a, b)| a.peak_rss_mib / b.peak_rss_mib);
    put("B1_over_B3_peak_rss", rss(Config::B1, Config::B3));
    put("P_over_B3_peak_rss", rss(Config::P, Config::B3));
    put("B1_over_PEER_WARM_peak_rss", rss(Config::B1, Config::PeerWarm));
    let gpu = |a: Config, b: Config| get(a).zip(get(b)).and_then(|(a, b)| Some(a.peak_gpu_mib? / b.peak_gpu_mib?));
    put("B1_over_PEER_WARM_peak_gpu", gpu(Config::B1, Config::PeerWarm));
    serde_json::Value::Object(out)
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite()).map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// What the tables' clocks and peers are, printed above them.
pub const CLOCKS: &str = "TTFT from capture: from the due time of the question's frame on the live source to the \
    first token (encoding, ingestion and the question's wait included; the headline). From question: from the \
    question's arrival (runtime: right after its frame's registration; peers: at the frame's due time). PEER: \
    llama-server with a naive client (every frame resent with each question); PEER-WARM: the same server with each \
    frame sent as it is captured and the question on its slot.";

fn feed_column(s: &Summary) -> String {
    match (s.feed_late_mean_ms, s.feed_late_max_ms) {
        (Some(mean), Some(max)) => format!("{mean:.0}/{max:.0}"),
        _ => "-".into(),
    }
}

/// The table, one configuration a row.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<9} {:>7} {:>7} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>11} {:>7} {:>8} {:>7} {:>7} {:>7} {:>15} {:>9} {:>11} {:>11} {:>11} {:>8} {:>8}\n",
        "cfg",
        "answers",
        "ans/s",
        "cap avg",
        "cap p50",
        "cap p95",
        "q avg",
        "q p95",
        "stale",
        "feed late",
        "enc f/s",
        "wait avg",
        "dec t/s",
        "dec ing",
        "dec idl",
        "len min/avg/max",
        "res/imp/rep",
        "lag fr/ms",
        "RSS/GPU MiB",
        "KV MiB a/u",
        "load ms",
        "failed",
    ));
    for s in summaries {
        out.push_str(&format!(
            "{:<9} {:>7} {:>7.3} {:>9.0} {:>9.0} {:>9.0} {:>8.0} {:>8.0} {:>8} {:>11} {:>7} {:>8} {:>7.1} {:>7} {:>7} {:>15} {:>9} {:>11} {:>11} {:>11} {:>8.0} {:>8}\n",
            s.config.name(),
            format!("{}/{}", s.answered, s.expected),
            s.throughput,
            s.ttft_from_capture_mean_ms,
            s.ttft_from_capture_p50_ms,
            s.ttft_from_capture_p95_ms,
            s.ttft_from_question_mean_ms,
            s.ttft_from_question_p95_ms,
            opt(s.staleness_mean_ms, 0),
            feed_column(s),
            opt(s.encoder_fps, 2),
            opt(s.wait_mean_ms, 0),
            s.decode_tok_s,
            opt(s.decode_ingesting_tok_s, 1),
            opt(s.decode_idle_tok_s, 1),
            format!("{}/{:.0}/{}", s.length_min, s.length_mean, s.length_max),
            if s.wait_mean_ms.is_some() {
                format!("{}/{}/{}", s.path_resident, s.path_import, s.path_replay)
            } else {
                "-".into()
            },
            match (s.lag_max_frames, s.lag_max_ms) {
                (Some(f), Some(m)) => format!("{f}/{m:.0}"),
                _ => "-".into(),
            },
            memory_column(s),
            kv_column(s),
            s.load_ms,
            s.failed,
        ));
    }
    out.push_str("cap: TTFT from capture (ms); q: TTFT from the question's arrival (ms); stale: staleness (ms); feed late: mean/max (ms)\n");
    out
}

/// Peak RSS, and peak GPU memory where it was seen (MiB).
fn memory_column(s: &Summary) -> String {
    match s.peak_gpu_mib {
        Some(gpu) => format!("{:.0}/{gpu:.0}", s.peak_rss_mib),
        None => format!("{:.0}", s.peak_rss_mib),
    }
}

fn kv_column(s: &Summary) -> String {
    match (s.kv_allocated_mib, s.kv_peak_in_use_mib) {
        (Some(a), Some(u)) => format!("{a:.0}/{u:.0}"),
        _ => "-".into(),
    }
}

fn ms_cell(v: f64) -> String {
    if v.is_finite() { format!("{v:.0} ms") } else { "-".into() }
}

/// The table as Markdown (for docs/benchmarks.md); the clocks are named in its header.
pub fn markdown(summaries: &[Summary]) -> String {
    let mut out = String::from(
        "| config | answers | answers/s | TTFT from capture mean | p50 | p95 | TTFT from question mean | p95 | staleness mean / max | feed lateness mean / max | encoder frames/s | wait mean | decode tok/s (all / ingesting / idle) | length min/mean/max | resident/import/replay | lag max (frames / ms) | peak RSS / GPU MiB | KV MiB allocated / in use | load ms |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in summaries {
        out.push_str(&format!(
            "| {} ({}) | {}/{} | {:.3} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} / {} / {} | {}/{:.0}/{} | {} | {} | {} | {} | {:.0} |\n",
            s.config.name(),
            s.description,
            s.answered,
            s.expected,
            s.throughput,
            ms_cell(s.ttft_from_capture_mean_ms),
            ms_cell(s.ttft_from_capture_p50_ms),
            ms_cell(s.ttft_from_capture_p95_ms),
            ms_cell(s.ttft_from_question_mean_ms),
            ms_cell(s.ttft_from_question_p95_ms),
            match (s.staleness_mean_ms, s.staleness_max_ms) {
                (Some(m), Some(x)) => format!("{m:.0} / {x:.0} ms"),
                _ => "-".into(),
            },
            match (s.feed_late_mean_ms, s.feed_late_max_ms) {
                (Some(m), Some(x)) => format!("{m:.0} / {x:.0} ms"),
                _ => "-".into(),
            },
            opt(s.encoder_fps, 2),
            s.wait_mean_ms.map_or_else(|| "-".into(), |w| format!("{w:.0} ms")),
            s.decode_tok_s,
            opt(s.decode_ingesting_tok_s, 1),
            opt(s.decode_idle_tok_s, 1),
            s.length_min,
            s.length_mean,
            s.length_max,
            if s.wait_mean_ms.is_some() {
                format!("{}/{}/{}", s.path_resident, s.path_import, s.path_replay)
            } else {
                "-".into()
            },
            match (s.lag_max_frames, s.lag_max_ms) {
                (Some(f), Some(m)) => format!("{f} / {m:.0}"),
                _ => "-".into(),
            },
            memory_column(s),
            kv_column(s),
            s.load_ms,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{AnswerRecord, DecodeSplit, RunRecord};

    /// An answer asked 50 ms after its frame's capture (its newest frame's too).
    fn answer(ttft_ms: f64, tokens: u32, path: Option<&str>) -> AnswerRecord {
        let mut a = AnswerRecord {
            wait_ms: path.map(|_| 10.0),
            ttft_from_question_ms: ttft_ms,
            tokens,
            path: path.map(str::to_owned),
            frames: 2,
            ..AnswerRecord::asked(0, 0, 2, 100.0, ttft_ms + 1000.0)
        };
        a.set_capture(50.0, Some(50.0));
        a
    }

    fn run(config: Config, answers: Vec<AnswerRecord>, window_ms: f64, rss_kib: u64) -> RunRecord {
        RunRecord {
            load_ms: 100.0,
            peak_rss_kib: rss_kib,
            window_ms,
            answers,
            decode_split: Some(DecodeSplit {
                busy_steps: 10,
                busy_ms: 500.0,
                idle_steps: 20,
                idle_ms: 400.0,
                ..Default::default()
            }),
            ..RunRecord::empty(config, 0, 1)
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 10.0);
        assert_eq!(percentile(&v, 95.0), 19.0);
        assert_eq!(percentile(&v[..1], 95.0), 1.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn summary_counts_rates_and_paths() {
        let mut failed = answer(0.0, 0, Some("resident"));
        failed.error = Some("boom".into());
        let r = run(
            Config::P,
            vec![answer(100.0, 11, Some("resident")), answer(300.0, 11, Some("import")), failed],
            2000.0,
            2048,
        );
        let s = summarize(Config::P, &[&r], 4);
        assert_eq!((s.answered, s.failed, s.expected), (2, 1, 4));
        assert_eq!(s.throughput, 1.0); // 2 answers over 2 s
        assert_eq!(s.ttft_from_question_mean_ms, 200.0);
        assert_eq!(s.ttft_from_capture_mean_ms, 250.0, "the question came 50 ms after its frame's capture");
        assert_eq!((s.staleness_mean_ms, s.staleness_max_ms), (Some(50.0), Some(50.0)));
        assert_eq!(s.feed_late_mean_ms, None, "no feed measured");
        assert_eq!(s.decode_tok_s, 10.0); // 20 tokens after the first ones over 2 s of decode
        assert_eq!(s.decode_ingesting_tok_s, Some(20.0)); // 50 ms a step
        assert_eq!(s.decode_idle_tok_s, Some(50.0)); // 20 ms a step
        assert_eq!((s.path_resident, s.path_import, s.path_replay), (1, 1, 0));
        assert_eq!(s.peak_rss_mib, 2.0);
        assert_eq!(s.errors, vec!["boom".to_owned()]);
    }

    #[test]
    fn ratios_compare_what_ran() {
        let b1 = run(Config::B1, vec![answer(400.0, 8, Some("resident"))], 1000.0, 1024);
        let b2 = run(Config::B2, vec![answer(200.0, 8, Some("resident"))], 2000.0, 1024);
        let p =
            run(Config::P, vec![answer(100.0, 8, Some("resident")), answer(100.0, 8, Some("resident"))], 1000.0, 1024);
        let b3 = run(Config::B3, vec![answer(100.0, 8, Some("resident"))], 1000.0, 2048);
        let summaries: Vec<_> = [(Config::B1, &b1), (Config::B2, &b2), (Config::P, &p), (Config::B3, &b3)]
            .into_iter()
            .map(|(c, r)| summarize(c, &[r], 1))
            .collect();
        let r = ratios(&summaries);
        assert_eq!(r["P_over_best_B1_B2_throughput"], 2.0); // 2/s against B1's 1/s
        assert_eq!(r["P_over_best_B1_B2_ttft_from_capture_mean"], 0.6); // 150 ms against B2's 250 ms
        assert_eq!(r["B1_over_B3_peak_rss"], 0.5);
        assert!(r.get("B1_over_PEER_WARM_ttft_from_capture_mean").is_none());
        assert_eq!(table(&summaries).lines().count(), 6);
        assert_eq!(markdown(&summaries).lines().count(), 6);
    }

    #[test]
    fn peers_are_compared_on_both_clocks_warm_first() {
        let b1 = run(Config::B1, vec![answer(100.0, 8, Some("resident"))], 1000.0, 1024);
        let warm = run(Config::PeerWarm, vec![answer(350.0, 8, None)], 1000.0, 1024);
        let naive = run(Config::Peer, vec![answer(950.0, 8, None)], 1000.0, 1024);
        let summaries: Vec<_> = [(Config::B1, &b1), (Config::PeerWarm, &warm), (Config::Peer, &naive)]
            .into_iter()
            .map(|(c, r)| summarize(c, &[r], 1))
            .collect();
        let r = ratios(&summaries);
        assert_eq!(r["B1_over_PEER_WARM_ttft_from_capture_mean"], 0.375); // 150 / 400
        assert_eq!(r["B1_over_PEER_ttft_from_capture_mean"], 0.15); // 150 / 1000
        assert_eq!(r["B1_over_PEER_WARM_ttft_from_question_mean"], 100.0 / 350.0);
        assert_eq!(r["PEER_WARM_over_PEER_ttft_from_capture_mean"], 0.4);
        let md = markdown(&summaries);
        assert!(md.lines().next().unwrap().contains("TTFT from capture mean"), "{md}");
        assert!(md.contains("| PEER-WARM (llama-server, warm client"), "{md}");
    }

    #[test]
    fn feed_lateness_and_encoder_rate_are_summarized() {
        let mut r = run(Config::B1, vec![answer(100.0, 8, Some("resident"))], 1000.0, 1024);
        let mut feed = crate::record::FeedStats { encoded: 4, encode_ms: 2000.0, ..Default::default() };
        for late in [100.0, 300.0, 200.0, 400.0] {
            feed.fed(late);
        }
        r.feed = Some(feed);
        let s = summarize(Config::B1, &[&r], 1);
        assert_eq!((s.feed_late_mean_ms, s.feed_late_max_ms), (Some(250.0), Some(400.0)));
        assert_eq!(s.encoder_fps, Some(2.0));
    }

    #[test]
    fn frame_stages_split_capture_to_published_per_stream() {
        use crate::record::FrameTiming;
        let t = |stream, frame, due: f64, published: Option<f64>| FrameTiming {
            stream,
            frame,
            due_ms: due,
            encode_start_ms: due + 10.0,
            encode_end_ms: due + 110.0,
            registered_ms: due + 120.0,
            published_ms: published,
            skipped: published.is_none(),
        };
        let timings = [t(0, 1, 0.0, Some(320.0)), t(0, 2, 1000.0, Some(1420.0)), t(1, 1, 0.0, None)];
        let stages = frame_stages(&timings);
        assert_eq!(stages.len(), 2);
        let s0 = &stages[0];
        assert_eq!((s0.frames, s0.skipped, s0.published), (2, 0, 2));
        assert_eq!((s0.start_late_ms, s0.encode_ms, s0.register_ms), (10.0, 100.0, 10.0));
        assert_eq!((s0.ingest_ms, s0.capture_to_published_ms), (250.0, 370.0)); // (200 + 300) / 2
        assert!(stages[1].ingest_ms.is_nan() && stages[1].skipped == 1);
        let mut r = run(Config::B1, vec![answer(100.0, 8, Some("resident"))], 1000.0, 1024);
        r.frame_timings = timings.to_vec();
        let s = summarize(Config::B1, &[&r], 1);
        assert_eq!((s.frame_stages.len(), &s.frame_stages[0]), (2, &stages[0]));
        assert_eq!(stages_markdown(&[s]).lines().count(), 4);
    }

    #[test]
    fn older_reports_read_back_on_the_question_clock() {
        let old = serde_json::json!({
            "config": "B1", "description": "", "rounds": 1, "answered": 1, "expected": 1, "failed": 0,
            "throughput": 1.0, "throughput_rounds": [1.0], "ttft_mean_ms": 120.0, "ttft_p50_ms": 110.0,
            "ttft_p95_ms": 150.0, "ttft_mean_rounds": [120.0], "wait_mean_ms": null, "decode_tok_s": 50.0,
            "decode_ingesting_tok_s": null, "decode_idle_tok_s": null, "decode_ingesting_steps": null,
            "decode_idle_steps": null, "generated_tok_s": 10.0, "length_min": 8, "length_mean": 8.0,
            "length_max": 8, "path_resident": 1, "path_import": 0, "path_replay": 0, "lag_max_frames": null,
            "lag_max_ms": null, "lag_mean_ms": null, "frames_skipped": null, "peak_rss_mib": 100.0,
            "load_ms": 10.0, "errors": []
        });
        let s: Summary = serde_json::from_value(old).unwrap();
        assert_eq!((s.ttft_from_question_mean_ms, s.ttft_from_question_p95_ms), (120.0, 150.0));
        assert!(s.ttft_from_capture_mean_ms.is_nan());
        let a: AnswerRecord = serde_json::from_value(serde_json::json!({
            "stream": 0, "index": 0, "after_frame": 2, "arrival_ms": 5.0, "wait_ms": null, "ttft_ms": 80.0,
            "total_ms": 200.0, "tokens": 8, "path": null, "engine": null, "frames": 2, "error": null
        }))
        .unwrap();
        assert_eq!((a.ttft_from_question_ms, a.ttft_from_capture_ms), (80.0, None));
    }

    #[test]
    fn summaries_survive_json_with_nan() {
        let s = summarize(Config::B0, &[], 8);
        let back: Summary = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert!(back.ttft_from_capture_mean_ms.is_nan() && back.ttft_from_question_mean_ms.is_nan());
        assert_eq!(back.expected, 0);
    }
}
