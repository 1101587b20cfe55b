//! Per-configuration summaries, the ratios the issue asks for, and the printed table.

use serde::{Deserialize, Serialize};

use crate::record::{Config, RunRecord};

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
    /// Arrival to first token (ms).
    #[serde(deserialize_with = "nan_if_null")]
    pub ttft_mean_ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub ttft_p50_ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub ttft_p95_ms: f64,
    /// Mean TTFT of each round, so a round hit by outside load shows.
    #[serde(default)]
    pub ttft_mean_rounds: Vec<f64>,
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

/// JSON has no NaN: serde_json writes it as null; read null back as NaN.
pub fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
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

pub fn summarize(config: Config, runs: &[&RunRecord], expected_per_round: usize) -> Summary {
    let answers: Vec<_> = runs.iter().flat_map(|r| r.answers.iter()).collect();
    let ok: Vec<_> = answers.iter().filter(|a| a.error.is_none()).collect();
    let mut ttft: Vec<f64> = ok.iter().map(|a| a.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
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
        ttft_mean_ms: mean(&ttft),
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p95_ms: percentile(&ttft, 95.0),
        ttft_mean_rounds: runs
            .iter()
            .map(|r| mean(&r.answers.iter().filter(|a| a.error.is_none()).map(|a| a.ttft_ms).collect::<Vec<_>>()))
            .collect(),
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
    let best_ttft = [Config::B1, Config::B2].into_iter().filter_map(get).map(|s| s.ttft_mean_ms).reduce(f64::min);
    put("P_over_best_B1_B2_throughput", get(Config::P).zip(best_throughput).map(|(p, b)| p.throughput / b));
    put("P_over_best_B1_B2_ttft_mean", get(Config::P).zip(best_ttft).map(|(p, b)| p.ttft_mean_ms / b));
    let ttft = |a: Config, b: Config| get(a).zip(get(b)).map(|(a, b)| a.ttft_mean_ms / b.ttft_mean_ms);
    put("B1_over_B0_ttft_mean", ttft(Config::B1, Config::B0));
    put("B1_over_PEER_ttft_mean", ttft(Config::B1, Config::Peer));
    put("P_over_PEER_ttft_mean", ttft(Config::P, Config::Peer));
    let rss = |a: Config, b: Config| get(a).zip(get(b)).map(|(a, b)| a.peak_rss_mib / b.peak_rss_mib);
    put("B1_over_B3_peak_rss", rss(Config::B1, Config::B3));
    put("P_over_B3_peak_rss", rss(Config::P, Config::B3));
    serde_json::Value::Object(out)
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite()).map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// The table, one configuration a row.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<5} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>15} {:>9} {:>11} {:>9} {:>11} {:>8} {:>8}\n",
        "cfg",
        "answers",
        "ans/s",
        "ttft avg",
        "ttft p50",
        "ttft p95",
        "wait avg",
        "dec t/s",
        "dec ing",
        "dec idl",
        "len min/avg/max",
        "res/imp/rep",
        "lag fr/ms",
        "RSS MiB",
        "KV MiB a/u",
        "load ms",
        "failed",
    ));
    for s in summaries {
        out.push_str(&format!(
            "{:<5} {:>7} {:>7.3} {:>8.0} {:>8.0} {:>8.0} {:>8} {:>7.1} {:>7} {:>7} {:>15} {:>9} {:>11} {:>9.0} {:>11} {:>8.0} {:>8}\n",
            s.config.name(),
            format!("{}/{}", s.answered, s.expected),
            s.throughput,
            s.ttft_mean_ms,
            s.ttft_p50_ms,
            s.ttft_p95_ms,
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
            s.peak_rss_mib,
            kv_column(s),
            s.load_ms,
            s.failed,
        ));
    }
    out
}

fn kv_column(s: &Summary) -> String {
    match (s.kv_allocated_mib, s.kv_peak_in_use_mib) {
        (Some(a), Some(u)) => format!("{a:.0}/{u:.0}"),
        _ => "-".into(),
    }
}

/// The table as Markdown (for docs/benchmarks.md).
pub fn markdown(summaries: &[Summary]) -> String {
    let mut out = String::from(
        "| config | answers | answers/s | TTFT mean | p50 | p95 | wait mean | decode tok/s (all / ingesting / idle) | length min/mean/max | resident/import/replay | lag max (frames / ms) | peak RSS MiB | KV MiB allocated / in use | load ms |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in summaries {
        out.push_str(&format!(
            "| {} ({}) | {}/{} | {:.3} | {:.0} ms | {:.0} ms | {:.0} ms | {} | {:.1} / {} / {} | {}/{:.0}/{} | {} | {} | {:.0} | {} | {:.0} |\n",
            s.config.name(),
            s.description,
            s.answered,
            s.expected,
            s.throughput,
            s.ttft_mean_ms,
            s.ttft_p50_ms,
            s.ttft_p95_ms,
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
            s.peak_rss_mib,
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

    fn answer(ttft_ms: f64, tokens: u32, path: Option<&str>) -> AnswerRecord {
        AnswerRecord {
            stream: 0,
            index: 0,
            after_frame: 2,
            arrival_ms: 0.0,
            wait_ms: path.map(|_| 10.0),
            prepare_ms: None,
            ttft_ms,
            total_ms: ttft_ms + 1000.0,
            tokens,
            path: path.map(str::to_owned),
            engine: None,
            frames: 2,
            prime_ms: None,
            error: None,
        }
    }

    fn run(config: Config, answers: Vec<AnswerRecord>, window_ms: f64, rss_kib: u64) -> RunRecord {
        RunRecord {
            load_ms: 100.0,
            peak_rss_kib: rss_kib,
            window_ms,
            answers,
            decode_split: Some(DecodeSplit { busy_steps: 10, busy_ms: 500.0, idle_steps: 20, idle_ms: 400.0 }),
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
        assert_eq!(s.ttft_mean_ms, 200.0);
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
        assert_eq!(r["P_over_best_B1_B2_ttft_mean"], 0.5); // 100 ms against B2's 200 ms
        assert_eq!(r["B1_over_B3_peak_rss"], 0.5);
        assert!(r.get("B1_over_PEER_ttft_mean").is_none());
        assert_eq!(table(&summaries).lines().count(), 5);
        assert_eq!(markdown(&summaries).lines().count(), 6);
    }

    #[test]
    fn summaries_survive_json_with_nan() {
        let s = summarize(Config::B0, &[], 8);
        let back: Summary = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert!(back.ttft_mean_ms.is_nan());
        assert_eq!(back.expected, 0);
    }
}
