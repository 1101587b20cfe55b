//! The benchmark's second level: the seed's workload through a real pipeline of the three
//! elements, side by side with the runtime alone (`vlm-bench --configs B1`, the same engine
//! settings), alternating round by round; the element overhead is the ratio of the two.
//!
//!   cargo build -p vlm-bench && cargo run -p gst-plugin-vlm --example pipeline_bench -- \
//!       --rounds 3 --json docs/benchmarks/pipeline.json
//!
//! Each stream is `videotestsrc is-live=true` at `--fps` (320x240) into its own `vlmencode`
//! (every frame due, `--encoder-threads`, as the runtime benchmark's encoder; `--gate` for the
//! change gate at its defaults), one `vlmcontext` for both streams (its defaults, as B1), and one
//! `vlmquery` per stream (`exact-tokens=true`); when the 2nd, 4th, 6th or 8th frame of a stream is
//! captured (reaches `vlmencode`), a question timed at its capture goes to that `vlmquery`'s
//! `query` pad, which binds it to that frame once the video has passed its time (or to the frame
//! the change gate keeps standing for it), as a user asks about what the camera sees now. Models
//! load in READY (the `load-model` Progress message), before the window, as the runtime
//! benchmark's warm-up does. Throughput is answers over the window (PLAYING to the last answer).
//!
//! Two clocks, as vlm-bench's: the headline TTFT counts from the capture of the question's frame
//! (its running time on the live source), encoding included: the `vlm-answer`'s
//! `ttft-from-capture-ms`. The secondary column counts from the later of the question (its
//! frame's capture) and the registration of the frame it is bound to (a frame leaving
//! `vlmcontext`), as the runtime benchmark asks right after registering. Also per answer the
//! staleness (`picture-age-ms`: the question's time minus the capture of the newest frame in
//! its answer) and per round the feed lateness (a frame leaving `vlmcontext` minus its
//! timestamp) and the encoders' frames/s
//! (`frames-encoded` over `mean-encode-ms`). With `--peer`, llama.cpp's `llama-server` runs as
//! vlm-bench's PEER-WARM (each frame sent as captured) and PEER (naive) in the same vlm-bench run
//! as B1, so the pipeline is compared with the server directly, warm first.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
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
    /// Frames per second of each live source (0.1: one frame every 10 s).
    #[arg(long, default_value_t = 2.0)]
    fps: f64,
    /// Picture size WIDTHxHEIGHT (both levels).
    #[arg(long, default_value = "320x240")]
    frame_size: String,
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
    /// CPU threads of the vision encoder on both levels (vlmencode's `threads`, vlm-bench's
    /// `--encoder cpu:N`).
    #[arg(long, default_value_t = 1)]
    encoder_threads: u32,
    /// vlmencode's change gate at its default (`min-change` unset): an unchanged frame (the
    /// still smpte stream) is neither encoded nor ingested. Off (`min-change=0`, every frame
    /// encoded as the runtime level does) unless given.
    #[arg(long)]
    gate: bool,
    /// Flash attention on both levels and the peers, the engines' and the vision encoder's
    /// alike (vlmcontext's `flash-attention`, vlm-bench's `--flash-attention`, the server's
    /// `-fa`); off unless given, as vlm-bench's.
    #[arg(long)]
    flash_attention: bool,
    /// CPU engines pause answers after their first token while the vision encoder needs the
    /// cores, each once (vlmcontext's `encode-first=true`, vlm-bench's `--encode-first`).
    #[arg(long)]
    encode_first: bool,
    /// The runtime benchmark's binary (default: `vlm-bench` beside this example's folder).
    #[arg(long)]
    vlm_bench: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also run llama-server (vlm-bench's PEER-WARM and PEER; built by
    /// scripts/build-llama-server.sh).
    #[arg(long)]
    peer: bool,
}

/// One round of one level.
#[derive(Debug, Default, Clone)]
struct Round {
    expected: usize,
    /// From the capture of the question's frame to the first token (the headline).
    ttft_from_capture_ms: Vec<f64>,
    /// From the question's arrival (`ask`) to the first token.
    ttft_from_question_ms: Vec<f64>,
    staleness_ms: Vec<f64>,
    wait_ms: Vec<f64>,
    window_ms: f64,
    /// Frames fed, their lateness summed and at most (ms).
    feed: Option<(u64, f64, f64)>,
    /// Frames encoded and the encoders' time (ms).
    encoder: Option<(u64, f64)>,
    /// Frames the change gate held (not encoded, not ingested).
    unchanged: u64,
}

impl Round {
    fn throughput(&self) -> f64 {
        self.ttft_from_question_ms.len() as f64 / (self.window_ms / 1e3)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "expected": self.expected,
            "ttft_from_capture_ms": self.ttft_from_capture_ms,
            "ttft_from_question_ms": self.ttft_from_question_ms,
            "staleness_ms": self.staleness_ms,
            "wait_ms": self.wait_ms,
            "window_ms": self.window_ms,
            "feed_late_mean_ms": self.feed.filter(|f| f.0 > 0).map(|(n, sum, _)| sum / n as f64),
            "feed_late_max_ms": self.feed.filter(|f| f.0 > 0).map(|f| f.2),
            "encoder_fps": self.encoder.filter(|e| e.0 > 0 && e.1 > 0.0).map(|(n, ms)| 1e3 * n as f64 / ms),
            "frames_encoded": self.encoder.map(|e| e.0),
            "frames_unchanged": self.unchanged,
        })
    }
}

/// `fps` as a caps fraction (to the thousandth of a frame per second).
fn framerate(fps: f64) -> String {
    let (mut n, mut d) = ((fps * 1000.0).round() as u64, 1000u64);
    let (mut x, mut y) = (n, d);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    if x > 1 {
        (n, d) = (n / x, d / x);
    }
    format!("{n}/{d}")
}

fn frame_size(a: &Args) -> Result<(u32, u32), BoxError> {
    a.frame_size
        .split_once('x')
        .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)))
        .ok_or_else(|| format!("--frame-size {}: expected WIDTHxHEIGHT", a.frame_size).into())
}

/// What the probes saw: each registered frame's capture and registration (running time, ms) by
/// (stream, number), and the feed's lateness (frames, sum, max).
#[derive(Default)]
struct Seen {
    registered: HashMap<(usize, u64), (f64, f64)>,
    feed: (u64, f64, f64),
}

fn running_ms(t: gst::ClockTime) -> f64 {
    t.nseconds() as f64 / 1e6
}

/// A buffer's timestamp as running time on `pad` (a live source stamps the running time it was
/// captured at).
fn running_time(pad: &gst::Pad, buffer: &gst::BufferRef) -> Option<gst::ClockTime> {
    pad.sticky_event::<gst::event::Segment>(0)
        .and_then(|e| e.segment().downcast_ref::<gst::ClockTime>()?.to_running_time(buffer.pts()?))
}

fn pipeline_round(a: &Args) -> Result<Round, BoxError> {
    let (width, height) = frame_size(a)?;
    let mut description = format!(
        "vlmcontext name=ctx model={} flash-attention={} encode-first={} ",
        a.model, a.flash_attention, a.encode_first
    );
    if let Some(engine) = &a.engine {
        description += &format!("engines={engine} ");
    }
    for (s, pattern) in [(0, "ball"), (1, "smpte")] {
        description += &format!(
            "videotestsrc is-live=true pattern={pattern} num-buffers={} ! video/x-raw,width={width},height={height},framerate={} \
             ! videoconvert ! vlmencode name=enc{s} mmproj={} model={} interval=0 {}threads={} ! ctx.sink_{s} \
             ctx.src_{s} ! vlmquery name=q{s} max-tokens={} exact-tokens=true ! fakesink sync=false async=false \
             appsrc name=qs{s} format=time caps=text/x-raw,format=utf8 ! q{s}.query ",
            a.frames,
            framerate(a.fps),
            a.mmproj,
            a.model,
            if a.gate { "" } else { "min-change=0 " },
            a.encoder_threads,
            a.tokens
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

    let seen = Arc::new(Mutex::new(Seen::default()));
    for s in 0..2 {
        let by_name = |name: String| pipeline.by_name(&name).ok_or(format!("no {name}"));
        let questions = by_name(format!("qs{s}"))?.downcast::<gst_app::AppSrc>().map_err(|_| "not an appsrc")?;
        // The n-th frame captured: its question, timed at its capture, goes to vlmquery's query
        // pad now, as a user asks about what the camera sees now; vlmquery binds it to the frame
        // of that time (or the one standing for it) once the video has passed there.
        let ask_after = a.ask_after.clone();
        let count = std::sync::atomic::AtomicU64::new(0);
        by_name(format!("enc{s}"))?.static_pad("sink").ok_or("no sink pad")?.add_probe(
            gst::PadProbeType::BUFFER,
            move |pad, info| {
                let n = count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                let capture = info.buffer().and_then(|b| running_time(pad, b));
                if let (Some(index), Some(capture)) = (ask_after.iter().position(|&a| a == n), capture) {
                    let mut question = gst::Buffer::from_slice(QUESTIONS[index % QUESTIONS.len()].as_bytes());
                    question.get_mut().expect("new").set_pts(capture);
                    let _ = questions.push_buffer(question);
                }
                gst::PadProbeReturn::Ok
            },
        );
        // Each frame leaving vlmcontext, joined to the history, held or skipped: how late.
        let pipe = pipeline.downgrade();
        let seen = Arc::clone(&seen);
        by_name("ctx".into())?.static_pad(&format!("src_{s}")).ok_or("no src pad")?.add_probe(
            gst::PadProbeType::BUFFER,
            move |pad, info| {
                let Some(buffer) = info.buffer() else { return gst::PadProbeReturn::Ok };
                let Some(meta) = buffer.meta::<VlmFrameMeta>() else { return gst::PadProbeReturn::Ok };
                let capture = running_time(pad, buffer).map(running_ms);
                let now = pipe.upgrade().and_then(|p| p.current_running_time()).map(running_ms);
                let mut seen = seen.lock().expect("no panics hold it");
                if let (Some(capture), Some(now)) = (capture, now) {
                    let late = (now - capture).max(0.0);
                    seen.feed = (seen.feed.0 + 1, seen.feed.1 + late, seen.feed.2.max(late));
                    if let Some((_, number)) = meta.position() {
                        // A held or skipped frame carries the newest joined frame's number: keep
                        // the first.
                        seen.registered.entry((s, number)).or_insert((capture, now));
                    }
                }
                gst::PadProbeReturn::Ok
            },
        );
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
                    let stream = usize::from(msg.src().is_some_and(|q| q.name() == "q1"));
                    // (-1: no clock, or the frame left the element's recent ones.)
                    let from_capture = s.get::<f64>("ttft-from-capture-ms")?;
                    let age = s.get::<f64>("picture-age-ms")?;
                    if from_capture < 0.0 || age < 0.0 {
                        return Err(format!("an answer without its capture clock: {s}").into());
                    }
                    round.ttft_from_capture_ms.push(from_capture);
                    round.wait_ms.push(s.get::<f64>("wait-ms")?);
                    round.window_ms = started.elapsed().as_secs_f64() * 1e3;
                    // The picture's age at the question's time: its capture to the newest frame
                    // in its answer.
                    round.staleness_ms.push(age);
                    // From the question or its frame's registration, whichever came later.
                    let frames = s.get::<u64>("frames")?;
                    let registered = seen.lock().expect("no panics hold it").registered.get(&(stream, frames)).copied();
                    round.ttft_from_question_ms.push(match registered {
                        Some((capture, at)) => from_capture - (at - capture - age).max(0.0),
                        None => from_capture,
                    });
                }
            }
            _ => (),
        }
    }
    let mut encoded = (0u64, 0f64);
    for s in 0..2 {
        if let Some(enc) = pipeline.by_name(&format!("enc{s}")) {
            let n = enc.property_value("frames-encoded").get::<u64>().unwrap_or(0);
            let mean = enc.property::<f64>("mean-encode-ms");
            encoded = (encoded.0 + n, encoded.1 + n as f64 * mean);
            round.unchanged += enc.property_value("frames-unchanged").get::<u64>().unwrap_or(0);
        }
    }
    round.encoder = Some(encoded);
    round.feed = Some(seen.lock().expect("no panics hold it").feed);
    pipeline.set_state(gst::State::Null)?;
    Ok(round)
}

/// The levels of a `vlm-bench` run: the runtime alone, and with `--peer` the warm and naive peers.
const BENCH_LEVELS: [(&str, &str); 3] = [("runtime", "B1"), ("peer-warm", "PEER-WARM"), ("peer", "PEER")];

/// The same workload through the runtime alone: one round of `vlm-bench`, B1 (and the peers with
/// `--peer`), in that order.
fn runtime_round(a: &Args, bench: &PathBuf) -> Result<Vec<Round>, BoxError> {
    let json = std::env::temp_dir().join(format!("vlm-pipeline-bench-{}.json", std::process::id()));
    let asked: Vec<String> = a.ask_after.iter().map(u64::to_string).collect();
    let status = Command::new(bench)
        .args([
            "--configs",
            if a.peer { "B1,PEER-WARM,PEER" } else { "B1" },
            "--rounds",
            "1",
            "--streams",
            "2",
            "--questions",
            &a.ask_after.len().to_string(),
        ])
        .args(["--fps", &a.fps.to_string(), "--frames", &a.frames.to_string(), "--tokens", &a.tokens.to_string()])
        .args(["--frame-size", &a.frame_size])
        .args(["--ask-after", &asked.join(","), "--model", &a.model, "--mmproj", &a.mmproj])
        .args(a.engine.iter().flat_map(|e| ["--engine", e.as_str()]))
        .args(["--encoder", &format!("cpu:{}", a.encoder_threads)])
        .args(a.flash_attention.then_some("--flash-attention"))
        .args(a.encode_first.then_some("--encode-first"))
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
        let values = |key: &str| answered.iter().filter_map(|x| x[key].as_f64()).collect::<Vec<f64>>();
        let feed = &run["feed"];
        Ok(Round {
            expected: 2 * a.ask_after.len(),
            ttft_from_capture_ms: values("ttft_from_capture_ms"),
            ttft_from_question_ms: values("ttft_from_question_ms"),
            staleness_ms: values("staleness_ms"),
            wait_ms: values("wait_ms"),
            window_ms: run["window_ms"].as_f64().ok_or("no window")?,
            feed: feed["frames"]
                .as_u64()
                .map(|n| (n, feed["late_sum_ms"].as_f64().unwrap_or(0.0), feed["late_max_ms"].as_f64().unwrap_or(0.0))),
            encoder: feed["encoded"].as_u64().map(|n| (n, feed["encode_ms"].as_f64().unwrap_or(0.0))),
            unchanged: 0,
        })
    };
    let levels = if a.peer { &BENCH_LEVELS[..] } else { &BENCH_LEVELS[..1] };
    levels.iter().map(|(_, config)| round(config)).collect()
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
    // (vlmencode's vision encoder as the engines: vlm-bench and the server do the same.)
    vlm_runtime::llama::set_projector_flash_attention(Some(a.flash_attention));
    let bench = match &a.vlm_bench {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.parent().and_then(|p| p.parent()).ok_or("no target folder")?.join("vlm-bench"),
    };
    let (mut pipeline, mut runtime, mut peer_warm, mut peer) = (vec![], vec![], vec![], vec![]);
    for r in 0..a.rounds {
        // Alternate which level goes first, so the machine's drift hits both alike.
        for level in if r % 2 == 0 { ["pipeline", "runtime"] } else { ["runtime", "pipeline"] } {
            let rounds = if level == "pipeline" {
                vec![("pipeline", pipeline_round(&a)?)]
            } else {
                BENCH_LEVELS.iter().map(|(name, _)| *name).zip(runtime_round(&a, &bench)?).collect()
            };
            for (level, round) in rounds {
                eprintln!(
                    "round {} {level:9}: {}/{} answers, mean TTFT from capture {:.0} ms, from question {:.0} ms, \
                     {:.3} answers/s",
                    r + 1,
                    round.ttft_from_question_ms.len(),
                    round.expected,
                    mean(&round.ttft_from_capture_ms),
                    mean(&round.ttft_from_question_ms),
                    round.throughput()
                );
                match level {
                    "pipeline" => &mut pipeline,
                    "runtime" => &mut runtime,
                    "peer-warm" => &mut peer_warm,
                    _ => &mut peer,
                }
                .push(round);
            }
        }
    }
    let summary = |rounds: &[Round]| {
        let all = |f: fn(&Round) -> &Vec<f64>| rounds.iter().flat_map(|r| f(r).clone()).collect::<Vec<f64>>();
        let (capture, question) = (all(|r| &r.ttft_from_capture_ms), all(|r| &r.ttft_from_question_ms));
        let (staleness, wait) = (all(|r| &r.staleness_ms), all(|r| &r.wait_ms));
        let feed =
            rounds.iter().filter_map(|r| r.feed).fold((0, 0.0, 0.0), |a, f| (a.0 + f.0, a.1 + f.1, f64::max(a.2, f.2)));
        let encoder = rounds.iter().filter_map(|r| r.encoder).fold((0, 0.0), |a, e| (a.0 + e.0, a.1 + e.1));
        serde_json::json!({
            "answered": question.len(),
            "expected": rounds.iter().map(|r| r.expected).sum::<usize>(),
            "ttft_from_capture_mean_ms": mean(&capture),
            "ttft_from_capture_p50_ms": percentile(&capture, 50.0),
            "ttft_from_capture_p95_ms": percentile(&capture, 95.0),
            "ttft_from_question_mean_ms": mean(&question),
            "ttft_from_question_p50_ms": percentile(&question, 50.0),
            "ttft_from_question_p95_ms": percentile(&question, 95.0),
            "staleness_mean_ms": (!staleness.is_empty()).then(|| mean(&staleness)),
            "staleness_max_ms": staleness.iter().copied().reduce(f64::max),
            "feed_late_mean_ms": (feed.0 > 0).then(|| feed.1 / feed.0 as f64),
            "feed_late_max_ms": (feed.0 > 0).then_some(feed.2),
            "encoder_fps": (encoder.0 > 0 && encoder.1 > 0.0).then(|| 1e3 * encoder.0 as f64 / encoder.1),
            "frames_encoded": encoder.0,
            "frames_unchanged": rounds.iter().map(|r| r.unchanged).sum::<u64>(),
            "wait_mean_ms": (!wait.is_empty()).then(|| mean(&wait)),
            "throughput": mean(&rounds.iter().map(Round::throughput).collect::<Vec<_>>()),
            "ttft_from_capture_mean_rounds": rounds.iter().map(|r| mean(&r.ttft_from_capture_ms)).collect::<Vec<_>>(),
            "ttft_from_question_mean_rounds": rounds.iter().map(|r| mean(&r.ttft_from_question_ms)).collect::<Vec<_>>(),
        })
    };
    let (p, rt, warm, server) = (summary(&pipeline), summary(&runtime), summary(&peer_warm), summary(&peer));
    let over = |a: &serde_json::Value, b: &serde_json::Value, key: &str| {
        a[key].as_f64().unwrap_or(f64::NAN) / b[key].as_f64().unwrap_or(f64::NAN)
    };
    let ratio = |key: &str| over(&p, &rt, key);
    let mut table = String::from(
        "| level | answers | answers/s | TTFT from capture mean | p50 | p95 | TTFT from question mean | p95 | staleness mean | feed lateness mean / max | encoder frames/s | frames encoded / held | wait mean |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut levels = vec![("pipeline (vlmencode ! vlmcontext ! vlmquery)", &p), ("runtime alone (vlm-bench B1)", &rt)];
    if a.peer {
        levels.push(("llama-server, warm client (vlm-bench PEER-WARM)", &warm));
        levels.push(("llama-server, naive client (vlm-bench PEER)", &server));
    }
    let cell =
        |v: &serde_json::Value| v.as_f64().filter(|v| v.is_finite()).map_or("-".into(), |v| format!("{v:.0} ms"));
    for (name, s) in levels {
        table += &format!(
            "| {name} | {}/{} | {:.3} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            s["answered"],
            s["expected"],
            s["throughput"].as_f64().unwrap_or(0.0),
            cell(&s["ttft_from_capture_mean_ms"]),
            cell(&s["ttft_from_capture_p50_ms"]),
            cell(&s["ttft_from_capture_p95_ms"]),
            cell(&s["ttft_from_question_mean_ms"]),
            cell(&s["ttft_from_question_p95_ms"]),
            cell(&s["staleness_mean_ms"]),
            match (s["feed_late_mean_ms"].as_f64(), s["feed_late_max_ms"].as_f64()) {
                (Some(m), Some(x)) => format!("{m:.0} / {x:.0} ms"),
                _ => "-".into(),
            },
            s["encoder_fps"].as_f64().map_or("-".into(), |v| format!("{v:.2}")),
            match (s["frames_encoded"].as_u64(), s["frames_unchanged"].as_u64()) {
                (Some(e), Some(u)) => format!("{e} / {u}"),
                _ => "-".into(),
            },
            cell(&s["wait_mean_ms"]),
        );
    }
    println!("{table}");
    println!(
        "element overhead: TTFT from capture pipeline / runtime {:.2}, throughput pipeline / runtime {:.2}",
        ratio("ttft_from_capture_mean_ms"),
        ratio("throughput")
    );
    if a.peer {
        println!(
            "pipeline / llama-server (TTFT from capture): warm client {:.2}, naive client {:.2}; throughput {:.2} / {:.2}",
            over(&p, &warm, "ttft_from_capture_mean_ms"),
            over(&p, &server, "ttft_from_capture_mean_ms"),
            over(&p, &warm, "throughput"),
            over(&p, &server, "throughput")
        );
    }
    let report = serde_json::json!({
        "benchmark": "pipeline-bench",
        "date": std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]).output().ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()),
        "workload": { "streams": 2, "fps": a.fps, "frames": a.frames, "ask_after": a.ask_after, "tokens": a.tokens,
                      "frame_size": a.frame_size, "model": a.model, "mmproj": a.mmproj, "rounds": a.rounds,
                      "gate": a.gate },
        "clocks": "ttft_from_capture: from the question's frame's timestamp (running time on the live source) to \
            the first token, encoding included (the headline); ttft_from_question: from the later of the \
            question and its bound frame's registration (pipeline), the registration (runtime) or the frame's due time \
            (peers)",
        "pipeline": p, "runtime": rt, "peer_warm": a.peer.then_some(&warm), "peer": a.peer.then_some(&server),
        "ratios": { "ttft_from_capture_mean": ratio("ttft_from_capture_mean_ms"),
                    "ttft_from_question_mean": ratio("ttft_from_question_mean_ms"),
                    "throughput": ratio("throughput"),
                    "pipeline_over_peer_warm_ttft_from_capture_mean":
                        a.peer.then(|| over(&p, &warm, "ttft_from_capture_mean_ms")),
                    "pipeline_over_peer_ttft_from_capture_mean":
                        a.peer.then(|| over(&p, &server, "ttft_from_capture_mean_ms")),
                    "pipeline_over_peer_warm_throughput": a.peer.then(|| over(&p, &warm, "throughput")),
                    "pipeline_over_peer_throughput": a.peer.then(|| over(&p, &server, "throughput")) },
        "rounds": { "pipeline": pipeline.iter().map(Round::json).collect::<Vec<_>>(),
                    "runtime": runtime.iter().map(Round::json).collect::<Vec<_>>(),
                    "peer_warm": peer_warm.iter().map(Round::json).collect::<Vec<_>>(),
                    "peer": peer.iter().map(Round::json).collect::<Vec<_>>() },
        "markdown_table": table,
    });
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    println!("{report}");
    let short = pipeline
        .iter()
        .chain(&runtime)
        .chain(&peer_warm)
        .chain(&peer)
        .any(|r| r.ttft_from_question_ms.len() < r.expected);
    if short {
        return Err("some questions were not answered".into());
    }
    Ok(())
}
