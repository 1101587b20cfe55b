//! Bad input, through real pipelines: each case asserts its defined outcome (an error or a
//! warning on the bus naming the cause, or a clean answer), and every wait is bounded, so a
//! crash or a hang fails the test instead of stopping it. docs/reliability.md lists the cases
//! and their outcomes.
//!
//! - media: a resolution change and a format change mid-stream, tiny (2x2) and large (1920x1080)
//!   frames, buffers without timestamps (a timed question then binds to the newest frame), a
//!   GAP event and a discontinuity;
//! - questions: 1 MiB of text, invalid UTF-8 on the query pad, `max-tokens` 1000000, a question
//!   longer than the context, a burst of 1000 `ask` calls against `max-questions`;
//! - lifecycle: a flushing seek mid-answer, two pipelines sharing one model file, a history
//!   that overflows on one stream, an engine fault on one stream while the other answers, and
//!   a remote (RPC) engine whose server dies mid-answer.
//!
//! The harness (bounded waits, the bus log, an appsrc-fed pipeline) is in `badinput/harness.rs`.

mod common;
#[path = "badinput/harness.rs"]
mod harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use gst::prelude::*;
use gst_video::VideoFormat;
use gst_vlm_elements::events::QuestionEvent;
use harness::*;

// ----------------------------------------------------------------------------------------------
// Media

/// Push `frames` (format, width, height), then ask: every frame is encoded at its own caps, joins
/// the history and the answer covers all of them.
fn frames_are_all_encoded_and_answered(frames: &[(VideoFormat, u32, u32)]) {
    let _s = serial();
    let mut f = Fed::new("", "", "");
    for (i, &(format, w, h)) in frames.iter().enumerate() {
        f.push(format, w, h, i as u64, Some(gst::ClockTime::from_mseconds(100 * i as u64)));
    }
    let n = frames.len() as u64;
    f.frames.wait(n, "frames");
    let id = f.ask("What is in the picture?").expect("accepted");
    let a = f.answer(&id, Duration::from_secs(60));
    assert_eq!(status(&a), "answered", "{a}");
    assert_eq!(field::<u64>(&a, "frames"), n, "{a}");
    assert_eq!(f.element("enc").property::<u64>("frames-encoded"), n);
    assert_clean(&f.finish());
}

#[test]
fn a_resolution_change_mid_stream_is_encoded_at_each_size() {
    use VideoFormat::Rgb;
    frames_are_all_encoded_and_answered(&[(Rgb, 64, 48), (Rgb, 160, 120), (Rgb, 160, 120), (Rgb, 48, 64)]);
}

#[test]
fn a_format_change_mid_stream_is_encoded_in_each_format() {
    use VideoFormat::*;
    frames_are_all_encoded_and_answered(&[(Rgb, 64, 48), (I420, 64, 48), (Nv12, 64, 48), (Bgrx, 64, 48)]);
}

#[test]
fn tiny_frames_are_encoded() {
    use VideoFormat::*;
    frames_are_all_encoded_and_answered(&[(Rgb, 2, 2), (I420, 2, 2), (Nv12, 2, 2), (Rgb, 1, 1), (I420, 1, 1)]);
}

#[test]
fn large_frames_are_encoded() {
    use VideoFormat::*;
    frames_are_all_encoded_and_answered(&[(Rgb, 1920, 1080), (I420, 1920, 1080)]);
}

#[test]
fn buffers_without_timestamps_join_the_history_and_timed_questions_bind_to_the_newest() {
    let _s = serial();
    let (mut f, questions) = Fed::with_questions();
    for i in 0..3 {
        f.push(VideoFormat::Rgb, 64, 48, i, None);
    }
    f.frames.wait(3, "untimed frames");
    // Untimed video cannot be matched to a question's time: the question binds to the newest
    // frame instead of waiting for video that will never pass its time.
    let mut q = gst::Buffer::from_slice(b"What is shown?");
    q.get_mut().unwrap().set_pts(gst::ClockTime::from_seconds(2));
    assert_eq!(questions.push_buffer(q), Ok(gst::FlowSuccess::Ok));
    let bus = f.bus.clone();
    assert!(
        f.log.pump(&bus, Duration::from_secs(60), |l| !l.answers.is_empty()),
        "a timed question over untimed video was not answered before EOS: {:?}",
        f.log
    );
    let a = f.log.answers[0].clone();
    assert_eq!((status(&a), field::<u64>(&a, "frames")), ("answered".into(), 3), "{a}");
    // An ask over untimed frames binds to the newest too.
    let id = f.ask("And now?").unwrap();
    assert_eq!(field::<u64>(&f.answer(&id, Duration::from_secs(60)), "frames"), 3);
    assert_eq!(questions.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    assert_clean(&f.finish());
}

/// One buffer without a timestamp among timed ones does not make the video untimed: a timed
/// question ahead of the video waits for its time (not bound to the newest frame at once), and a
/// GAP past its time binds it, as a frame after it would, to the frames up to its time.
#[test]
fn a_timed_question_waits_past_an_untimed_buffer_and_binds_at_a_gap() {
    let _s = serial();
    let (mut f, questions) = Fed::with_questions();
    f.push_frames(2);
    let mut q = gst::Buffer::from_slice(b"What is shown?");
    q.get_mut().unwrap().set_pts(gst::ClockTime::from_seconds(5));
    assert_eq!(questions.push_buffer(q), Ok(gst::FlowSuccess::Ok));
    f.push(VideoFormat::Rgb, 64, 48, 2, None);
    f.frames.wait(3, "the untimed frame");
    let gap =
        gst::event::Gap::builder(gst::ClockTime::from_mseconds(200)).duration(gst::ClockTime::from_seconds(10)).build();
    assert!(f.src.send_event(gap), "appsrc refused the GAP event");
    let bus = f.bus.clone();
    assert!(
        f.log.pump(&bus, Duration::from_secs(60), |l| !l.answers.is_empty()),
        "not answered at the GAP: {:?}",
        f.log
    );
    let a = f.log.answers[0].clone();
    assert_eq!((status(&a), field::<u64>(&a, "frames")), ("answered".into(), 2), "{a}");
    assert_eq!(questions.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    assert_clean(&f.finish());
}

/// Periodic captions over untimed video keep their interval on the wall clock: one caption for a
/// burst of frames (one was asked on every frame, filling the question queue).
#[test]
fn periodic_captions_over_untimed_video_keep_their_interval() {
    let _s = serial();
    let mut f = Fed::new("", "max-tokens=2 caption-prompt=Describe. caption-interval=600000000000", "");
    for i in 0..8 {
        f.push(VideoFormat::Rgb, 64, 48, i, None);
    }
    f.frames.wait(8, "untimed frames");
    let bus = f.bus.clone();
    f.log.pump(&bus, Duration::from_secs(60), |l| !l.answers.is_empty());
    let log = f.finish();
    let captions = log.answers.iter().filter(|a| field::<String>(a, "question") == "Describe.").count();
    assert_eq!(captions, 1, "{:?}", log.answers);
}

/// `vlmencode interval` over untimed video keeps its interval on the wall clock: one frame of a
/// burst is encoded (every one was).
#[test]
fn the_encoders_interval_holds_over_untimed_video() {
    let _s = serial();
    let f = Fed::new("", "", "");
    let enc = f.element("enc");
    enc.set_property("interval", 600_000_000_000u64);
    let passed = count_buffers(&f.q.static_pad("video_src").unwrap());
    for i in 0..8 {
        f.push(VideoFormat::Rgb, 64, 48, i, None);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while passed.load(Ordering::Acquire) < 8 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(passed.load(Ordering::Acquire), 8);
    assert_eq!(enc.property::<u64>("frames-encoded"), 1);
    assert_clean(&f.finish());
}

/// `max-unchanged` holds over untimed video too (on the wall clock): a still picture is
/// encoded again once that long has passed since the gate last let one through.
#[test]
fn max_unchanged_holds_over_untimed_video() {
    let _s = serial();
    let f = Fed::new("", "", "");
    let enc = f.element("enc");
    enc.set_property("interval", 0u64);
    enc.set_property("min-change", 0.01f64);
    enc.set_property("max-unchanged", 200_000_000u64);
    let passed = count_buffers(&f.q.static_pad("video_src").unwrap());
    for n in 1..=3 {
        f.push(VideoFormat::Rgb, 64, 48, 0, None);
        let deadline = Instant::now() + Duration::from_secs(60);
        while passed.load(Ordering::Acquire) < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(passed.load(Ordering::Acquire), 3);
    assert_eq!(enc.property::<u64>("frames-unchanged"), 0);
    assert_eq!(enc.property::<u64>("frames-encoded"), 3, "a still picture is encoded again after max-unchanged");
    assert_clean(&f.finish());
}

#[test]
fn a_gap_event_and_a_discontinuity_leave_the_stream_answering() {
    let _s = serial();
    let mut f = Fed::new("", "", "");
    f.push_frames(2);
    // Nothing for a while (a GAP event in order with the buffers), then frames resume 10 s later
    // with the DISCONT flag.
    let gap =
        gst::event::Gap::builder(gst::ClockTime::from_mseconds(200)).duration(gst::ClockTime::from_seconds(10)).build();
    assert!(f.src.send_event(gap), "appsrc refused the GAP event");
    for i in 0..2u64 {
        let mut buffer = picture(VideoFormat::Rgb, 64, 48, 10 + i);
        let b = buffer.get_mut().unwrap();
        b.set_pts(gst::ClockTime::from_mseconds(10_200 + 100 * i));
        if i == 0 {
            b.set_flags(gst::BufferFlags::DISCONT);
        }
        assert_eq!(f.src.push_buffer(buffer), Ok(gst::FlowSuccess::Ok));
    }
    f.frames.wait(4, "frames after the gap");
    let id = f.ask("What happened?").unwrap();
    let a = f.answer(&id, Duration::from_secs(60));
    assert_eq!((status(&a), field::<u64>(&a, "frames")), ("answered".into(), 4), "{a}");
    assert_clean(&f.finish());
}

// ----------------------------------------------------------------------------------------------
// Questions

#[test]
fn a_question_of_one_mebibyte_fails_with_its_length() {
    let _s = serial();
    let mut f = Fed::new("", "", "");
    f.push_frames(1);
    let huge = "very ".repeat((1 << 20) / 5);
    let started = Instant::now();
    let id = f.ask(&huge).expect("accepted: its length is known once it is tokenized");
    let a = f.answer(&id, Duration::from_secs(120));
    let reason = field::<String>(&a, "reason");
    assert_eq!(status(&a), "failed", "{reason}");
    assert!(reason.contains("tokens") && reason.contains("does not fit"), "the reason must name the length: {reason}");
    assert!(
        f.log.warnings.iter().any(|w| w.contains(&id) && w.contains("does not fit")),
        "no warning naming the question: {:?}",
        f.log.warnings
    );
    eprintln!("1 MiB question failed after {:?}: {reason}", started.elapsed());
    // The element goes on.
    let id = f.ask("Still there?").unwrap();
    assert_eq!(status(&f.answer(&id, Duration::from_secs(60))), "answered");
    assert_clean(&f.finish());
}

#[test]
fn invalid_utf8_on_the_query_pad_is_refused_with_a_warning_and_the_next_question_answered() {
    let _s = serial();
    let (mut f, questions) = Fed::with_questions();
    f.push_frames(1);
    for bytes in [&b"\xff\xfe What?"[..], b"caf\xc3", b"\xc0\xaf"] {
        assert_eq!(questions.push_buffer(gst::Buffer::from_slice(bytes)), Ok(gst::FlowSuccess::Ok));
    }
    assert_eq!(questions.push_buffer(gst::Buffer::from_slice(b"What is it?")), Ok(gst::FlowSuccess::Ok));
    // NUL bytes (C terminators some producers leave) are not part of the question.
    assert_eq!(questions.push_buffer(gst::Buffer::from_slice(b"\0And \0now?\0")), Ok(gst::FlowSuccess::Ok));
    let bus = f.bus.clone();
    assert!(f.log.pump(&bus, Duration::from_secs(60), |l| l.answers.len() >= 2), "{:?}", f.log);
    assert_eq!(questions.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    let log = f.finish();
    let refused = log.warnings.iter().filter(|w| w.contains("not UTF-8")).count();
    assert_eq!(refused, 3, "one warning per invalid buffer: {:?}", log.warnings);
    assert_eq!(log.answers.len(), 2, "{:?}", log.answers);
    assert!(log.answers.iter().all(|a| status(a) == "answered"), "{:?}", log.answers);
    assert_eq!(field::<String>(&log.answers[0], "question"), "What is it?");
    assert_eq!(field::<String>(&log.answers[1], "question"), "And now?");
    assert_clean(&log);
}

/// A question source that keeps asking after the video's end (every 0.3 s, never its EOS)
/// holds the pipeline's EOS for at most 10 s, not for good.
#[test]
fn a_question_source_that_keeps_asking_does_not_hold_eos() {
    let _s = serial();
    let (mut f, questions) = Fed::with_questions();
    f.push_frames(1);
    let asking = Arc::new(AtomicBool::new(true));
    let asker = {
        let asking = Arc::clone(&asking);
        std::thread::spawn(move || {
            while asking.load(Ordering::Acquire) {
                if questions.push_buffer(gst::Buffer::from_slice(b"Still?")).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    assert_eq!(f.src.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    let bus = f.bus.clone();
    let eos = f.log.pump(&bus, Duration::from_secs(60), |l| l.eos || !l.errors.is_empty());
    asking.store(false, Ordering::Release);
    asker.join().unwrap();
    assert!(eos, "no EOS while questions kept coming: {:?}", f.log.errors);
    assert!(!f.log.answers.is_empty());
    set_state(&f.pipeline, gst::State::Null, "stop");
    assert_clean(&f.log);
}

/// With `output-format=json` a failed question's line is counted in `answers-failed`, not in
/// `answers` too.
#[test]
fn json_lines_of_failed_questions_are_not_counted_as_answers() {
    let _s = serial();
    let mut f = Fed::new("context-size=512 kv-layout=per-sequence", "output-format=json", "");
    f.push_frames(1);
    let sink = f.q.static_pad("sink").unwrap();
    assert!(sink.send_event(QuestionEvent::event(&words(600), Some("long"), None)));
    assert_eq!(status(&f.answer("long", Duration::from_secs(60))), "failed");
    let id = f.ask("What is it?").unwrap();
    assert_eq!(status(&f.answer(&id, Duration::from_secs(60))), "answered");
    // (Counted as the text pad takes the lines, after their messages.)
    let deadline = Instant::now() + Duration::from_secs(30);
    while f.q.property::<u64>("answers") < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!((f.q.property::<u64>("answers"), f.q.property::<u64>("answers-failed")), (1, 1));
    assert_clean(&f.finish());
}

/// A question of `n` words (about one token each).
fn words(n: usize) -> String {
    format!("Count{}?", " very".repeat(n))
}

#[test]
fn a_huge_max_tokens_is_clamped_by_the_context() {
    let _s = serial();
    // exact-tokens: the answer goes on past end-of-generation, so only the context stops it.
    // (Per sequence: an answer has the rest of its own context-size cells.)
    let mut f = Fed::new("context-size=512 kv-layout=per-sequence", "exact-tokens=true", "");
    f.push_frames(1);
    let sink = f.q.static_pad("sink").unwrap();
    assert!(sink.send_event(QuestionEvent::event(&words(350), Some("huge"), Some(1_000_000))));
    let a = f.answer("huge", Duration::from_secs(60));
    assert_eq!(status(&a), "answered", "{a}");
    let tokens = field::<u32>(&a, "tokens");
    assert!((1..=512 - 350).contains(&tokens), "{tokens} tokens: not clamped to the 512-cell context");
    eprintln!("max-tokens 1000000 with exact-tokens: {tokens} tokens, the rest of the 512-cell context");
    assert_clean(&f.finish());
}

#[test]
fn a_question_longer_than_the_context_fails_with_the_reason() {
    let _s = serial();
    let mut f = Fed::new("context-size=512 kv-layout=per-sequence", "", "");
    f.push_frames(1);
    let id = f.ask(&words(600)).unwrap();
    let a = f.answer(&id, Duration::from_secs(60));
    let reason = field::<String>(&a, "reason");
    assert_eq!(status(&a), "failed", "{a}");
    assert!(reason.contains("does not fit") && reason.contains("512"), "{reason}");
    assert!(f.log.warnings.iter().any(|w| w.contains(&id)), "{:?}", f.log.warnings);
    // A question that fits is answered.
    let id = f.ask("Short?").unwrap();
    assert_eq!(status(&f.answer(&id, Duration::from_secs(60))), "answered");
    assert_clean(&f.finish());
}

#[test]
fn a_burst_of_1000_asks_is_bounded_by_max_questions_and_each_accepted_one_answered_once() {
    let _s = serial();
    let mut f = Fed::new("", "max-tokens=2", "");
    f.push_frames(1);
    let max = f.q.property::<u32>("max-questions") as usize;
    assert_eq!(max, 16);
    let accepted: Vec<String> = (0..1000).filter_map(|i| f.ask(&format!("Question {i}?"))).collect();
    // Answers may end during the burst and make room: never fewer than max-questions accepted.
    assert!(accepted.len() >= max && accepted.len() < 1000, "{} accepted", accepted.len());
    let bus = f.bus.clone();
    let all = f.log.pump(&bus, Duration::from_secs(180), |l| accepted.iter().all(|id| !l.answers_to(id).is_empty()));
    assert!(all, "{} of {} accepted questions answered", f.log.answers.len(), accepted.len());
    let log = f.finish();
    let refusals = log.warnings.iter().filter(|w| w.contains("refused") && w.contains("max-questions")).count();
    assert_eq!(refusals, 1000 - accepted.len(), "one warning per refused ask");
    for id in &accepted {
        let answers = log.answers_to(id);
        assert_eq!(answers.len(), 1, "{id}: {answers:?}");
        assert_eq!(status(answers[0]), "answered", "{}", answers[0]);
    }
    assert_eq!(log.answers.len(), accepted.len(), "an answer to a question that was refused");
    eprintln!("burst of 1000 asks: {} accepted and answered once each, {refusals} refused", accepted.len());
    assert_clean(&log);
}

#[test]
fn question_events_past_max_questions_are_refused_not_waited_for() {
    let _s = serial();
    // The video's thread must never wait for answers (an overlay may hold them until the video
    // passes their time): question events past max-questions are refused with a warning each.
    let mut f = Fed::new("", "max-tokens=2 max-questions=2", "");
    f.push_frames(1);
    let sink = f.q.static_pad("sink").unwrap();
    let started = Instant::now();
    for i in 0..20 {
        assert!(sink.send_event(QuestionEvent::event(&format!("Event {i}?"), Some(&format!("e{i}")), None)));
    }
    eprintln!("20 question events sent in {:?}", started.elapsed());
    let bus = f.bus.clone();
    f.log.pump(&bus, Duration::from_secs(120), |l| l.answers.len() + l.warnings.len() >= 20);
    let log = f.finish();
    let refused = log.warnings.iter().filter(|w| w.contains("refused") && w.contains("max-questions")).count();
    assert!(refused > 0, "no question event was refused: {:?}", log.warnings);
    assert_eq!(log.answers.len() + refused, 20, "every event answered once or refused: {:?}", log.answers);
    assert!(log.answers.iter().all(|a| status(a) == "answered"));
    assert_clean(&log);
}

#[test]
fn ask_before_the_element_starts_is_refused() {
    init();
    // Nothing would answer it: READY->PAUSED starts the element afresh.
    let q = gst::ElementFactory::make("vlmquery").build().unwrap();
    assert_eq!(q.emit_by_name::<Option<String>>("ask", &[&"Anyone there?"]), None);
    q.set_state(gst::State::Ready).unwrap();
    assert_eq!(q.emit_by_name::<Option<String>>("ask", &[&"Anyone there?"]), None);
    q.set_state(gst::State::Null).unwrap();
}

#[test]
fn settings_that_apply_at_start_are_refused_while_playing_with_a_warning() {
    let _s = serial();
    // `context-size`, `mmproj` and `commit-answers` apply when the elements start: changed while PLAYING they are
    // refused with a warning naming them (the value kept), not ignored without a word;
    // `interval` applies at once and changes.
    let pipeline = launch(
        "videotestsrc is-live=true ! video/x-raw,width=64,height=48,framerate=10/1 ! videoconvert \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf context-size=2048 ! vlmquery name=q ! fakesink",
    );
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let (enc, ctx, q) = (bin.by_name("enc").unwrap(), bin.by_name("ctx").unwrap(), bin.by_name("q").unwrap());
    set_state(&pipeline, gst::State::Playing, "start");
    let p = pipeline.clone();
    let (_, now, _) = within(Duration::from_secs(60), "PLAYING", move || p.state(gst::ClockTime::from_seconds(60)));
    assert_eq!(now, gst::State::Playing);
    ctx.set_property("context-size", 4096u32);
    enc.set_property("mmproj", "models/test-idefics3-mmproj.gguf");
    enc.set_property("interval", 2_000_000_000u64);
    q.set_property_from_str("commit-answers", "ordered");
    assert_eq!(ctx.property::<u32>("context-size"), 2048);
    assert_eq!(q.property_value("commit-answers").serialize().unwrap().as_str(), "none");
    assert_eq!(enc.property::<String>("mmproj"), "models/test-mmproj-mlp.gguf");
    assert_eq!(enc.property::<u64>("interval"), 2_000_000_000);
    let mut log = Log::default();
    let both =
        |l: &Log| ["context-size", "mmproj", "commit-answers"].iter().all(|p| l.warnings.iter().any(|w| w.contains(p)));
    log.pump(&pipeline.bus().unwrap(), Duration::from_secs(10), both);
    set_state(&pipeline, gst::State::Null, "stop");
    assert!(both(&log), "{:?}", log.warnings);
    // Stopped, they change again.
    ctx.set_property("context-size", 4096u32);
    assert_eq!(ctx.property::<u32>("context-size"), 4096);
}

#[test]
fn answers_go_to_the_bus_when_only_the_video_of_vlmquery_is_linked() {
    let _s = serial();
    // The text pad is left unlinked: its NOT_LINKED is no error while video_src is linked.
    let run = run(&launch(
        "videotestsrc num-buffers=90 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=1000000000 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q max-tokens=4 \
         q.video_src ! fakesink sync=false filesrc location=pipelines/questions.srt ! subparse ! q.query",
    ));
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 3, "{:?} {:?}", run.answers, run.warnings);
    assert!(run.answers.iter().all(|a| status(a) == "answered"), "{:?}", run.answers);
}

// ----------------------------------------------------------------------------------------------
// Lifecycle

#[test]
fn a_flushing_seek_mid_answer_cancels_it_and_the_pipeline_goes_on() {
    let _s = serial();
    let pipeline = launch(
        "videotestsrc pattern=ball ! video/x-raw,format=RGB,width=64,height=48,framerate=5/1 \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q max-tokens=300 exact-tokens=true stream-tokens=true ! fakesink sync=false async=false \
         q.subtitle_src ! fakesink sync=false async=false",
    );
    let bin = pipeline.clone().downcast::<gst::Bin>().unwrap();
    let q = bin.by_name("q").unwrap();
    let frames = Frames::watch(&q.static_pad("sink").unwrap());
    // The cues on subtitle_src (its own task, paused by the flush and started again after it).
    let (cue, cues) = std::sync::mpsc::channel();
    q.static_pad("subtitle_src").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        if let Some(b) = info.buffer() {
            let _ = cue.send(gst_vlm_elements::meta::answer_of(b).and_then(|m| m.get::<String>("id").ok()));
        }
        gst::PadProbeReturn::Ok
    });
    // The answer's first streamed piece says it is being generated.
    let (first_piece, generating) = std::sync::mpsc::sync_channel(1);
    q.static_pad("src").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        let _ = first_piece.try_send(());
        gst::PadProbeReturn::Ok
    });
    let bus = pipeline.bus().unwrap();
    let mut log = Log::default();
    set_state(&pipeline, gst::State::Playing, "start");
    frames.wait(2, "before the seek");
    let long = q.emit_by_name::<Option<String>>("ask", &[&"Tell me a long story."]).unwrap();
    generating.recv_timeout(Duration::from_secs(60)).expect("the long answer is being generated");
    // Mid-answer: 300 tokens take several seconds here; what the bus has so far is no answer.
    while let Some(msg) = bus.pop() {
        log.record(&msg);
    }
    assert!(log.answers_to(&long).is_empty(), "{log:?}");
    let p = pipeline.clone();
    let seeked = within(Duration::from_secs(10), "the flushing seek", move || {
        p.seek_simple(gst::SeekFlags::FLUSH, gst::ClockTime::ZERO)
    });
    assert!(seeked.is_ok(), "the seek was refused: {seeked:?}");
    assert!(log.pump(&bus, Duration::from_secs(10), |l| !l.answers_to(&long).is_empty()), "{log:?}");
    let a = log.answers_to(&long)[0].clone();
    assert_eq!(status(&a), "cancelled", "{a}");
    assert!(field::<u32>(&a, "tokens") == 0 && field::<String>(&a, "text").is_empty(), "{a}");
    // The pipeline goes on: frames after the seek, and a question answered over them.
    let before = frames.newest();
    frames.wait(before + 1, "after the seek");
    let sink = q.static_pad("sink").unwrap();
    assert!(sink.send_event(QuestionEvent::event("What now?", Some("after-seek"), Some(3))));
    assert!(log.pump(&bus, Duration::from_secs(30), |l| !l.answers_to("after-seek").is_empty()), "{log:?}");
    let a = log.answers_to("after-seek")[0].clone();
    assert_eq!((status(&a), field::<u32>(&a, "tokens")), ("answered".into(), 3), "{a}");
    assert_eq!(log.answers_to(&long).len(), 1, "the cancelled question was answered again");
    // Its cue, the only one (the cancelled answer has none).
    let id = cues.recv_timeout(Duration::from_secs(10)).expect("a cue after the seek");
    assert_eq!(id.as_deref(), Some("after-seek"));
    assert!(cues.try_recv().is_err(), "one cue");
    set_state(&pipeline, gst::State::Null, "stop");
    assert_clean(&log);
}

/// A live-like pipeline over a moving ball whose sync bus handler keeps every `vlm-answer` as it
/// is posted (NULL flushes the bus) and, on the thread posting the first answer to question
/// `id` (or, `on_warning`, the first warning about it), runs `act` on the pipeline and sends
/// what it returns. `query`: vlmquery's further properties.
struct OnAnswer<T> {
    pipeline: gst::Element,
    sink: gst::Pad,
    frames: Frames,
    answers: std::sync::Arc<std::sync::Mutex<Vec<gst::Structure>>>,
    acted: std::sync::mpsc::Receiver<T>,
}

impl<T: Send + 'static> OnAnswer<T> {
    fn new(id: &'static str, act: impl Fn(&gst::Element) -> T + Send + Sync + 'static) -> OnAnswer<T> {
        Self::with(id, "", false, act)
    }

    fn with(
        id: &'static str,
        query: &str,
        on_warning: bool,
        act: impl Fn(&gst::Element) -> T + Send + Sync + 'static,
    ) -> OnAnswer<T> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let pipeline = launch(&format!(
            "videotestsrc pattern=ball ! video/x-raw,format=RGB,width=64,height=48,framerate=5/1 \
             ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 \
             ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
             ! vlmquery name=q exact-tokens=true {query} ! fakesink sync=false async=false"
        ));
        let q = pipeline.clone().downcast::<gst::Bin>().unwrap().by_name("q").unwrap();
        let sink = q.static_pad("sink").unwrap();
        let frames = Frames::watch(&sink);
        let answers = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
        let (acted_tx, acted) = std::sync::mpsc::channel();
        let (once, seen, weak) = (AtomicBool::new(false), std::sync::Arc::clone(&answers), pipeline.downgrade());
        pipeline.bus().unwrap().set_sync_handler(move |_, msg| {
            let about = match msg.view() {
                gst::MessageView::Warning(w) if on_warning => w.details().map(|d| d.to_owned()),
                _ => msg.structure().filter(|s| s.name() == "vlm-answer").map(|s| s.to_owned()),
            };
            if let Some(s) = about {
                if s.name() == "vlm-answer" {
                    seen.lock().unwrap().push(s.clone());
                }
                let first = s.get::<String>("id").is_ok_and(|i| i == id) && !once.swap(true, Ordering::AcqRel);
                if let Some(p) = weak.upgrade().filter(|_| first) {
                    let _ = acted_tx.send(act(&p));
                }
            }
            gst::BusSyncReply::Pass
        });
        OnAnswer { pipeline, sink, frames, answers, acted }
    }

    fn ask(&self, id: &str, text: &str, tokens: u32) {
        assert!(self.sink.send_event(QuestionEvent::event(text, Some(id), Some(tokens))));
    }

    /// The statuses of the answers to `id` once there is one (or `limit` has passed).
    fn statuses(&self, id: &str, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        loop {
            let of: Vec<String> = self
                .answers
                .lock()
                .unwrap()
                .iter()
                .filter(|a| a.get::<String>("id").is_ok_and(|i| i == id))
                .map(status)
                .collect();
            if !of.is_empty() || Instant::now() >= deadline {
                return of;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// An application that seeks with a flush from a sync bus handler, on the thread that posts a
/// `vlm-answer` (a player that restarts its clip on an answer): the seek returns, the question it
/// cancels gets its one `cancelled` answer, and the pipeline goes on. (It hung: the answers were
/// posted under the lock the flush takes to cancel the others.)
#[test]
fn a_flushing_seek_from_a_sync_bus_handler_on_an_answer_returns() {
    let _s = serial();
    let on = OnAnswer::new("seek-now", |p| p.seek_simple(gst::SeekFlags::FLUSH, gst::ClockTime::ZERO).is_ok());
    set_state(&on.pipeline, gst::State::Playing, "start");
    on.frames.wait(2, "before the questions");
    on.ask("seek-now", "Say something.", 2);
    on.ask("long", "Tell me a long story.", 300);
    let ok = on.acted.recv_timeout(Duration::from_secs(60)).expect("the seek from the sync handler returned");
    assert!(ok, "the seek was refused");
    assert_eq!(on.statuses("seek-now", Duration::ZERO), ["answered"]);
    assert_eq!(on.statuses("long", Duration::from_secs(10)), ["cancelled"]);
    // The pipeline goes on after the seek.
    let before = on.frames.newest();
    on.frames.wait(before + 1, "after the seek");
    on.ask("after-seek", "What now?", 3);
    assert_eq!(on.statuses("after-seek", Duration::from_secs(30)), ["answered"]);
    set_state(&on.pipeline, gst::State::Null, "stop");
    for id in ["seek-now", "long", "after-seek"] {
        assert_eq!(on.statuses(id, Duration::ZERO).len(), 1, "{id}");
    }
}

/// An application that stops its pipeline from a sync bus handler on a `vlm-answer` (stop after
/// the first answer), on the thread that posts it: NULL returns without waiting out the bound on
/// answering threads for that thread (the one stopping: the stop's warning says when it gives up
/// on one), and the question it cancels gets its one `cancelled` answer before the bus flushes.
#[test]
fn null_from_a_sync_bus_handler_on_an_answer_returns_without_waiting_for_itself() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let _s = serial();
    init();
    let gave_up = Arc::new(AtomicBool::new(false));
    let cat = gst::DebugCategory::get("vlmquery").expect("the plugin is registered");
    let threshold = cat.threshold();
    cat.set_threshold(threshold.max(gst::DebugLevel::Warning));
    let seen = Arc::clone(&gave_up);
    let log = gst::log::add_log_function(move |cat, _, _, _, _, _, message| {
        if cat.name() == "vlmquery" && message.get().is_some_and(|m| m.contains("thread is still running")) {
            seen.store(true, Ordering::Release);
        }
    });
    let on = OnAnswer::new("stop-now", |p| p.set_state(gst::State::Null).is_ok());
    set_state(&on.pipeline, gst::State::Playing, "start");
    on.frames.wait(2, "before the questions");
    on.ask("stop-now", "Say something.", 2);
    on.ask("long", "Tell me a long story.", 300);
    let ok = on.acted.recv_timeout(Duration::from_secs(60)).expect("NULL from the sync handler returned");
    gst::log::remove_log_function(log);
    cat.set_threshold(threshold);
    assert!(ok, "the change to NULL failed");
    assert!(!gave_up.load(Ordering::Acquire), "the stop waited out its bound for the thread that asked for it");
    assert_eq!(on.statuses("stop-now", Duration::ZERO), ["answered"]);
    assert_eq!(on.statuses("long", Duration::ZERO), ["cancelled"]);
}

/// The same from the warning a failed question posts (here: `placement` names no engine), which
/// went out under the lock that orders the answers and that a stop takes: it hung.
#[test]
fn null_from_a_sync_bus_handler_on_a_failed_questions_warning_returns() {
    let _s = serial();
    let on = OnAnswer::with("fail-now", "placement=nosuch", true, |p| p.set_state(gst::State::Null).is_ok());
    set_state(&on.pipeline, gst::State::Playing, "start");
    on.frames.wait(2, "before the question");
    on.ask("fail-now", "Say something.", 2);
    let ok = on.acted.recv_timeout(Duration::from_secs(60)).expect("NULL from the sync handler returned");
    assert!(ok, "the change to NULL failed");
    assert_eq!(on.statuses("fail-now", Duration::ZERO), ["failed"]);
}

/// An application that names its questions `q<N>` itself: a generated id passes over the ones it
/// took (the generated question was refused as a duplicate of the application's); a blank id
/// gets a generated one (it was taken as the id `""`, and the next blank one refused).
#[test]
fn generated_question_ids_pass_over_the_applications_own() {
    let _s = serial();
    let mut f = Fed::new("", "max-tokens=2", "");
    f.push_frames(1);
    let first = f.ask("One?").expect("accepted");
    let n: u64 = first[1..].parse().expect("a generated id is q<N>");
    let sink = f.q.static_pad("sink").unwrap();
    for taken in [n + 1, n + 2] {
        assert!(sink.send_event(QuestionEvent::event("Mine?", Some(&format!("q{taken}")), None)));
    }
    let generated = f.ask("Three?").expect("a generated id that is free");
    assert!(![first.clone(), format!("q{}", n + 1), format!("q{}", n + 2)].contains(&generated), "{generated}");
    // A blank id is none: each such question gets a generated id of its own.
    for blank in ["", "  "] {
        assert!(sink.send_event(QuestionEvent::event("Blank?", Some(blank), None)));
    }
    let bus = f.bus.clone();
    f.log.pump(&bus, Duration::from_secs(120), |l| l.answers.len() >= 6);
    let log = f.finish();
    assert_eq!(log.answers.len(), 6, "{:?}", log.answers);
    assert!(log.answers.iter().all(|a| status(a) == "answered"), "{:?}", log.answers);
    let ids: std::collections::HashSet<String> = log.answers.iter().map(|a| a.get::<String>("id").unwrap()).collect();
    assert_eq!(ids.len(), 6, "every answer has an id of its own: {ids:?}");
    assert!(ids.iter().all(|id| !id.trim().is_empty()), "{ids:?}");
    assert_clean(&log);
}

#[test]
fn two_pipelines_in_one_process_share_one_model_and_both_answer() {
    let _s = serial();
    let model = std::path::PathBuf::from(model());
    let mut one = Fed::new("", "", "");
    one.push_frames(1);
    let owners_alone = one.element("ctx").property::<u32>("model-owners");
    let mut two = Fed::new("", "", "");
    two.push_frames(1);
    let owners_both = two.element("ctx").property::<u32>("model-owners");
    assert_eq!(owners_both, one.element("ctx").property::<u32>("model-owners"), "one copy of the weights");
    assert!(
        owners_both > owners_alone,
        "the second pipeline did not share the loaded weights ({owners_alone} owners, then {owners_both})"
    );
    assert_eq!(owners_both as usize, vlm_runtime::models::model_owners(&model));
    eprintln!("model-owners: {owners_alone} with one pipeline, {owners_both} with two");
    let (a, b) = (one.ask("One?").unwrap(), two.ask("Two?").unwrap());
    assert_ne!(a, b, "generated question ids are unique in the process, across vlmquery elements");
    assert_eq!(status(&one.answer(&a, Duration::from_secs(60))), "answered");
    assert_eq!(status(&two.answer(&b, Duration::from_secs(60))), "answered");
    assert_clean(&one.finish());
    assert_clean(&two.finish());
}

/// Two streams through one vlmcontext (`extra` its properties), one vlmquery each (`q0`, `q1`),
/// fed by appsrc `src0` and `src1`.
fn two_streams(extra: &str) -> (gst::Element, gst::Bin, [gst_app::AppSrc; 2], [gst::Element; 2], [Frames; 2]) {
    let pipeline = launch(&format!(
        "vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf max-streams=2 {extra} \
         appsrc name=src0 format=time ! vlmencode name=enc0 mmproj=models/test-mmproj-mlp.gguf interval=0 cache-entries=0 min-change=0 \
           ! ctx.sink_0 ctx.src_0 ! vlmquery name=q0 max-tokens=4 ! fakesink sync=false async=false \
         appsrc name=src1 format=time ! vlmencode name=enc1 mmproj=models/test-mmproj-mlp.gguf interval=0 cache-entries=0 min-change=0 \
           ! ctx.sink_1 ctx.src_1 ! vlmquery name=q1 max-tokens=4 ! fakesink sync=false async=false"
    ));
    let bin = pipeline.clone().downcast::<gst::Bin>().unwrap();
    let src = ["src0", "src1"].map(|n| bin.by_name(n).unwrap().downcast::<gst_app::AppSrc>().unwrap());
    for s in &src {
        s.set_caps(Some(&video_caps(VideoFormat::Rgb, 64, 48)));
    }
    let q = ["q0", "q1"].map(|n| bin.by_name(n).unwrap());
    let frames = q.clone().map(|q| Frames::watch(&q.static_pad("sink").unwrap()));
    set_state(&pipeline, gst::State::Playing, "start");
    (pipeline, bin, src, q, frames)
}

fn push_rgb(src: &gst_app::AppSrc, from: u64, n: u64) {
    for i in from..from + n {
        let mut buffer = picture(VideoFormat::Rgb, 64, 48, i);
        buffer.get_mut().unwrap().set_pts(gst::ClockTime::from_mseconds(100 * i));
        assert_eq!(src.push_buffer(buffer), Ok(gst::FlowSuccess::Ok));
    }
}

fn ask_and_wait(q: &gst::Element, bus: &gst::Bus, log: &mut Log, text: &str) -> gst::Structure {
    let id = q.emit_by_name::<Option<String>>("ask", &[&text]).expect("accepted");
    assert!(log.pump(bus, Duration::from_secs(60), |l| !l.answers_of(q, &id).is_empty()), "no answer to {id}: {log:?}");
    log.pump(bus, Duration::from_millis(200), |_| false);
    let answers = log.answers_of(q, &id);
    assert_eq!(answers.len(), 1, "question {id} of {} must end in exactly one vlm-answer", q.name());
    answers[0].clone()
}

#[test]
fn a_full_history_stops_one_stream_while_the_other_keeps_answering() {
    let _s = serial();
    // 512 cells, 256 kept for answers: a few 36-row frames fill a stream's history.
    let (pipeline, bin, src, q, frames) = two_streams("context-size=512 history-policy=stop");
    let bus = pipeline.bus().unwrap();
    let mut log = Log::default();
    push_rgb(&src[0], 0, 12);
    push_rgb(&src[1], 0, 1);
    // Every frame passes vlmcontext; the ones past the full history without joining it.
    let ctx = bin.by_name("ctx").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ctx.property::<u64>("frames-dropped") + frames[0].newest() < 12 && Instant::now() < deadline {
        log.pump(&bus, Duration::from_millis(100), |_| false);
    }
    frames[1].wait(1, "stream 1");
    let dropped = ctx.property::<u64>("frames-dropped");
    assert!(dropped > 0 && frames[0].newest() + dropped == 12, "{} joined, {dropped} dropped", frames[0].newest());
    assert!(
        log.warnings.iter().any(|w| w.contains("sink_0") && w.contains("history full")),
        "no warning naming the full stream: {:?}",
        log.warnings
    );
    // The full stream still answers from its history; a question that no longer fits after it
    // fails with the reason; the other stream answers.
    let a = ask_and_wait(&q[0], &bus, &mut log, "Still?");
    assert_eq!((status(&a), field::<u64>(&a, "frames")), ("answered".into(), frames[0].newest()), "{a}");
    let a = ask_and_wait(&q[0], &bus, &mut log, &words(300));
    assert_eq!(status(&a), "failed", "{a}");
    assert!(field::<String>(&a, "reason").contains("does not fit"), "{a}");
    let a = ask_and_wait(&q[1], &bus, &mut log, "And you?");
    assert_eq!((status(&a), field::<String>(&a, "stream")), ("answered".into(), "sink_1".into()), "{a}");
    set_state(&pipeline, gst::State::Null, "stop");
    assert_clean(&log);
}

/// A camera beyond `max-streams` (every engine's sequences taken) is refused with a WARNING
/// naming its pad, its frames pass without joining a history, and the other stream goes on
/// answering (the stream's open failed with an ERROR before, ending the whole pipeline). Which
/// of the two opens first is up to their streaming threads.
#[test]
fn a_stream_beyond_max_streams_is_refused_with_a_warning_and_the_other_answers() {
    let _s = serial();
    let (pipeline, bin, src, q, frames) = two_streams("max-streams=1");
    let bus = pipeline.bus().unwrap();
    let mut log = Log::default();
    let passed = [0, 1].map(|i| count_buffers(&q[i].static_pad("sink").unwrap()));
    push_rgb(&src[0], 0, 3);
    push_rgb(&src[1], 0, 3);
    let refused_pad = |l: &Log| {
        ["sink_0", "sink_1"].into_iter().position(|pad| {
            l.warnings.iter().any(|w| w.contains(&format!("{pad}: no stream sequence")) && w.contains("max-streams=1"))
        })
    };
    assert!(log.pump(&bus, Duration::from_secs(60), |l| refused_pad(l).is_some()), "no warning: {log:?}");
    let refused = refused_pad(&log).unwrap();
    let open = 1 - refused;
    frames[open].wait(3, "the stream that opened");
    let deadline = Instant::now() + Duration::from_secs(60);
    while passed[refused].load(Ordering::Acquire) < 3 && Instant::now() < deadline {
        log.pump(&bus, Duration::from_millis(100), |_| false);
    }
    assert_eq!(passed[refused].load(Ordering::Acquire), 3, "the refused stream's frames pass");
    assert_eq!(frames[refused].newest(), 0, "none joined a history");
    assert_eq!(log.warnings.iter().filter(|w| w.contains("max-streams")).count(), 1, "said once: {:?}", log.warnings);
    let a = ask_and_wait(&q[open], &bus, &mut log, "Still there?");
    assert_eq!((status(&a), field::<u64>(&a, "frames")), ("answered".into(), 3), "{a}");
    // The open stream's camera goes away (its branch stopped, its pad released): the refused
    // stream opens at its next frame, announces itself downstream, and answers.
    let enc = bin.by_name(&format!("enc{open}")).unwrap();
    for e in [src[open].upcast_ref::<gst::Element>(), &enc] {
        e.set_locked_state(true);
        e.set_state(gst::State::Null).unwrap();
    }
    let ctx = bin.by_name("ctx").unwrap();
    let sink = enc.static_pad("src").unwrap().peer().unwrap();
    enc.static_pad("src").unwrap().unlink(&sink).unwrap();
    ctx.release_request_pad(&sink);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut next = 3;
    while frames[refused].newest() == 0 && Instant::now() < deadline {
        push_rgb(&src[refused], next, 1);
        next += 1;
        log.pump(&bus, Duration::from_millis(200), |_| false);
    }
    assert!(frames[refused].newest() > 0, "the refused stream never opened");
    let a = ask_and_wait(&q[refused], &bus, &mut log, "And you?");
    assert_eq!(status(&a), "answered", "{a}");
    drop(bin);
    set_state(&pipeline, gst::State::Null, "stop");
    assert_clean(&log);
}

/// The part upstream of a `vlmquery` that plays on is stopped (to be rebuilt with another
/// model, say): `vlmcontext`'s engines and weights are freed, not kept by `vlmquery`'s reference
/// to the stream it saw last.
#[test]
fn a_stopped_vlmcontext_frees_its_engines_while_vlmquery_plays_on() {
    let _s = serial();
    let f = Fed::new("", "", "");
    f.push_frames(2);
    let ctx = f.element("ctx");
    assert!(ctx.property::<u32>("model-owners") > 0);
    f.q.set_locked_state(true);
    for name in ["src", "enc", "ctx"] {
        f.element(name).set_state(gst::State::Null).unwrap();
    }
    // (The sinks' last buffers carry the frames' embeddings, which hold the projector.)
    for sink in f.bin.iterate_sinks().into_iter().flatten() {
        sink.set_property("enable-last-sample", false);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while ctx.property::<u32>("model-owners") > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(ctx.property::<u32>("model-owners"), 0, "the weights are still loaded");
    f.q.set_locked_state(false);
}

/// Video reaching vlmquery without a vlmcontext before it: one WARNING says so (questions
/// waited for a frame that never came, and nothing said why); video through vlmcontext has none.
#[test]
fn video_without_a_vlmcontext_is_warned_about() {
    let _s = serial();
    let plain = run(&launch("videotestsrc num-buffers=5 ! vlmquery ! fakesink sync=false"));
    assert!(plain.errors.is_empty(), "{:?}", plain.errors);
    let said: Vec<_> = plain.warnings.iter().filter(|w| w.contains("no vlmcontext stream")).collect();
    assert_eq!(said.len(), 1, "{:?}", plain.warnings);
    let through = run(&launch(
        "videotestsrc num-buffers=5 ! video/x-raw,width=64,height=48 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery ! fakesink sync=false",
    ));
    assert!(through.errors.is_empty(), "{:?}", through.errors);
    assert!(!through.warnings.iter().any(|w| w.contains("vlmcontext")), "{:?}", through.warnings);
}

/// An engine fault cannot be provoked through the elements' inputs (a bad file is refused before
/// an engine starts, bad questions and frames fail only their own work), so the test injects
/// one through the runtime's API: a panic on the engine thread of stream 0. Its questions and
/// ingestion then fail with an error naming the stream, and stream 1, on its own engine, keeps
/// answering; NULL completes.
#[test]
fn an_engine_fault_on_one_stream_fails_it_while_the_other_keeps_answering() {
    let _s = serial();
    // One stream per engine: each lives on its own.
    let (pipeline, _bin, src, q, frames) = two_streams("engines=a:cpu:1,b:cpu:1 max-streams=1");
    let bus = pipeline.bus().unwrap();
    let mut log = Log::default();
    push_rgb(&src[0], 0, 1);
    push_rgb(&src[1], 0, 1);
    frames[0].wait(1, "stream 0");
    frames[1].wait(1, "stream 1");
    let stream = vlm_runtime::stream::lookup(frames[0].stream().unwrap()).expect("stream 0 is open");
    let other = vlm_runtime::stream::lookup(frames[1].stream().unwrap()).expect("stream 1 is open");
    let healthy = other.engine().name().to_owned();
    assert_ne!(stream.engine().name(), healthy, "one stream per engine");
    drop(other);
    // call: returns once the engine thread has run the job (here: died of it).
    let fault = stream.engine().call(|_| -> () { panic!("injected engine fault") });
    assert!(fault.is_err(), "the engine survived a panic");
    drop(stream);
    // Stream 0: a question fails with the reason, a new frame's ingestion fails with an error
    // naming the stream.
    let a = ask_and_wait(&q[0], &bus, &mut log, "Are you there?");
    assert_eq!(status(&a), "failed", "{a}");
    eprintln!("stream 0 after the fault: {}", field::<String>(&a, "reason"));
    push_rgb(&src[0], 1, 1);
    assert!(log.pump(&bus, Duration::from_secs(30), |l| !l.errors.is_empty()), "no error for stream 0: {log:?}");
    assert!(log.errors.iter().any(|e| e.contains("sink_0")), "the error must name the stream: {:?}", log.errors);
    // Stream 1 keeps answering, over new frames too.
    push_rgb(&src[1], 1, 2);
    frames[1].wait(3, "stream 1 after the fault");
    for i in 0..2 {
        let a = ask_and_wait(&q[1], &bus, &mut log, "And you?");
        assert_eq!(status(&a), "answered", "question {i} on stream 1: {a}");
        assert_eq!(field::<String>(&a, "engine"), healthy, "{a}");
    }
    set_state(&pipeline, gst::State::Null, "stop");
}

/// A remote engine through the elements (`engines=local:cpu:1,far:rpc:127.0.0.1:PORT`, one
/// stream per engine, flash attention as docs/deploy.md advises for RPC): placed there, a question is
/// answered on it like on the local engine (the same greedy text, after importing a snapshot of
/// the local stream's history); then its `rpc-server` is killed
/// while it answers. That question fails with a reason naming the endpoint, later questions of
/// the local stream are answered locally, the stream that lived there fails with an error naming
/// it (it would move to the local engine, which has no free stream sequence at `max-streams=1`;
/// `runtime/tests/rpc.rs` moves one), and NULL completes.
#[test]
fn an_rpc_engine_answers_through_the_elements_and_its_server_dying_fails_only_its_work() {
    let _s = serial();
    let mut server = RpcServer::start();
    let endpoint = server.endpoint.clone();
    let (pipeline, _bin, src, q, frames) =
        two_streams(&format!("engines=local:cpu:1,far:rpc:{endpoint} max-streams=1 flash-attention=true"));
    let bus = pipeline.bus().unwrap();
    let mut log = Log::default();
    push_rgb(&src[0], 0, 2);
    push_rgb(&src[1], 0, 2);
    frames[0].wait(2, "stream 0");
    frames[1].wait(2, "stream 1");
    // Which stream lives on the local engine (the placer puts them by measured cost).
    let resident = |i: usize| {
        let id = frames[i].stream().unwrap();
        vlm_runtime::stream::lookup(id).expect("open").engine().name().to_owned()
    };
    let (home, away) = if resident(0) == "local" { (0, 1) } else { (1, 0) };
    assert_eq!((resident(home).as_str(), resident(away).as_str()), ("local", "far"));
    let (home_q, home_src) = (&q[home], &src[home]);

    home_q.set_property("placement", "local");
    let local = ask_and_wait(home_q, &bus, &mut log, "What is in the picture?");
    home_q.set_property("placement", "far");
    let far = ask_and_wait(home_q, &bus, &mut log, "What is in the picture?");
    assert_eq!((status(&local), field::<String>(&local, "engine")), ("answered".into(), "local".into()), "{local}");
    assert_eq!((status(&far), field::<String>(&far, "engine")), ("answered".into(), "far".into()), "{far}");
    // A snapshot of the local stream imported there: with flash attention an import costs ~1/100
    // of a replay over RPC (docs/benchmarks.md), so the placer takes it.
    assert_eq!(field::<String>(&far, "path"), "import", "{far}");
    assert_eq!(field::<String>(&far, "text"), field::<String>(&local, "text"), "the RPC engine answered differently");

    // A long answer on the RPC engine; its server is killed once the first piece is out.
    let (piece_tx, piece_rx) = std::sync::mpsc::sync_channel(1);
    home_q.static_pad("src").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        let _ = piece_tx.try_send(());
        gst::PadProbeReturn::Ok
    });
    home_q.set_property("max-tokens", 2000u32);
    home_q.set_property("exact-tokens", true);
    home_q.set_property("stream-tokens", true);
    let id = home_q.emit_by_name::<Option<String>>("ask", &[&"Describe the picture at length."]).expect("accepted");
    piece_rx.recv_timeout(Duration::from_secs(60)).expect("the RPC engine produced no text");
    server.kill();
    assert!(log.pump(&bus, Duration::from_secs(60), |l| !l.answers_of(home_q, &id).is_empty()), "no answer to {id}");
    let failed = log.answers_of(home_q, &id)[0].clone();
    assert_eq!(status(&failed), "failed", "{failed}");
    assert!(field::<String>(&failed, "reason").contains(&endpoint), "the reason must name the endpoint: {failed}");

    // The placer passes the failed engine over; the local stream goes on, over new frames too.
    home_q.set_property("placement", "auto");
    home_q.set_property("max-tokens", 4u32);
    home_q.set_property("exact-tokens", false);
    push_rgb(home_src, 2, 1);
    frames[home].wait(3, "the local stream after the failure");
    let after = ask_and_wait(home_q, &bus, &mut log, "And now?");
    assert_eq!((status(&after), field::<String>(&after, "engine")), ("answered".into(), "local".into()), "{after}");
    // The stream that lived on the RPC engine has nowhere to go: it fails with an error naming
    // the endpoint.
    push_rgb(&src[away], 2, 1);
    assert!(log.pump(&bus, Duration::from_secs(30), |l| !l.errors.is_empty()), "no error for the far stream: {log:?}");
    assert!(log.errors.iter().any(|e| e.contains(&endpoint)), "the error must name the endpoint: {:?}", log.errors);
    set_state(&pipeline, gst::State::Null, "stop");
}
