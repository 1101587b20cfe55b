//! `vlm-bench`: the seed's workload (S live streams x F frames at R frames/s, questions right
//! after given frames, answers of exactly T tokens) through gst-vlm's runtime, against its
//! baselines and llama.cpp's own server, configurations alternating round by round.
//!
//!   cargo run --release -p vlm-bench -- [--configs B0,B1,B2,P,B3,PEER] [--rounds 3]
//!       [--json FILE] [--plots DIR]
//!   cargo run --release -p vlm-bench -- --smoke        # seconds-long, for CI
//!   vlm-bench plot --from FILE --plots DIR             # redraw the plots of a JSON report
//!
//! Each runtime configuration runs in a fresh worker process (this binary, re-executed), so model
//! load, warm-up and peak RSS are its own; B3 runs one worker per stream, and the peer is a
//! llama-server started once per round. See docs/benchmarks.md.

mod peer;
mod plots;
mod record;
mod report;
mod runtime_run;
mod workload;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use record::{ALL_CONFIGS, AnswerRecord, Config, DecodeSplit, LagStats, RunRecord, WorkerMsg};
use runtime_run::WorkerSpec;
use workload::{Workload, unix_ms};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser)]
#[command(version, about = "gst-vlm's system benchmark: the seed's workload against its baselines and llama-server")]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Redraw the plots of a JSON report (e.g. one written on another machine).
    Plot {
        #[arg(long)]
        from: PathBuf,
        #[arg(long)]
        plots: PathBuf,
    },
    /// Internal: run one configuration's worker process (spec as JSON).
    #[command(name = "__worker", hide = true)]
    Worker { spec: String },
}

#[derive(Args)]
struct RunArgs {
    /// Live streams.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    /// Frames per stream.
    #[arg(long, default_value_t = 8)]
    frames: usize,
    /// Frames per second of each stream (fed in real time).
    #[arg(long, default_value_t = 2.0)]
    fps: f64,
    /// Questions per stream: the first Q frames of --ask-after.
    #[arg(long, default_value_t = 4)]
    questions: usize,
    /// A question is asked right after each of these frames (1-based) is registered.
    #[arg(long, value_delimiter = ',', default_value = "2,4,6,8")]
    ask_after: Vec<usize>,
    /// Answer length: exactly this many tokens (end-of-generation ignored).
    #[arg(long, default_value_t = 128)]
    tokens: u32,
    /// Picture size WIDTHxHEIGHT.
    #[arg(long, default_value = "320x240")]
    frame_size: String,
    /// Language model GGUF.
    #[arg(long, env = "VLM_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Projector (libmtmd mmproj) GGUF.
    #[arg(long, env = "VLM_MMPROJ", default_value = "models/test-mmproj-mlp.gguf")]
    mmproj: PathBuf,
    /// Configurations to run, in this order in round 1 (later rounds rotate it).
    #[arg(long, value_delimiter = ',', default_value = "B0,B1,B2,P,B3,PEER")]
    configs: Vec<Config>,
    /// Rounds; every configuration runs once per round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Engine of B0 and B1 (NAME[:cpu|gpu[:THREADS[:CORES]]]); default: one CPU engine with
    /// every core.
    #[arg(long)]
    engine: Option<String>,
    /// The two engines of P (B2 is the second alone; B3's process i uses engine i mod 2);
    /// default: two CPU engines, each with half the cores, pinned.
    #[arg(long)]
    engines: Option<String>,
    /// Answers generated at once per engine (vlmcontext's max-answers default).
    #[arg(long, default_value_t = 8)]
    max_answers: u32,
    /// Least KV cells per sequence (and per server slot).
    #[arg(long, default_value_t = 2048)]
    context: u32,
    /// Frames waiting for ingestion before the overload policy applies (vlmcontext's
    /// max-pending default).
    #[arg(long, default_value_t = 2)]
    max_pending: usize,
    /// Block the source past --max-pending instead of skipping frames (skipping is what
    /// vlmcontext's overload=auto does for a live source, which this workload is).
    #[arg(long)]
    block_on_overload: bool,
    /// llama-server binary (default: scripts/build-llama-server.sh's CPU build).
    #[arg(long, env = "VLM_LLAMA_SERVER")]
    llama_server: Option<PathBuf>,
    /// Threads of llama-server (default: B1's engine's).
    #[arg(long)]
    peer_threads: Option<usize>,
    /// Extra llama-server arguments, space-separated (e.g. "-ngl 99").
    #[arg(long, allow_hyphen_values = true)]
    peer_args: Option<String>,
    /// Also write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write PNG plots into this folder.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Worker and server logs (default: a folder under the system's temporary directory).
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Longest a configuration may take in one round (load, window and shutdown) before its
    /// processes are stopped and the round counts as failed (s).
    #[arg(long, default_value_t = 900)]
    timeout_s: u64,
    /// A seconds-long run for CI: one configuration (B1 unless --configs names others), one
    /// round, 2 frames, 1 question, 8 tokens.
    #[arg(long)]
    smoke: bool,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

fn default_pair(n: usize) -> String {
    if n < 2 {
        return "cpu0:cpu:1,cpu1:cpu:1".into();
    }
    let h = n / 2;
    format!("cpu0:cpu:{h}:0-{},cpu1:cpu:{}:{h}-{}", h - 1, n - h, n - 1)
}

fn workload(a: &RunArgs) -> Result<Workload, BoxError> {
    let (width, height) = a
        .frame_size
        .split_once('x')
        .and_then(|(w, h)| Some((w.parse::<u32>().ok()?, h.parse::<u32>().ok()?)))
        .filter(|&(w, h)| w >= 8 && h >= 8)
        .ok_or_else(|| format!("--frame-size {}: expected WIDTHxHEIGHT, at least 8x8", a.frame_size))?;
    if a.questions > a.ask_after.len() {
        return Err(format!("--questions {} needs as many frames in --ask-after", a.questions).into());
    }
    let ask_after = a.ask_after[..a.questions].to_vec();
    if let Some(bad) = ask_after.iter().find(|&&f| f == 0 || f > a.frames) {
        return Err(format!("--ask-after {bad}: frames are numbered 1..={}", a.frames).into());
    }
    if a.streams == 0 || a.frames == 0 || a.fps <= 0.0 || a.tokens == 0 || a.rounds == 0 {
        return Err("streams, frames, fps, tokens and rounds must be positive".into());
    }
    Ok(Workload {
        streams: a.streams,
        frames: a.frames,
        fps: a.fps,
        ask_after,
        tokens: a.tokens,
        width,
        height,
        model: a.model.clone(),
        mmproj: a.mmproj.clone(),
        engine: a.engine.clone().unwrap_or_else(|| format!("cpu:cpu:{}", cores())),
        engines: a.engines.clone().unwrap_or_else(|| default_pair(cores())),
        max_answers: a.max_answers,
        context: a.context,
        max_pending: a.max_pending,
        skip_on_overload: !a.block_on_overload,
    })
}

enum Event {
    Msg(usize, WorkerMsg),
    Closed,
}

/// Run `streams` worker processes of `config` (one for every configuration but B3), start them
/// together once all are ready, and merge what they report.
fn run_workers(
    config: Config,
    round: usize,
    w: &Workload,
    logs: &std::path::Path,
    bar: &ProgressBar,
    timeout: Duration,
) -> Result<RunRecord, BoxError> {
    let exe = std::env::current_exe()?;
    let specs: Vec<WorkerSpec> = if config == Config::B3 {
        (0..w.streams).map(|i| WorkerSpec { config, only_stream: Some(i), workload: w.clone() }).collect()
    } else {
        vec![WorkerSpec { config, only_stream: None, workload: w.clone() }]
    };
    let (tx, rx) = mpsc::channel();
    let mut children = vec![];
    let mut stdins = vec![];
    for (i, spec) in specs.iter().enumerate() {
        let log = std::fs::File::create(logs.join(format!("round{}-{}-{i}.log", round + 1, config.name())))?;
        let mut child = Command::new(&exe)
            .arg("__worker")
            .arg(serde_json::to_string(spec)?)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()?;
        stdins.push(child.stdin.take().expect("piped"));
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(msg) = serde_json::from_str::<WorkerMsg>(&line) {
                    let _ = tx.send(Event::Msg(i, msg));
                }
            }
            let _ = tx.send(Event::Closed);
        });
        children.push(child);
    }
    drop(tx);
    let mut record = RunRecord {
        config,
        round,
        processes: specs.len(),
        load_ms: 0.0,
        peak_rss_kib: 0,
        window_ms: 0.0,
        answers: vec![],
        decode_split: Some(DecodeSplit::default()),
        lag: Some(LagStats::default()),
        error: None,
    };
    let mut errors: Vec<String> = vec![];
    let mut ready = 0;
    let mut open = specs.len();
    let mut started = false;
    let deadline = Instant::now() + timeout;
    loop {
        let event = match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(event) => event,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                errors.push(format!("timed out after {} s", timeout.as_secs()));
                started = false; // stop the workers below
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        match event {
            Event::Msg(_, WorkerMsg::Ready { load_ms }) => {
                record.load_ms = record.load_ms.max(load_ms);
                ready += 1;
                if ready == specs.len() {
                    // Everyone loaded: start the window together, a moment from now.
                    let at = unix_ms() + 200;
                    for stdin in &mut stdins {
                        writeln!(stdin, "go {at}")?;
                        stdin.flush()?;
                    }
                    started = true;
                }
            }
            Event::Msg(_, WorkerMsg::Answer(a)) => {
                bar.inc(1);
                record.answers.push(a);
            }
            Event::Msg(_, WorkerMsg::Done { window_ms, peak_rss_kib, decode_split, lag }) => {
                record.window_ms = record.window_ms.max(window_ms);
                record.peak_rss_kib += peak_rss_kib;
                record.decode_split.as_mut().expect("set above").add(&decode_split);
                record.lag.as_mut().expect("set above").add(&lag);
            }
            Event::Msg(i, WorkerMsg::Failed { error }) => {
                errors.push(format!("worker {i}: {error}"));
                if !started {
                    break; // it will never be ready: stop the others below
                }
            }
            Event::Closed => {
                open -= 1;
                if open == 0 {
                    break;
                }
                if !started {
                    errors.push("a worker exited before it was ready".into());
                    break;
                }
            }
        }
    }
    drop(stdins);
    for (i, mut child) in children.into_iter().enumerate() {
        if !started {
            let _ = child.kill();
        }
        let status = child.wait()?;
        if !status.success() && started {
            errors.push(format!("worker {i} exited with {status}"));
        }
    }
    if !errors.is_empty() {
        record.error = Some(format!("{} (logs in {})", errors.join("; "), logs.display()));
    }
    Ok(record)
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn machine() -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu =
        cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|l| l.trim_start_matches([' ', '\t', ':']));
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: Option<u64> = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
    serde_json::json!({
        "cpus": cores(),
        "cpu": cpu,
        "memory_gib": mem_kib.map(|k| (k as f64 / 1048576.0 * 10.0).round() / 10.0),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_owned()),
    })
}

fn date() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| format!("unix {}", unix_ms() / 1000))
}

fn run(mut a: RunArgs) -> Result<(), BoxError> {
    if a.smoke {
        if a.configs == ALL_CONFIGS {
            a.configs = vec![Config::B1];
        }
        a.rounds = 1;
        a.frames = 2;
        a.questions = 1;
        a.ask_after = vec![2];
        a.tokens = 8;
    }
    let w = workload(&a)?;
    let mut configs = a.configs.clone();
    configs.dedup();
    let server = peer::find_server(a.llama_server.as_deref());
    if configs.contains(&Config::Peer) && server.as_ref().is_none_or(|s| !s.is_file()) {
        eprintln!(
            "vlm-bench: no llama-server binary ({}); PEER is left out. Build it with scripts/build-llama-server.sh \
             or name it with --llama-server.",
            server.as_ref().map_or_else(|| "not built".into(), |s| s.display().to_string())
        );
        configs.retain(|c| *c != Config::Peer);
    }
    if configs.is_empty() {
        return Err("no configuration to run".into());
    }
    let logs =
        a.log_dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("vlm-bench-{}", std::process::id())));
    std::fs::create_dir_all(&logs)?;
    let single_threads = vlm_runtime::EngineConfig::parse_list(&w.engine, &vlm_runtime::EngineConfig::default())?
        .first()
        .map_or(cores(), |e| e.threads as usize);
    let peer_settings = server.map(|server| peer::PeerSettings {
        server,
        threads: a.peer_threads.unwrap_or(single_threads),
        args: a.peer_args.as_deref().unwrap_or("").split_whitespace().map(str::to_owned).collect(),
        logs: logs.clone(),
        timeout: Duration::from_secs(a.timeout_s),
    });

    eprintln!(
        "vlm-bench: {} streams x {} frames at {} fps, questions after frames {:?}, {} tokens, {}x{} pictures; \
         configurations {:?}, {} round(s); engine {:?}, engines {:?}; logs in {}",
        w.streams,
        w.frames,
        w.fps,
        w.ask_after,
        w.tokens,
        w.width,
        w.height,
        configs.iter().map(|c| c.name()).collect::<Vec<_>>(),
        a.rounds,
        w.engine,
        w.engines,
        logs.display()
    );
    let bar = ProgressBar::new((a.rounds * configs.len() * w.total_questions()) as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} answers  {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let started = Instant::now();
    let mut runs: Vec<RunRecord> = vec![];
    for round in 0..a.rounds {
        // Rotate the order every round, so each configuration meets each moment of drift.
        let mut order = configs.clone();
        order.rotate_left(round % configs.len());
        for config in order {
            bar.set_message(format!("round {}/{}: {} ({})", round + 1, a.rounds, config, config.describe()));
            let record = if config == Config::Peer {
                let settings = peer_settings.as_ref().expect("the peer is only kept with a server");
                let on_answer = |_: &AnswerRecord| bar.inc(1);
                peer::run_round(settings, &w, round, &on_answer)
            } else {
                run_workers(config, round, &w, &logs, &bar, Duration::from_secs(a.timeout_s))?
            };
            let ok: Vec<_> = record.answers.iter().filter(|a| a.error.is_none()).collect();
            let mut line = format!(
                "round {} {:<4}: {}/{} answers in {:.1} s, mean TTFT {:.0} ms, load {:.0} ms, peak RSS {} MiB",
                round + 1,
                config.name(),
                ok.len(),
                w.total_questions(),
                record.window_ms / 1e3,
                ok.iter().map(|a| a.ttft_ms).sum::<f64>() / ok.len().max(1) as f64,
                record.load_ms,
                record.peak_rss_kib / 1024
            );
            if let Some(e) = &record.error {
                line.push_str(&format!("; error: {e}"));
            }
            if bar.is_hidden() {
                eprintln!("{line}")
            } else {
                bar.println(line)
            }
            runs.push(record);
        }
    }
    bar.finish_and_clear();

    let summaries: Vec<_> = configs
        .iter()
        .map(|&c| report::summarize(c, &runs.iter().filter(|r| r.config == c).collect::<Vec<_>>(), w.total_questions()))
        .collect();
    let ratios = report::ratios(&summaries);
    let commit = git(&["rev-parse", "--short", "HEAD"]).map(|c| {
        let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        if dirty { format!("{c}+dirty") } else { c }
    });
    let json = serde_json::json!({
        "benchmark": "vlm-bench",
        "commit": commit,
        "date": date(),
        "machine": machine(),
        "workload": w,
        "rounds": a.rounds,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "peer": peer_settings.as_ref().map(|p| serde_json::json!({
            "server": p.server, "threads": p.threads, "args": p.args, "media_marker": peer::MEDIA_MARKER,
        })),
        "decode_split_note": "decode_ingesting/idle come from the engines' step times (one token per active answer \
            per step); llama-server does not expose the split",
        "summaries": summaries,
        "ratios": ratios,
        "markdown_table": report::markdown(&summaries),
        "runs": runs,
    });
    println!("{}", report::table(&summaries));
    println!("ratios: {ratios}");
    println!("{json}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        eprintln!("vlm-bench: JSON written to {}", path.display());
    }
    if let Some(dir) = &a.plots {
        let title = format!("{} streams x {} frames, {} tokens", w.streams, w.frames, w.tokens);
        match plots::write(dir, &summaries, &runs, &title) {
            Ok(files) => eprintln!("vlm-bench: plots {:?}", files),
            Err(e) => eprintln!("vlm-bench: no plots: {e}"),
        }
    }
    let failed: usize = summaries.iter().map(|s| s.expected - s.answered.min(s.expected)).sum();
    if failed > 0 {
        return Err(
            format!("{failed} question(s) not answered; see the table and the logs in {}", logs.display()).into()
        );
    }
    Ok(())
}

fn replot(from: &std::path::Path, dir: &std::path::Path) -> Result<(), BoxError> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(from)?)?;
    let summaries: Vec<report::Summary> = serde_json::from_value(json["summaries"].clone())?;
    let runs: Vec<RunRecord> = serde_json::from_value(json["runs"].clone())?;
    let w = &json["workload"];
    let title = format!("{} streams x {} frames, {} tokens", w["streams"], w["frames"], w["tokens"]);
    let files = plots::write(dir, &summaries, &runs, &title)?;
    eprintln!("vlm-bench: plots {files:?}");
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Cmd::Worker { spec }) => match serde_json::from_str::<WorkerSpec>(&spec) {
            Ok(spec) => std::process::exit(runtime_run::main(&spec)),
            Err(e) => Err(format!("bad worker spec: {e}").into()),
        },
        Some(Cmd::Plot { from, plots }) => replot(&from, &plots),
        None => run(cli.run),
    };
    if let Err(e) = result {
        eprintln!("vlm-bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> RunArgs {
        Cli::try_parse_from(["vlm-bench"].iter().chain(extra)).expect("valid arguments").run
    }

    #[test]
    fn defaults_are_the_seed_workload() {
        let w = workload(&args(&[])).unwrap();
        assert_eq!((w.streams, w.frames, w.fps, w.tokens), (2, 8, 2.0, 128));
        assert_eq!(w.ask_after, vec![2, 4, 6, 8]);
        assert_eq!((w.width, w.height), (320, 240));
        assert_eq!(args(&[]).configs, ALL_CONFIGS);
    }

    #[test]
    fn workload_arguments_are_checked() {
        let w = workload(&args(&["--questions", "2", "--frame-size", "64x48", "--configs", "p,peer"])).unwrap();
        assert_eq!(w.ask_after, vec![2, 4]);
        assert_eq!((w.width, w.height), (64, 48));
        assert_eq!(args(&["--configs", "p,peer"]).configs, vec![Config::P, Config::Peer]);
        assert!(workload(&args(&["--frame-size", "64"])).is_err());
        assert!(workload(&args(&["--ask-after", "2,9"])).is_err()); // only 8 frames
        assert!(workload(&args(&["--questions", "5"])).is_err());
        assert!(Cli::try_parse_from(["vlm-bench", "--configs", "B9"]).is_err());
    }

    #[test]
    fn the_two_engines_split_the_cores() {
        assert_eq!(default_pair(2), "cpu0:cpu:1:0-0,cpu1:cpu:1:1-1");
        assert_eq!(default_pair(16), "cpu0:cpu:8:0-7,cpu1:cpu:8:8-15");
        let base = vlm_runtime::EngineConfig::default();
        let pair = vlm_runtime::EngineConfig::parse_list(&default_pair(2), &base).unwrap();
        assert_eq!((pair[1].threads, pair[1].cores.clone()), (1, vec![1]));
    }
}
