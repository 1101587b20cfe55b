//! Standing questions (`vlmquery alerts`) through real pipelines: each stream's first state of
//! an alert and each change are posted once as `vlm-alert` (and as a JSON line), `alert-hold`
//! holds states against flapping, a malformed list is refused with a message, and alerts stop
//! cleanly at EOS and NULL. The assertions hold however many frames the engine thins out.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::*;
use gst::prelude::*;

const FIELDS: [&str; 9] =
    ["id", "question", "stream", "state", "probability", "frame", "pts", "latency-ms", "evaluations"];

const FRAMES: u64 = 12;

/// What an alert run left: the bus, the text pad's buffers, the frames of the history that
/// reached vlmquery, and its `alert-evaluations` and `alerts-thinned`.
struct AlertRun {
    run: Run,
    lines: Vec<String>,
    frames: u64,
    evaluations: u64,
    thinned: u64,
}

/// A non-live run of `FRAMES` frames with `props` on vlmquery and its text pad into an appsink
/// whose buffers are collected.
fn alert_run(props: &str) -> AlertRun {
    let pipeline = launch(&format!(
        "videotestsrc pattern=ball num-buffers={FRAMES} ! video/x-raw,width=96,height=96,framerate=5/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q {props} ! appsink name=text sync=false"
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let lines = Arc::new(Mutex::new(vec![]));
    let l2 = Arc::clone(&lines);
    let appsink = bin.by_name("text").unwrap();
    appsink.set_property("emit-signals", true);
    appsink.connect("new-sample", false, move |args| {
        let sink = args[0].get::<gst::Element>().unwrap();
        let sample = sink.emit_by_name::<gst::Sample>("pull-sample", &[]);
        let map = sample.buffer().unwrap().map_readable().unwrap();
        l2.lock().unwrap().push(String::from_utf8(map.to_vec()).unwrap());
        Some(gst::FlowReturn::Ok.to_value())
    });
    // The frames that joined the history (vlmencode may let some pass unencoded).
    let frames = Arc::new(Mutex::new(0u64));
    let f2 = Arc::clone(&frames);
    let q = bin.by_name("q").unwrap();
    q.static_pad("sink").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        if joined_frame(info).is_some() {
            *f2.lock().unwrap() += 1;
        }
        gst::PadProbeReturn::Ok
    });
    let run = run_to_eos(&pipeline, 300);
    let (evaluations, thinned) = (q.property::<u64>("alert-evaluations"), q.property::<u64>("alerts-thinned"));
    pipeline.set_state(gst::State::Null).unwrap();
    let lines = lines.lock().unwrap().clone();
    let frames = *frames.lock().unwrap();
    AlertRun { run, lines, frames, evaluations, thinned }
}

fn alerts_of(run: &Run) -> Vec<gst::Structure> {
    run.messages.iter().filter(|m| m.name() == "vlm-alert").cloned().collect()
}

/// (state, frame, evaluations) of each `vlm-alert` of one (id, stream).
type Posted = Vec<(bool, u64, u64)>;

/// Per (id, stream): the first message is the first state, then every message changes the state;
/// the evaluation counts grow; the fields are all there and consistent.
fn check_sequence(alerts: &[gst::Structure]) -> HashMap<(String, String), Vec<bool>> {
    let mut seen: HashMap<(String, String), Posted> = HashMap::new();
    for a in alerts {
        for f in FIELDS {
            assert!(a.has_field(f), "vlm-alert lacks {f}: {a}");
        }
        let p = a.get::<f64>("probability").unwrap();
        assert!((0.0..=1.0).contains(&p), "{a}");
        assert!(a.get::<f64>("latency-ms").unwrap() >= 0.0, "{a}");
        let (frame, evaluations) = (a.get::<u64>("frame").unwrap(), a.get::<u64>("evaluations").unwrap());
        assert!((1..=FRAMES).contains(&frame), "{a}");
        assert!(evaluations >= 1 && evaluations <= frame, "{a}");
        assert!(a.get::<Option<gst::ClockTime>>("pts").unwrap().is_some(), "{a}");
        let key = (a.get::<String>("id").unwrap(), a.get::<String>("stream").unwrap());
        let first = a.get::<bool>("first").unwrap();
        let state = a.get::<bool>("state").unwrap();
        let history = seen.entry(key).or_default();
        assert_eq!(
            first,
            history.is_empty(),
            "exactly the first message of an alert and stream is its first state: {a}"
        );
        if let Some(&(last, last_frame, last_evaluations)) = history.last() {
            assert_ne!(state, last, "a change posted twice, or a non-change posted: {a}");
            assert!(frame > last_frame && evaluations > last_evaluations, "{a}");
        }
        history.push((state, frame, evaluations));
    }
    seen.into_iter().map(|(k, v)| (k, v.into_iter().map(|s| s.0).collect())).collect()
}

#[test]
fn json_lines_of_answers_and_alerts_are_stamped_in_order_at_their_own_times() {
    // Captions (answers) and alert changes as JSON lines on one pad: the PTS never go back, and
    // each line is stamped within the video (a JSON answer moved the pad `answer-duration`, 5 s,
    // ahead: the next alert line was stamped there, past the video's end, and the answer after
    // it back at its frame).
    let pipeline = launch(&format!(
        "videotestsrc pattern=ball num-buffers={FRAMES} ! video/x-raw,width=96,height=96,framerate=5/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q output-format=json max-tokens=4 caption-prompt=\"What is it?\" caption-interval=400000000 \
           alerts=\"ball:Is there a ball in the picture?;dark:Is the picture dark?\" ! fakesink sync=false"
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let lines = Arc::new(Mutex::new(vec![]));
    let l2 = Arc::clone(&lines);
    bin.by_name("q").unwrap().static_pad("src").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        let b = info.buffer().unwrap();
        let text = String::from_utf8(b.map_readable().unwrap().to_vec()).unwrap();
        l2.lock().unwrap().push((b.pts().unwrap(), text));
        gst::PadProbeReturn::Ok
    });
    let run = run_for(&pipeline, 300);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let lines = lines.lock().unwrap();
    let kinds = |t: &str| lines.iter().filter(|(_, l)| l.contains(&format!("\"type\":\"{t}\""))).count();
    assert!(kinds("alert") >= 2 && lines.len() > kinds("alert"), "answers and alerts: {lines:?}");
    assert!(lines.windows(2).all(|w| w[0].0 <= w[1].0), "PTS went back: {lines:?}");
    let end = gst::ClockTime::from_mseconds(200 * FRAMES);
    assert!(lines.iter().all(|(pts, _)| *pts <= end), "stamped past the video's end ({end}): {lines:?}");
}

#[test]
fn each_streams_first_state_and_every_change_are_posted_once_on_the_bus_and_as_json() {
    let AlertRun { run, lines, frames, evaluations, thinned } =
        alert_run("alerts=\"ball:Is there a ball in the picture?;dark:Is the picture dark?\" output-format=json");
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let alerts = alerts_of(&run);
    let states = check_sequence(&alerts);
    // One first state per alert (one stream).
    let mut ids: Vec<_> = states.keys().map(|k| k.0.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["ball", "dark"], "{alerts:?}");
    // Every frame is evaluated against both alerts, or thinned (a newer frame came first).
    assert!(thinned < frames, "at least the last frame is evaluated");
    assert_eq!(evaluations, 2 * (frames - thinned), "{frames} frames: {evaluations} evaluations, {thinned} thinned");
    // The last message of each alert counts no more evaluations than were done.
    assert!(alerts.iter().all(|a| a.get::<u64>("evaluations").unwrap() <= frames - thinned));
    // The same changes as JSON lines on the text pad, in order.
    let json: Vec<serde_json::Value> = lines
        .iter()
        .flat_map(|b| b.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).collect::<Vec<_>>())
        .filter(|v| v["type"] == "alert")
        .collect();
    assert_eq!(json.len(), alerts.len(), "{json:?}");
    for (j, a) in json.iter().zip(&alerts) {
        assert_eq!(j["id"], a.get::<String>("id").unwrap().as_str());
        assert_eq!(j["state"], a.get::<bool>("state").unwrap());
        assert_eq!(j["frame"], a.get::<u64>("frame").unwrap());
        assert_eq!(j["evaluations"], a.get::<u64>("evaluations").unwrap());
        assert_eq!(j["probability"], a.get::<f64>("probability").unwrap());
        assert_eq!(j["question"], a.get::<String>("question").unwrap().as_str());
        assert!(j["pts"].is_u64() && j["latency-ms"].is_f64(), "{j}");
    }
}

#[test]
fn alert_hold_keeps_the_first_state_against_changes_that_do_not_hold() {
    // A change needs 1000 evaluations in a row: never in 12 frames.
    let AlertRun { run, frames, evaluations, thinned, .. } = alert_run(
        "alerts=\"ball:Is there a ball in the picture?;dark:Is the picture dark?;red:Is it red?\" alert-hold=1000",
    );
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let alerts = alerts_of(&run);
    check_sequence(&alerts);
    assert_eq!(alerts.len(), 3, "only each alert's first state: {alerts:?}");
    assert!(alerts.iter().all(|a| a.get::<bool>("first").unwrap()));
    assert_eq!(evaluations, 3 * (frames - thinned));
}

#[test]
fn alert_interval_evaluates_every_nth_frame() {
    let AlertRun { run, frames, evaluations, thinned, .. } =
        alert_run("alerts=\"ball:Is there a ball?\" alert-interval=2");
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    // Frames 2, 4, ... are scheduled.
    assert!(frames >= 2);
    assert_eq!(evaluations + thinned, frames / 2, "{frames} frames: {evaluations} evaluations, {thinned} thinned");
    let alerts = alerts_of(&run);
    assert!(alerts.iter().all(|a| a.get::<u64>("frame").unwrap() % 2 == 0), "{alerts:?}");
}

fn warnings(bus: &gst::Bus) -> Vec<String> {
    std::iter::from_fn(|| bus.pop_filtered(&[gst::MessageType::Warning]))
        .map(|m| match m.view() {
            gst::MessageView::Warning(w) => w.error().to_string(),
            _ => unreachable!(),
        })
        .collect()
}

#[test]
fn a_malformed_alert_list_is_refused_with_a_message_and_the_previous_one_kept() {
    init();
    let pipeline = gst::Pipeline::new();
    let q = gst::ElementFactory::make("vlmquery").build().unwrap();
    pipeline.add(&q).unwrap();
    let bus = pipeline.bus().unwrap();
    q.set_property("alerts", "door:Is the door open?;person:Is someone there?");
    assert!(warnings(&bus).is_empty());
    for (bad, says) in [
        ("a:x;a:y", "\"a\" is used twice"),
        (":Is it?", "empty id"),
        ("door", "has no question"),
        ("door:Is it?;person:  ", "empty question"),
    ] {
        q.set_property("alerts", bad);
        assert_eq!(q.property::<String>("alerts"), "door:Is the door open?;person:Is someone there?", "{bad}");
        let w = warnings(&bus);
        assert_eq!(w.len(), 1, "{bad}: {w:?}");
        assert!(w[0].contains(says) && w[0].contains("invalid alerts"), "{bad}: {}", w[0]);
    }
    q.set_property("alerts", "");
    assert_eq!(q.property::<String>("alerts"), "");
    // In a pipeline description: refused (the default stays), no crash.
    let launched = launch("fakesrc ! vlmquery name=q alerts=\"a:x;a:y\" ! fakesink");
    let q = launched.downcast_ref::<gst::Bin>().unwrap().by_name("q").unwrap();
    assert_eq!(q.property::<String>("alerts"), "");
}

#[test]
fn alerts_are_settable_while_playing_and_stop_cleanly_at_null() {
    let pipeline = launch(
        "videotestsrc is-live=true pattern=ball ! video/x-raw,width=96,height=96,framerate=10/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q ! fakesink sync=false  q.video_src ! fakesink sync=false",
    );
    let q = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("q").unwrap();
    // The alert states riding the video (`VlmAlertMeta`).
    let (metas, ridden) = mpsc::channel();
    let metas = Mutex::new(metas);
    q.static_pad("video_src").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        if let Some(m) = info.buffer().and_then(|b| gst_vlm_elements::meta::alerts_of(b)) {
            let _ = metas.lock().unwrap().send(m);
        }
        gst::PadProbeReturn::Ok
    });
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    // Set while PLAYING (the model is loading or frames are flowing); the first states follow.
    q.set_property("alerts", "ball:Is there a ball?;dark:Is it dark?");
    assert_eq!(q.property::<String>("alerts"), "ball:Is there a ball?;dark:Is it dark?");
    q.set_property("alert-hold", 2u32);
    let mut firsts = vec![];
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while firsts.len() < 2 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let msg = bus.timed_pop(gst::ClockTime::from_nseconds(left.as_nanos() as u64)).expect("no vlm-alert in 240 s");
        match msg.view() {
            gst::MessageView::Error(e) => panic!("{} ({:?})", e.error(), e.debug()),
            gst::MessageView::Element(e) if e.structure().is_some_and(|s| s.name() == "vlm-alert") => {
                firsts.push(e.structure().unwrap().to_owned())
            }
            _ => (),
        }
    }
    // Both states are reported (and posted): the next video buffers carry them. With alert-hold=2
    // no change comes before two more evaluations; a later frame's meta may show one.
    let meta = std::iter::from_fn(|| Some(ridden.recv_timeout(Duration::from_secs(60)).expect("no VlmAlertMeta")))
        .find(|m| m.get::<gst::Array>("ids").unwrap().len() == 2)
        .unwrap();
    assert_eq!(meta.get::<String>("stream").unwrap(), "sink_0", "{meta}");
    let ids: Vec<String> = meta.get::<gst::Array>("ids").unwrap().iter().map(|v| v.get().unwrap()).collect();
    assert_eq!(ids, ["ball", "dark"], "{meta}");
    for f in ["states", "probabilities", "frames"] {
        assert_eq!(meta.get::<gst::Array>(f).unwrap().len(), 2, "{meta}");
    }
    // Stopped while evaluations are going on: NULL comes back, with nothing left hanging.
    let (tx, rx) = mpsc::channel();
    let p = pipeline.clone();
    std::thread::spawn(move || {
        let _ = tx.send(p.set_state(gst::State::Null));
    });
    let stopped = rx.recv_timeout(Duration::from_secs(120)).expect("the pipeline did not reach NULL in 120 s");
    assert!(stopped.is_ok());
    assert_eq!(q.property::<u64>("alert-evaluations"), 0, "counts start again at zero");
}

/// A live-like alert pipeline (`vlmquery` named q) whose sync bus handler, on the alert thread
/// posting the first `vlm-alert`, runs `act` on the pipeline and sends what it returns.
fn on_first_alert<T: Send + 'static>(
    act: impl Fn(&gst::Element) -> T + Send + Sync + 'static,
) -> (gst::Element, gst::Element, mpsc::Receiver<T>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let pipeline = launch(
        "videotestsrc pattern=ball ! video/x-raw,width=96,height=96,framerate=10/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q alerts=\"ball:Is there a ball?\" ! fakesink sync=false",
    );
    let q = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("q").unwrap();
    let (acted_tx, acted) = mpsc::channel();
    let (once, weak) = (AtomicBool::new(false), pipeline.downgrade());
    pipeline.bus().unwrap().set_sync_handler(move |_, msg| {
        let first = msg.structure().is_some_and(|s| s.name() == "vlm-alert") && !once.swap(true, Ordering::AcqRel);
        if let Some(p) = weak.upgrade().filter(|_| first) {
            let _ = acted_tx.send(act(&p));
        }
        gst::BusSyncReply::Pass
    });
    (pipeline, q, acted)
}

/// Wait until `q` has evaluated alerts beyond `before`.
fn wait_for_evaluations(q: &gst::Element, before: u64, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while q.property::<u64>("alert-evaluations") <= before {
        assert!(std::time::Instant::now() < deadline, "no evaluation {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An application that stops its pipeline from a sync bus handler on a `vlm-alert` (stop on the
/// first alarm), on the alert thread that posts it: NULL returns, and the element evaluates its
/// alerts again when the pipeline plays again (the stop joined the alert thread, the thread
/// stopping: it panicked, and the element with it).
#[test]
fn null_from_a_sync_bus_handler_on_an_alert_returns_and_the_alerts_go_on_after() {
    let (pipeline, q, stopped) = on_first_alert(|p| p.set_state(gst::State::Null).is_ok());
    pipeline.set_state(gst::State::Playing).unwrap();
    let ok = stopped.recv_timeout(Duration::from_secs(240)).expect("NULL from the alert's sync handler returned");
    assert!(ok, "the change to NULL failed");
    assert_eq!(pipeline.current_state(), gst::State::Null);
    // Played again (its counts start again at zero).
    pipeline.set_state(gst::State::Playing).expect("PLAYING again");
    wait_for_evaluations(&q, 0, "after playing again");
    pipeline.set_state(gst::State::Null).unwrap();
}

/// The application stops its pipeline (NULL) from its own thread while a sync bus handler on
/// the alert thread stops it too: both return. (The stop waited for the alert thread without
/// end, and the alert thread, in the handler, for the pipeline's state lock that the stop holds.)
#[test]
fn null_from_the_application_and_from_an_alert_handler_at_once_both_return() {
    let (go, stop_now) = mpsc::channel::<()>();
    let (pipeline, _q, handler_stopped) = on_first_alert(move |p| {
        let _ = go.send(());
        // Once the application's stop is under way (it holds the pipeline's state lock).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while p.pending_state() != gst::State::Null && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        p.set_state(gst::State::Null).is_ok()
    });
    pipeline.set_state(gst::State::Playing).unwrap();
    stop_now.recv_timeout(Duration::from_secs(240)).expect("no vlm-alert in 240 s");
    let (tx, app_stopped) = mpsc::channel();
    let p = pipeline.clone();
    std::thread::spawn(move || {
        let _ = tx.send(p.set_state(gst::State::Null).is_ok());
    });
    assert_eq!(app_stopped.recv_timeout(Duration::from_secs(60)), Ok(true), "the application's stop hung");
    assert_eq!(handler_stopped.recv_timeout(Duration::from_secs(60)), Ok(true), "the handler's stop hung");
    assert_eq!(pipeline.current_state(), gst::State::Null);
}

/// A flushing seek from a sync bus handler on a `vlm-alert`, on the alert thread: the seek
/// returns, nothing evaluated before it is posted after it (two alerts' first states come from
/// one evaluation: the handler seeks on the first, and the second was still posted after the
/// seek), and each alert starts afresh after it (its first state posted again).
#[test]
fn a_flushing_seek_from_a_sync_bus_handler_on_an_alert_returns() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let pipeline = launch(
        "videotestsrc pattern=ball ! video/x-raw,width=96,height=96,framerate=10/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q alerts=\"ball:Is there a ball?;dark:Is it dark?\" ! fakesink sync=false",
    );
    // (frame, id, first, posted after the seek) of each vlm-alert, in order.
    let seen = Arc::new(Mutex::new(Vec::<(u64, String, bool, bool)>::new()));
    let (seeked_tx, seeked) = mpsc::channel();
    let (seen2, after, weak) = (Arc::clone(&seen), AtomicBool::new(false), pipeline.downgrade());
    pipeline.bus().unwrap().set_sync_handler(move |_, msg| {
        if let Some(a) = msg.structure().filter(|s| s.name() == "vlm-alert") {
            let was_after = after.load(Ordering::Acquire);
            let (frame, id, first) = (a.get("frame").unwrap(), a.get("id").unwrap(), a.get("first").unwrap());
            seen2.lock().unwrap().push((frame, id, first, was_after));
            if let Some(p) = weak.upgrade().filter(|_| !was_after) {
                let ok = p.seek_simple(gst::SeekFlags::FLUSH, gst::ClockTime::ZERO).is_ok();
                after.store(true, Ordering::Release);
                let _ = seeked_tx.send(ok);
            }
        }
        gst::BusSyncReply::Pass
    });
    pipeline.set_state(gst::State::Playing).unwrap();
    let ok = seeked.recv_timeout(Duration::from_secs(240)).expect("the seek from the alert's sync handler returned");
    assert!(ok, "the seek was refused");
    // Both alerts post their first states again after the seek.
    let firsts_after = || {
        let seen = seen.lock().unwrap();
        ["ball", "dark"].iter().all(|id| seen.iter().any(|(_, i, first, after)| *after && *first && i == id))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while !firsts_after() {
        assert!(std::time::Instant::now() < deadline, "no first states after the seek: {:?}", seen.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
    pipeline.set_state(gst::State::Null).unwrap();
    let seen = seen.lock().unwrap();
    let before = seen[0].0;
    assert!(
        seen.iter().filter(|s| s.3).all(|(frame, ..)| *frame > before),
        "an evaluation of frame {before}, from before the seek, was posted after it: {seen:?}"
    );
}

/// An alert whose question changes while an evaluation of it is in flight (set from a sync bus
/// handler on the `vlm-alert-overload` that the alert thread posts after taking its next frames,
/// before it evaluates them): the old question's result is not reported, neither under the new
/// question nor as its first state; the new question's first state follows.
#[test]
fn an_alert_changed_during_its_evaluation_reports_the_new_question_only() {
    use std::sync::atomic::{AtomicBool, Ordering};
    // A long question: each evaluation takes longer than a frame, so frames are thinned.
    let old = format!("Is there a ball{}?", " in the picture".repeat(40));
    let new = "Is it dark?";
    let pipeline = launch(&format!(
        "videotestsrc pattern=ball num-buffers=600 ! video/x-raw,width=96,height=96,framerate=10/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q alerts=\"ball:{old}\" ! fakesink sync=false"
    ));
    let q = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("q").unwrap();
    // (question, first, posted after the change) of each vlm-alert, in order.
    let seen = Arc::new(Mutex::new(Vec::<(String, bool, bool)>::new()));
    let (seen2, changed, weak) = (Arc::clone(&seen), Arc::new(AtomicBool::new(false)), q.downgrade());
    let changed2 = Arc::clone(&changed);
    pipeline.bus().unwrap().set_sync_handler(move |_, msg| {
        match msg.structure() {
            Some(s) if s.name() == "vlm-alert-overload" && !changed2.load(Ordering::Acquire) => {
                if let Some(q) = weak.upgrade() {
                    q.set_property("alerts", format!("ball:{new}"));
                    changed2.store(true, Ordering::Release);
                }
            }
            Some(s) if s.name() == "vlm-alert" => {
                let after = changed2.load(Ordering::Acquire);
                seen2.lock().unwrap().push((s.get("question").unwrap(), s.get("first").unwrap(), after));
            }
            _ => (),
        }
        gst::BusSyncReply::Pass
    });
    pipeline.set_state(gst::State::Playing).unwrap();
    let new_first = || seen.lock().unwrap().iter().any(|(question, first, after)| *after && *first && question == new);
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while !new_first() {
        assert!(
            std::time::Instant::now() < deadline,
            "no first state of the new question in 240 s (changed: {}): {:?}",
            changed.load(Ordering::Acquire),
            seen.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    pipeline.set_state(gst::State::Null).unwrap();
    let seen = seen.lock().unwrap();
    assert!(
        seen.iter().filter(|s| s.2).all(|(question, ..)| question == new),
        "the old question's result was reported after the change: {seen:?}"
    );
}

/// An alert whose question does not fit an answer's cells fails on every frame: a WARNING says
/// so once, and the other alert goes on.
#[test]
fn an_alert_that_cannot_be_evaluated_is_warned_about_once() {
    let long = format!("Is it{} big?", " very".repeat(400));
    let run = alert_run(&format!("alerts=\"ball:Is there a ball?;long:{long}\""));
    assert!(run.run.errors.is_empty(), "{:?}", run.run.errors);
    let about: Vec<_> = run.run.warnings.iter().filter(|w| w.contains("alert long")).collect();
    assert_eq!(about.len(), 1, "{:?}", run.run.warnings);
    let alerts = alerts_of(&run.run);
    assert!(alerts.iter().any(|a| a.get::<String>("id").unwrap() == "ball"), "{alerts:?}");
    assert!(alerts.iter().all(|a| a.get::<String>("id").unwrap() != "long"), "{alerts:?}");
}

/// A flushing seek drops the frames waiting for evaluation and ends the one in flight; the
/// alerts go on with the frames after it, and the pipeline ends at EOS.
#[test]
fn alerts_go_on_after_a_flushing_seek_and_end_at_eos() {
    let pipeline = launch(
        "videotestsrc pattern=ball num-buffers=40 ! video/x-raw,width=96,height=96,framerate=10/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q alerts=\"ball:Is there a ball?\" ! fakesink sync=false  q.video_src ! fakesink sync=true",
    );
    let q = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("q").unwrap();
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let evaluations = || q.property::<u64>("alert-evaluations");
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(240);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what} did not happen in 240 s");
            if let Some(m) = bus.pop_filtered(&[gst::MessageType::Error]) {
                panic!("{m:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for("a first evaluation", &|| evaluations() >= 1);
    assert!(pipeline.seek_simple(gst::SeekFlags::FLUSH, gst::ClockTime::ZERO).is_ok());
    let after = evaluations();
    wait_for("an evaluation after the flush", &|| evaluations() > after);
    let run = run_for(&pipeline, 240);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
}

/// A model whose vocabulary has no single-token "yes" and "no" (the generated Qwen2-VL test pair)
/// cannot evaluate alerts: a warning says so, no `vlm-alert` is posted, the answers go on.
#[test]
fn a_model_without_yes_and_no_tokens_disables_the_alerts_with_a_warning() {
    let pipeline = launch(
        "videotestsrc num-buffers=3 ! video/x-raw,width=64,height=48,framerate=5/1 ! videoconvert \
         ! vlmencode mmproj=models/test-qwen2vl-mmproj.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/test-qwen2vl-lm.gguf \
         ! vlmquery alerts=\"a:Is it there?\" ! fakesink sync=false",
    );
    let run = run(&pipeline);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(alerts_of(&run).is_empty());
    assert!(
        run.warnings.iter().any(|w| w.contains("alerts disabled") && w.contains("test-qwen2vl-lm.gguf")),
        "{:?}",
        run.warnings
    );
}

/// Two streams of one `vlmcontext` reach one `vlmquery` (through a funnel): each stream gets its
/// own first state of each alert, and its own changes.
#[test]
fn each_stream_reaching_vlmquery_gets_its_own_first_states() {
    let pipeline = launch(
        "vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf max-streams=2 \
         videotestsrc pattern=ball num-buffers=6 ! video/x-raw,width=96,height=96,framerate=5/1 ! videoconvert \
           ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 ! ctx.sink_0 \
         videotestsrc pattern=smpte num-buffers=6 ! video/x-raw,width=96,height=96,framerate=5/1 ! videoconvert \
           ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 ! ctx.sink_1 \
         ctx.src_0 ! funnel name=f ctx.src_1 ! f. \
         f. ! vlmquery name=q alerts=\"ball:Is there a ball?;dark:Is the picture dark?\" ! fakesink sync=false",
    );
    let run = run(&pipeline);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let alerts = alerts_of(&run);
    let states = check_sequence(&alerts);
    let mut keys: Vec<_> = states.keys().cloned().collect();
    keys.sort();
    let expected: Vec<(String, String)> =
        ["ball", "dark"].iter().flat_map(|id| ["sink_0", "sink_1"].map(|s| (id.to_string(), s.to_string()))).collect();
    assert_eq!(keys, expected, "{alerts:?}");
}

#[test]
fn alert_period_evaluates_frames_at_least_that_far_apart_in_running_time() {
    // 5 frames/s: with a 0.6 s period, frames 1, 4, 7, ... (running time 0, 0.6, 1.2 s, ...).
    let AlertRun { run, frames, evaluations, thinned, .. } =
        alert_run("alerts=\"ball:Is there a ball?\" alert-period=600000000");
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(frames >= 4);
    assert_eq!(
        evaluations + thinned,
        frames.div_ceil(3),
        "{frames} frames: {evaluations} evaluations, {thinned} thinned"
    );
    let alerts = alerts_of(&run);
    assert!(!alerts.is_empty());
    assert!(alerts.iter().all(|a| a.get::<u64>("frame").unwrap() % 3 == 1), "{alerts:?}");
}
