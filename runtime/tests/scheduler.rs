//! The engine's step scheduler against real llama.cpp: answers keep their decode rate while
//! streams ingest, a question does not wait behind another answer's whole generation, chunked
//! ingestion changes no answer, and a stream that cannot keep up skips frames under its policy.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::*;
use vlm_runtime::encoder::{CpuEncode, MtmdEncoder};
use vlm_runtime::error::Error;
use vlm_runtime::{AnswerReport, Engine, EngineConfig, Overload, Stream, StreamConfig, Version, answer};

/// These tests compare timings within a run: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn exact(text: &str, tokens: u32) -> vlm_runtime::Question {
    vlm_runtime::Question { ignore_eos: true, ..question(text, tokens) }
}

fn ask_exact(stream: &Arc<Stream>, frames: u64, tokens: u32) -> AnswerReport {
    let never = Arc::new(AtomicBool::new(false));
    let version = stream.wait_version(frames, &never).expect("version");
    answer(&version, &exact("Describe the picture.", tokens), &never, |_| {}).expect("answer")
}

/// Milliseconds per generated token after the first.
fn ms_per_token(r: &AnswerReport) -> f64 {
    (r.total_ms - r.ttft_ms) / (r.tokens - 1) as f64
}

/// A retained stream allowed `max_pending` frames ahead of its ingestion, then `overload`.
fn open_pending(engine: &Arc<Engine>, name: &str, max_pending: usize, overload: Overload) -> Arc<Stream> {
    let prompt =
        Arc::new(vlm_runtime::prompt::Prompt::new(engine.model(), vlm_runtime::prompt::DEFAULT_SYSTEM_PROMPT).unwrap());
    let config = StreamConfig { max_pending, overload, ..StreamConfig::new(name) };
    Stream::open(engine, prompt, config).unwrap()
}

/// `max_pending: 0` is taken as one: a blocking stream's frames are registered and published
/// instead of waiting for ever, a skipping one's not all skipped.
#[test]
fn a_max_pending_of_zero_is_one() {
    let _alone = serial();
    let engine = engine("cpu");
    let enc = encoder();
    for overload in [Overload::Block, Overload::Skip] {
        let stream = open_pending(&engine, "zero", 0, overload);
        let registration = stream.register(frame(&enc, 0), &AtomicBool::new(false)).unwrap();
        assert!(!registration.skipped, "{overload:?}: the first frame was skipped");
        assert_eq!(stream.wait_version(1, &AtomicBool::new(false)).unwrap().frames(), 1);
        stream.close();
    }
}

#[test]
fn exact_length_answers_generate_exactly_max_tokens() {
    let _alone = serial();
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    stream.register(frame(&enc, 0), &AtomicBool::new(false)).unwrap();
    // 40 tokens is more than the test model says about the picture before its end token.
    let free = {
        let never = Arc::new(AtomicBool::new(false));
        let v = stream.wait_version(1, &never).unwrap();
        answer(&v, &question("Say yes.", 40), &never, |_| {}).unwrap()
    };
    let r = ask_exact(&stream, 1, 40);
    assert_eq!(r.tokens, 40);
    assert!(free.tokens < 40, "the free answer should end on its own (got {} tokens)", free.tokens);
}

/// Two streams ingest pre-encoded frames at 2 frames/s each while an answer decodes: the answer
/// keeps at least 70% of the decode rate it has on an idle engine. Idle and busy answers
/// alternate over five rounds; the median of the rounds' ratios is compared, each ratio taken
/// between answers seconds apart, so load on the machine (which moves this VM's speed by 2x
/// from minute to minute) hits both sides of a ratio alike.
#[test]
fn answers_keep_their_decode_rate_while_two_streams_ingest() {
    let _alone = serial();
    let config = EngineConfig {
        name: "cpu".into(),
        context_per_sequence: 8192,
        max_streams: 3,
        max_branches: 2,
        ..EngineConfig::default()
    };
    let engine = Engine::start(&model_path(), config).unwrap();
    let enc = encoder();
    let never = AtomicBool::new(false);
    let asked = open(&engine, "asked", true);
    asked.register(frame(&enc, 0), &never).unwrap();
    let frames: Vec<_> = (0..8).map(|v| frame(&enc, v + 1)).collect();
    let (a, b) = (open_pending(&engine, "a", 2, Overload::Skip), open_pending(&engine, "b", 2, Overload::Skip));
    a.wait_version(0, &never).unwrap();
    b.wait_version(0, &never).unwrap();
    ask_exact(&asked, 1, 8); // warm up
    let (mut idle, mut busy, mut ingested) = (vec![], vec![], 0);
    for _ in 0..5 {
        idle.push(ms_per_token(&ask_exact(&asked, 1, 96)));
        let before = a.published() + b.published();
        let stop = AtomicBool::new(false);
        let r = std::thread::scope(|scope| {
            for s in [&a, &b] {
                let (frames, stop) = (&frames, &stop);
                scope.spawn(move || {
                    let never = AtomicBool::new(false);
                    for f in frames.iter().cycle() {
                        if stop.load(std::sync::atomic::Ordering::Acquire) {
                            break;
                        }
                        s.register(Arc::clone(f), &never).unwrap();
                        std::thread::sleep(Duration::from_millis(500));
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(200));
            let r = ask_exact(&asked, 1, 96);
            ingested += a.published() + b.published() - before;
            stop.store(true, std::sync::atomic::Ordering::Release);
            r
        });
        busy.push(ms_per_token(&r));
        // Let the streams catch up, so the next idle answer has the engine alone.
        a.wait_version(a.registered(), &never).unwrap();
        b.wait_version(b.registered(), &never).unwrap();
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratio = median(idle.iter().zip(&busy).map(|(i, b)| i / b).collect());
    let (idle, busy) = (median(idle), median(busy));
    eprintln!(
        "idle {idle:.1} ms/token, while ingesting {busy:.1} ms/token: {:.0}% of the idle rate; {ingested} frames \
         ingested meanwhile, {} skipped; {:?}",
        ratio * 100.0,
        a.skipped() + b.skipped(),
        engine.decode_rates()
    );
    assert!(ingested >= 2, "the streams hardly ingested while the answers decoded");
    assert!(ratio >= 0.7, "decode rate while ingesting fell to {:.0}% of idle", ratio * 100.0);
}

/// A second answer on the same stream starts while the first is still generating: its first
/// token comes long before the first answer's last.
#[test]
fn a_question_does_not_wait_for_the_previous_answer() {
    let _alone = serial();
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    stream.register(frame(&enc, 0), &AtomicBool::new(false)).unwrap();
    ask_exact(&stream, 1, 4); // warm up
    let (first, second) = std::thread::scope(|scope| {
        let long = scope.spawn(|| ask_exact(&stream, 1, 96));
        // Ask once the long answer is generating.
        std::thread::sleep(Duration::from_millis(400));
        let short = ask_exact(&stream, 1, 4);
        (long.join().unwrap(), short)
    });
    eprintln!("first: {:.0} ms total; second: ttft {:.0} ms", first.total_ms, second.ttft_ms);
    assert!(engine.widest_step() >= 2, "the answers were never decoded together");
    assert!(
        second.total_ms + 400.0 < first.total_ms,
        "the second answer ({:.0} ms) waited for the first ({:.0} ms)",
        second.total_ms,
        first.total_ms
    );
}

/// A question cancelled while it waits for a branch (the only one is taken by a long answer)
/// ends at once with `Cancelled`, not when the long answer ends and frees it.
#[test]
fn a_question_cancelled_while_it_waits_for_a_branch_ends_at_once() {
    let _alone = serial();
    let config = EngineConfig { name: "cpu".into(), max_branches: 1, ..EngineConfig::default() };
    let engine = Engine::start(&model_path(), config).unwrap();
    let enc = encoder();
    let stream = open(&engine, "s", true);
    stream.register(frame(&enc, 0), &AtomicBool::new(false)).unwrap();
    let version = stream.wait_version(1, &AtomicBool::new(false)).unwrap();
    let long_done = AtomicBool::new(false);
    let (version, long_done) = (&version, &long_done);
    std::thread::scope(|scope| {
        let (first, first_token) = std::sync::mpsc::channel();
        let long = scope.spawn(move || {
            let never = Arc::new(AtomicBool::new(false));
            let report = answer(version, &exact("Describe the picture.", 400), &never, move |_| {
                let _ = first.send(());
            });
            long_done.store(true, std::sync::atomic::Ordering::Release);
            report
        });
        first_token.recv().unwrap();
        let cancel = Arc::new(AtomicBool::new(false));
        let asked = Arc::clone(&cancel);
        let before = engine.start_backlog_ms();
        let waiting = scope.spawn(move || answer(version, &exact("What is it?", 4), &asked, |_| {}));
        wait_queued(&engine, before);
        cancel.store(true, std::sync::atomic::Ordering::Release);
        let cancelled = waiting.join().unwrap();
        assert!(matches!(cancelled, Err(vlm_runtime::Error::Cancelled)), "{cancelled:?}");
        assert!(
            !long_done.load(std::sync::atomic::Ordering::Acquire),
            "the cancelled question ended only after the answer holding the branch"
        );
        assert_eq!(long.join().unwrap().unwrap().tokens, 400);
    });
}

/// Chunked, batched ingestion of two streams at once gives each stream exactly the history a
/// whole-frame replay gives: the retained answers equal the re-prefill baseline's.
#[test]
fn chunked_ingestion_of_several_streams_equals_a_replay() {
    let _alone = serial();
    let config = EngineConfig {
        name: "cpu".into(),
        context_per_sequence: 1024,
        max_streams: 4,
        max_branches: 2,
        step_budget_ms: 10.0,
        ..EngineConfig::default()
    };
    let engine = Engine::start(&model_path(), config).unwrap();
    let enc = encoder();
    let never = AtomicBool::new(false);
    let (a, b, baseline) = (open(&engine, "a", true), open(&engine, "b", true), open(&engine, "base", false));
    // Keep an answer decoding so ingestion runs in budget-sized chunks, both streams together.
    let background = open(&engine, "bg", false);
    std::thread::scope(|scope| {
        scope.spawn(|| ask_exact(&background, 0, 64));
        std::thread::sleep(Duration::from_millis(100));
        for v in 0..3 {
            a.register(frame(&enc, v), &never).unwrap();
            b.register(frame(&enc, v), &never).unwrap();
            baseline.register(frame(&enc, v), &never).unwrap();
        }
        a.wait_version(3, &AtomicBool::new(false)).unwrap();
        b.wait_version(3, &AtomicBool::new(false)).unwrap();
    });
    let reference = ask_exact(&baseline, 3, 16).text;
    assert_eq!(ask_exact(&a, 3, 16).text, reference, "stream a's chunked history differs from a replay");
    assert_eq!(ask_exact(&b, 3, 16).text, reference, "stream b's chunked history differs from a replay");
}

/// Frames arriving faster than the engine ingests them: past `max_pending` the skip policy
/// keeps them out of the history, counted, so the lag stays bounded and a question on the
/// newest registered frame never waits for more than `max_pending` frames.
#[test]
fn a_stream_that_cannot_keep_up_skips_frames_and_stays_bounded() {
    let _alone = serial();
    let engine = engine("cpu");
    let enc = encoder();
    let never = AtomicBool::new(false);
    let stream = open_pending(&engine, "fast", 2, Overload::Skip);
    let frames: Vec<_> = (0..30).map(|v| frame(&enc, v % 5)).collect();
    let mut max_lag = 0;
    for f in &frames {
        let r = stream.register(Arc::clone(f), &never).unwrap();
        max_lag = max_lag.max(stream.lag().frames);
        assert!(r.number <= stream.registered());
    }
    let skipped = stream.skipped();
    eprintln!("registered {}, skipped {skipped}, max lag {max_lag} frames", stream.registered());
    assert!(skipped > 0, "30 frames registered back to back were all ingested in time?");
    assert_eq!(stream.registered() + skipped, 30);
    assert!(max_lag <= 2, "lag {max_lag} frames exceeds max_pending");
    let newest = stream.registered();
    assert_eq!(stream.wait_version(newest, &never).unwrap().frames(), newest);
}

/// A skipping stream (a live camera) never waits, even for its prompt's prefill behind a busy
/// engine: past `max-pending` its frames are skipped (the prompt was counted while it waited,
/// blocking the camera's thread until the engine got to it).
#[test]
fn a_skipping_stream_does_not_wait_for_its_prompt() {
    let _alone = serial();
    let engine = engine("cpu");
    let enc = encoder();
    let (release, holder) = hold(&engine);
    let stream = open_pending(&engine, "live", 1, Overload::Skip);
    let (done, registered) = std::sync::mpsc::channel();
    let frames: Vec<_> = (0..3).map(|v| frame(&enc, v)).collect();
    let registering = {
        let stream = Arc::clone(&stream);
        std::thread::spawn(move || {
            let never = AtomicBool::new(false);
            for f in frames {
                let _ = done.send(stream.register(f, &never).unwrap().skipped);
            }
        })
    };
    // The engine is held: nothing is prefilled, the prompt included.
    let skipped: Vec<bool> =
        (0..3).map(|_| registered.recv_timeout(Duration::from_secs(20)).expect("register returned")).collect();
    assert_eq!(skipped, [false, true, true], "one frame pending, the rest skipped");
    release.send(()).unwrap();
    holder.join().unwrap();
    registering.join().unwrap();
    stream.wait_version(1, &AtomicBool::new(false)).unwrap();
}

/// A panic on one engine's thread fails what waits on that engine (a frame's version, an answer)
/// with an error instead of leaving it waiting, the engine counts as failed (no new stream is
/// placed there), later work there is refused, and another engine keeps answering.
#[test]
fn a_panic_on_one_engine_fails_its_waiters_and_another_engine_keeps_answering() {
    let _alone = serial();
    let (bad, good) = (engine("bad"), engine("good"));
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let (s, t) = (open(&bad, "s", true), open(&good, "t", true));
    s.wait_version(0, &never).unwrap();
    let (release, held) = std::sync::mpsc::channel::<()>();
    bad.submit(move |_| {
        let _ = held.recv();
        panic!("injected engine fault");
    })
    .unwrap();
    s.register(frame(&enc, 0), &never).unwrap();
    let waiter = {
        let (s, never) = (Arc::clone(&s), Arc::clone(&never));
        std::thread::spawn(move || s.wait_version(1, &never).map(|v| v.number))
    };
    release.send(()).unwrap();
    let waited = waiter.join().unwrap();
    assert!(waited.is_err(), "the frame's version was waited for on a dead engine: {waited:?}");
    // The dead engine counts as failed: a new stream goes to the other one.
    assert!(bad.failure().is_some_and(|f| f.contains("injected engine fault")), "{:?}", bad.failure());
    let engines = [Arc::clone(&bad), Arc::clone(&good)];
    assert!(Arc::ptr_eq(vlm_runtime::residence::resident_engine(&engines).unwrap(), &good));
    let version0 = s.wait_version(0, &never);
    assert!(
        version0.is_err() || answer(&version0.unwrap(), &question("Hi?", 4), &never, |_| {}).is_err(),
        "an answer on the dead engine must fail"
    );
    t.register(frame(&enc, 1), &never).unwrap();
    assert_eq!(ask_exact(&t, 1, 4).tokens, 4, "the other engine keeps answering");
}

/// Frames queued on the `busy` stream before the other stream's one frame.
const BACKLOG: u64 = 10;

/// Two streams on one engine: `busy` with `BACKLOG` frames queued, and `other` with none yet
/// (and the encoder that made the frames).
fn beside_a_backlog(other: &str) -> (Arc<Engine>, MtmdEncoder, Arc<Stream>, Arc<Stream>) {
    let engine = engine("cpu");
    let enc = encoder();
    let never = AtomicBool::new(false);
    let open_deep = |name: &str| open_pending(&engine, name, 16, Overload::Block);
    let (busy, other) = (open_deep("busy"), open_deep(other));
    for v in 0..BACKLOG {
        busy.register(frame(&enc, v as u32 % 5), &never).unwrap();
    }
    (engine, enc, busy, other)
}

/// The other stream's frame was published when `busy_done` frames of the backlog were: before
/// the whole backlog, which is then ingested all the same, in its order.
fn assert_ahead_of_the_backlog(busy: &Arc<Stream>, busy_done: u64, what: &str) {
    eprintln!("the {what} stream's frame was published after {busy_done} of the busy stream's {BACKLOG}");
    assert!(busy_done < BACKLOG, "the {what} stream's frame was ingested after the whole backlog of another stream");
    assert_eq!(busy.wait_version(BACKLOG, &AtomicBool::new(false)).unwrap().frames(), BACKLOG);
}

/// A question waiting for a frame of one stream does not wait behind another stream's backlog on
/// the same engine: the waited-for stream's frames are ingested first (earliest deadline first),
/// while the other stream keeps its order and catches up after.
#[test]
fn a_waited_for_frame_goes_before_another_streams_backlog() {
    let _alone = serial();
    let (_engine, enc, busy, asked) = beside_a_backlog("asked");
    let never = AtomicBool::new(false);
    asked.register(frame(&enc, 7), &never).unwrap();
    asked.wait_version(1, &never).unwrap();
    assert_ahead_of_the_backlog(&busy, busy.published(), "asked");
}

/// A stream whose every version is read (standing alerts: `Stream::watch`) has its frames ingested
/// as a waiting question's are, before another stream's backlog, though nobody has asked for the
/// frame yet: a reader of each new version asks only once the frame is registered, and its
/// prefill may already have begun. Without the watch the frame waits behind the whole backlog.
/// (Nothing here may wait with `wait_version`, which counts as demand itself: the publication is
/// polled for, the event, not a time.)
#[test]
fn a_watched_streams_frame_goes_before_another_streams_backlog() {
    let _alone = serial();
    let (_engine, enc, busy, watched) = beside_a_backlog("watched");
    let _watch = watched.watch();
    watched.register(frame(&enc, 7), &AtomicBool::new(false)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while watched.published() < 1 {
        assert!(std::time::Instant::now() < deadline, "the watched stream's frame was never published");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_ahead_of_the_backlog(&busy, busy.published(), "watched");
}

/// Questions raise and drop a stream's demand from their own threads at any moment (each
/// `wait_version` counts while it runs); the scheduler reads it while it orders the stream's
/// queued frames. However the demand flickers, the frames are ingested in their order: a frame
/// moved before the one it follows had its positions refused by llama.cpp, and the stream failed
/// (seen once in CI under alert evaluations). A race: without the fix it fails only sometimes.
#[test]
fn a_flickering_demand_never_reorders_a_streams_frames() {
    let _alone = serial();
    let engine = engine("cpu");
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let stream = open_pending(&engine, "flicker", 16, Overload::Block);
    stream.wait_version(0, &never).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flicker = {
        let (stream, stop, never) = (Arc::clone(&stream), Arc::clone(&stop), Arc::clone(&never));
        std::thread::spawn(move || {
            // (The newest published version: waiting for it returns at once. A failed stream
            // shows in the last frame's version below.)
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = stream.wait_version(stream.published(), &never);
            }
        })
    };
    const FRAMES: u64 = 24;
    for v in 0..FRAMES {
        stream.register(frame(&enc, v as u32 % 5), &never).unwrap();
    }
    let last = stream.wait_version(FRAMES, &never);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flicker.join().unwrap();
    assert_eq!(last.expect("every frame ingested in order").frames(), FRAMES);
}

/// A chunk of prefill is as long as the step budget allows at the engine's measured rate, but
/// never longer than one `llama_decode` takes (`n_batch`, 512): with a rate as fast as a GPU's
/// set in the rate table, a question of ~800 tokens is prefilled in pieces and answered (a
/// single chunk of all of it was refused by llama.cpp's batch limit).
#[test]
fn a_fast_rate_never_yields_a_chunk_longer_than_the_batch() {
    let _alone = serial();
    let engine = engine_with("cpu", 2048);
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let stream = open(&engine, "s", true);
    stream.register(frame(&enc, 0), &never).unwrap();
    let version = stream.wait_version(1, &never).unwrap();
    engine.call(|w| w.set_rate(vlm_runtime::engine::Stage::Prefill, 0.001)).unwrap();
    let long = "Is the red ball still moving to the left of the blue box? ".repeat(60);
    let suffix = engine.model().tokenize(&long, false, false).unwrap().len();
    assert!(suffix > 600, "the question is {suffix} tokens");
    let r = answer(&version, &exact(&long, 4), &never, |_| {}).expect("a long question is answered");
    assert_eq!(r.tokens, 4);
}

/// A seeded rate (the calibration run's, here one set through the rate table as if a calibration
/// had run while other processes held the cores: a million times too slow) is replaced by the
/// first (faster) measurement of real work, not blended with it: one ingested frame brings the engine's
/// prefill rate back to what it measured (blended, it would stay above 800 000 ms per token).
#[test]
fn a_calibration_taken_under_contention_is_replaced_by_the_first_real_measurement() {
    let _alone = serial();
    let engine = engine("cpu");
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let stream = open(&engine, "s", true);
    stream.wait_version(0, &never).unwrap();
    engine.call(|w| w.set_rate(vlm_runtime::engine::Stage::Prefill, 1e6)).unwrap();
    stream.register(frame(&enc, 0), &never).unwrap();
    stream.wait_version(1, &never).unwrap();
    let rate = engine.rates().prefill_ms_per_token;
    assert!(rate < 1e3, "the seed still weighs on the prefill rate: {rate} ms per token");
}

/// An answer on its own thread, its tokens counted as they come; its end on the channel.
fn counted_answer(version: &Version, tokens: u32) -> (Arc<AtomicUsize>, Arc<AtomicBool>, Receiver<Result<u32, Error>>) {
    let (count, cancel) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
    let (done, ended) = std::sync::mpsc::channel();
    let (version, counted, cancelled) = (version.clone(), Arc::clone(&count), Arc::clone(&cancel));
    std::thread::spawn(move || {
        let r = answer(&version, &exact("Describe the picture.", tokens), &cancelled, |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        let _ = done.send(r.map(|r| r.tokens));
    });
    (count, cancel, ended)
}

/// Wait (at most 60 s) until `count` reaches `n`.
fn wait_for(count: &AtomicUsize, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while count.load(Ordering::SeqCst) < n {
        assert!(Instant::now() < deadline, "{n} tokens never came ({} did)", count.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Wait (at most 120 s) until each of `streams` has published `frames` frames.
fn wait_published(streams: &[&Arc<Stream>], frames: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while streams.iter().any(|s| s.published() < frames) {
        assert!(Instant::now() < deadline, "the frames were never published");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The answer counted by `count` is paused, read against the engine's own progress: `frames`
/// (encoded before, so that no encode ends meanwhile) are registered on `watched`, whose frames
/// count as waited for and so are ingested while answers pause, one small chunk a step; once
/// they are published the answer has gained at most the token of the step under way when the
/// pause began, and has not ended. Unpaused, it gains a token every step.
fn assert_paused(
    count: &AtomicUsize,
    ended: &Receiver<Result<u32, Error>>,
    watched: &Arc<Stream>,
    frames: Vec<Arc<vlm_runtime::Frame>>,
) {
    let before = count.load(Ordering::SeqCst);
    let target = watched.published() + frames.len() as u64;
    for f in frames {
        watched.register(f, &AtomicBool::new(false)).unwrap();
    }
    wait_published(&[watched], target);
    let gained = count.load(Ordering::SeqCst) - before;
    assert!(gained <= 1, "the answer decoded {gained} tokens while an encode needed the cores");
    assert!(ended.try_recv().is_err(), "the answer ended while an encode needed the cores");
}

/// `encode_first`: while a CPU vision encode that needs the cores runs (one announced here with
/// more threads than any machine's cores), an answer that has its first token pauses until the
/// encode ends; a second encode does not pause it again; a paused answer that is cancelled ends
/// at once. (With `encode_first` off the first check fails: the answer goes on.) A step budget
/// of 1 ms makes every chunk of the watched stream's frames a step of its own.
#[test]
fn an_answer_pauses_once_for_an_encode_that_needs_the_cores() {
    let _alone = serial();
    let config = EngineConfig {
        name: "cpu".into(),
        max_streams: 2,
        max_branches: 2,
        context_per_sequence: 2048,
        step_budget_ms: 1.0,
        encode_first: true,
        ..EngineConfig::default()
    };
    let engine = Engine::start(&model_path(), config).unwrap();
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let watched = open(&engine, "watched", true);
    let _watch = watched.watch();
    let version = with_frames(&stream, &enc, 1);
    let mut frames: Vec<Arc<vlm_runtime::Frame>> = (1..=4).map(|v| frame(&enc, v)).collect();

    let (count, _, ended) = counted_answer(&version, 1000);
    wait_for(&count, 2);
    let encode = CpuEncode::begin(1 << 16);
    assert_paused(&count, &ended, &watched, frames.drain(..2).collect());
    drop(encode);
    let resumed = count.load(Ordering::SeqCst);
    wait_for(&count, resumed + 2);
    let encode = CpuEncode::begin(1 << 16);
    let held = count.load(Ordering::SeqCst);
    wait_for(&count, held + 3); // not paused a second time
    drop(encode);
    assert_eq!(ended.recv_timeout(Duration::from_secs(120)).unwrap().unwrap(), 1000);

    let (count, cancel, ended) = counted_answer(&version, 1000);
    wait_for(&count, 2);
    let _encode = CpuEncode::begin(1 << 16);
    assert_paused(&count, &ended, &watched, frames);
    cancel.store(true, Ordering::SeqCst);
    let outcome = ended.recv_timeout(Duration::from_secs(10)).expect("the cancelled answer ended while paused");
    assert!(matches!(outcome, Err(Error::Cancelled)), "{outcome:?}");
}

/// Frames that questions wait for (here watched streams', which count as such) share a step's
/// prefill budget where they fit in it, instead of one frame's chunk a step: four streams' frames
/// registered at once, with an answer decoding, are all published after one decode step, not
/// one each (on a GPU a frame takes a fraction of the budget, and a burst of questions each
/// waiting for its own stream's frame took a step a frame). The budget is made large so that
/// the frames fit on any machine.
#[test]
fn frames_questions_wait_for_share_a_steps_budget() {
    let _alone = serial();
    let config = EngineConfig {
        name: "cpu".into(),
        max_streams: 5,
        max_branches: 1,
        context_per_sequence: 1024,
        step_budget_ms: 60_000.0,
        ..EngineConfig::default()
    };
    let engine = Engine::start(&model_path(), config).unwrap();
    let enc = encoder();
    let never = AtomicBool::new(false);
    let talker = open(&engine, "talker", true);
    let version = with_frames(&talker, &enc, 1);
    let watched: Vec<Arc<Stream>> = (1..=4).map(|i| open(&engine, &format!("watched{i}"), true)).collect();
    let _watches: Vec<_> = watched.iter().map(|s| s.watch()).collect();
    let (count, _, ended) = counted_answer(&version, 600);
    wait_for(&count, 2);
    let (release, holder) = hold(&engine);
    for (i, s) in watched.iter().enumerate() {
        s.register(frame(&enc, i as u32 + 1), &never).unwrap();
    }
    let before = engine.decode_rates().busy_steps;
    release.send(()).unwrap();
    holder.join().unwrap();
    wait_published(&watched.iter().collect::<Vec<_>>(), 1);
    let steps = engine.decode_rates().busy_steps - before;
    assert!(steps <= 2, "{steps} decode steps ran while the four frames were ingested");
    assert!(ended.recv_timeout(Duration::from_secs(120)).unwrap().is_ok());
}
