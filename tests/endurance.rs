//! Endurance: many NULL→PLAYING→NULL cycles of a pipeline with a loaded model, and a long live
//! run at one frame a second with a question every few seconds. Each reports the process's RSS
//! (VmRSS) at start (after a warm-up) and at the end, and fails when it grew past
//! [`rss_bound_mib`] (64 MiB, or 2% of the RSS at start where more); every question asked is
//! answered exactly once.
//!
//! Short by default (CI): 30 cycles and a 20 s run. `VLM_ENDURANCE=1` runs the full sizes of
//! issue 10 (1000 cycles, 30 minutes); `VLM_ENDURANCE_CYCLES` and `VLM_ENDURANCE_SECS` set
//! either size. The live run takes `VLM_MODEL` / `VLM_MMPROJ` (a timing pair, say) and
//! `VLM_ENDURANCE_ENCODE`, properties for its `vlmencode`s (default `interval=0 min-change=0`:
//! every frame encoded; an encoder slower than the camera needs an `interval`), and
//! `VLM_ENDURANCE_ASK_SECS`, seconds between questions on each stream (3).
//! `cargo test -p gst-plugin-vlm --test endurance -- --nocapture` prints the figures.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use gst::prelude::*;

/// Most the RSS may grow from the end of the warm-up to the end of a run: this, or
/// [`RSS_BOUND_SHARE`] of the RSS at the start where that is more (32 streams of SmolVLM-500M
/// frames hold ~5 GiB, whose caches and histories are still filling when a short run starts
/// counting: +76 MiB, 1.5%, over the last 135 s of a 150 s run on an H100).
const RSS_BOUND_MIB: f64 = 64.0;
const RSS_BOUND_SHARE: f64 = 0.02;

/// The bound on a run's RSS growth from `start` MiB.
fn rss_bound_mib(start: f64) -> f64 {
    RSS_BOUND_MIB.max(start * RSS_BOUND_SHARE)
}
/// Cycles run before the start figure is taken (allocators and llama.cpp's caches settle).
const WARM_UP_CYCLES: usize = 5;

/// The figures are the whole process's: the two tests never run at once.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn full() -> bool {
    std::env::var("VLM_ENDURANCE").is_ok_and(|v| v == "1")
}

fn size(var: &str, short: u64, long: u64) -> u64 {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(if full() { long } else { short })
}

unsafe extern "C" {
    /// glibc: give free heap memory back to the system.
    fn malloc_trim(pad: usize) -> i32;
}

/// The RSS once the memory a stopped pipeline frees on other threads (engines, answer threads)
/// is given back: read until two reads 200 ms apart agree within 1 MiB (at most 5 s), free heap
/// pages trimmed first (the figure then follows what is still allocated, not how fragmented
/// the allocator's arenas are).
fn settled_rss_mib() -> f64 {
    // SAFETY: malloc_trim only releases free memory of glibc's allocator; any thread may call it.
    unsafe { malloc_trim(0) };
    let mut last = rss_mib();
    for _ in 0..25 {
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: as above.
        unsafe { malloc_trim(0) };
        let now = rss_mib();
        if (now - last).abs() < 1.0 {
            return now;
        }
        last = now;
    }
    last
}

/// Set `state`, failing if it does not return within `limit`.
fn set_state(pipeline: &gst::Element, state: gst::State, limit: Duration, what: &str) {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = pipeline.clone();
    std::thread::spawn(move || {
        let _ = tx.send(p.set_state(state));
    });
    let result = rx.recv_timeout(limit).unwrap_or_else(|_| panic!("{what}: {state:?} did not return within {limit:?}"));
    assert!(result.is_ok(), "{what}: the change to {state:?} failed");
}

/// Count the frames that joined a history at `pad`.
fn count_frames(pad: &gst::Pad) -> Arc<AtomicU64> {
    let count = Arc::new(AtomicU64::new(0));
    let c = Arc::clone(&count);
    pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        if joined_frame(info).is_some() {
            c.fetch_add(1, Ordering::Relaxed);
        }
        gst::PadProbeReturn::Ok
    });
    count
}

/// Answers seen on the bus: the statuses of each question id, (when, TTFT ms) of each answered
/// one, and its stream's lag when it was asked (ms the history was behind the camera); and the
/// frames skipped under overload that `vlm-overload` reported, per stream (its latest count).
#[derive(Default)]
struct Answers {
    status: std::collections::HashMap<String, Vec<String>>,
    ttft: Vec<(Instant, f64)>,
    /// TTFT from the capture of the question's frame (`ttft-from-capture-ms`: live cameras).
    ttft_from_capture: Vec<f64>,
    /// How old the picture an answer saw was when it was asked (`picture-age-ms`: staleness).
    picture_age: Vec<f64>,
    lag_ms: Vec<f64>,
    overload: std::collections::HashMap<String, u64>,
    /// Answers by how they were prepared (`resident`, `import`, `replay`).
    paths: std::collections::BTreeMap<String, u64>,
}

/// Read `bus` until `done` or `limit`; errors fail the test, answers are counted per id.
fn pump(
    bus: &gst::Bus,
    answers: &mut Answers,
    limit: Duration,
    done: impl Fn(&std::collections::HashMap<String, Vec<String>>) -> bool,
) -> bool {
    let deadline = Instant::now() + limit;
    while !done(&answers.status) {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(msg) =
            (!left.is_zero()).then(|| bus.timed_pop(gst::ClockTime::from_nseconds(left.as_nanos() as u64))).flatten()
        else {
            return done(&answers.status);
        };
        match msg.view() {
            gst::MessageView::Error(e) => panic!("error: {} ({:?})", e.error(), e.debug()),
            gst::MessageView::Element(e) => {
                if let Some(s) = e.structure().filter(|s| s.name() == "vlm-overload") {
                    let skipped = s.get::<u64>("skipped").unwrap();
                    let stream = s.get::<String>("stream").unwrap();
                    let reported = answers.overload.entry(stream).or_default();
                    *reported = (*reported).max(skipped);
                }
                if let Some(s) = e.structure().filter(|s| s.name() == "vlm-answer") {
                    let status = s.get::<String>("status").unwrap();
                    if status == "answered" {
                        answers.ttft.push((Instant::now(), s.get::<f64>("ttft-ms").unwrap()));
                        answers.ttft_from_capture.push(s.get::<f64>("ttft-from-capture-ms").unwrap());
                        answers.picture_age.push(s.get::<f64>("picture-age-ms").unwrap_or(0.0));
                        answers.lag_ms.push(s.get::<f64>("lag-ms").unwrap_or(0.0));
                        *answers.paths.entry(s.get::<String>("path").unwrap_or_default()).or_default() += 1;
                    }
                    answers.status.entry(s.get::<String>("id").unwrap()).or_default().push(status);
                }
            }
            _ => (),
        }
    }
    true
}

fn report(what: &str, start: f64, end: f64, detail: &str) {
    let bound = rss_bound_mib(start);
    println!(
        "{{\"endurance\":\"{what}\",{detail},\"rss-start-mib\":{start:.1},\"rss-end-mib\":{end:.1},\"growth-mib\":{:.1},\"bound-mib\":{bound:.1}}}",
        end - start
    );
    assert!(end <= start + bound, "{what}: RSS grew from {start:.1} MiB to {end:.1} MiB (bound +{bound:.1} MiB)");
}

/// What the live run's `vlmencode`s get unless `VLM_ENDURANCE_ENCODE` says otherwise.
const EVERY_FRAME: &str = "interval=0 min-change=0";

/// `streams` live 64x48 cameras at `fps` into one `vlmcontext` (with `context` added to its
/// properties), each through a `vlmencode` named `enc0`, `enc1`, ... (with `encode`) and with its
/// own `vlmquery` named `q0`, `q1`, ...
fn live(streams: usize, fps: &str, context: &str, encode: &str) -> String {
    let mut description = format!("vlmcontext name=ctx model={} {context} ", model());
    for i in 0..streams {
        description += &format!(
            "videotestsrc is-live=true pattern=ball ! video/x-raw,width=64,height=48,framerate={fps} ! videoconvert \
             ! vlmencode name=enc{i} mmproj={} {encode} ! ctx.sink_{i} \
             ctx.src_{i} ! vlmquery name=q{i} max-tokens=4 ! fakesink async=false ",
            mmproj()
        );
    }
    description
}

#[test]
fn null_playing_null_cycles_keep_memory_bounded() {
    let _alone = alone();
    let cycles = size("VLM_ENDURANCE_CYCLES", 30, 1000) as usize;
    let pipeline = launch(&live(1, "10/1", "", EVERY_FRAME));
    let q = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("q0").unwrap();
    let frames = count_frames(&q.static_pad("sink").unwrap());
    let bus = pipeline.bus().unwrap();
    let mut answers = Answers::default();
    let (mut start, mut asked) = (None, 0);
    let began = Instant::now();
    for i in 0..cycles {
        // Both figures are taken in NULL, once settled: after the warm-up and after the last cycle.
        if i == WARM_UP_CYCLES.min(cycles - 1) {
            start = Some((settled_rss_mib(), Instant::now()));
        }
        let seen = frames.load(Ordering::Relaxed);
        set_state(&pipeline, gst::State::Playing, Duration::from_secs(60), &format!("cycle {i}"));
        // The model is loaded and a frame ingested in every cycle; every third one a question is
        // answered, and every fifth another is cut off by the state change (cancelled).
        let deadline = Instant::now() + Duration::from_secs(60);
        while frames.load(Ordering::Relaxed) == seen {
            assert!(Instant::now() < deadline, "cycle {i}: no frame joined the history");
            pump(&bus, &mut answers, Duration::from_millis(20), |_| false);
        }
        if i % 3 == 0 {
            let id = q.emit_by_name::<Option<String>>("ask", &[&"What is it?"]).expect("accepted");
            asked += 1;
            assert!(pump(&bus, &mut answers, Duration::from_secs(60), |a| a.contains_key(&id)), "cycle {i}: no answer");
            assert_eq!(answers.status[&id], ["answered"], "cycle {i}");
        } else if i % 5 == 0 {
            let id = q.emit_by_name::<Option<String>>("ask", &[&"Stopped?"]).expect("accepted");
            asked += 1;
            // Its vlm-answer comes at PAUSED->READY (the pipeline's bus drops what is still
            // queued at READY->NULL, so it is read in between).
            set_state(&pipeline, gst::State::Ready, Duration::from_secs(30), &format!("cycle {i}"));
            assert!(pump(&bus, &mut answers, Duration::from_secs(10), |a| a.contains_key(&id)), "cycle {i}: no answer");
            assert!(
                ["answered", "cancelled"].contains(&answers.status[&id][0].as_str()),
                "cycle {i}: {:?}",
                answers.status[&id]
            );
        }
        set_state(&pipeline, gst::State::Null, Duration::from_secs(30), &format!("cycle {i}"));
        if std::env::var("VLM_ENDURANCE_VERBOSE").is_ok() {
            eprintln!("cycle {i}: {:.0} s, RSS {:.1} MiB", began.elapsed().as_secs_f64(), rss_mib());
        }
    }
    pump(&bus, &mut answers, Duration::from_millis(500), |_| false);
    let end = settled_rss_mib();
    let (start, from) = start.unwrap();
    assert_eq!(answers.status.len(), asked, "a question without its one vlm-answer");
    assert!(answers.status.values().all(|s| s.len() == 1), "a question answered twice");
    report(
        "cycles",
        start,
        end,
        &format!(
            "\"cycles\":{cycles},\"warm-up\":{WARM_UP_CYCLES},\"seconds\":{:.0},\"seconds-after-warm-up\":{:.0},\"questions\":{asked}",
            began.elapsed().as_secs_f64(),
            from.elapsed().as_secs_f64()
        ),
    );
}

/// With every property at its default, or with `VLM_ENDURANCE_CONTEXT`'s properties added to
/// vlmcontext (an A/B of a setting against the defaults over the same run).
#[test]
fn a_long_live_run_keeps_memory_bounded_and_answers_every_question() {
    let context = std::env::var("VLM_ENDURANCE_CONTEXT").unwrap_or_default();
    live_run(&context);
}

/// `history-policy=slide` with a short context (512 cells: the history fills every few frames):
/// the history slides again and again without a restart, every question is answered, and the
/// p95 TTFT of the run's last sixth (the last 5 minutes of 30) is reported beside its first's.
#[test]
fn a_live_run_slides_its_history_without_restarting() {
    let run = live_run("history-policy=slide context-size=512");
    assert_eq!(run.restarts, 0, "history-policy=slide restarted the history");
    assert!(run.slides >= 2, "the history slid {} times", run.slides);
    let (first, last) = (quantile(run.ttft_first, 0.95), quantile(run.ttft_last, 0.95));
    println!(
        "{{\"endurance\":\"slide-ttft\",\"p95-first-ms\":{first:.0},\"p95-last-ms\":{last:.0},\"ratio\":{:.2}}}",
        last / first
    );
}

/// A structure's number, boolean and string fields as JSON object members.
fn json_fields(s: &gst::StructureRef) -> String {
    s.iter()
        .map(|(name, value)| {
            let json = if let Ok(x) = value.get::<f64>() {
                format!("{x:.1}")
            } else if let Ok(text) = value.get::<String>() {
                format!("{text:?}")
            } else {
                // u64, i32 and bool print as JSON does.
                value.serialize().map_or("null".into(), |v| v.to_string())
            };
            format!("\"{name}\":{json}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The `q` quantile of `v` (NaN when empty; 1.0 is the largest).
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1))).copied().unwrap_or(f64::NAN)
}

/// What a live run counted.
struct LiveRun {
    restarts: u64,
    slides: u64,
    /// TTFTs of the answers of the run's first and last sixth.
    ttft_first: Vec<f64>,
    ttft_last: Vec<f64>,
}

/// A live run at one frame a second with a question every `VLM_ENDURANCE_ASK_SECS` (3 s) on each
/// of `VLM_ENDURANCE_STREAMS` streams (1) for `VLM_ENDURANCE_SECS` (20 s, or 30 minutes), `context`
/// added to vlmcontext's properties: every question answered once, RSS growth bounded.
fn live_run(context: &str) -> LiveRun {
    let _alone = alone();
    let seconds = size("VLM_ENDURANCE_SECS", 20, 1800);
    let streams = size("VLM_ENDURANCE_STREAMS", 1, 1) as usize;
    let encode = std::env::var("VLM_ENDURANCE_ENCODE").unwrap_or_else(|_| EVERY_FRAME.into());
    let ask_every = size("VLM_ENDURANCE_ASK_SECS", 3, 3).max(1);
    let pipeline = launch(&live(streams, "1/1", context, &encode));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let qs: Vec<gst::Element> = (0..streams).map(|i| bin.by_name(&format!("q{i}")).unwrap()).collect();
    let counted: Vec<_> = qs.iter().map(|q| count_frames(&q.static_pad("sink").unwrap())).collect();
    let frames = || counted.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>();
    let bus = pipeline.bus().unwrap();
    let mut answers = Answers::default();
    set_state(&pipeline, gst::State::Playing, Duration::from_secs(60), "start");
    // Questions bind to frames: the first is asked once one has reached vlmquery.
    let deadline = Instant::now() + Duration::from_secs(60);
    while counted.iter().any(|c| c.load(Ordering::Relaxed) == 0) {
        assert!(Instant::now() < deadline, "no frame joined the history");
        pump(&bus, &mut answers, Duration::from_millis(20), |_| false);
    }
    let began = Instant::now();
    let mut ids = vec![];
    let ctx = bin.by_name("ctx").unwrap();
    let filled = || ctx.property::<u64>("history-slides") + ctx.property::<u64>("history-restarts");
    // The RSS after the warm-up: at the first answer after the run's first tenth, or, where every
    // history fills its context later than that (a slow encoder), once it has (a slide or a
    // restart per stream: the KV pages a full history touches are resident then).
    let (mut start, mut start_filled) = (None, None);
    // RSS at every question: the means of the run's first and last tenth, and of every tenth,
    // are reported; with the allocator's figures of the first and the last tenth (what grew: the
    // memory in use, or the free memory its arenas hold).
    let mut rss = vec![];
    let mut heap = vec![];
    let warm_up = Duration::from_secs(seconds / 10);
    while began.elapsed() < Duration::from_secs(seconds) {
        for q in &qs {
            ids.extend(q.emit_by_name::<Option<String>>("ask", &[&"What is moving?"]));
        }
        let tick = Instant::now();
        pump(&bus, &mut answers, Duration::from_secs(ask_every), |_| false);
        std::thread::sleep(Duration::from_secs(ask_every).saturating_sub(tick.elapsed()));
        rss.push((began.elapsed(), rss_mib()));
        heap.push((began.elapsed(), heap_mib()));
        if start.is_none() && !answers.status.is_empty() && began.elapsed() >= warm_up {
            start = Some(rss.last().unwrap().1);
        }
        if start.is_some() && start_filled.is_none() && filled() >= streams as u64 {
            start_filled = Some(rss.last().unwrap().1);
        }
    }
    let all = pump(&bus, &mut answers, Duration::from_secs(60), |a| ids.iter().all(|id| a.contains_key(id)));
    let end = rss_mib();
    // What vlmcontext counted, read before PAUSED→READY starts its statistics again at zero.
    let (skipped, dropped, restarts, slides) = (
        ctx.property::<u64>("frames-skipped"),
        ctx.property::<u64>("frames-dropped"),
        ctx.property::<u64>("history-restarts"),
        ctx.property::<u64>("history-slides"),
    );
    let encoders: Vec<gst::Element> = (0..streams).map(|i| bin.by_name(&format!("enc{i}")).unwrap()).collect();
    let sum = |name: &str| encoders.iter().map(|e| e.property::<u64>(name)).sum::<u64>();
    let (encoded, encoder_skipped) = (sum("frames-encoded"), sum("frames-skipped"));
    let (tiles_encoded, tiles_reused) = (sum("tiles-encoded"), sum("tiles-reused"));
    // Due frames the change gate held (nothing changed enough to encode them).
    let unchanged = sum("frames-unchanged");
    // Where a frame's encode went (the means weighted by each encoder's frames), and each
    // engine's time (a run that cannot keep up says why).
    let mean_of = |name: &str| {
        let total: f64 =
            encoders.iter().map(|e| e.property::<f64>(name) * e.property::<u64>("frames-encoded") as f64).sum();
        total / encoded.max(1) as f64
    };
    println!(
        "{{\"endurance\":\"encoder-time\",\"mean-encode-ms\":{:.1},\"mean-prepare-ms\":{:.1},\"mean-context-wait-ms\":{:.1}}}",
        mean_of("mean-encode-ms"),
        mean_of("mean-prepare-ms"),
        mean_of("mean-context-wait-ms")
    );
    for stats in ctx.property::<gst::Array>("engine-stats").iter() {
        println!("{{\"endurance\":\"engine-stats\",{}}}", json_fields(&stats.get::<gst::Structure>().unwrap()));
    }
    // (The bus once more, for a `vlm-overload` posted as the counts were read.)
    pump(&bus, &mut answers, Duration::from_millis(200), |_| false);
    set_state(&pipeline, gst::State::Null, Duration::from_secs(30), "stop");
    assert!(all, "{} of {} questions answered", answers.status.len(), ids.len());
    assert!(
        ids.len() as u64 >= streams as u64 * (seconds / ask_every).saturating_sub(1),
        "questions refused: {} asked",
        ids.len()
    );
    for id in &ids {
        assert_eq!(answers.status[id], ["answered"], "{id}");
    }
    // Every encoded frame joined the history or was counted: skipped under overload (a history
    // restart replays its kept frames, and a live stream does not wait for that) or dropped; and
    // with every frame due, every frame was encoded.
    // A degradation is said on the bus: a stream's first skipped frame and every tenth.
    let reported: u64 = answers.overload.values().sum();
    assert!(skipped == 0 || reported > 0, "{skipped} frames skipped and no vlm-overload message");
    let frames = frames();
    assert!(
        frames + skipped + dropped + 2 * streams as u64 >= encoded,
        "{frames} frames joined the histories, {skipped} skipped, {dropped} dropped of {encoded} encoded"
    );
    let due = streams as u64 * seconds;
    assert!(
        encode != EVERY_FRAME || encoded + 2 * streams as u64 >= due,
        "{encoded} frames encoded ({encoder_skipped} skipped by the encoder) in {seconds} s at 1 frame/s x {streams}"
    );
    let mean = |samples: &[(Duration, f64)], from: Duration, to: Duration| {
        let inside: Vec<f64> = samples.iter().filter(|(at, _)| *at >= from && *at < to).map(|(_, r)| *r).collect();
        inside.iter().sum::<f64>() / inside.len().max(1) as f64
    };
    let tenth = |from: Duration, to: Duration| mean(&rss, from, to);
    // (A tenth of a short run holds no sample: then its first 3 s.)
    let tick = warm_up.max(Duration::from_secs(4));
    let last_tenth = Duration::from_secs(seconds).saturating_sub(tick);
    let (first, last) = (tenth(Duration::ZERO, tick), tenth(last_tenth, Duration::MAX));
    let heap_of =
        |field: fn(&Heap) -> f64| -> Vec<(Duration, f64)> { heap.iter().map(|(at, h)| (*at, field(h))).collect() };
    let (in_use, free) = (heap_of(|h| h.in_use), heap_of(|h| h.free));
    let heap_tenths = format!(
        "\"heap-in-use-first-tenth-mib\":{:.1},\"heap-in-use-last-tenth-mib\":{:.1},\"heap-free-first-tenth-mib\":{:.1},\"heap-free-last-tenth-mib\":{:.1},\"arenas\":{}",
        mean(&in_use, Duration::ZERO, tick),
        mean(&in_use, last_tenth, Duration::MAX),
        mean(&free, Duration::ZERO, tick),
        mean(&free, last_tenth, Duration::MAX),
        vlm_runtime::llama::arenas::count().map_or(-1, |n| n as i64),
    );
    // Each tenth's mean (null where a short run's tenth holds no sample).
    let tenths: Vec<String> = (0..10)
        .map(|i| {
            let (from, to) = (Duration::from_secs(seconds * i / 10), Duration::from_secs(seconds * (i + 1) / 10));
            match rss.iter().any(|(at, _)| *at >= from && *at < to) {
                true => format!("{:.1}", tenth(from, to)),
                false => "null".into(),
            }
        })
        .collect();
    // (Printed first: the report below fails the test when the RSS grew past its bound.)
    let ttft: Vec<f64> = answers.ttft.iter().map(|(_, t)| *t).collect();
    let lag = answers.lag_ms.clone();
    let from_capture = answers.ttft_from_capture.clone();
    let age = answers.picture_age.clone();
    println!(
        "{{\"endurance\":\"live-run-ttft\",\"context\":{context:?},\"answers\":{},\"p50-ms\":{:.0},\"p95-ms\":{:.0},\"max-ms\":{:.0},\"from-capture-p50-ms\":{:.0},\"from-capture-p95-ms\":{:.0},\"picture-age-p50-ms\":{:.0},\"picture-age-p95-ms\":{:.0},\"lag-p50-ms\":{:.0},\"lag-p95-ms\":{:.0},\"lag-max-ms\":{:.0},\"paths\":{:?}}}",
        ttft.len(),
        quantile(ttft.clone(), 0.5),
        quantile(ttft.clone(), 0.95),
        quantile(ttft, 1.0),
        quantile(from_capture.clone(), 0.5),
        quantile(from_capture, 0.95),
        quantile(age.clone(), 0.5),
        quantile(age, 0.95),
        quantile(lag.clone(), 0.5),
        quantile(lag.clone(), 0.95),
        quantile(lag, 1.0),
        answers.paths
    );
    report(
        "live-run",
        start_filled.or(start).expect("no answer in the whole run"),
        end,
        &format!(
            "\"context\":{context:?},\"streams\":{streams},\"seconds\":{seconds},\"rss-first-tenth-mib\":{:.1},\"rss-last-tenth-mib\":{:.1},\"rss-tenths-mib\":[{}],{heap_tenths},\"encode\":{encode:?},\"encoded\":{encoded},\"encoder-skipped\":{encoder_skipped},\"frames-unchanged\":{unchanged},\"tiles-encoded\":{tiles_encoded},\"tiles-reused\":{tiles_reused},\"frames\":{frames},\"skipped\":{skipped},\"skipped-reported\":{reported},\"dropped\":{dropped},\"restarts\":{restarts},\"slides\":{slides},\"questions\":{}",
            first,
            last,
            tenths.join(","),
            ids.len()
        ),
    );
    let sixth = Duration::from_secs(seconds / 6);
    let in_window = |from: Instant, to: Instant| -> Vec<f64> {
        answers.ttft.iter().filter(|(at, _)| *at >= from && *at < to).map(|(_, t)| *t).collect()
    };
    let end_of_run = began + Duration::from_secs(seconds);
    LiveRun {
        restarts,
        slides,
        ttft_first: in_window(began, began + sixth),
        ttft_last: in_window(end_of_run - sixth, end_of_run),
    }
}
