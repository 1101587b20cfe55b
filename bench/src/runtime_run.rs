//! The worker process: one runtime configuration (or, for B3, one stream of it) through
//! `vlm_runtime`, with no GStreamer. It loads and warms up, says `ready`, waits for the start
//! time on stdin, runs the window and reports every answer and its totals on stdout.

use std::error::Error;
use std::io::BufRead;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{
    Device, Engine, EngineConfig, Overload, Question, Sampling, Stream, StreamConfig, answer_frame, models,
};

use crate::record::{AnswerRecord, Config, DecodeSplit, LagStats, WorkerMsg};
use crate::workload::{Workload, instant_of_unix_ms, ms, peak_rss_kib, picture, question_text, sleep_until};

type BoxError = Box<dyn Error + Send + Sync>;

/// What the orchestrator tells a worker.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct WorkerSpec {
    pub config: Config,
    /// B3: the one stream this process runs (its global index); otherwise every stream.
    pub only_stream: Option<usize>,
    pub workload: Workload,
}

fn emit(msg: &WorkerMsg) {
    // One line per message; stdout is line-buffered and println! holds its lock for the line.
    println!("{}", serde_json::to_string(msg).expect("worker messages serialize"));
}

/// Run the worker; the process's exit status.
pub fn main(spec: &WorkerSpec) -> i32 {
    match run(spec) {
        Ok(()) => 0,
        Err(e) => {
            emit(&WorkerMsg::Failed { error: e.to_string() });
            1
        }
    }
}

fn totals(engines: &[Arc<Engine>]) -> DecodeSplit {
    let mut split = DecodeSplit::default();
    for e in engines {
        let r = e.decode_rates();
        split.add(&DecodeSplit {
            busy_steps: r.busy_steps,
            busy_ms: r.busy_ms_per_step * r.busy_steps as f64,
            idle_steps: r.idle_steps,
            idle_ms: r.idle_ms_per_step * r.idle_steps as f64,
        });
    }
    split
}

fn run(spec: &WorkerSpec) -> Result<(), BoxError> {
    let w = &spec.workload;
    let loading = Instant::now();
    let streams: Vec<usize> = match spec.only_stream {
        Some(i) => vec![i],
        None => (0..w.streams).collect(),
    };

    // The encoder (libmtmd on the CPU, like vlmencode) and a warm-up frame, which also gives
    // the positions a frame takes, hence the cells a sequence needs.
    let cpu_model = models::model(&w.model, &Device::Cpu)?;
    let encoder = MtmdEncoder::new(models::projector(&w.mmproj, &cpu_model, false, 1)?);
    let encode =
        |rgb: &[u8]| encoder.encode(&Picture::packed(rgb, w.width, w.height, w.width as usize * 3, PixelLayout::Rgb));
    let per_frame = encode(&picture(99, 0, w.width, w.height))?.n_pos() as u32;
    let answer_reserve = w.tokens + 64;
    let needed = 128 + w.frames as u32 * per_frame + answer_reserve;
    let base = EngineConfig {
        context_per_sequence: w.context.max(needed.next_power_of_two()),
        max_streams: streams.len() as u32,
        max_branches: w.max_answers,
        ..EngineConfig::default()
    };
    let single = EngineConfig::parse_list(&w.engine, &base)?;
    let pair = EngineConfig::parse_list(&w.engines, &base)?;
    if pair.len() < 2 && matches!(spec.config, Config::B2 | Config::P) {
        return Err(format!("--engines must name two engines for {} (got {})", spec.config, w.engines).into());
    }
    let configs: Vec<EngineConfig> = match spec.config {
        Config::B0 | Config::B1 => vec![single[0].clone()],
        Config::B2 => vec![pair[1].clone()],
        Config::P => pair[..2].to_vec(),
        Config::B3 => vec![pair[spec.only_stream.unwrap_or(0) % pair.len()].clone()],
        Config::Peer => return Err("the peer does not run in a worker".into()),
    };
    let mut engines = vec![];
    for c in configs {
        engines.push(Engine::start(&w.model, c)?);
    }
    let prompt = Arc::new(Prompt::new(engines[0].model(), DEFAULT_SYSTEM_PROMPT)?);
    let never = Arc::new(AtomicBool::new(false));
    let mut opened = vec![];
    for &gs in &streams {
        // vlmcontext's choice: where the stream's ingestion costs least (P: one stream per engine
        // when they are alike).
        let resident = vlm_runtime::placer::resident_engine(&engines).expect("at least one engine");
        let config = StreamConfig {
            retain: spec.config != Config::B0,
            answer_reserve: answer_reserve as i32,
            max_pending: w.max_pending,
            overload: if w.skip_on_overload { Overload::Skip } else { Overload::Block },
            peers: if spec.config == Config::P { engines.clone() } else { vec![] },
            ..StreamConfig::new(&format!("s{gs}"))
        };
        let stream = Stream::open(resident, Arc::clone(&prompt), config)?;
        // Version 0 (the prompt) is prefilled before the window; an error here shows later.
        let _ = stream.wait_version(0, &never);
        let placement = if spec.config == Config::P { "auto".to_owned() } else { resident.name().to_owned() };
        opened.push((gs, stream, placement));
    }
    emit(&WorkerMsg::Ready { load_ms: ms(loading.elapsed()) });

    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let start_ms: u64 = line
        .trim()
        .strip_prefix("go ")
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| format!("expected \"go <unix ms>\" on stdin, got {line:?}"))?;
    let t0 = instant_of_unix_ms(start_ms);
    let before = totals(&engines);
    let last_end = Mutex::new(t0);
    let lag = Mutex::new(LagStats::default());

    std::thread::scope(|scope| {
        for (gs, stream, placement) in &opened {
            let (encode, never, lag, last_end) = (&encode, &never, &lag, &last_end);
            scope.spawn(move || {
                let mut local = LagStats::default();
                for number in 1..=w.frames {
                    let due = w.frame_due(t0, number);
                    sleep_until(due);
                    let registration = encode(&picture(*gs, number, w.width, w.height))
                        .map_err(|e| e.to_string())
                        .and_then(|f| stream.register(Arc::new(f), never).map_err(|e| e.to_string()));
                    let registration = match registration {
                        Ok(r) => r,
                        Err(e) => {
                            emit(&WorkerMsg::Failed { error: format!("stream {gs}, frame {number}: {e}") });
                            break;
                        }
                    };
                    let now = Instant::now();
                    let l = stream.lag();
                    local.samples += 1;
                    local.max_frames = local.max_frames.max(l.frames);
                    local.max_ms = local.max_ms.max(l.ms);
                    local.sum_ms += l.ms;
                    local.feed_late_max_ms = local.feed_late_max_ms.max(ms(now.saturating_duration_since(due)));
                    local.skipped += registration.skipped as u64;
                    for (index, _) in w.ask_after.iter().enumerate().filter(|(_, a)| **a == number) {
                        let (stream, placement) = (Arc::clone(stream), placement.as_str());
                        let bound = registration.number;
                        scope.spawn(move || {
                            let arrival = Instant::now();
                            let question = Question {
                                id: format!("s{gs}q{index}"),
                                text: question_text(index).into(),
                                max_tokens: w.tokens,
                                ignore_eos: true,
                                sampling: Sampling::default(),
                                arrival,
                            };
                            let result = answer_frame(&stream, bound, &question, placement, never, |_| {});
                            let end = Instant::now();
                            let mut record =
                                AnswerRecord::asked(*gs, index, number, ms(arrival - t0), ms(end - arrival));
                            match result {
                                Ok(r) => {
                                    record.wait_ms = Some(r.wait_ms);
                                    record.ttft_ms = r.ttft_ms;
                                    record.total_ms = r.total_ms;
                                    record.tokens = r.tokens;
                                    record.path = Some(r.path.name().into());
                                    record.engine = Some(r.engine);
                                    record.frames = r.frames;
                                }
                                Err(e) => record.error = Some(e.to_string()),
                            }
                            emit(&WorkerMsg::Answer(record));
                            let mut last = last_end.lock().expect("no panics hold it");
                            *last = (*last).max(end);
                        });
                    }
                }
                lag.lock().expect("no panics hold it").add(&local);
            });
        }
    });

    let window_ms = ms(*last_end.lock().expect("no panics hold it") - t0);
    let after = totals(&engines);
    let decode_split = DecodeSplit {
        busy_steps: after.busy_steps - before.busy_steps,
        busy_ms: after.busy_ms - before.busy_ms,
        idle_steps: after.idle_steps - before.idle_steps,
        idle_ms: after.idle_ms - before.idle_ms,
    };
    let lag = *lag.lock().expect("no panics hold it");
    emit(&WorkerMsg::Done { window_ms, peak_rss_kib: peak_rss_kib(None).unwrap_or(0), decode_split, lag });
    for (_, stream, _) in &opened {
        stream.close();
    }
    drop(opened);
    for engine in &engines {
        engine.stop();
    }
    Ok(())
}
