//! The worker process: one runtime configuration (or, for B3, one stream of it) through
//! `vlm_runtime`, with no GStreamer. It loads and warms up, says `ready`, waits for the start
//! time on stdin, runs the window and reports every answer and its totals on stdout.

use std::collections::HashMap;
use std::error::Error;
use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::llama::{Demand, Turn};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{
    Engine, EngineConfig, KvLayout, KvType, Overload, Question, Sampling, Stream, StreamConfig, answer_frame, models,
};

use crate::record::{
    AnswerRecord, Config, DecodeSplit, EngineTime, FeedStats, FrameTiming, KvStats, LagStats, WorkerMsg,
};
use crate::workload::{
    HistorySpec, Workload, instant_of_unix_ms, ms, peak_rss_kib, picture, question_text, sleep_until,
};

type BoxError = Box<dyn Error + Send + Sync>;

/// What the orchestrator tells a worker.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct WorkerSpec {
    pub config: Config,
    /// B3: the one stream this process runs (its global index); otherwise every stream.
    pub only_stream: Option<usize>,
    pub workload: Workload,
    /// Run the history curve (one stream) instead of the live workload.
    #[serde(default)]
    pub history: Option<HistorySpec>,
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
            engine_time: EngineTime::of(&e.time_split()),
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

    let answer_reserve = w.tokens + 64;
    let base = EngineConfig {
        max_streams: streams.len() as u32,
        max_branches: w.max_answers,
        kv_layout: match w.kv_layout.as_str() {
            // vlmcontext's `auto`, for this worker's engines and streams.
            "auto" => {
                let list = if matches!(spec.config, Config::B0 | Config::B1) { &w.engine } else { &w.engines };
                let devices =
                    vlm_runtime::engine_spec::devices(list).map_err(|e| format!("--engine(s) {list}: {e}"))?;
                KvLayout::auto(&devices, streams.len() as u32)
            }
            l => KvLayout::parse(l).ok_or_else(|| format!("--kv-layout {l}: auto, per-sequence or unified"))?,
        },
        kv_type: KvType::parse(&w.kv_type).ok_or_else(|| format!("--kv-type {}: f16, q8_0 or q4_0", w.kv_type))?,
        flash_attention: w.flash_attention,
        merge_frames: match w.merge_frames.as_str() {
            "on" => Some(true),
            "off" => Some(false),
            _ => None,
        },
        answer_cells: answer_reserve,
        encode_first: w.encode_first,
        ..EngineConfig::default()
    };
    let single = EngineConfig::parse_list(&w.engine, &base)?;
    let pair = EngineConfig::parse_list(&w.engines, &base)?;
    if pair.len() < 2 && matches!(spec.config, Config::B2 | Config::P) {
        return Err(format!("--engines must name two engines for {} (got {})", spec.config, w.engines).into());
    }
    let mut configs: Vec<EngineConfig> = match spec.config {
        Config::B0 | Config::B1 => vec![single[0].clone()],
        Config::B2 => vec![pair[1].clone()],
        Config::P => pair[..2].to_vec(),
        Config::B3 => vec![pair[spec.only_stream.unwrap_or(0) % pair.len()].clone()],
        Config::Peer | Config::PeerWarm => return Err("the peer does not run in a worker".into()),
    };

    // The encoder (libmtmd, like vlmencode: on the CPU unless --encoder gpu) and a warm-up frame,
    // which also gives the cells a frame takes, hence the cells a sequence needs. Its language
    // model is the first engine's copy (vlmencode takes any loaded copy), so a GPU engine's
    // weights are not loaded a second time on the CPU.
    let model = models::model(&w.model, &configs[0].device)?;
    let contexts = vlm_runtime::encoder::encoder_contexts(w.encoder_contexts, w.encoder_gpu);
    // Flash attention in the vision encoder as in the engines: the server's `-fa` sets both.
    vlm_runtime::llama::set_projector_flash_attention(Some(w.flash_attention));
    let projector = models::projector(&w.mmproj, &model, w.encoder_gpu, w.encoder_threads as i32, contexts)?;
    if let Some(threads) = w.prepare_threads {
        projector.set_prepare_threads(threads);
    }
    let encoder_contexts = projector.contexts();
    // Automatic contexts follow the load, as vlmencode's do.
    let encoder = match w.encoder_contexts {
        0 => MtmdEncoder::for_stream(projector, w.encoder_threads as i32),
        _ => MtmdEncoder::new(projector),
    };
    // (A stream's demand puts its frames first while a question waits on it, as vlmencode's do.)
    let encode = |rgb: &[u8], demand: Option<&Demand>| {
        encoder.encode_for(
            &Picture::packed(rgb, w.width, w.height, w.width as usize * 3, PixelLayout::Rgb),
            Turn::of(demand),
        )
    };
    let warm = encode(&picture(99, 0, w.width, w.height), None)?;
    let frame_cells = warm.n_pos().max(warm.cells()) as u32;
    let cells = Workload { frame_cells: Some(frame_cells), ..w.clone() }.sequence_cells();
    for c in &mut configs {
        c.context_per_sequence = cells;
    }
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
            overload: if w.skip_on_overload && spec.history.is_none() { Overload::Skip } else { Overload::Block },
            peers: if spec.config == Config::P { engines.clone() } else { vec![] },
            ..StreamConfig::new(&format!("s{gs}"))
        };
        let stream = Stream::open(resident, Arc::clone(&prompt), config)?;
        // Version 0 (the prompt) is prefilled before the window; an error here shows later.
        let _ = stream.wait_version(0, &never);
        let placement = if spec.config == Config::P { "auto".to_owned() } else { resident.name().to_owned() };
        opened.push(Opened { gs, stream, placement });
    }
    emit(&WorkerMsg::Ready {
        load_ms: ms(loading.elapsed()),
        frame_cells: Some(frame_cells),
        kv_layout: Some(base.kv_layout.name().into()),
        encoder_contexts: Some(encoder_contexts),
    });

    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let start_ms: u64 = line
        .trim()
        .strip_prefix("go ")
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| format!("expected \"go <unix ms>\" on stdin, got {line:?}"))?;
    let t0 = instant_of_unix_ms(start_ms);
    let before = totals(&engines);
    let window = Window {
        w,
        t0,
        encode: &encode,
        encoder: Mutex::new(BusyClock::default()),
        never: &never,
        last_end: Mutex::new(t0),
    };
    let done = AtomicBool::new(false);
    let ((lag, mut feed), kv) = std::thread::scope(|s| {
        // The engines' KV memory, sampled over the window.
        let sampler = s.spawn(|| {
            let mut kv = KvStats::default();
            while !done.load(Ordering::Acquire) {
                let now: Vec<_> = engines.iter().map(|e| e.kv_memory()).collect();
                kv.allocated_bytes = now.iter().map(|m| m.allocated_bytes() as u64).sum();
                kv.cell_bytes = now.iter().map(|m| m.cell_bytes as u64).max().unwrap_or(0);
                kv.peak_in_use_bytes = kv.peak_in_use_bytes.max(now.iter().map(|m| m.in_use_bytes as u64).sum());
                std::thread::sleep(Duration::from_millis(20));
            }
            kv
        });
        let lag = match &spec.history {
            Some(h) => window.history(&opened[0], h),
            None => window.live(&opened),
        };
        done.store(true, Ordering::Release);
        (lag, sampler.join().expect("the KV sampler does not panic"))
    });

    let clock = window.encoder.lock().expect("no panics hold it");
    (feed.encoded, feed.encode_ms) = (clock.encoded, clock.busy_ms);
    drop(clock);
    let window_ms = ms(*window.last_end.lock().expect("no panics hold it") - t0);
    let after = totals(&engines);
    let decode_split = DecodeSplit {
        busy_steps: after.busy_steps - before.busy_steps,
        busy_ms: after.busy_ms - before.busy_ms,
        idle_steps: after.idle_steps - before.idle_steps,
        idle_ms: after.idle_ms - before.idle_ms,
        engine_time: after.engine_time.plus(&before.engine_time, -1.0),
    };
    let encoder_contexts = Some(encoder.contexts());
    let peak_rss_kib = peak_rss_kib(None).unwrap_or(0);
    emit(&WorkerMsg::Done { window_ms, peak_rss_kib, kv, decode_split, lag, feed, encoder_contexts });
    for o in &opened {
        o.stream.close();
    }
    drop(opened);
    for engine in &engines {
        engine.stop();
    }
    Ok(())
}

/// A stream of the worker: its global index, the stream and where its answers go.
struct Opened {
    gs: usize,
    stream: Arc<Stream>,
    placement: String,
}

type Encode<'a> = dyn Fn(&[u8], Option<&Demand>) -> vlm_runtime::Result<vlm_runtime::Frame> + Sync + 'a;

/// The encoder's busy time: the union of the intervals during which at least one frame was
/// being encoded (so encodes of several streams that overlap count once, whether the encoder
/// runs them one after another or together).
#[derive(Default)]
struct BusyClock {
    active: usize,
    since: Option<Instant>,
    busy_ms: f64,
    encoded: u64,
}

impl BusyClock {
    fn start(&mut self, now: Instant) {
        if self.active == 0 {
            self.since = Some(now);
        }
        self.active += 1;
    }

    fn end(&mut self, now: Instant, encoded: bool) {
        self.active -= 1;
        self.encoded += encoded as u64;
        if self.active == 0
            && let Some(since) = self.since.take()
        {
            self.busy_ms += ms(now - since);
        }
    }
}

/// The measured window, shared by the live workload and the history curve.
struct Window<'a> {
    w: &'a Workload,
    t0: Instant,
    encode: &'a Encode<'a>,
    encoder: Mutex<BusyClock>,
    never: &'a Arc<AtomicBool>,
    /// When the last answer ended.
    last_end: Mutex<Instant>,
}

impl Window<'_> {
    /// Encode and register frame `number` of stream `o`: the registration, and when the encode
    /// call began and returned.
    fn feed(&self, o: &Opened, number: usize) -> Result<(vlm_runtime::Registration, Instant, Instant), String> {
        let w = self.w;
        let rgb = picture(o.gs, number, w.width, w.height);
        let start = Instant::now();
        self.encoder.lock().expect("no panics hold it").start(start);
        let frame = (self.encode)(&rgb, Some(&o.stream.demand()));
        let end = Instant::now();
        self.encoder.lock().expect("no panics hold it").end(end, frame.is_ok());
        frame
            .map_err(|e| e.to_string())
            .and_then(|f| o.stream.register(Arc::new(f), self.never).map_err(|e| e.to_string()))
            .map(|r| (r, start, end))
            .map_err(|e| format!("stream {}, frame {number}: {e}", o.gs))
    }

    /// Ask question `index` about frame `bound` (asked right after frame `after`), now; report it.
    /// `capture`: when frame `after` was due and frame `bound` was (live workload only).
    fn ask(
        &self,
        o: &Opened,
        index: usize,
        after: usize,
        bound: u64,
        prime_ms: Option<f64>,
        capture: Option<(Instant, Option<Instant>)>,
    ) {
        let arrival = Instant::now();
        let question = Question {
            id: format!("s{}q{index}", o.gs),
            text: question_text(index).into(),
            max_tokens: self.w.tokens,
            ignore_eos: true,
            sampling: Sampling::default(),
            arrival,
        };
        let result = answer_frame(&o.stream, bound, &question, &o.placement, self.never, |_| {});
        let end = Instant::now();
        let mut record = AnswerRecord::asked(o.gs, index, after, ms(arrival - self.t0), ms(end - arrival));
        record.prime_ms = prime_ms;
        match result {
            Ok(r) => {
                record.wait_ms = Some(r.wait_ms);
                record.prepare_ms = Some(r.prepare_ms);
                record.ttft_from_question_ms = r.ttft_ms;
                record.total_ms = r.total_ms;
                record.tokens = r.tokens;
                record.path = Some(r.path.name().into());
                record.engine = Some(r.engine);
                record.frames = r.frames;
            }
            Err(e) => record.error = Some(e.to_string()),
        }
        if let Some((due, newest)) = capture {
            record.set_capture(ms(due - self.t0), newest.map(|n| ms(n - self.t0)));
        }
        emit(&WorkerMsg::Answer(record));
        let mut last = self.last_end.lock().expect("no panics hold it");
        *last = (*last).max(end);
    }

    /// The live workload: every stream fed in real time, each question asked from its own
    /// thread right after its frame is registered.
    /// Each frame's way to its version is reported once published (see [`Window::watch`]).
    fn live(&self, opened: &[Opened]) -> (LagStats, FeedStats) {
        let w = self.w;
        let lag = Mutex::new((LagStats::default(), FeedStats::default()));
        let pending: Mutex<Vec<(Arc<Stream>, u64, FrameTiming)>> = Mutex::new(vec![]);
        let feeding = AtomicUsize::new(opened.len());
        std::thread::scope(|scope| {
            scope.spawn(|| self.watch(&pending, &feeding));
            for o in opened {
                let (lag, pending, feeding) = (&lag, &pending, &feeding);
                scope.spawn(move || {
                    let mut local = LagStats::default();
                    let mut feed = FeedStats::default();
                    // Due time of each frame that joined the history, by its number there.
                    let mut joined: HashMap<u64, Instant> = HashMap::new();
                    for number in 1..=w.frames {
                        let due = w.frame_due(self.t0, o.gs, number);
                        sleep_until(due);
                        let (registration, encode_start, encode_end) = match self.feed(o, number) {
                            Ok(r) => r,
                            Err(error) => {
                                emit(&WorkerMsg::Failed { error });
                                break;
                            }
                        };
                        let now = Instant::now();
                        let at = |t: Instant| ms(t.saturating_duration_since(self.t0));
                        let timing = FrameTiming {
                            stream: o.gs,
                            frame: number,
                            due_ms: at(due),
                            encode_start_ms: at(encode_start),
                            encode_end_ms: at(encode_end),
                            registered_ms: at(now),
                            published_ms: None,
                            skipped: registration.skipped,
                        };
                        if registration.skipped {
                            emit(&WorkerMsg::Frame(timing));
                        } else {
                            let entry = (Arc::clone(&o.stream), registration.number, timing);
                            pending.lock().expect("no panics hold it").push(entry);
                        }
                        let l = o.stream.lag();
                        local.samples += 1;
                        local.max_frames = local.max_frames.max(l.frames);
                        local.max_ms = local.max_ms.max(l.ms);
                        local.sum_ms += l.ms;
                        feed.fed(ms(now.saturating_duration_since(due)));
                        local.skipped += registration.skipped as u64;
                        if !registration.skipped {
                            joined.insert(registration.number, due);
                        }
                        for (index, _) in w.ask_after.iter().enumerate().filter(|(_, a)| **a == number) {
                            let bound = registration.number;
                            let capture = Some((due, joined.get(&bound).copied()));
                            scope.spawn(move || self.ask(o, index, number, bound, None, capture));
                        }
                    }
                    let mut all = lag.lock().expect("no panics hold it");
                    all.0.add(&local);
                    all.1.add(&feed);
                    feeding.fetch_sub(1, Ordering::AcqRel);
                });
            }
        });
        lag.into_inner().expect("no panics hold it")
    }

    /// Report each registered frame once its version is published: `pending` polled every 5 ms
    /// (waiting for a version would count as a question in the stream's demand) until the
    /// feeders are done (`feeding` at 0) and every frame is reported, or 60 s after that (the
    /// rest reported unpublished).
    fn watch(&self, pending: &Mutex<Vec<(Arc<Stream>, u64, FrameTiming)>>, feeding: &AtomicUsize) {
        let mut fed_at = None;
        loop {
            let now = Instant::now();
            let done = feeding.load(Ordering::Acquire) == 0;
            let give_up = done && *fed_at.get_or_insert(now) + Duration::from_secs(60) < now;
            let mut list = pending.lock().expect("no panics hold it");
            list.retain_mut(|(stream, number, timing)| {
                let published = stream.published() >= *number;
                if published {
                    timing.published_ms = Some(ms(now.saturating_duration_since(self.t0)));
                }
                if published || give_up {
                    emit(&WorkerMsg::Frame(*timing));
                }
                !(published || give_up)
            });
            if done && list.is_empty() {
                return;
            }
            drop(list);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The history curve: frames given as fast as they are taken (blocking past max-pending);
    /// at each point, once its version is published, `reps` questions one after another.
    fn history(&self, o: &Opened, h: &HistorySpec) -> (LagStats, FeedStats) {
        let mut next = 1;
        for &point in &h.points {
            let started = Instant::now();
            while next <= point {
                if let Err(error) = self.feed(o, next) {
                    emit(&WorkerMsg::Failed { error });
                    return Default::default();
                }
                next += 1;
            }
            if let Err(e) = o.stream.wait_version(point as u64, self.never) {
                emit(&WorkerMsg::Failed { error: format!("frame {point}: {e}") });
                return Default::default();
            }
            let prime_ms = ms(started.elapsed());
            for rep in 0..h.reps {
                std::thread::sleep(Duration::from_millis(h.settle_ms));
                self.ask(o, rep, point, point as u64, Some(prime_ms), None);
            }
        }
        Default::default()
    }
}
