//! `vlm-bench`: the seed's workload (S live streams x F frames at R frames/s, questions right
//! after given frames, answers of exactly T tokens) through gst-vlm's runtime, against its
//! baselines and llama.cpp's own server, configurations alternating round by round.
//!
//!   cargo run --release -p vlm-bench -- [--configs B0,B1,B2,P,B3,PEER,PEER-WARM] [--rounds 3]
//!       [--json FILE] [--plots DIR]
//!   vlm-bench --print-peer-plan warm [--streams 1 --frames 3 ...]  # the peer's requests, no server
//!   cargo run --release -p vlm-bench -- --smoke        # seconds-long, for CI
//!   vlm-bench plot --from FILE --plots DIR             # redraw the plots of a JSON report
//!   vlm-bench capacity [--max-streams 8] [--pair smolvlm-256m] [--smoke]   # streams sustained
//!   vlm-bench encoders [--contexts 1,2,4,8] [--streams 1,4,16] [--encoder gpu]  # encoding scale
//!
//! Each runtime configuration runs in a fresh worker process (this binary, re-executed), so model
//! load, warm-up and peak RSS are its own; B3 runs one worker per stream, and the peer is a
//! llama-server started once per round, driven by a naive client (PEER) or a warm one
//! (PEER-WARM). TTFT is reported on two clocks: from the capture of the question's frame (the
//! headline) and from the question's arrival. See docs/benchmarks.md.

mod capacity;
mod encoders;
mod gpu_memory;
mod levels;
mod peer;
mod plots;
mod record;
mod report;
mod runtime_run;
mod session;
mod workload;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use record::{ALL_CONFIGS, Config, RunRecord};
use runtime_run::WorkerSpec;
use session::Session;
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
    /// Capacity: how many live streams each side sustains at a TTFT target (S = 1, 2, 4, ...),
    /// and TTFT against history length, the retained runtime against llama-server.
    Capacity(Box<capacity::CapacityArgs>),
    /// Vision encoding throughput against encoder contexts and streams encoding at once.
    Encoders(Box<encoders::EncodersArgs>),
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
    /// Configurations to run, in this order in round 1 (later rounds rotate it). PEER is
    /// llama-server with a naive client, PEER-WARM the same server with every frame sent as it
    /// is captured.
    #[arg(long, value_delimiter = ',', default_value = "B0,B1,B2,P,B3,PEER,PEER-WARM")]
    configs: Vec<Config>,
    /// Rounds; every configuration runs once per round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Longest a configuration may take in one round (load, window and shutdown) before its
    /// processes are stopped and the round counts as failed (s).
    #[arg(long, default_value_t = 900)]
    timeout_s: u64,
    /// A seconds-long run for CI: one configuration (B1 unless --configs names others), one
    /// round, 2 frames, 1 question, 8 tokens.
    #[arg(long)]
    smoke: bool,
    /// Print the requests the peer's client of this mode (naive or warm) would send over the
    /// workload, as JSON (images named, not sent), and exit: no server, no model.
    #[arg(long, value_parser = ["naive", "warm"])]
    print_peer_plan: Option<String>,
    #[command(flatten)]
    common: CommonArgs,
}

/// What the seed workload and the capacity mode share: models, engines, the peer, outputs.
#[derive(Args, Clone)]
pub struct CommonArgs {
    /// Picture size WIDTHxHEIGHT.
    #[arg(long, default_value = "320x240")]
    frame_size: String,
    /// Language model GGUF.
    #[arg(long, env = "VLM_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Projector (libmtmd mmproj) GGUF.
    #[arg(long, env = "VLM_MMPROJ", default_value = "models/test-mmproj-mlp.gguf")]
    mmproj: PathBuf,
    /// A timing-true model pair, models/timing/NAME-lm.gguf and NAME-mmproj.gguf (e.g.
    /// smolvlm-256m), generated by scripts/make_timing_pair.py when missing; replaces --model
    /// and --mmproj.
    #[arg(long)]
    pair: Option<String>,
    /// With --pair: the pair generated for frames resized to this many pixels on their longest
    /// edge (SmolVLM: 512 gives one tile and the overview, 2 x 64 image tokens a frame, where the
    /// checkpoint's 2048 gives 13 x 64 for a 4:3 frame), kept in models/timing-leN/.
    #[arg(long, requires = "pair")]
    pair_longest_edge: Option<u32>,
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
    /// The runtime's vision encoder, `cpu[:THREADS]` or `gpu` (libmtmd, as `vlmencode backend=`);
    /// the server encodes on the device its `--peer-args` give it.
    #[arg(long, default_value = "cpu:1")]
    encoder: String,
    /// The runtime's encoder contexts (vlmencode's encoder-contexts; 0, automatic, as there: on a
    /// GPU 2 for up to 4 streams of a worker and 4 for more, 1 on the CPU).
    #[arg(long, default_value_t = 0)]
    encoder_contexts: usize,
    /// Threads resizing each picture of a tiled (SmolVLM) projector before libmtmd cuts it (0:
    /// libmtmd resizes it on the encode's thread, as before the resize moved; default: up to 4).
    #[arg(long)]
    prepare_threads: Option<usize>,
    /// The engines' KV layout: auto, per-sequence or unified (vlmcontext's kv-layout; auto as
    /// there: the unified pool on CPU engines and for at most 2 streams on a GPU).
    #[arg(long, default_value = "auto")]
    kv_layout: String,
    /// KV element type: f16, q8_0, q4_0 (vlmcontext's kv-type; quantized types need
    /// --flash-attention); the server gets the same.
    #[arg(long, default_value = "f16")]
    kv_type: String,
    /// Flash attention on the engines and the server.
    #[arg(long)]
    flash_attention: bool,
    /// A frame of several segments (tiles and their wrapper text) ingested as one batch of
    /// embedding rows: auto (GPU and RPC engines), on or off (the runtime's
    /// `EngineConfig::merge_frames`).
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    merge_frames: String,
    /// CPU engines pause answers after their first token while the vision encoder needs the
    /// cores, each once (vlmcontext's `encode-first=true`; off by default, as there).
    #[arg(long)]
    encode_first: bool,
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
    /// On a shared machine: run a configuration again (twice at most, after waiting for 20 quiet
    /// seconds) when other processes used more than this share of the CPU (percent of all
    /// cores) during it; the discarded runs' shares are kept in the JSON.
    #[arg(long)]
    retry_busy_pct: Option<f64>,
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

/// The workload of `c`'s models, engines and pictures with these streams, frames and questions.
fn build_workload(
    c: &CommonArgs,
    streams: usize,
    frames: usize,
    fps: f64,
    ask_after: Vec<usize>,
    tokens: u32,
) -> Result<Workload, BoxError> {
    let (width, height) = c
        .frame_size
        .split_once('x')
        .and_then(|(w, h)| Some((w.parse::<u32>().ok()?, h.parse::<u32>().ok()?)))
        .filter(|&(w, h)| w >= 8 && h >= 8)
        .ok_or_else(|| format!("--frame-size {}: expected WIDTHxHEIGHT, at least 8x8", c.frame_size))?;
    if let Some(bad) = ask_after.iter().find(|&&f| f == 0 || f > frames) {
        return Err(format!("a question after frame {bad}: frames are numbered 1..={frames}").into());
    }
    if streams == 0 || frames == 0 || fps <= 0.0 || tokens == 0 {
        return Err("streams, frames, fps and tokens must be positive".into());
    }
    let (encoder_gpu, encoder_threads) = match c.encoder.split_once(':').unwrap_or((&c.encoder, "1")) {
        ("gpu", _) => (true, 1),
        ("cpu", n) => (false, n.parse().ok().filter(|&n: &u32| n > 0).ok_or("--encoder cpu:THREADS: THREADS >= 1")?),
        _ => return Err(format!("--encoder {}: expected cpu[:THREADS] or gpu", c.encoder).into()),
    };
    Ok(Workload {
        kv_layout: c.kv_layout.clone(),
        kv_type: c.kv_type.clone(),
        flash_attention: c.flash_attention,
        merge_frames: c.merge_frames.clone(),
        encode_first: c.encode_first,
        encoder_gpu,
        encoder_threads,
        encoder_contexts: c.encoder_contexts,
        prepare_threads: c.prepare_threads,
        streams,
        frames,
        fps,
        ask_after,
        tokens,
        width,
        height,
        model: c.model.clone(),
        mmproj: c.mmproj.clone(),
        engine: c.engine.clone().unwrap_or_else(|| format!("cpu:cpu:{}", cores())),
        engines: c.engines.clone().unwrap_or_else(|| default_pair(cores())),
        max_answers: c.max_answers,
        context: c.context,
        max_pending: c.max_pending,
        skip_on_overload: !c.block_on_overload,
        stagger: false,
        frame_cells: None,
    })
}

fn workload(a: &RunArgs) -> Result<Workload, BoxError> {
    if a.questions > a.ask_after.len() {
        return Err(format!("--questions {} needs as many frames in --ask-after", a.questions).into());
    }
    if a.rounds == 0 {
        return Err("--rounds must be positive".into());
    }
    build_workload(&a.common, a.streams, a.frames, a.fps, a.ask_after[..a.questions].to_vec(), a.tokens)
}

/// `--pair NAME`: the timing-true pair's files, generated by scripts/make_timing_pair.py when
/// either is missing: models/timing/NAME-{lm,mmproj}.gguf, or with `--pair-longest-edge N`
/// models/timing-leN/ (the projector resizes frames to N px on their longest edge).
fn resolve_pair(c: &mut CommonArgs) -> Result<(), BoxError> {
    let Some(name) = c.pair.clone() else { return Ok(()) };
    let dir =
        PathBuf::from(c.pair_longest_edge.map_or_else(|| "models/timing".into(), |n| format!("models/timing-le{n}")));
    let (model, mmproj) = (dir.join(format!("{name}-lm.gguf")), dir.join(format!("{name}-mmproj.gguf")));
    if !model.is_file() || !mmproj.is_file() {
        let script = PathBuf::from("scripts/make_timing_pair.py");
        if !script.is_file() {
            return Err(format!(
                "--pair {name}: {} or {} is missing and {} does not exist to generate them",
                model.display(),
                mmproj.display(),
                script.display()
            )
            .into());
        }
        let python = [".deps/venv/bin/python", "python3"]
            .into_iter()
            .find(|p| !p.contains('/') || std::path::Path::new(p).is_file())
            .expect("python3 is the fallback");
        let mut command = Command::new(python);
        command.arg(&script).arg(&name).arg("--out-dir").arg(&dir);
        if let Some(n) = c.pair_longest_edge {
            command.arg("--longest-edge").arg(n.to_string());
        }
        eprintln!("vlm-bench: generating the timing pair {name}: {command:?}");
        let status = command.status()?;
        if !status.success() || !model.is_file() || !mmproj.is_file() {
            return Err(format!("--pair {name}: {} failed ({status})", script.display()).into());
        }
    }
    c.model = model;
    c.mmproj = mmproj;
    Ok(())
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
        // Transparent huge pages (the bracketed mode of `always [madvise] never`): memory figures
        // depend on it.
        "transparent_hugepages": std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .ok()
            .and_then(|s| Some(s.split_once('[')?.1.split_once(']')?.0.to_owned())),
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

fn progress_bar(answers: usize) -> ProgressBar {
    let bar = ProgressBar::new(answers as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} answers  {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Print one run's line above the progress bar: `prefix` (round, level), answers, TTFT, RSS.
fn report_run(bar: &ProgressBar, prefix: &str, record: &RunRecord, expected: usize) {
    let ok: Vec<_> = record.answers.iter().filter(|a| a.error.is_none()).collect();
    let from_capture: Vec<f64> = ok.iter().filter_map(|a| a.ttft_from_capture_ms).collect();
    let mut line = format!(
        "{prefix} {:<9}: {}/{} answers in {:.1} s, mean TTFT from capture {}, from question {:.0} ms, load {:.0} ms, \
         peak RSS {} MiB",
        record.config.name(),
        ok.len(),
        expected,
        record.window_ms / 1e3,
        if from_capture.is_empty() {
            "-".into()
        } else {
            format!("{:.0} ms", from_capture.iter().sum::<f64>() / from_capture.len() as f64)
        },
        ok.iter().map(|a| a.ttft_from_question_ms).sum::<f64>() / ok.len().max(1) as f64,
        record.load_ms,
        record.peak_rss_kib / 1024
    );
    if let Some(gpu) = record.peak_gpu_mib {
        line.push_str(&format!(", peak GPU {gpu} MiB"));
    }
    if let Some(f) = record.feed.filter(|f| f.frames > 0) {
        line.push_str(&format!(", feed late {:.0}/{:.0} ms", f.late_mean_ms().unwrap_or(0.0), f.late_max_ms));
        if let Some(fps) = f.encoder_fps() {
            line.push_str(&format!(", encoder {fps:.2} frames/s"));
        }
    }
    if let Some(pct) = record.foreign_cpu_pct.filter(|&p| p >= 5.0) {
        line.push_str(&format!("; other processes used {pct:.0}% of the CPU meanwhile"));
    }
    if let Some(e) = &record.error {
        line.push_str(&format!("; error: {e}"));
    }
    if bar.is_hidden() { eprintln!("{line}") } else { bar.println(line) }
}

/// Where and when a report was measured: commit (with `+dirty`), date, machine.
fn provenance() -> serde_json::Value {
    let commit = git(&["rev-parse", "--short", "HEAD"]).map(|c| {
        let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        if dirty { format!("{c}+dirty") } else { c }
    });
    serde_json::json!({ "commit": commit, "date": date(), "machine": machine() })
}

/// Print the report, write it as JSON (`--json`) and draw its plots (`--plots`) with `draw`.
fn publish(
    c: &CommonArgs,
    mut json: serde_json::Value,
    draw: impl FnOnce(&std::path::Path) -> Result<Vec<PathBuf>, BoxError>,
) -> Result<(), BoxError> {
    if let (Some(map), serde_json::Value::Object(p)) = (json.as_object_mut(), provenance()) {
        for (k, v) in p {
            map.entry(k).or_insert(v);
        }
    }
    println!("{json}");
    if let Some(path) = &c.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        eprintln!("vlm-bench: JSON written to {}", path.display());
    }
    if let Some(dir) = &c.plots {
        match draw(dir) {
            Ok(files) => eprintln!("vlm-bench: plots {files:?}"),
            Err(e) => eprintln!("vlm-bench: no plots: {e}"),
        }
    }
    Ok(())
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
    if let Some(mode) = &a.print_peer_plan {
        let w = workload(&a)?;
        let mode = if mode == "warm" { peer::Mode::Warm } else { peer::Mode::Naive };
        println!("{}", serde_json::to_string_pretty(&peer::plan_json(&w, mode))?);
        return Ok(());
    }
    resolve_pair(&mut a.common)?;
    let w = workload(&a)?;
    let session = Session::new(&a.common, &w, &a.configs, Duration::from_secs(a.timeout_s))?;
    let configs = session.configs.clone();

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
        session.logs.display()
    );
    let bar = progress_bar(a.rounds * configs.len() * w.total_questions());
    let started = Instant::now();
    let mut runs: Vec<RunRecord> = vec![];
    // The server's slots are sized like the runtime's sequences, from the cells a frame fills,
    // which a runtime worker measures: until one has, the server goes last.
    let mut frame_cells = None;
    for round in 0..a.rounds {
        // Rotate the order every round, so each configuration meets each moment of drift.
        let mut order = configs.clone();
        order.rotate_left(round % configs.len());
        if frame_cells.is_none() {
            order.sort_by_key(|c| c.is_peer());
        }
        for config in order {
            bar.set_message(format!("round {}/{}: {} ({})", round + 1, a.rounds, config, config.describe()));
            let w = Workload { frame_cells, ..w.clone() };
            let record = session.run_config(config, &w, round, &format!("round{}", round + 1), None, &bar)?;
            frame_cells = frame_cells.or(record.frame_cells);
            report_run(&bar, &format!("round {}", round + 1), &record, w.total_questions());
            runs.push(record);
        }
    }
    bar.finish_and_clear();

    let summaries: Vec<_> = configs
        .iter()
        .map(|&c| report::summarize(c, &runs.iter().filter(|r| r.config == c).collect::<Vec<_>>(), w.total_questions()))
        .collect();
    let ratios = report::ratios(&summaries);
    println!("{}\n{}", report::CLOCKS, report::table(&summaries));
    let stages = report::stages_markdown(&summaries);
    if stages.lines().count() > 2 {
        println!("Frames from capture to published version, per stream (means):\n{stages}");
    }
    println!("ratios: {ratios}");
    let json = serde_json::json!({
        "benchmark": "vlm-bench",
        "workload": w,
        "rounds": a.rounds,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "peer": session.peer_json(),
        "clocks": report::CLOCKS,
        "decode_split_note": "decode_ingesting/idle come from the engines' step times (one token per active answer \
            per step); llama-server does not expose the split",
        "summaries": summaries,
        "ratios": ratios,
        "markdown_table": report::markdown(&summaries),
        "markdown_frame_stages": report::stages_markdown(&summaries),
        "runs": runs,
    });
    let title = format!("{} streams x {} frames, {} tokens", w.streams, w.frames, w.tokens);
    publish(&a.common, json, |dir| plots::write(dir, &summaries, &runs, &title))?;
    let failed: usize = summaries.iter().map(|s| s.expected - s.answered.min(s.expected)).sum();
    if failed > 0 {
        return Err(format!(
            "{failed} question(s) not answered; see the table and the logs in {}",
            session.logs.display()
        )
        .into());
    }
    Ok(())
}

fn replot(from: &std::path::Path, dir: &std::path::Path) -> Result<(), BoxError> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(from)?)?;
    if json["benchmark"] == capacity::BENCHMARK {
        return capacity::replot(&json, dir);
    }
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
        Some(Cmd::Capacity(args)) => capacity::run(*args),
        Some(Cmd::Encoders(args)) => encoders::run(*args),
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
        assert_eq!(args(&["--configs", "b1,peer-warm"]).configs, vec![Config::B1, Config::PeerWarm]);
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
