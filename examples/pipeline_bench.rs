//! The benchmark's second level: the seed's workload through a real pipeline of the three
//! elements, side by side with the runtime alone (`vlm-bench --configs B1`, the same engine
//! settings), alternating round by round; the element overhead is the ratio of the two.
//!
//!   cargo build -p vlm-bench && cargo run -p gst-plugin-vlm --example pipeline_bench -- \
//!       --rounds 3 --json docs/benchmarks/pipeline.json
//!
//! Each stream is `videotestsrc is-live=true` at `--fps` (320x240) into its own `vlmencode`
//! (every frame encoded, one thread, as the runtime benchmark's encoder), one `vlmcontext` for both streams (its defaults, as B1), and one
//! `vlmquery` per stream (`exact-tokens=true`); when the 2nd, 4th, 6th or 8th frame of a stream
//! leaves `vlmcontext`, the question is asked there with `ask`, as the runtime benchmark asks
//! right after registering that frame. Models load in READY (the `load-model` Progress message), before
//! the window, as the runtime benchmark's warm-up does. TTFT and wait come from each `vlm-answer`
//! (measured from the `ask`); throughput is answers over the window (PLAYING to the last answer).
//! With `--peer`, llama.cpp's `llama-server` (vlm-bench's PEER configuration, in the same
//! vlm-bench run as B1) is a third level, so the pipeline is compared with the server directly.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use gst::prelude::*;
use gst_vlm_elements::meta::VlmFrameMeta;

type BoxError = Box<dyn std::error::Error>;

const QUESTIONS: [&str; 4] = [
    "What do you see in the video?",
    "Is the ball moving?",
    "Describe the scene in one sentence.",
    "What changed since the previous frames?",
];

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 2)]
    fps: u32,
    #[arg(long, default_value_t = 8)]
    frames: u32,
    #[arg(long, value_delimiter = ',', default_value = "2,4,6,8")]
    ask_after: Vec<u64>,
    #[arg(long, default_value_t = 128)]
    tokens: u32,
    #[arg(long, env = "VLM_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: String,
    #[arg(long, env = "VLM_MMPROJ", default_value = "models/test-mmproj-mlp.gguf")]
    mmproj: String,
    /// The one language engine of both levels (vlmcontext's `engines`, vlm-bench's `--engine`),
    /// e.g. `gpu:gpu:16`; default: a CPU engine with every core.
    #[arg(long)]
    engine: Option<String>,
    /// The runtime benchmark's binary (default: `vlm-bench` beside this example's folder).
    #[arg(long)]
    vlm_bench: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also run llama-server (vlm-bench's PEER; built by scripts/build-llama-server.sh).
    #[arg(long)]
    peer: bool,
}

/// One round of one level.
#[derive(Debug, Default, Clone)]
struct Round {
    expected: usize,
    ttft_ms: Vec<f64>,
    wait_ms: Vec<f64>,
    window_ms: f64,
}

impl Round {
    fn throughput(&self) -> f64 {
        self.ttft_ms.len() as f64 / (self.window_ms / 1e3)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "expected": self.expected, "ttft_ms": self.ttft_ms, "wait_ms": self.wait_ms, "window_ms": self.window_ms })
    }
}

fn pipeline_round(a: &Args) -> Result<Round, BoxError> {
    let mut description = format!("vlmcontext name=ctx model={} ", a.model);
    if let Some(engine) = &a.engine {
        description += &format!("engines={engine} ");
    }
    for (s, pattern) in [(0, "ball"), (1, "smpte")] {
        description += &format!(
            "videotestsrc is-live=true pattern={pattern} num-buffers={} ! video/x-raw,width=320,height=240,framerate={}/1 \
             ! videoconvert ! vlmencode mmproj={} model={} interval=0 threads=1 ! ctx.sink_{s} \
             ctx.src_{s} ! vlmquery name=q{s} max-tokens={} exact-tokens=true ! fakesink sync=false async=false ",
            a.frames, a.fps, a.mmproj, a.model, a.tokens
        );
    }
    let pipeline = gst::parse::launch(&description)?.downcast::<gst::Pipeline>().map_err(|_| "not a pipeline")?;
    let bus = pipeline.bus().ok_or("no bus")?;
    // Load in READY, outside the window.
    pipeline.set_state(gst::State::Ready)?;
    let loaded = bus.iter_timed(gst::ClockTime::from_seconds(120)).find_map(|m| match m.view() {
        gst::MessageView::Progress(p) if p.get().0 == gst::ProgressType::Complete => Some(Ok(())),
        gst::MessageView::Progress(p) if p.get().0 == gst::ProgressType::Error => Some(Err(p.get().2.to_string())),
        gst::MessageView::Error(e) => Some(Err(e.error().to_string())),
        _ => None,
    });
    loaded.ok_or("the model did not load within 120 s")??;

    for s in 0..2 {
        let q = pipeline.by_name(&format!("q{s}")).ok_or("no vlmquery")?;
        let ask_after = a.ask_after.clone();
        let src =
            pipeline.by_name("ctx").ok_or("no vlmcontext")?.static_pad(&format!("src_{s}")).ok_or("no src pad")?;
        // The n-th frame leaving vlmcontext, joined to the history or skipped by the overload
        // policy (then the question binds to the newest frame that joined), as the runtime
        // benchmark counts registrations.
        let seen = std::sync::atomic::AtomicU64::new(0);
        src.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
            if info.buffer().and_then(|b| b.meta::<VlmFrameMeta>()).is_none() {
                return gst::PadProbeReturn::Ok;
            }
            let n = seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if let Some(index) = ask_after.iter().position(|&a| a == n) {
                q.emit_by_name::<Option<String>>("ask", &[&QUESTIONS[index % QUESTIONS.len()]]);
            }
            gst::PadProbeReturn::Ok
        });
    }
    let started = Instant::now();
    pipeline.set_state(gst::State::Playing)?;
    let mut round = Round { expected: 2 * a.ask_after.len(), ..Round::default() };
    for msg in bus.iter_timed(gst::ClockTime::from_seconds(300)) {
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => {
                pipeline.set_state(gst::State::Null)?;
                return Err(format!("{} ({:?})", e.error(), e.debug()).into());
            }
            gst::MessageView::Element(e) => {
                if let Some(s) = e.structure().filter(|s| s.name() == "vlm-answer")
                    && s.get::<String>("status")? == "answered"
                {
                    round.ttft_ms.push(s.get::<f64>("ttft-ms")?);
                    round.wait_ms.push(s.get::<f64>("wait-ms")?);
                    round.window_ms = started.elapsed().as_secs_f64() * 1e3;
                }
            }
            _ => (),
        }
    }
    pipeline.set_state(gst::State::Null)?;
    Ok(round)
}

/// The same workload through the runtime alone: one round of `vlm-bench`, B1 (and the peer with
/// `--peer`), in that order.
fn runtime_round(a: &Args, bench: &PathBuf) -> Result<Vec<Round>, BoxError> {
    let json = std::env::temp_dir().join(format!("vlm-pipeline-bench-{}.json", std::process::id()));
    let asked: Vec<String> = a.ask_after.iter().map(u64::to_string).collect();
    let status = Command::new(bench)
        .args([
            "--configs",
            if a.peer { "B1,PEER" } else { "B1" },
            "--rounds",
            "1",
            "--streams",
            "2",
            "--questions",
            &a.ask_after.len().to_string(),
        ])
        .args(["--fps", &a.fps.to_string(), "--frames", &a.frames.to_string(), "--tokens", &a.tokens.to_string()])
        .args(["--ask-after", &asked.join(","), "--model", &a.model, "--mmproj", &a.mmproj])
        .args(a.engine.iter().flat_map(|e| ["--engine", e.as_str()]))
        .arg("--json")
        .arg(&json)
        .stdout(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        return Err(format!("{} failed: {status}", bench.display()).into());
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json)?)?;
    let _ = std::fs::remove_file(&json);
    let round = |config: &str| -> Result<Round, BoxError> {
        let runs = report["runs"].as_array().ok_or("no runs")?;
        let run = runs.iter().find(|r| r["config"] == config).ok_or_else(|| format!("no {config} run"))?;
        let answered: Vec<&serde_json::Value> =
            run["answers"].as_array().ok_or("no answers")?.iter().filter(|x| x["error"].is_null()).collect();
        Ok(Round {
            expected: 2 * a.ask_after.len(),
            ttft_ms: answered.iter().filter_map(|x| x["ttft_ms"].as_f64()).collect(),
            wait_ms: answered.iter().filter_map(|x| x["wait_ms"].as_f64()).collect(),
            window_ms: run["window_ms"].as_f64().ok_or("no window")?,
        })
    };
    if a.peer { Ok(vec![round("B1")?, round("PEER")?]) } else { Ok(vec![round("B1")?]) }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Nearest-rank percentile, as `vlm-bench` reports them.
fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(((p / 100.0 * v.len() as f64).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN)
}

fn main() -> Result<(), BoxError> {
    let a = Args::parse();
    gst::init()?;
    gstvlm::plugin_register_static()?;
    let bench = match &a.vlm_bench {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.parent().and_then(|p| p.parent()).ok_or("no target folder")?.join("vlm-bench"),
    };
    let (mut pipeline, mut runtime, mut peer) = (vec![], vec![], vec![]);
    for r in 0..a.rounds {
        // Alternate which level goes first, so the machine's drift hits both alike.
        for level in if r % 2 == 0 { ["pipeline", "runtime"] } else { ["runtime", "pipeline"] } {
            let rounds = if level == "pipeline" {
                vec![("pipeline", pipeline_round(&a)?)]
            } else {
                ["runtime", "peer"].into_iter().zip(runtime_round(&a, &bench)?).collect()
            };
            for (level, round) in rounds {
                eprintln!(
                    "round {} {level:8}: {}/{} answers, mean TTFT {:.0} ms, {:.3} answers/s",
                    r + 1,
                    round.ttft_ms.len(),
                    round.expected,
                    mean(&round.ttft_ms),
                    round.throughput()
                );
                match level {
                    "pipeline" => &mut pipeline,
                    "runtime" => &mut runtime,
                    _ => &mut peer,
                }
                .push(round);
            }
        }
    }
    let summary = |rounds: &[Round]| {
        let ttft: Vec<f64> = rounds.iter().flat_map(|r| r.ttft_ms.clone()).collect();
        let wait: Vec<f64> = rounds.iter().flat_map(|r| r.wait_ms.clone()).collect();
        serde_json::json!({
            "answered": ttft.len(),
            "expected": rounds.iter().map(|r| r.expected).sum::<usize>(),
            "ttft_mean_ms": mean(&ttft),
            "ttft_p50_ms": percentile(&ttft, 50.0),
            "ttft_p95_ms": percentile(&ttft, 95.0),
            "wait_mean_ms": (!wait.is_empty()).then(|| mean(&wait)),
            "throughput": mean(&rounds.iter().map(Round::throughput).collect::<Vec<_>>()),
            "ttft_mean_rounds": rounds.iter().map(|r| mean(&r.ttft_ms)).collect::<Vec<_>>(),
        })
    };
    let (p, rt, server) = (summary(&pipeline), summary(&runtime), summary(&peer));
    let over = |a: &serde_json::Value, b: &serde_json::Value, key: &str| {
        a[key].as_f64().unwrap_or(f64::NAN) / b[key].as_f64().unwrap_or(f64::NAN)
    };
    let ratio = |key: &str| over(&p, &rt, key);
    let mut table = String::from(
        "| level | answers | answers/s | TTFT mean | p50 | p95 | wait mean |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut levels = vec![("pipeline (vlmencode ! vlmcontext ! vlmquery)", &p), ("runtime alone (vlm-bench B1)", &rt)];
    if a.peer {
        levels.push(("llama-server (vlm-bench PEER)", &server));
    }
    for (name, s) in levels {
        table += &format!(
            "| {name} | {}/{} | {:.3} | {:.0} ms | {:.0} ms | {:.0} ms | {} |\n",
            s["answered"],
            s["expected"],
            s["throughput"].as_f64().unwrap_or(0.0),
            s["ttft_mean_ms"].as_f64().unwrap_or(0.0),
            s["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            s["ttft_p95_ms"].as_f64().unwrap_or(0.0),
            s["wait_mean_ms"].as_f64().map_or("-".into(), |w| format!("{w:.0} ms"))
        );
    }
    println!("{table}");
    println!(
        "element overhead: TTFT pipeline / runtime {:.2}, throughput pipeline / runtime {:.2}",
        ratio("ttft_mean_ms"),
        ratio("throughput")
    );
    if a.peer {
        println!(
            "pipeline / llama-server: TTFT {:.2}, throughput {:.2}",
            over(&p, &server, "ttft_mean_ms"),
            over(&p, &server, "throughput")
        );
    }
    let report = serde_json::json!({
        "benchmark": "pipeline-bench",
        "date": std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]).output().ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()),
        "workload": { "streams": 2, "fps": a.fps, "frames": a.frames, "ask_after": a.ask_after, "tokens": a.tokens,
                      "model": a.model, "mmproj": a.mmproj, "rounds": a.rounds },
        "pipeline": p, "runtime": rt, "peer": a.peer.then_some(&server),
        "ratios": { "ttft_mean": ratio("ttft_mean_ms"), "throughput": ratio("throughput"),
                    "pipeline_over_peer_ttft_mean": a.peer.then(|| over(&p, &server, "ttft_mean_ms")),
                    "pipeline_over_peer_throughput": a.peer.then(|| over(&p, &server, "throughput")) },
        "rounds": { "pipeline": pipeline.iter().map(Round::json).collect::<Vec<_>>(),
                    "runtime": runtime.iter().map(Round::json).collect::<Vec<_>>(),
                    "peer": peer.iter().map(Round::json).collect::<Vec<_>>() },
        "markdown_table": table,
    });
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    println!("{report}");
    let short = pipeline.iter().chain(&runtime).chain(&peer).any(|r| r.ttft_ms.len() < r.expected);
    if short {
        return Err("some questions were not answered".into());
    }
    Ok(())
}
