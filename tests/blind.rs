//! No blind answers (issue 34): a question bound to a stream that has no registered frame yet
//! waits for the stream's first frame instead of being answered from none, holds its
//! `max-questions` slot meanwhile, and ends in exactly one `vlm-answer`: answered over at least
//! one frame once frames come, `failed` with a reason at the video's EOS without any frame,
//! `cancelled` by a stop. Appsrc-fed pipelines (`badinput/harness.rs`), every wait bounded.

mod common;
#[path = "badinput/harness.rs"]
#[allow(dead_code)] // shared with the bad-input tests
mod harness;

use std::time::Duration;

use gst::prelude::*;
use gst_video::VideoFormat;
use harness::*;

/// The `reason` of a question whose video ended before any frame was registered.
const NO_FRAME: &str = "the video ended before any frame was registered";

fn ms(n: u64) -> Option<gst::ClockTime> {
    Some(gst::ClockTime::from_mseconds(n))
}

#[test]
fn an_ask_before_the_first_frame_waits_for_it() {
    let _s = serial();
    // Asked at once: the model may still be loading and no video has reached vlmquery.
    let mut f = Fed::new("", "", "");
    let id = f.ask("What is in the picture?").expect("ask before any frame is accepted");
    let bus = f.bus.clone();
    // It waits: no answer (and no failure) while there is no frame.
    assert!(!f.log.pump(&bus, Duration::from_millis(1500), |l| !l.answers_to(&id).is_empty()), "{:?}", f.log);
    f.push_frames(2);
    let a = f.answer(&id, Duration::from_secs(120));
    assert_eq!(status(&a), "answered", "{a}");
    assert!(field::<u64>(&a, "frames") >= 1, "answered from no frames: {a}");
    assert!(!field::<String>(&a, "stream").is_empty(), "the stream it waited for is named: {a}");
    let log = f.finish();
    assert_clean(&log);
    assert_eq!(log.answers_to(&id).len(), 1, "{log:?}");
}

#[test]
fn a_video_without_frames_fails_the_waiting_question_at_eos() {
    let _s = serial();
    let f = Fed::new("", "max-questions=1", "");
    let id = f.ask("What is in the picture?").expect("ask before any frame is accepted");
    // The waiting question holds its max-questions slot.
    assert_eq!(f.ask("And now?"), None, "a second question found a free slot");
    let log = f.finish();
    assert_clean(&log);
    let answers = log.answers_to(&id);
    assert_eq!(answers.len(), 1, "exactly one vlm-answer: {log:?}");
    let a = answers[0];
    assert_eq!(status(a), "failed", "{a}");
    assert_eq!(field::<String>(a, "reason"), NO_FRAME, "{a}");
    assert_eq!((field::<u64>(a, "frames"), field::<u32>(a, "tokens")), (0, 0), "{a}");
    assert!(log.warnings.iter().any(|w| w.contains(NO_FRAME)), "{:?}", log.warnings);
    assert_eq!(log.answers.len(), 1, "{log:?}");
}

#[test]
fn a_timed_question_before_the_first_frame_binds_to_it() {
    let _s = serial();
    let mut f = Fed::new("", "", "appsrc name=qs format=time caps=text/x-raw,format=utf8 ! q.query");
    let qs = f.element("qs").downcast::<gst_app::AppSrc>().unwrap();
    // A subtitle question at 0.1 s, the video's first frame at 0.5 s.
    let mut question = gst::Buffer::from_slice(b"What is in the picture?");
    question.get_mut().unwrap().set_pts(ms(100));
    assert_eq!(qs.push_buffer(question), Ok(gst::FlowSuccess::Ok));
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..3 {
        f.push(VideoFormat::Rgb, 64, 48, i, ms(500 + 100 * i));
    }
    f.frames.wait(3, "the video");
    let bus = f.bus.clone();
    assert!(f.log.pump(&bus, Duration::from_secs(120), |l| !l.answers.is_empty()), "{:?}", f.log);
    let a = f.log.answers[0].clone();
    assert_eq!(status(&a), "answered", "{a}");
    assert!(field::<u64>(&a, "frames") >= 1, "answered from no frames: {a}");
    assert_eq!(qs.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    let log = f.finish();
    assert_clean(&log);
    assert_eq!(log.answers.len(), 1, "exactly one vlm-answer: {log:?}");
}

/// A camera at a low rate: a question timed in the first half of a frame's duration (here from
/// the caps' 10 frames/s) binds to that frame as soon as it passes, not when the next frame comes.
#[test]
fn a_timed_question_binds_to_the_frame_that_lasts_past_its_time() {
    let _s = serial();
    let mut f = Fed::new("", "", "appsrc name=qs format=time caps=text/x-raw,format=utf8 ! q.query");
    let qs = f.element("qs").downcast::<gst_app::AppSrc>().unwrap();
    for i in 0..3 {
        f.push(VideoFormat::Rgb, 64, 48, i, ms(100 * i));
    }
    f.frames.wait(3, "the video");
    // At 220 ms, early in the third frame (200-300 ms); no frame follows until it is answered.
    let mut question = gst::Buffer::from_slice(b"What is in the picture?");
    question.get_mut().unwrap().set_pts(ms(220));
    assert_eq!(qs.push_buffer(question), Ok(gst::FlowSuccess::Ok));
    let bus = f.bus.clone();
    assert!(f.log.pump(&bus, Duration::from_secs(120), |l| !l.answers.is_empty()), "{:?}", f.log);
    let a = f.log.answers[0].clone();
    assert_eq!(status(&a), "answered", "{a}");
    assert_eq!(field::<u64>(&a, "frames"), 3, "bound to the frame at 200 ms: {a}");
    assert_eq!(qs.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    let log = f.finish();
    assert_clean(&log);
    assert_eq!(log.answers.len(), 1, "exactly one vlm-answer: {log:?}");
}

#[test]
fn a_stop_cancels_a_question_waiting_for_the_first_frame() {
    let _s = serial();
    let mut f = Fed::new("", "", "");
    let id = f.ask("What is in the picture?").expect("ask before any frame is accepted");
    set_state(&f.pipeline, gst::State::Ready, "stop");
    let bus = f.bus.clone();
    assert!(f.log.pump(&bus, Duration::from_secs(10), |l| !l.answers_to(&id).is_empty()), "{:?}", f.log);
    f.log.pump(&bus, Duration::from_millis(300), |_| false);
    let answers = f.log.answers_to(&id);
    assert_eq!(answers.len(), 1, "exactly one vlm-answer: {:?}", f.log);
    assert_eq!(status(answers[0]), "cancelled", "{}", answers[0]);
}
