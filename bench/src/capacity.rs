//! `vlm-bench capacity`: how many live streams each side sustains. Levels of S = 1, 2, 4, ...
//! streams (each at a fixed frame rate, a question every K frames, answers of exactly T tokens),
//! every configuration once per level in turn (a fresh worker process or server each time), each
//! level judged end to end: no lost answers and no failed run (a warm peer's frame request
//! refused counts), p95 TTFT from the frame's capture within a target,
//! feed lateness under one frame interval and few frames skipped; a side stops after a level it
//! clearly does not sustain. Then the history curve: one stream, TTFT of questions over 8, 16,
//! ..., 128 frames, the retained runtime against the server, each with its history made ready
//! first (see docs/benchmarks.md, "Capacity").

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use serde::{Deserialize, Serialize};

pub use crate::levels::{HistoryPoint, Level};
use crate::record::{Config, RunRecord};
use crate::report::{self, Summary};
use crate::workload::{HistorySpec, Workload};
use crate::{BoxError, CommonArgs, Session, build_workload, plots, progress_bar, report_run, resolve_pair};

/// The `benchmark` field of a capacity report (how `plot --from` tells it apart).
pub const BENCHMARK: &str = "vlm-bench capacity";

const DEFAULT_CONFIGS: [Config; 4] = [Config::B1, Config::P, Config::PeerWarm, Config::Peer];

#[derive(Args)]
pub struct CapacityArgs {
    /// Stream counts to run, in order (default: 1, 2, 4, ... up to --max-streams).
    #[arg(long, value_delimiter = ',')]
    levels: Vec<usize>,
    /// Largest stream count of the default levels.
    #[arg(long, default_value_t = 8)]
    max_streams: usize,
    /// Frames per stream (the last question's history).
    #[arg(long, default_value_t = 32)]
    frames: usize,
    /// Frames per second of each stream (fed in real time; streams staggered over the interval).
    #[arg(long, default_value_t = 1.0)]
    fps: f64,
    /// A question every K frames of each stream (right after frames K, 2K, ...).
    #[arg(long, default_value_t = 4)]
    every: usize,
    /// Answer length: exactly this many tokens.
    #[arg(long, default_value_t = 32)]
    tokens: u32,
    /// A level is sustained when its p95 TTFT from the capture of the question's frame is at
    /// most this, ...
    #[arg(long, default_value_t = 2000.0)]
    ttft_target_ms: f64,
    /// ... its feed lateness (a frame's registration, or the warm peer's frame request answered,
    /// minus its due time) stayed under one frame interval, and it skipped at most this share of
    /// its frames (percent; runtime only: the server never skips a frame).
    #[arg(long, default_value_t = 10.0)]
    max_skipped_pct: f64,
    /// A configuration runs no further level after one with answers lost or a run failed, or its p95 TTFT, feed
    /// lateness or skipped frames beyond this many times what is allowed.
    #[arg(long, default_value_t = 1.5)]
    stop_factor: f64,
    /// Configurations (runtime ones, PEER-WARM and PEER), each once per level per round, in turn.
    #[arg(long, value_delimiter = ',', default_value = "B1,P,PEER-WARM,PEER")]
    configs: Vec<Config>,
    /// Rounds per level.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// The history curve's points (frames of history when a question is asked).
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128")]
    history: Vec<usize>,
    /// Questions timed at each point of the history curve.
    #[arg(long, default_value_t = 3)]
    history_reps: usize,
    /// The runtime configuration of the history curve (beside PEER when it runs).
    #[arg(long, default_value = "B1")]
    history_config: Config,
    /// Leave the history curve out.
    #[arg(long)]
    no_history: bool,
    /// Leave the levels out (the history curve only).
    #[arg(long)]
    no_levels: bool,
    /// Longest one configuration's run may take (s; default: twice the window plus 5 minutes).
    #[arg(long)]
    timeout_s: Option<u64>,
    /// A seconds-long run for CI: S = 1, 2, 4 frames at 4 frames/s, a question every 2 frames,
    /// 8 tokens, B1 only unless --configs names others; history points 2, 4 with one question.
    #[arg(long)]
    smoke: bool,
    #[command(flatten)]
    common: CommonArgs,
}

/// A run of one level (or of the history curve, level 1).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LevelRun {
    pub streams: usize,
    pub record: RunRecord,
}

struct Plan {
    levels: Vec<usize>,
    ask_after: Vec<usize>,
    history: Option<HistorySpec>,
}

fn plan(a: &mut CapacityArgs) -> Result<Plan, BoxError> {
    if a.smoke {
        if a.configs == DEFAULT_CONFIGS {
            a.configs = vec![Config::B1];
        }
        a.levels = vec![1, 2];
        a.frames = 4;
        a.fps = 4.0;
        a.every = 2;
        a.tokens = 8;
        a.rounds = 1;
        a.history = vec![2, 4];
        a.history_reps = 1;
    }
    if a.every == 0 || a.every > a.frames || a.rounds == 0 || a.max_streams == 0 {
        return Err("--every must be in 1..=--frames; --rounds and --max-streams must be positive".into());
    }
    if a.history_config.is_peer() || a.history_config == Config::B3 {
        return Err("--history-config must be a one-process runtime configuration (B0, B1, B2 or P)".into());
    }
    let levels = if a.levels.is_empty() {
        std::iter::successors(Some(1usize), |s| Some(s * 2)).take_while(|&s| s <= a.max_streams).collect()
    } else {
        a.levels.clone()
    };
    let history = (!a.no_history && !a.history.is_empty()).then(|| {
        let mut points = a.history.clone();
        points.sort_unstable();
        points.dedup();
        HistorySpec { points, reps: a.history_reps.max(1), settle_ms: 300 }
    });
    Ok(Plan {
        levels: if a.no_levels { vec![] } else { levels },
        ask_after: (a.every..=a.frames).step_by(a.every).collect(),
        history,
    })
}

/// Judge a level end to end: (sustained, verdict, clearly unsustained).
fn judge(s: &Summary, lost: usize, frames_offered: usize, a: &CapacityArgs) -> (bool, String, bool) {
    let skipped = s.frames_skipped.unwrap_or(0) as f64;
    let allowed = a.max_skipped_pct / 100.0 * frames_offered as f64;
    let p95 = s.ttft_from_capture_p95_ms;
    // NaN (nothing answered) is beyond any target.
    let beyond = |limit: f64| p95.is_nan() || p95 > limit;
    let interval_ms = 1e3 / a.fps;
    let late = s.feed_late_max_ms.unwrap_or(0.0);
    let mut why = vec![];
    if lost > 0 {
        why.push(format!("{lost} answer(s) lost"));
    }
    // A run's own failure (a warm peer's frame request refused, a worker that failed) leaves the
    // level unmeasured however its answers went.
    if let Some(error) = s.errors.first() {
        why.push(format!("a run failed: {error}"));
    }
    if beyond(a.ttft_target_ms) {
        why.push(format!("p95 TTFT from capture {p95:.0} ms > {:.0} ms", a.ttft_target_ms));
    }
    if late >= interval_ms {
        why.push(format!("feed lateness up to {late:.0} ms >= the {interval_ms:.0} ms frame interval"));
    }
    if skipped > allowed {
        why.push(format!("{skipped:.0} of {frames_offered} frames skipped"));
    }
    let clearly = lost > 0
        || !s.errors.is_empty()
        || beyond(a.stop_factor * a.ttft_target_ms)
        || late >= a.stop_factor * interval_ms
        || skipped > (a.stop_factor * allowed).max(allowed + 1.0);
    if why.is_empty() { (true, "sustained".into(), false) } else { (false, why.join("; "), clearly) }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The history curve's points of one run.
fn history_points(record: &RunRecord, points: &[usize]) -> Vec<HistoryPoint> {
    points
        .iter()
        .map(|&frames| {
            let answers: Vec<_> = record.answers.iter().filter(|a| a.after_frame == frames).collect();
            let ok: Vec<_> = answers.iter().filter(|a| a.error.is_none()).collect();
            let ttft: Vec<f64> = ok.iter().map(|a| a.ttft_from_question_ms).collect();
            let decode_s: f64 = ok.iter().map(|a| a.decode_seconds()).sum();
            let decode_tokens: f64 = ok.iter().map(|a| a.tokens.saturating_sub(1) as f64).sum();
            let mut errors: Vec<String> = answers.iter().filter_map(|a| a.error.clone()).collect();
            if ok.is_empty()
                && let Some(e) = &record.error
            {
                errors.push(e.clone());
            }
            HistoryPoint {
                config: record.config,
                frames,
                answered: ok.len(),
                ttft_from_question_median_ms: median(&ttft),
                ttft_from_question_ms: ttft,
                decode_tok_s: if decode_s > 0.0 { decode_tokens / decode_s } else { f64::NAN },
                prime_ms: answers.iter().find_map(|a| a.prime_ms).unwrap_or(f64::NAN),
                errors,
            }
        })
        .collect()
}

/// The largest level each configuration sustained with every smaller level it ran sustained
/// too (0: none; a level that passed above one that failed is luck, not capacity).
fn sustained(levels: &[Level]) -> BTreeMap<String, usize> {
    let mut by_streams: Vec<&Level> = levels.iter().collect();
    by_streams.sort_by_key(|l| l.streams);
    let mut out = BTreeMap::new();
    let mut failed = std::collections::BTreeSet::new();
    for l in by_streams {
        let name = l.config.name().to_owned();
        let best = out.entry(name.clone()).or_insert(0);
        if !l.sustained {
            failed.insert(name);
        } else if !failed.contains(&name) {
            *best = (*best).max(l.streams);
        }
    }
    out
}

fn ms_or_dash(v: f64) -> String {
    if v.is_finite() { format!("{v:.0}") } else { "-".into() }
}

fn lag_cells(s: &Summary) -> (String, String) {
    match (s.frames_skipped, s.lag_max_ms, s.lag_mean_ms) {
        (Some(k), Some(max), Some(mean)) => (k.to_string(), format!("{mean:.0} / {max:.0}")),
        _ => ("-".into(), "-".into()),
    }
}

/// The level table as Markdown (also what is printed); its header names the clocks.
pub fn levels_markdown(levels: &[Level], target_ms: f64, max_skipped_pct: f64) -> String {
    let mut out = format!(
        "| S | config | answered | lost | TTFT from capture mean | p95 | TTFT from question p95 | staleness mean | feed lateness mean / max ms | encoder frames/s | answers/s (asked/s) | decode tok/s per answer | generated tok/s | frames skipped | lag mean / max ms | history frames | peak RSS MiB | other CPU % | sustained (p95 from capture <= {target_ms:.0} ms, feed lateness < 1 interval, skipped <= {max_skipped_pct:.0}%, none lost) |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    );
    for l in levels {
        let s = &l.summary;
        let (skipped, lag) = lag_cells(s);
        out.push_str(&format!(
            "| {} | {} | {}/{} | {} | {} ms | {} ms | {} ms | {} | {} | {} | {:.2} ({:.2}) | {:.1} | {:.1} | {} | {} | {:.1} | {:.0} | {} | {}{} |\n",
            l.streams,
            l.config.name(),
            s.answered,
            s.expected,
            l.lost,
            ms_or_dash(s.ttft_from_capture_mean_ms),
            ms_or_dash(s.ttft_from_capture_p95_ms),
            ms_or_dash(s.ttft_from_question_p95_ms),
            s.staleness_mean_ms.map_or("-".into(), |v| format!("{v:.0} ms")),
            match (s.feed_late_mean_ms, s.feed_late_max_ms) {
                (Some(m), Some(x)) => format!("{m:.0} / {x:.0}"),
                _ => "-".into(),
            },
            s.encoder_fps.map_or("-".into(), |v| format!("{v:.2}")),
            s.throughput,
            l.offered_per_s,
            s.decode_tok_s,
            s.generated_tok_s,
            skipped,
            lag,
            l.history_frames_mean,
            s.peak_rss_mib,
            l.foreign_cpu_pct.map_or("-".into(), |p| format!("{p:.0}")),
            if l.sustained { "yes" } else { "no: " },
            if l.sustained { "" } else { l.verdict.as_str() },
        ));
    }
    out
}

/// The history curve as Markdown: one row per point, the runtime configuration beside the peer.
pub fn history_markdown(points: &[HistoryPoint]) -> String {
    let mut configs: Vec<Config> = vec![];
    for p in points {
        if !configs.contains(&p.config) {
            configs.push(p.config);
        }
    }
    let mut out = String::from("| history frames |");
    let mut rule = String::from("|---:|");
    for c in &configs {
        out.push_str(&format!(" {0} TTFT from question (median) | {0} decode tok/s | {0} ready ms |", c.name()));
        rule.push_str("---:|---:|---:|");
    }
    let ratio = configs.len() == 2 && configs[1].is_peer();
    if ratio {
        out.push_str(&format!(" {} / {} TTFT |", configs[0].name(), configs[1].name()));
        rule.push_str("---:|");
    }
    out.push('\n');
    out.push_str(&rule);
    out.push('\n');
    let mut frames: Vec<usize> = points.iter().map(|p| p.frames).collect();
    frames.sort_unstable();
    frames.dedup();
    for n in frames {
        out.push_str(&format!("| {n} |"));
        let row: Vec<Option<&HistoryPoint>> =
            configs.iter().map(|c| points.iter().find(|p| p.frames == n && p.config == *c)).collect();
        for p in &row {
            match p {
                Some(p) => out.push_str(&format!(
                    " {} ms | {:.1} | {} |",
                    ms_or_dash(p.ttft_from_question_median_ms),
                    p.decode_tok_s,
                    ms_or_dash(p.prime_ms)
                )),
                None => out.push_str(" - | - | - |"),
            }
        }
        if ratio {
            let r = row[0].zip(row[1]).map(|(a, b)| a.ttft_from_question_median_ms / b.ttft_from_question_median_ms);
            out.push_str(&format!(" {} |", r.filter(|r| r.is_finite()).map_or("-".into(), |r| format!("{r:.2}"))));
        }
        out.push('\n');
    }
    out
}

pub fn run(mut a: CapacityArgs) -> Result<(), BoxError> {
    let plan = plan(&mut a)?;
    resolve_pair(&mut a.common)?;
    let largest = plan.levels.iter().copied().max().unwrap_or(1);
    // The workload of a level (its stream count set per level); frames staggered over the interval.
    let base = Workload {
        stagger: true,
        ..build_workload(&a.common, largest, a.frames, a.fps, plan.ask_after.clone(), a.tokens)?
    };
    let window_s = a.frames as f64 / a.fps;
    let timeout = Duration::from_secs(a.timeout_s.unwrap_or((2.0 * window_s) as u64 + 300));
    let mut configs = a.configs.clone();
    // The server's slots are sized from the frame a runtime worker measured: runtime first.
    configs.sort_by_key(|c| c.is_peer());
    let session = Session::new(&a.common, &base, &configs, timeout)?;
    let configs = session.configs.clone();
    // The history curve primes the history before each point, so both peers' clients send the
    // same requests there: it runs the first peer named.
    let history_peer = configs.iter().copied().find(|c| c.is_peer());
    let has_peer = history_peer.is_some();
    eprintln!(
        "vlm-bench capacity: levels {:?} streams x {} frames at {} fps (staggered), a question every {} frames, \
         {} tokens, {}x{} pictures, p95 TTFT target {} ms; configurations {:?}, {} round(s) a level; history \
         curve {:?}; engine {:?}, engines {:?}; logs in {}",
        plan.levels,
        a.frames,
        a.fps,
        a.every,
        a.tokens,
        base.width,
        base.height,
        a.ttft_target_ms,
        configs.iter().map(|c| c.name()).collect::<Vec<_>>(),
        a.rounds,
        plan.history.as_ref().map(|h| &h.points),
        base.engine,
        base.engines,
        session.logs.display()
    );
    let history_answers = plan.history.as_ref().map_or(0, |h| h.points.len() * h.reps * (1 + has_peer as usize));
    let level_answers: usize = plan.levels.iter().map(|s| s * plan.ask_after.len() * a.rounds * configs.len()).sum();
    let bar = progress_bar(level_answers + history_answers);
    let started = Instant::now();

    let mut frame_cells: Option<u32> = None;
    let mut runs: Vec<LevelRun> = vec![];
    let mut levels: Vec<Level> = vec![];
    let mut stopped: Vec<Config> = vec![];
    for (li, &streams) in plan.levels.iter().enumerate() {
        let active: Vec<Config> = configs.iter().copied().filter(|c| !stopped.contains(c)).collect();
        if active.is_empty() {
            break;
        }
        let w = Workload { streams, ..base.clone() };
        for round in 0..a.rounds {
            // Alternate the order from level to level and round to round.
            let mut order = active.clone();
            order.rotate_left((li + round) % active.len());
            if frame_cells.is_none() {
                order.sort_by_key(|c| c.is_peer());
            }
            for config in order {
                bar.set_message(format!(
                    "S={streams} round {}/{}: {config} ({})",
                    round + 1,
                    a.rounds,
                    config.describe()
                ));
                let w = Workload { frame_cells, ..w.clone() };
                let label = format!("S{streams}-round{}", round + 1);
                let record = session.run_config(config, &w, round, &label, None, &bar)?;
                frame_cells = frame_cells.or(record.frame_cells);
                report_run(&bar, &format!("S={streams} round {}", round + 1), &record, w.total_questions());
                runs.push(LevelRun { streams, record });
            }
        }
        for &config in &active {
            let level_runs: Vec<&RunRecord> =
                runs.iter().filter(|r| r.streams == streams && r.record.config == config).map(|r| &r.record).collect();
            let summary = report::summarize(config, &level_runs, w.total_questions());
            let lost = summary.expected - summary.answered.min(summary.expected);
            let frames_offered = streams * a.frames * a.rounds;
            let (ok, verdict, clearly) = judge(&summary, lost, frames_offered, &a);
            let answers: Vec<_> = level_runs.iter().flat_map(|r| &r.answers).filter(|a| a.error.is_none()).collect();
            let level = Level {
                streams,
                config,
                lost,
                frames_offered,
                history_frames_mean: answers.iter().map(|a| a.frames as f64).sum::<f64>() / answers.len() as f64,
                offered_per_s: w.total_questions() as f64 / window_s,
                sustained: ok,
                verdict,
                stopped: clearly,
                foreign_cpu_pct: level_runs.iter().filter_map(|r| r.foreign_cpu_pct).reduce(f64::max),
                summary,
            };
            let line = format!("S={streams} {:<4}: {}", config.name(), level.verdict);
            if bar.is_hidden() {
                eprintln!("{line}")
            } else {
                bar.println(line)
            }
            if clearly {
                stopped.push(config);
            }
            levels.push(level);
        }
    }

    let mut history: Vec<HistoryPoint> = vec![];
    let mut history_runs: Vec<LevelRun> = vec![];
    if let Some(h) = &plan.history {
        let last = *h.points.last().expect("at least one point");
        let w = Workload {
            streams: 1,
            frames: last,
            ask_after: h.points.clone(),
            stagger: false,
            frame_cells,
            ..base.clone()
        };
        let sides = [Some(a.history_config), history_peer];
        for config in sides.into_iter().flatten() {
            bar.set_message(format!("history curve: {config} ({})", config.describe()));
            let w = Workload { frame_cells, ..w.clone() };
            let record = session.run_config(config, &w, 0, "history", Some(h), &bar)?;
            frame_cells = frame_cells.or(record.frame_cells);
            report_run(&bar, "history", &record, h.points.len() * h.reps);
            history.extend(history_points(&record, &h.points));
            history_runs.push(LevelRun { streams: 1, record });
        }
    }
    bar.finish_and_clear();

    let sustained = sustained(&levels);
    let levels_md = levels_markdown(&levels, a.ttft_target_ms, a.max_skipped_pct);
    let history_md = history_markdown(&history);
    if !levels.is_empty() {
        println!("{}\n{levels_md}", report::CLOCKS);
        println!(
            "largest S sustained end to end (p95 TTFT from capture <= {} ms, feed lateness under one frame interval, \
             at most {}% of frames skipped, no answer lost): {sustained:?}",
            a.ttft_target_ms, a.max_skipped_pct
        );
    }
    if !history.is_empty() {
        println!(
            "\nTTFT from the question against history length (one stream, history ready before each question):\n\
             {history_md}"
        );
    }
    let json = serde_json::json!({
        "benchmark": BENCHMARK,
        "workload": base,
        "capacity": {
            "levels": plan.levels,
            "frames": a.frames,
            "fps": a.fps,
            "every": a.every,
            "tokens": a.tokens,
            "ttft_from_capture_target_ms": a.ttft_target_ms,
            "max_skipped_pct": a.max_skipped_pct,
            "stop_factor": a.stop_factor,
            "rounds": a.rounds,
            "pair": a.common.pair,
            "pair_longest_edge": a.common.pair_longest_edge,
            "frame_cells": frame_cells,
            "rule": "a level is sustained end to end when every question is answered, p95 TTFT from the capture of \
                the question's frame <= the target, feed lateness (a frame's registration, or the warm peer's frame \
                request answered, minus its due time) stays under one frame interval, and at most max_skipped_pct of \
                the frames were skipped; a configuration runs no further level after one with answers lost or p95 \
                TTFT / feed lateness / skipped frames beyond stop_factor times the allowance",
            "clocks": report::CLOCKS,
        },
        "history_curve": plan.history,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "peer": session.peer_json(),
        "sustained": sustained,
        "levels": levels,
        "history": history,
        "markdown_levels": levels_md,
        "markdown_history": history_md,
        "runs": runs,
        "history_runs": history_runs,
    });
    let titles = titles(&json);
    crate::publish(&a.common, json, |dir| plots::capacity(dir, &levels, &history, a.ttft_target_ms, &titles))?;
    let failed = history.iter().filter(|p| p.answered == 0).count();
    if failed > 0 {
        return Err(format!(
            "{failed} point(s) of the history curve unanswered; see the logs in {}",
            session.logs.display()
        )
        .into());
    }
    Ok(())
}

/// The plots' titles: the levels' workload, and the history curve's.
fn titles(json: &serde_json::Value) -> [String; 2] {
    let c = &json["capacity"];
    let pair = c["pair"].as_str().map_or(String::new(), |p| {
        let edge = c["pair_longest_edge"].as_u64().map_or(String::new(), |n| format!(" (longest edge {n})"));
        format!(", {p}{edge}")
    });
    [
        format!(
            "{} frames at {} fps, a question every {} frames, {} tokens{pair}",
            c["frames"], c["fps"], c["every"], c["tokens"]
        ),
        format!("{} tokens, median of {}{pair}", c["tokens"], json["history_curve"]["reps"]),
    ]
}

/// `plot --from` for a capacity report.
pub fn replot(json: &serde_json::Value, dir: &Path) -> Result<(), BoxError> {
    let levels: Vec<Level> = serde_json::from_value(json["levels"].clone())?;
    let history: Vec<HistoryPoint> = serde_json::from_value(json["history"].clone())?;
    // Reports before the capture clock named the target on the question's clock.
    let c = &json["capacity"];
    let target = c["ttft_from_capture_target_ms"].as_f64().or(c["ttft_target_ms"].as_f64()).unwrap_or(f64::NAN);
    let files: Vec<PathBuf> = plots::capacity(dir, &levels, &history, target, &titles(json))?;
    eprintln!("vlm-bench: plots {files:?}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cli;
    use clap::Parser;

    fn args(extra: &[&str]) -> CapacityArgs {
        match Cli::try_parse_from(["vlm-bench", "capacity"].iter().chain(extra)).expect("valid arguments").command {
            Some(crate::Cmd::Capacity(a)) => *a,
            _ => panic!("not the capacity subcommand"),
        }
    }

    #[test]
    fn default_levels_double_up_to_the_largest() {
        let mut a = args(&[]);
        let p = plan(&mut a).unwrap();
        assert_eq!(p.levels, vec![1, 2, 4, 8]);
        assert_eq!(p.ask_after, vec![4, 8, 12, 16, 20, 24, 28, 32]);
        assert_eq!(p.history.unwrap().points, vec![8, 16, 32, 64, 128]);
        assert_eq!(a.configs, DEFAULT_CONFIGS);
        let mut a = args(&["--max-streams", "6", "--every", "5", "--no-history"]);
        let p = plan(&mut a).unwrap();
        assert_eq!(p.levels, vec![1, 2, 4]);
        assert_eq!(p.ask_after, vec![5, 10, 15, 20, 25, 30]);
        assert!(p.history.is_none());
        let mut a = args(&["--smoke"]);
        let p = plan(&mut a).unwrap();
        assert_eq!((p.levels, a.configs), (vec![1, 2], vec![Config::B1]));
        assert!(plan(&mut args(&["--every", "40"])).is_err());
    }

    fn summary(p95_from_capture: f64, skipped: u64) -> Summary {
        let mut s = report::summarize(Config::B1, &[], 0);
        s.ttft_from_capture_p95_ms = p95_from_capture;
        s.ttft_from_question_p95_ms = 10.0; // never judged
        s.frames_skipped = Some(skipped);
        s
    }

    #[test]
    fn levels_are_judged_end_to_end() {
        // One frame a second: a 1000 ms interval; 10% of 100 frames may be skipped.
        let a = args(&["--ttft-target-ms", "1000"]);
        assert_eq!(judge(&summary(900.0, 0), 0, 100, &a), (true, "sustained".into(), false));
        let (ok, why, clearly) = judge(&summary(1200.0, 1), 0, 100, &a);
        assert!(!ok && !clearly && why.contains("from capture"), "{why}");
        assert!(judge(&summary(1600.0, 0), 0, 100, &a).2, "p95 beyond 1.5x the target");
        assert!(judge(&summary(900.0, 0), 1, 100, &a).2, "an answer lost");
        // Every answer in time, but a warm peer's frame request failed: not measured.
        let failed = Summary { errors: vec!["a frame request failed: refused".into()], ..summary(900.0, 0) };
        let (ok, why, clearly) = judge(&failed, 0, 100, &a);
        assert!(!ok && clearly && why.contains("a frame request failed"), "{why}");
        assert!(judge(&summary(900.0, 10), 0, 100, &a).0, "10 of 100 frames skipped");
        let (ok, why, clearly) = judge(&summary(900.0, 11), 0, 100, &a);
        assert!(!ok && !clearly && why.contains("11 of 100 frames skipped"), "{why}");
        assert!(judge(&summary(900.0, 16), 0, 100, &a).2);
        assert!(judge(&summary(f64::NAN, 0), 0, 100, &a).2, "nothing answered");
        // Feed lateness: under one interval sustains; one interval or more does not.
        let late =
            |max: f64| Summary { feed_late_mean_ms: Some(max / 2.0), feed_late_max_ms: Some(max), ..summary(900.0, 0) };
        assert!(judge(&late(999.0), 0, 100, &a).0);
        let (ok, why, clearly) = judge(&late(1000.0), 0, 100, &a);
        assert!(!ok && !clearly && why.contains("feed lateness"), "{why}");
        assert!(judge(&late(1500.0), 0, 100, &a).2, "lateness beyond 1.5 intervals");
        let fast = args(&["--ttft-target-ms", "1000", "--fps", "4"]);
        assert!(!judge(&late(300.0), 0, 100, &fast).0, "a 250 ms interval");
    }

    #[test]
    fn history_points_and_tables() {
        let mut record = RunRecord::empty(Config::B1, 0, 1);
        for (frames, ttft) in [(8, 100.0), (8, 120.0), (8, 110.0), (16, 130.0)] {
            let mut a = crate::record::AnswerRecord::asked(0, 0, frames, 0.0, ttft + 310.0);
            (a.ttft_from_question_ms, a.tokens, a.prime_ms) = (ttft, 32, Some(900.0));
            record.answers.push(a);
        }
        let mut points = history_points(&record, &[8, 16]);
        assert_eq!((points[0].answered, points[0].ttft_from_question_median_ms, points[0].prime_ms), (3, 110.0, 900.0));
        assert!((points[1].decode_tok_s - 100.0).abs() < 1e-9); // 31 tokens in 310 ms
        let mut peer = points.clone();
        for p in &mut peer {
            p.config = Config::Peer;
            p.ttft_from_question_median_ms *= 2.0;
        }
        points.extend(peer);
        let md = history_markdown(&points);
        assert_eq!(md.lines().count(), 4);
        assert!(md.lines().nth(2).unwrap().ends_with("| 0.50 |"), "{md}");
        let level = Level {
            streams: 2,
            config: Config::B1,
            lost: 0,
            frames_offered: 64,
            history_frames_mean: 18.0,
            offered_per_s: 0.5,
            sustained: true,
            verdict: "sustained".into(),
            stopped: false,
            foreign_cpu_pct: Some(1.0),
            summary: report::summarize(Config::B1, &[&record], 4),
        };
        let other = Level { config: Config::PeerWarm, sustained: false, ..level.clone() };
        assert_eq!(sustained(&[level.clone(), other]), BTreeMap::from([("B1".into(), 2), ("PEER-WARM".into(), 0)]));
        // A level that passed above one that failed does not count.
        let failed_at_1 = Level { streams: 1, sustained: false, ..level.clone() };
        let passed_at_4 = Level { streams: 4, ..level.clone() };
        assert_eq!(sustained(&[passed_at_4, level.clone(), failed_at_1]), BTreeMap::from([("B1".into(), 0)]));
        let back: Level = serde_json::from_str(&serde_json::to_string(&level).unwrap()).unwrap();
        let md = levels_markdown(&[back], 1000.0, 10.0);
        assert_eq!(md.lines().count(), 3);
        assert!(md.starts_with("| S | config | answered | lost | TTFT from capture mean |"), "{md}");
    }
}
