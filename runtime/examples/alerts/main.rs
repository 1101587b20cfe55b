//! Benchmark of standing questions (issue 30, item 4): latency from a frame's capture to the end
//! of its alert evaluations (p50/p95) and evaluations per second, for streams x alerts at a
//! frame rate, through the runtime alone (no GStreamer): what `vlmquery alerts` runs.
//!
//!   cargo run --release -p vlm-runtime --example alerts -- [--streams 1,2] [--alerts 1,4] [--fps 1] [--frames 10] [--peer] [--gpu] [--engines N] [--json FILE]
//!
//! Each stream has a capture thread: at each due time (its clock: the capture) it encodes a new
//! picture (libmtmd; on the GPU with `--gpu`) and registers it (overload `skip`: the history never
//! falls behind, skipped frames are counted), then puts the frame in the stream's one evaluation
//! slot; an evaluator thread per stream takes the newest frame (an older one still in the slot is
//! thinned, counted), waits for its version and evaluates every alert on it (`alert::evaluate`:
//! one forced choice each, all queued at once). An alert's latency is capture to its choice, encode,
//! ingestion and queueing included; a frame's ("all") is capture to the last of its alerts'
//! choices (the runtime decides a frame's alerts in one decode, the server one request after
//! another, so the first server choices come sooner and the last later). With `--peer`, the same streams, frames and alerts through
//! llama-server after each level (`peer.rs`: its strongest client, one slot a stream, prompt
//! cache), on the same clock. Prints a table and one JSON object.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use clap::Parser;
use parking_lot::{Condvar, Mutex};

#[path = "../common/mod.rs"]
mod common;
mod peer;
use vlm_runtime::alert::{self, AlertSpec, YesNo};
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Device, Engine, EngineConfig, Gpu, KvLayout, Overload, Stream, StreamConfig, models};

#[derive(Parser)]
struct Args {
    /// Stream counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    streams: Vec<usize>,
    /// Alert counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    alerts: Vec<usize>,
    /// Frames per second of each stream.
    #[arg(long, default_value_t = 1.0)]
    fps: f64,
    /// Frames per stream.
    #[arg(long, default_value_t = 10)]
    frames: usize,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Run each level through llama-server too (`VLM_LLAMA_SERVER`, else the build script's).
    #[arg(long)]
    peer: bool,
    /// A KV sequence per stream and answer, without flash attention (default: what
    /// `vlmcontext` runs, the unified pool with flash attention; the server gets the same
    /// flash attention).
    #[arg(long)]
    per_sequence: bool,
    /// The engine, the encoder (4 contexts) and the server (`-ngl 99`) on the GPU, a KV sequence
    /// per stream and answer with flash attention (what `vlmcontext` runs on a GPU).
    #[arg(long)]
    gpu: bool,
    /// Language engines (each a copy of the context on the same device, as `vlmcontext
    /// engines=g0:gpu,g1:gpu`); streams are dealt out to them in turn.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    engines: u32,
    /// libmtmd encoder contexts (0: automatic, as `vlmencode` chooses: on the GPU 2, growing to 4
    /// with the load; 1 on the CPU).
    #[arg(long, default_value_t = 0)]
    encoder_contexts: usize,
    /// The engines' `ingest_share` (the engine's default otherwise).
    #[arg(long, default_value_t = vlm_runtime::engine::DEFAULT_INGEST_SHARE)]
    ingest_share: f64,
    /// Threads resizing each picture of a tiled (SmolVLM) projector before libmtmd (0: libmtmd
    /// resizes it on the encode's thread; default: up to 4).
    #[arg(long)]
    prepare_threads: Option<usize>,
    #[command(flatten)]
    files: common::ModelArgs,
}

const QUESTIONS: [&str; 8] = [
    "Is there a person in the picture?",
    "Is the door open?",
    "Is there a vehicle in the picture?",
    "Is the picture dark?",
    "Is there smoke or fire?",
    "Is anyone lying on the floor?",
    "Is there an animal in the picture?",
    "Is the scene crowded?",
];

fn picture(variant: usize) -> Vec<u8> {
    (0..64 * 48).flat_map(|i| [(i % 64 * 4) as u8, (i / 64 * 5) as u8, ((i / 8 + variant * 3) % 256) as u8]).collect()
}

/// One stream's evaluation slot: the newest frame (number, capture, encode ms) not yet taken,
/// or the end.
#[derive(Default)]
struct Slot {
    next: Option<(u64, Instant, f64)>,
    ended: bool,
    thinned: u64,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

/// One measured level: print its row and add it to `rows`.
struct Level<'a> {
    config: &'a str,
    streams: usize,
    alerts: usize,
    latencies: Vec<f64>,
    /// Capture to the last of a frame's alerts decided, per evaluated frame.
    frames_decided: Vec<f64>,
    thinned: u64,
    skipped: u64,
    wall_s: f64,
    /// Where a frame's time went (runtime only): (encode, capture to version, version to the
    /// last choice) per evaluated frame, ms.
    stages: Vec<[f64; 3]>,
}

fn report(args: &Args, level: Level, rows: &mut Vec<serde_json::Value>) {
    let Level { config, streams, alerts, mut latencies, mut frames_decided, thinned, skipped, wall_s, stages } = level;
    let evaluations = latencies.len();
    let (p50, p95) = (percentile(&mut latencies, 0.5), percentile(&mut latencies, 0.95));
    let (all50, all95) = (percentile(&mut frames_decided, 0.5), percentile(&mut frames_decided, 0.95));
    let rate = evaluations as f64 / wall_s;
    println!(
        "{config:>12} {streams:>7} {alerts:>6} {:>5} {evaluations:>8} {rate:>9.1} {p50:>8.1} {p95:>8.1} {all50:>8.1} {all95:>8.1} {thinned:>8} {skipped:>8}",
        args.fps
    );
    rows.push(serde_json::json!({
        "config": config, "streams": streams, "alerts": alerts, "fps": args.fps, "frames_per_stream": args.frames,
        "evaluations": evaluations, "evaluations_per_s": rate, "p50_ms": p50, "p95_ms": p95,
        "frame_decided_p50_ms": all50, "frame_decided_p95_ms": all95,
        "thinned": thinned, "skipped": skipped, "all_evaluated": thinned == 0 && skipped == 0,
        "latency_ms": latencies,
    }));
    if !stages.is_empty() {
        let mean = |k: usize| stages.iter().map(|s| s[k]).sum::<f64>() / stages.len() as f64;
        let (encode, ready, choices) = (mean(0), mean(1), mean(2));
        println!(
            "{:>12} mean of {} frames: encode {encode:.0} ms, capture to version {ready:.0} ms, version to last choice {choices:.0} ms",
            "",
            stages.len()
        );
        rows.last_mut().unwrap()["stages_mean_ms"] =
            serde_json::json!({"encode": encode, "capture_to_version": ready, "version_to_last_choice": choices});
    }
}

/// The peer's level: each stream a thread that, at each due time, adds the frame's picture and
/// sends every alert on the stream's slot, one after the other; a frame whose successor is
/// already due when its turn comes is thinned (its picture goes with the next one's alerts), as
/// the runtime thins.
fn peer_level(args: &Args, server: &peer::Server, n_streams: usize, specs: &[AlertSpec]) -> Level<'static> {
    let latencies = Mutex::new(Vec::<f64>::new());
    let frames_decided = Mutex::new(Vec::<f64>::new());
    let thinned = std::sync::atomic::AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for s in 0..n_streams {
            let (latencies, frames_decided, thinned) = (&latencies, &frames_decided, &thinned);
            scope.spawn(move || {
                let period = Duration::from_secs_f64(1.0 / args.fps);
                let first = Instant::now() + period.mul_f64(s as f64 / n_streams as f64);
                let mut images = vec![];
                for f in 0..args.frames {
                    let due = first + period * f as u32;
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    images.push(peer::png_url(&picture(f + 100 * s), 64, 48).expect("a PNG"));
                    if f + 1 < args.frames && Instant::now() >= due + period {
                        thinned.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        continue;
                    }
                    for spec in specs {
                        server.evaluate(&images, &alert::alert_prompt(&spec.question), s).expect("llama-server");
                        latencies.lock().push(due.elapsed().as_secs_f64() * 1e3);
                    }
                    frames_decided.lock().push(due.elapsed().as_secs_f64() * 1e3);
                }
            });
        }
    });
    let thinned = thinned.into_inner();
    Level {
        config: "llama-server",
        streams: n_streams,
        alerts: specs.len(),
        latencies: latencies.into_inner(),
        frames_decided: frames_decided.into_inner(),
        thinned,
        skipped: 0,
        wall_s: started.elapsed().as_secs_f64(),
        stages: vec![],
    }
}

fn specs(n_alerts: usize) -> Vec<AlertSpec> {
    (0..n_alerts).map(|i| AlertSpec { id: format!("a{i}"), question: QUESTIONS[i % QUESTIONS.len()].into() }).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as i32);
    let device = if args.gpu { Device::Gpu(Gpu { index: 0, layers: None }) } else { Device::Cpu };
    let model = models::model(&args.files.model, &device)?;
    let contexts = vlm_runtime::encoder::encoder_contexts(args.encoder_contexts, args.gpu);
    let projector = models::projector(&args.files.mmproj, &model, args.gpu, threads, contexts)?;
    if let Some(n) = args.prepare_threads {
        projector.set_prepare_threads(n);
    }
    let resized_before_libmtmd = projector.resizes_pictures();
    let encoder = Arc::new(match args.encoder_contexts {
        0 => MtmdEncoder::for_stream(projector, threads),
        _ => MtmdEncoder::new(projector),
    });
    // The engines' threads as vlmcontext gives them.
    let engine_threads = vlm_runtime::engine::default_threads(&device, threads);
    let per_sequence = args.per_sequence || args.gpu;
    let flash_attention = args.gpu || !args.per_sequence;
    let server_binary = match args.peer {
        true => Some(
            peer::find_server().ok_or("no llama-server: run scripts/build-llama-server.sh or set VLM_LLAMA_SERVER")?,
        ),
        false => None,
    };
    // Each sequence (and the server's slot) holds the prompt, every frame and the answer reserve.
    let frame_cells = encoder.encode(&Picture::packed(&picture(0), 64, 48, 192, PixelLayout::Rgb))?.cells() as u32;
    let cells = (96 + frame_cells * args.frames as u32 + 256).next_power_of_two();
    let (mut rows, mut engine_time) = (vec![], vec![]);
    println!(
        "{:>12} {:>7} {:>6} {:>5} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "config",
        "streams",
        "alerts",
        "fps",
        "evals",
        "evals/s",
        "p50 ms",
        "p95 ms",
        "all p50",
        "all p95",
        "thinned",
        "skipped"
    );
    for &n_streams in &args.streams {
        let n_engines = args.engines as usize;
        let engines = (0..n_engines)
            .map(|i| {
                Engine::start(
                    &args.files.model,
                    EngineConfig {
                        name: format!("{}{i}", if args.gpu { "g" } else { "c" }),
                        context_per_sequence: cells,
                        // (A run's streams are opened anew for each alert count.)
                        max_streams: (n_streams.div_ceil(n_engines) * args.alerts.len()) as u32,
                        max_branches: 8,
                        threads: engine_threads,
                        device: device.clone(),
                        kv_layout: if per_sequence { KvLayout::PerSequence } else { KvLayout::Unified },
                        flash_attention,
                        ingest_share: args.ingest_share,
                        ..EngineConfig::default()
                    },
                )
            })
            .collect::<vlm_runtime::Result<Vec<_>>>()?;
        let yes_no = YesNo::find(engines[0].model())?;
        let prompt = Arc::new(Prompt::new(engines[0].model(), DEFAULT_SYSTEM_PROMPT)?);
        for &n_alerts in &args.alerts {
            let specs: Arc<Vec<AlertSpec>> = Arc::new(specs(n_alerts));
            let latencies = Arc::new(Mutex::new(Vec::<f64>::new()));
            let stages = Arc::new(Mutex::new(Vec::<[f64; 3]>::new()));
            let mut skipped = 0;
            let mut thinned = 0;
            let started = Instant::now();
            std::thread::scope(|scope| -> Result<(), Box<dyn std::error::Error>> {
                let mut handles = vec![];
                for s in 0..n_streams {
                    let config = StreamConfig {
                        max_pending: 2,
                        overload: Overload::Skip,
                        answer_reserve: 96,
                        ..StreamConfig::new(&format!("s{s}"))
                    };
                    let stream: Arc<Stream> = Stream::open(&engines[s % n_engines], Arc::clone(&prompt), config)?;
                    let slot = Arc::new((Mutex::new(Slot::default()), Condvar::new()));
                    let (encoder, frames, fps) = (Arc::clone(&encoder), args.frames, args.fps);
                    let (st, sl) = (Arc::clone(&stream), Arc::clone(&slot));
                    // Capture: due times at the frame rate (streams offset within a period).
                    let capture = scope.spawn(move || -> vlm_runtime::Result<()> {
                        let never = AtomicBool::new(false);
                        let period = Duration::from_secs_f64(1.0 / fps);
                        let first = Instant::now() + period.mul_f64(s as f64 / n_streams as f64);
                        for f in 0..frames {
                            let due = first + period * f as u32;
                            std::thread::sleep(due.saturating_duration_since(Instant::now()));
                            let rgb = picture(f + 100 * s);
                            let frame =
                                Arc::new(encoder.encode(&Picture::packed(&rgb, 64, 48, 192, PixelLayout::Rgb))?);
                            let encode_ms = due.elapsed().as_secs_f64() * 1e3;
                            let r = st.register(frame, &never)?;
                            if !r.skipped {
                                let mut slot = sl.0.lock();
                                if slot.next.replace((r.number, due, encode_ms)).is_some() {
                                    slot.thinned += 1;
                                }
                                sl.1.notify_all();
                            }
                        }
                        sl.0.lock().ended = true;
                        sl.1.notify_all();
                        Ok(())
                    });
                    let (specs, latencies, stages, st, sl) = (
                        Arc::clone(&specs),
                        Arc::clone(&latencies),
                        Arc::clone(&stages),
                        Arc::clone(&stream),
                        Arc::clone(&slot),
                    );
                    let evaluator = scope.spawn(move || -> vlm_runtime::Result<()> {
                        let never = Arc::new(AtomicBool::new(false));
                        // Every new version is read, as `vlmquery alerts` reads them.
                        let _watch = st.watch();
                        loop {
                            let (number, due, encode_ms) = {
                                let mut slot = sl.0.lock();
                                loop {
                                    if let Some(next) = slot.next.take() {
                                        break next;
                                    }
                                    if slot.ended {
                                        return Ok(());
                                    }
                                    sl.1.wait(&mut slot);
                                }
                            };
                            let version = st.wait_version(number, &never)?;
                            let submitted = due.elapsed().as_secs_f64() * 1e3;
                            let mut last = 0f64;
                            for e in alert::evaluate(&version, &specs, yes_no, &never)? {
                                let total_ms = e?.total_ms;
                                latencies.lock().push(submitted + total_ms);
                                last = last.max(total_ms);
                            }
                            stages.lock().push([encode_ms, submitted, last]);
                        }
                    });
                    handles.push((stream, slot, capture, evaluator));
                }
                for (stream, slot, capture, evaluator) in handles {
                    capture.join().expect("capture thread")?;
                    evaluator.join().expect("evaluator thread")?;
                    skipped += stream.skipped();
                    thinned += slot.0.lock().thinned;
                    stream.close();
                }
                Ok(())
            })?;
            let wall_s = started.elapsed().as_secs_f64();
            let (latencies, stages) = (latencies.lock().clone(), stages.lock().clone());
            let frames_decided = stages.iter().map(|s| s[1] + s[2]).collect();
            let level = Level {
                config: "runtime",
                streams: n_streams,
                alerts: n_alerts,
                latencies,
                frames_decided,
                thinned,
                skipped,
                wall_s,
                stages,
            };
            report(&args, level, &mut rows);
        }
        for engine in &engines {
            let (t, rates) = (engine.time_split(), engine.rates());
            println!(
                "{:>12} engine {}: decode {:.0} ms, starts {:.0}, ingestion {:.0} ({:.0} inputs/s), jobs {:.0}, idle {:.0}, other {:.0} of {:.0} ms; prefill {:.3} ms an input",
                "",
                engine.name(),
                t.decode_ms,
                t.start_ms,
                t.ingest_ms,
                t.ingest_inputs_per_s(),
                t.jobs_ms,
                t.idle_ms,
                t.other_ms(),
                t.wall_ms,
                rates.prefill_ms_per_token
            );
            engine_time.push(serde_json::json!({
                "streams": n_streams, "engine": engine.name(), "wall_ms": t.wall_ms, "decode_ms": t.decode_ms,
                "start_ms": t.start_ms, "ingest_ms": t.ingest_ms, "ingest_inputs": t.ingest_inputs, "jobs_ms": t.jobs_ms,
                "idle_ms": t.idle_ms, "other_ms": t.other_ms(), "prefill_ms_per_input": rates.prefill_ms_per_token,
            }));
            engine.stop();
        }
        if let Some(binary) = &server_binary {
            let server = peer::start(&peer::Settings {
                server: binary,
                model: &args.files.model,
                mmproj: &args.files.mmproj,
                slots: n_streams,
                cells_per_slot: cells,
                threads,
                flash_attention,
                gpu: args.gpu,
            })
            .map_err(|e| e.to_string())?;
            // A first request builds the server's graphs, as the engine's calibration does.
            server.evaluate(&[], "Hello.", 0).map_err(|e| e.to_string())?;
            for &n_alerts in &args.alerts {
                let level = peer_level(&args, &server, n_streams, &specs(n_alerts));
                report(&args, level, &mut rows);
            }
        }
    }
    let json = serde_json::json!({
        "benchmark": "alerts-capture-to-choice", "clock": "capture (the frame's due time), encode included",
        "peer": server_binary.map(|p| p.display().to_string()),
        "kv_layout": if per_sequence { "per-sequence" } else { "unified" }, "flash_attention": flash_attention,
        "device": if args.gpu { "gpu" } else { "cpu" }, "engines": args.engines, "encoder_contexts": encoder.contexts(),
        "model": args.files.model, "mmproj": args.files.mmproj, "threads": threads, "engine_threads": engine_threads, "ingest_share": args.ingest_share,
        "pictures_resized_before_libmtmd": resized_before_libmtmd,
        "rows": rows, "engine_time": engine_time,
    });
    println!("{json}");
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
