//! The change gate of `vlmencode` (`min-change`, `max-unchanged`, `frames-unchanged`): what did
//! not change is not encoded, what moved is, and what the gate lets through answers as a full
//! encode of the same pictures would.

mod common;

use common::*;
use gst::prelude::*;
use gst_check::Harness;
use gst_vlm_elements::meta::VlmFrameMeta;

/// Encode `pattern` at 320x240, 30 frames/s for 10 s, one due frame a second; returns
/// (frames-encoded, frames-unchanged).
fn encodes(pattern: &str, settings: &str) -> (u64, u64) {
    let pipeline = launch(&format!(
        "videotestsrc pattern={pattern} num-buffers=300 ! video/x-raw,width=320,height=240,framerate=30/1 ! videoconvert \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf model=models/SmolLM2-135M-Instruct.Q4_1.gguf {settings} \
         ! fakesink"
    ));
    let run = run_to_eos(&pipeline, 240);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let enc = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("enc").unwrap();
    let counts = (enc.property::<u64>("frames-encoded"), enc.property::<u64>("frames-unchanged"));
    pipeline.set_state(gst::State::Null).unwrap();
    counts
}

#[test]
fn a_still_scene_with_a_noise_patch_is_encoded_once_per_cap() {
    // smpte: still bars and a patch of fresh noise every frame (5-6% of the pixels change).
    // Due at 0..9 s; the cap re-encodes the unchanged picture at 4 s and 8 s.
    assert_eq!(encodes("smpte", "max-unchanged=4000000000"), (3, 7));
    // Without the gate every due frame is encoded.
    assert_eq!(encodes("smpte", "min-change=0"), (10, 0));
    // The largest cap is never reached: the picture is encoded once.
    assert_eq!(encodes("smpte", &format!("max-unchanged={}", u64::MAX - 1)), (1, 9));
}

#[test]
fn a_moving_ball_is_encoded_at_every_due_frame() {
    // The ball changes under 1% of the pixels from one frame to the next, but all one way in
    // the blocks it leaves and enters.
    assert_eq!(encodes("ball", ""), (10, 0));
}

fn gray(level: u8) -> gst::Buffer {
    gst::Buffer::from_mut_slice(vec![level; 64 * 48 * 3])
}

fn rgb_caps(width: i32, height: i32) -> gst::Caps {
    gst::Caps::builder("video/x-raw")
        .field("format", "RGB")
        .field("width", width)
        .field("height", height)
        .field("framerate", gst::Fraction::new(1, 1))
        .build()
}

/// Push `buffer` at `secs` and return whether it left with embeddings, or held.
fn push(h: &mut Harness, mut buffer: gst::Buffer, secs: u64) -> &'static str {
    buffer.get_mut().unwrap().set_pts(gst::ClockTime::from_seconds(secs));
    let out = h.push_and_pull(buffer).unwrap();
    match out.meta::<VlmFrameMeta>() {
        Some(m) if m.frame().is_some() => "encoded",
        Some(m) if m.held() => "held",
        _ => "passed",
    }
}

/// A `vlmencode` encoding every frame with no embedding cache, `tile_reuse` set, in a harness
/// fed 64x48 RGB (its bus given first, when there is one).
fn harness(tile_reuse: &str, bus: Option<&gst::Bus>) -> (gst::Element, Harness) {
    init();
    let e = gst::ElementFactory::make("vlmencode")
        .property("mmproj", mmproj())
        .property("model", model())
        .property("interval", 0u64)
        .property("cache-entries", 0u32)
        .property_from_str("tile-reuse", tile_reuse)
        .build()
        .unwrap();
    if let Some(bus) = bus {
        e.set_bus(Some(bus));
    }
    let mut h = Harness::with_element(&e, Some("sink"), Some("src"));
    h.set_src_caps(rgb_caps(64, 48));
    (e, h)
}

#[test]
fn new_caps_and_a_flush_start_the_gate_afresh() {
    let (e, mut h) = harness("threshold", None);
    let mut seen = vec![push(&mut h, gray(100), 0), push(&mut h, gray(100), 1), push(&mut h, gray(160), 2)];
    // The same caps again change nothing; a new size does (the harness sends a new segment with
    // new caps, which starts afresh too).
    assert!(h.push_event(gst::event::Caps::new(&rgb_caps(64, 48))));
    seen.push(push(&mut h, gray(160), 3));
    h.set_src_caps(rgb_caps(32, 24));
    seen.push(push(&mut h, gst::Buffer::from_mut_slice(vec![160u8; 32 * 24 * 3]), 4));
    seen.push(push(&mut h, gst::Buffer::from_mut_slice(vec![160u8; 32 * 24 * 3]), 5));
    assert!(h.push_event(gst::event::FlushStart::new()));
    assert!(h.push_event(gst::event::FlushStop::new(true)));
    h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<gst::ClockTime>::new()));
    seen.push(push(&mut h, gst::Buffer::from_mut_slice(vec![160u8; 32 * 24 * 3]), 6));
    assert_eq!(seen, ["encoded", "held", "encoded", "held", "encoded", "held", "encoded"]);
    assert_eq!(e.property::<u64>("frames-unchanged"), 3);
    assert_eq!(e.property::<u64>("frames-encoded"), 4);
}

/// A buffer smaller than the `VideoMeta` on it says (GStreamer maps such a frame without checking
/// how far its planes reach) is not read past its end: as GstVideoFilter does with an invalid
/// buffer, a warning naming its size, and the frame passes without embeddings while the stream
/// goes on; the next due frame is encoded though its picture did not change.
#[test]
fn a_buffer_smaller_than_its_video_meta_says_passes_with_a_warning() {
    init();
    let bus = gst::Bus::new();
    let (e, mut h) = harness("threshold", Some(&bus));
    assert_eq!(push(&mut h, gray(100), 0), "encoded");
    let mut short = gst::Buffer::from_mut_slice(vec![0u8; 64]);
    gst_video::VideoMeta::add_full(
        short.get_mut().unwrap(),
        gst_video::VideoFrameFlags::empty(),
        gst_video::VideoFormat::Rgb,
        64,
        48,
        &[0],
        &[64 * 3],
    )
    .unwrap();
    assert_eq!(push(&mut h, short, 1), "passed");
    let warning =
        bus.timed_pop_filtered(gst::ClockTime::from_seconds(60), &[gst::MessageType::Warning]).expect("a warning");
    let gst::MessageView::Warning(warning) = warning.view() else { unreachable!() };
    assert!(warning.error().message().contains("64 bytes is smaller than its video meta"), "{}", warning.error());
    assert!(bus.pop_filtered(&[gst::MessageType::Error]).is_none(), "no error");
    assert_eq!(e.property::<u64>("frames-skipped"), 1);
    assert_eq!(push(&mut h, gray(100), 2), "encoded");
    assert_eq!(push(&mut h, gray(100), 3), "held");
}

/// `vlm-frame-not-taken` from downstream (vlmcontext skipped the frame, had no free stream or a
/// full history): the history lacks the picture the gate compares with, so the next due frame
/// is encoded whether or not it changed.
#[test]
fn a_frame_not_taken_downstream_makes_the_next_due_frame_encoded() {
    let (_e, mut h) = harness("threshold", None);
    assert_eq!(push(&mut h, gray(100), 0), "encoded");
    assert_eq!(push(&mut h, gray(100), 1), "held");
    assert!(h.push_upstream_event(gst_vlm_elements::events::NotTakenEvent::event()));
    assert_eq!(push(&mut h, gray(100), 2), "encoded");
    assert_eq!(push(&mut h, gray(100), 3), "held");
}

/// A gate turned off and on again starts afresh: it held a frame against the picture encoded
/// before it was off (a newer one had been encoded meanwhile).
#[test]
fn a_gate_turned_on_again_starts_afresh() {
    let (e, mut h) = harness("off", None);
    let mut seen = vec![push(&mut h, gray(100), 0)];
    e.set_property("min-change", 0.0);
    seen.push(push(&mut h, gray(160), 1));
    e.set_property("min-change", 0.001);
    seen.push(push(&mut h, gray(100), 2));
    seen.push(push(&mut h, gray(100), 3));
    assert_eq!(seen, ["encoded", "encoded", "encoded", "held"]);
}

/// Frames (gray level, second) through the three elements, then a question timed at 4.5 s;
/// returns its `vlm-answer`, vlmencode's frames-unchanged and, for each video buffer reaching
/// vlmquery, whether it was held and the frame number it carries.
fn answer(frames: &[(u8, u64)], settings: &str) -> (gst::Structure, u64, Vec<(bool, Option<u64>)>) {
    let srt = std::env::temp_dir().join(format!("vlm-gate-{}-{}.srt", std::process::id(), frames.len()));
    std::fs::write(&srt, "1\n00:00:04,500 --> 00:00:05,000\nWhat changed?\n").unwrap();
    let pipeline = launch(&format!(
        "appsrc name=src format=time caps=video/x-raw,format=RGB,width=64,height=48,framerate=1/1 \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf interval=0 {settings} \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q max-tokens=8 ! fakesink sync=false \
         filesrc location={} ! subparse ! q.query",
        srt.display()
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
    let seen_too = std::sync::Arc::clone(&seen);
    bin.by_name("q").unwrap().static_pad("sink").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        if let Some(m) = info.buffer().and_then(|b| b.meta::<VlmFrameMeta>()) {
            seen_too.lock().unwrap().push((m.held(), m.position().map(|p| p.1)));
        }
        gst::PadProbeReturn::Ok
    });
    let src = bin.by_name("src").unwrap().downcast::<gst_app::AppSrc>().unwrap();
    for &(level, secs) in frames {
        let mut b = gray(level);
        b.get_mut().unwrap().set_pts(gst::ClockTime::from_seconds(secs));
        b.get_mut().unwrap().set_duration(gst::ClockTime::from_seconds(1));
        src.push_buffer(b).unwrap();
    }
    src.end_of_stream().unwrap();
    let run = run_to_eos(&pipeline, 240);
    let _ = std::fs::remove_file(&srt);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 1, "{:?}", run.answers);
    let enc = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("enc").unwrap();
    let unchanged = enc.property::<u64>("frames-unchanged");
    pipeline.set_state(gst::State::Null).unwrap();
    let seen = seen.lock().unwrap().clone();
    (run.answers[0].clone(), unchanged, seen)
}

#[test]
fn held_duplicates_answer_as_the_changed_frames_alone_with_the_pictures_age() {
    // With the gate (default), the repeated pictures are held: the history is A, B, C as if
    // only the changes had been sent; the question at 4.5 s binds to B (captured at 3 s).
    let (gated, unchanged, seen) = answer(&[(60, 0), (60, 1), (60, 2), (120, 3), (120, 4), (180, 5)], "");
    assert_eq!(unchanged, 3);
    // Each held buffer carries the number of the frame that stands for it.
    let (frame, held) = (|n| (false, Some(n)), |n| (true, Some(n)));
    assert_eq!(seen, [frame(1), held(1), held(1), frame(2), held(2), frame(3)]);
    let (plain, none, _) = answer(&[(60, 0), (120, 3), (180, 5)], "min-change=0");
    assert_eq!(none, 0);
    for a in [&gated, &plain] {
        assert_eq!(a.get::<&str>("status").unwrap(), "answered", "{a}");
        assert_eq!(a.get::<u64>("frames").unwrap(), 2, "{a}");
        assert_eq!(a.get::<f64>("picture-age-ms").unwrap(), 1500.0, "{a}");
    }
    assert_eq!(gated.get::<&str>("text").unwrap(), plain.get::<&str>("text").unwrap());
}

/// A frame `max-unchanged` encodes again though it did not change does not hold the questions
/// about its time: the frame encoded last stands for it at once (`vlm-standing`), and the
/// refreshed picture joins the history after its encode, for the questions after it.
#[test]
fn a_question_at_a_refresh_binds_to_the_standing_frame_during_its_encode() {
    let pipeline = launch(
        "appsrc name=src format=time caps=video/x-raw,format=RGB,width=64,height=48,framerate=1/1 \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf interval=0 max-unchanged=2000000000 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q max-tokens=4 ! fakesink sync=false \
         appsrc name=qs format=time caps=text/x-raw,format=utf8 ! q.query",
    );
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    // The refreshed frame (at 2 s) is held back after its encode until the question is answered.
    let (answered, wait) = std::sync::mpsc::channel::<()>();
    let wait = std::sync::Mutex::new(wait);
    let held_back = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held_too = std::sync::Arc::clone(&held_back);
    let two = gst::ClockTime::from_seconds(2);
    bin.by_name("enc").unwrap().static_pad("src").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        if info.buffer().is_some_and(|b| b.pts() == Some(two)) {
            held_too.store(true, std::sync::atomic::Ordering::SeqCst);
            // (Until the answer came, or the test ended: the sender dropped.)
            let _ = wait.lock().unwrap().recv();
            held_too.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        gst::PadProbeReturn::Ok
    });
    let src = bin.by_name("src").unwrap().downcast::<gst_app::AppSrc>().unwrap();
    let qs = bin.by_name("qs").unwrap().downcast::<gst_app::AppSrc>().unwrap();
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    // Encoded at 0 s, held at 1 s, the same picture again at 2 s: the cap (2 s) is reached.
    for secs in 0..3 {
        let mut b = gray(60);
        b.get_mut().unwrap().set_pts(gst::ClockTime::from_seconds(secs));
        b.get_mut().unwrap().set_duration(gst::ClockTime::SECOND);
        src.push_buffer(b).unwrap();
    }
    let mut q = gst::Buffer::from_slice(b"What is in the picture?");
    q.get_mut().unwrap().set_pts(two);
    qs.push_buffer(q).unwrap();
    let answer = |bus: &gst::Bus| loop {
        let types = [gst::MessageType::Element, gst::MessageType::Error];
        let msg = bus.timed_pop_filtered(gst::ClockTime::from_seconds(120), &types).expect("a vlm-answer");
        if let gst::MessageView::Error(e) = msg.view() {
            panic!("{:?}", e.error());
        }
        if let Some(s) = msg.structure().filter(|s| s.name() == "vlm-answer") {
            break s.to_owned();
        }
    };
    let first = answer(&bus);
    let during_refresh = held_back.load(std::sync::atomic::Ordering::SeqCst);
    answered.send(()).unwrap();
    assert!(during_refresh, "answered only after the refreshed frame left vlmencode: {first}");
    assert_eq!(first.get::<&str>("status").unwrap(), "answered", "{first}");
    assert_eq!(first.get::<u64>("frames").unwrap(), 1, "bound to the frame encoded at 0 s: {first}");
    assert_eq!(first.get::<f64>("picture-age-ms").unwrap(), 2000.0, "{first}");
    // The refreshed picture joins the history: a question after it (at 3.2 s, the same picture
    // held at 3 s) binds to it.
    let mut b = gray(60);
    b.get_mut().unwrap().set_pts(gst::ClockTime::from_seconds(3));
    b.get_mut().unwrap().set_duration(gst::ClockTime::SECOND);
    src.push_buffer(b).unwrap();
    let mut q = gst::Buffer::from_slice(b"And now?");
    q.get_mut().unwrap().set_pts(gst::ClockTime::from_mseconds(3200));
    qs.push_buffer(q).unwrap();
    let second = answer(&bus);
    assert_eq!(second.get::<&str>("status").unwrap(), "answered", "{second}");
    assert_eq!(second.get::<u64>("frames").unwrap(), 2, "{second}");
    assert_eq!(bin.by_name("enc").unwrap().property::<u64>("frames-unchanged"), 2);
    pipeline.set_state(gst::State::Null).unwrap();
}

/// A 64x48 gradient with a white square of `side` px at (x, y) (none for side 0).
fn scene(x: usize, y: usize, side: usize) -> gst::Buffer {
    let mut rgb = vec![0u8; 64 * 48 * 3];
    for (i, px) in rgb.chunks_mut(3).enumerate() {
        let (px_x, px_y) = (i % 64, i / 64);
        let on = px_x >= x && px_x < x + side && px_y >= y && px_y < y + side;
        px.copy_from_slice(&if on { [255; 3] } else { [(px_x * 4) as u8, (px_y * 5) as u8, 90] });
    }
    gst::Buffer::from_mut_slice(rgb)
}

/// (tiles-encoded, tiles-reused) after a still scene, then a square appearing in its top-left
/// tile, through vlmencode with SmolVLM's projector type (the idefics3 test pair: 2x2 tiles
/// and an overview).
fn tiles(tile_reuse: &str) -> (u64, u64) {
    init();
    let e = gst::ElementFactory::make("vlmencode")
        .property("mmproj", "models/test-idefics3-mmproj.gguf")
        .property("model", "models/test-idefics3-lm.gguf")
        .property("interval", 0u64)
        .property_from_str("tile-reuse", tile_reuse)
        .build()
        .unwrap();
    let mut h = Harness::with_element(&e, Some("sink"), Some("src"));
    h.set_src_caps(rgb_caps(64, 48));
    assert_eq!(push(&mut h, scene(0, 0, 0), 0), "encoded");
    assert_eq!(push(&mut h, scene(4, 4, 12), 1), "encoded");
    (e.property::<u64>("tiles-encoded"), e.property::<u64>("tiles-reused"))
}

#[test]
fn a_square_in_one_tile_encodes_that_tile_and_the_overview() {
    assert_eq!(tiles("threshold"), (5 + 2, 3));
    assert_eq!(tiles("exact"), (5 + 2, 3));
    assert_eq!(tiles("off"), (5 + 5, 0));
}

/// Periodic captions of a still scene: the gate holds every frame after the first, and a
/// caption is still asked every `caption-interval` (about the picture standing for the held
/// frames), as of a moving one. On the code before, the held frames asked none: one caption in
/// 8 s.
#[test]
fn a_still_scene_is_captioned_at_every_interval_with_the_gate_on() {
    let pipeline = launch(
        "videotestsrc pattern=smpte num-buffers=80 ! video/x-raw,width=160,height=120,framerate=10/1 ! videoconvert \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf min-change=0.001 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery caption-prompt=\"Describe the scene.\" caption-interval=1000000000 max-tokens=4 ! fakesink",
    );
    let run = run_to_eos(&pipeline, 240);
    let held = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("enc").unwrap().property::<u64>("frames-unchanged");
    pipeline.set_state(gst::State::Null).unwrap();
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(held >= 6, "the gate held the still frames: {held}");
    // Captions at 0, 1, ..., 7 s of running time.
    assert_eq!(run.answers.len(), 8, "{:?}", run.answers);
    assert!(run.answers.iter().all(|a| a.get::<String>("status").as_deref() == Ok("answered")), "{:?}", run.answers);
}
