//! One `gst_check::Harness` per element, against the real test model.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use gst::prelude::*;
use gst_check::Harness;
use gst_video::prelude::*;
use gst_vlm_elements::events::{DemandQuery, ModelQuery, NotTakenEvent, QuestionEvent, StreamEvent};
use gst_vlm_elements::meta::VlmFrameMeta;
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Device, Engine, EngineConfig, Frame, Stream, StreamConfig, models};

const W: u32 = 64;
const H: u32 = 48;

/// A deterministic picture in `format` (RGB or BGRx), `variant` changing its content.
fn picture(format: gst_video::VideoFormat, variant: u32) -> gst::Buffer {
    let info = gst_video::VideoInfo::builder(format, W, H).build().unwrap();
    let mut buffer = gst::Buffer::with_size(info.size()).unwrap();
    {
        let buf = buffer.get_mut().unwrap();
        let mut frame = gst_video::VideoFrameRef::from_buffer_ref_writable(buf, &info).unwrap();
        let stride = frame.plane_stride()[0] as usize;
        let bpp = if format == gst_video::VideoFormat::Rgb { 3 } else { 4 };
        let data = frame.plane_data_mut(0).unwrap();
        for y in 0..H as usize {
            for x in 0..W as usize {
                let rgb = [(x * 4) as u8, (y * 5) as u8, ((x / 8 + y / 8) % 2 * 200 + variant as usize * 17) as u8];
                let px = &mut data[y * stride + x * bpp..][..bpp];
                match format {
                    gst_video::VideoFormat::Rgb => px.copy_from_slice(&rgb),
                    _ => px.copy_from_slice(&[rgb[2], rgb[1], rgb[0], 0]),
                }
            }
        }
    }
    buffer
}

fn caps(format: gst_video::VideoFormat) -> gst::Caps {
    gst_video::VideoInfo::builder(format, W, H).fps(gst::Fraction::new(10, 1)).build().unwrap().to_caps().unwrap()
}

fn encode_harness(format: gst_video::VideoFormat, interval: u64) -> Harness {
    init();
    let e = gst::ElementFactory::make("vlmencode")
        .property("mmproj", mmproj())
        .property("model", model())
        .property("interval", interval)
        // Every due frame encoded: these tests are about encoding (tests/gate.rs about the gate).
        .property("min-change", 0.0)
        .build()
        .unwrap();
    let mut h = Harness::with_element(&e, Some("sink"), Some("src"));
    h.set_src_caps(caps(format));
    h
}

fn embeddings(buffer: &gst::Buffer) -> Option<Vec<f32>> {
    let meta = buffer.meta::<VlmFrameMeta>()?;
    let frame = meta.frame()?;
    Some(
        frame
            .segments
            .iter()
            .flat_map(|s| match s {
                vlm_runtime::llama::Segment::Image(i) => i.data.to_vec(),
                vlm_runtime::llama::Segment::Text(_) => vec![],
            })
            .collect(),
    )
}

#[test]
fn vlmencode_attaches_embeddings_at_the_interval() {
    let mut h = encode_harness(gst_video::VideoFormat::Rgb, 1_000_000_000);
    let mut encoded = vec![];
    for i in 0..4u64 {
        let mut buf = picture(gst_video::VideoFormat::Rgb, i as u32);
        buf.get_mut().unwrap().set_pts(gst::ClockTime::from_mseconds(500 * i));
        let original = buf.map_readable().unwrap().to_vec();
        let out = h.push_and_pull(buf).unwrap();
        assert_eq!(out.map_readable().unwrap().as_slice(), original.as_slice(), "video must pass unchanged");
        encoded.push(embeddings(&out).map(|e| e.len()));
    }
    // 0 s and 1 s are due; 0.5 s and 1.5 s are not.
    assert_eq!(encoded, vec![Some(36 * 576), None, Some(36 * 576), None]);
    let e = h.element().unwrap();
    assert_eq!(e.property::<u64>("frames-seen"), 4);
    assert_eq!(e.property::<u64>("frames-encoded"), 2);
}

#[test]
fn vlmencode_bgrx_and_rgb_give_identical_embeddings() {
    let mut rgb = encode_harness(gst_video::VideoFormat::Rgb, 0);
    let mut bgrx = encode_harness(gst_video::VideoFormat::Bgrx, 0);
    let a = embeddings(&rgb.push_and_pull(picture(gst_video::VideoFormat::Rgb, 1)).unwrap()).unwrap();
    let b = embeddings(&bgrx.push_and_pull(picture(gst_video::VideoFormat::Bgrx, 1)).unwrap()).unwrap();
    assert_eq!(a, b);
    let c = embeddings(&rgb.push_and_pull(picture(gst_video::VideoFormat::Rgb, 2)).unwrap()).unwrap();
    assert_ne!(a, c, "different pictures must give different embeddings");
}

/// A stream of the runtime, on an engine of its own, as vlmcontext would make it.
fn runtime_stream(name: &str) -> Arc<Stream> {
    let config = EngineConfig { context_per_sequence: 1024, ..EngineConfig::default() };
    let engine = Engine::start(std::path::Path::new(&model()), config).unwrap();
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    Stream::open(&engine, prompt, StreamConfig::new(name)).unwrap()
}

/// A playing `vlmquery` answering up to `max_tokens` a question, fed RGB video of `stream`
/// (named `name`).
fn playing_vlmquery(stream: &Stream, name: &str, max_tokens: u32) -> Harness {
    let mut h = Harness::with_padnames("vlmquery", Some("sink"), Some("src"));
    h.element().unwrap().set_property("max-tokens", max_tokens);
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    assert!(h.push_event(StreamEvent::event(stream.id(), name)));
    h
}

fn encoder() -> MtmdEncoder {
    let m = models::model(std::path::Path::new(&model()), &Device::Cpu).unwrap();
    MtmdEncoder::new(models::projector(std::path::Path::new(&mmproj()), &m, false, 2, 1).unwrap())
}

fn frame(enc: &MtmdEncoder, variant: u32) -> Arc<Frame> {
    let buf = picture(gst_video::VideoFormat::Rgb, variant);
    let map = buf.map_readable().unwrap();
    Arc::new(enc.encode(&Picture::packed(&map, W, H, (W * 3) as usize, PixelLayout::Rgb)).unwrap())
}

#[test]
fn vlmcontext_registers_frames_in_order_and_answers_the_model_and_demand_queries() {
    init();
    let e = gst::ElementFactory::make("vlmcontext").property("model", model()).build().unwrap();
    let mut h = Harness::with_element(&e, Some("sink_0"), Some("src_0"));
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    let enc = encoder();
    let mut positions = vec![];
    for i in 0..3u32 {
        let mut buf = picture(gst_video::VideoFormat::Rgb, i);
        if i != 1 {
            VlmFrameMeta::add(buf.get_mut().unwrap(), frame(&enc, i));
        }
        let out = h.push_and_pull(buf).unwrap();
        positions.push(out.meta::<VlmFrameMeta>().and_then(|m| m.position()));
    }
    let stream_id = positions[0].unwrap().0;
    assert_eq!(positions, vec![Some((stream_id, 1)), None, Some((stream_id, 2))]);
    // The sticky vlm-stream event names the same stream.
    let sticky =
        h.sinkpad().unwrap().sticky_event::<gst::event::CustomDownstreamSticky>(0).and_then(|e| StreamEvent::parse(&e));
    assert_eq!(sticky, Some(stream_id));
    let stream = vlm_runtime::stream::lookup(stream_id).expect("live stream");
    let version = stream.wait_version(2, &AtomicBool::new(false)).unwrap();
    assert_eq!(version.frames(), 2);
    // vlmencode learns the language model from vlmcontext.
    let mut q = ModelQuery::query();
    assert!(h.srcpad().unwrap().peer_query(&mut q));
    assert_eq!(ModelQuery::model(&q).as_deref(), Some(model().as_str()));
    // ...and the demand of the stream its frames feed: the stream's own count of the readers
    // waiting on it (its encodes go first while it is not zero).
    let mut q = DemandQuery::query();
    assert!(h.srcpad().unwrap().peer_query(&mut q));
    let demand = DemandQuery::demand(&q).expect("the stream's demand");
    assert_eq!(demand.load(Ordering::Acquire), 0);
    let watch = stream.watch();
    assert_eq!(demand.load(Ordering::Acquire), 1, "a reader waiting on the stream is not seen");
    drop(watch);
    assert_eq!(demand.load(Ordering::Acquire), 0);
}

/// A frame the gate held reaching a stream with nothing registered (a new or reopened stream):
/// vlmcontext asks upstream (`vlm-frame-not-taken`) for the next due frame to be encoded; once a
/// frame has joined, it stands for the held ones and nothing is asked.
#[test]
fn vlmcontext_asks_for_an_encode_when_nothing_stands_for_a_held_frame() {
    init();
    let e = gst::ElementFactory::make("vlmcontext").property("model", model()).build().unwrap();
    let mut h = Harness::with_element(&e, Some("sink_0"), Some("src_0"));
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    let held = || {
        let mut buf = picture(gst_video::VideoFormat::Rgb, 0);
        VlmFrameMeta::add_held(buf.get_mut().unwrap());
        buf
    };
    let asked =
        |h: &mut Harness| std::iter::from_fn(|| h.try_pull_upstream_event()).filter(|e| NotTakenEvent::is(e)).count();
    let position = |buf: gst::Buffer| buf.meta::<VlmFrameMeta>().and_then(|m| m.position());
    assert_eq!(position(h.push_and_pull(held()).unwrap()), None);
    assert_eq!(asked(&mut h), 1);
    let mut buf = picture(gst_video::VideoFormat::Rgb, 0);
    VlmFrameMeta::add(buf.get_mut().unwrap(), frame(&encoder(), 0));
    let stream = position(h.push_and_pull(buf).unwrap()).expect("registered").0;
    assert_eq!(position(h.push_and_pull(held()).unwrap()), Some((stream, 1)));
    assert_eq!(asked(&mut h), 0);
}

#[test]
fn vlmquery_answers_a_question_event_from_the_frames_before_it() {
    init();
    let stream = runtime_stream("test");
    let enc = encoder();

    let mut h = playing_vlmquery(&stream, "test", 8);
    let never = AtomicBool::new(false);
    for i in 0..3u32 {
        let f = frame(&enc, i);
        let number = stream.register(Arc::clone(&f), &never).unwrap().number;
        let mut buf = picture(gst_video::VideoFormat::Rgb, i);
        {
            let b = buf.get_mut().unwrap();
            b.set_pts(gst::ClockTime::from_seconds(i as u64));
            VlmFrameMeta::add(b, f).set_position(stream.id(), number);
        }
        assert_eq!(h.push(buf), Ok(gst::FlowSuccess::Ok));
        if i == 1 {
            // Bound to frames 1..=2, not to the third frame that follows it.
            assert!(h.push_event(QuestionEvent::event("What is shown?", Some("mine"), None)));
        }
    }
    let answer = h.pull().expect("an answer buffer");
    let text = String::from_utf8(answer.map_readable().unwrap().to_vec()).unwrap();
    // Shown from where the video was when it completed: never before the bound frame.
    assert!(answer.pts() >= Some(gst::ClockTime::from_seconds(1)), "answer timestamped {:?}", answer.pts());
    let text = text.strip_suffix('\n').expect("a text answer ends with a newline").to_owned();
    let version = stream.wait_version(2, &never).unwrap();
    let q = vlm_runtime::Question {
        id: "ref".into(),
        text: "What is shown?".into(),
        max_tokens: 8,
        ignore_eos: false,
        sampling: Default::default(),
        arrival: std::time::Instant::now(),
    };
    let reference = vlm_runtime::answer(&version, &q, &Arc::new(AtomicBool::new(false)), |_| {}).unwrap();
    assert!(!text.is_empty());
    assert_eq!(text, reference.text, "the element's answer differs from the runtime's answer over the same version");
    assert!(h.push_event(gst::event::Eos::new()));
    // EOS follows the last answer.
    loop {
        let ev = h.pull_event().expect("EOS");
        if ev.type_() == gst::EventType::Eos {
            break;
        }
    }
}

#[test]
fn vlmquery_reports_a_malformed_question_without_failing() {
    init();
    let mut h = Harness::with_padnames("vlmquery", Some("sink"), Some("src"));
    let bus = gst::Bus::new();
    h.element().unwrap().set_bus(Some(&bus));
    h.play();
    let question = |fields: &[(&str, gst::glib::SendValue)]| {
        let mut s = gst::Structure::new_empty("vlm-question");
        for (name, value) in fields {
            s.set_value(*name, value.clone());
        }
        gst::event::CustomDownstream::new(s)
    };
    let warnings = || -> Vec<String> {
        std::iter::from_fn(|| bus.pop_filtered(&[gst::MessageType::Warning]))
            .map(|m| match m.view() {
                gst::MessageView::Warning(w) => format!("{} {:?}", w.error(), w.debug()),
                _ => unreachable!(),
            })
            .collect()
    };
    let cases = [
        (question(&[("text", 3i32.to_send_value())]), "'text'"),
        (question(&[("text", "Hi?".to_send_value()), ("max-tokens", "ten".to_send_value())]), "'max-tokens'"),
        (question(&[("text", "Hi?".to_send_value()), ("max-tokens", (-4i64).to_send_value())]), "'max-tokens'"),
        (QuestionEvent::event("   ", None, None), "empty"),
    ];
    for (event, field) in cases {
        assert!(h.push_event(event), "a malformed question must not fail the pad");
        let w = warnings();
        assert!(w.iter().any(|w| w.contains(field)), "no warning naming {field}: {w:?}");
    }
    // An id is answered once: the same id again is refused with a warning naming it.
    let id = |id: &str| question(&[("text", "Hi?".to_send_value()), ("id", id.to_send_value())]);
    assert!(h.push_event(id("twice")));
    assert!(h.push_event(id("twice")));
    let w = warnings();
    assert!(w.iter().any(|w| w.contains("twice") && w.contains("already taken")), "no refusal of a repeated id: {w:?}");
    // Any integer type is an integer: an int max-tokens is taken.
    assert!(h.push_event(question(&[("text", "Hi?".to_send_value()), ("max-tokens", 4i32.to_send_value())])));
    assert!(warnings().iter().all(|w| !w.contains("malformed")), "an int max-tokens was refused");
}

/// Embeddings of the first output of `h` for one pushed buffer.
fn push_embeddings(h: &mut Harness, buf: gst::Buffer) -> (Arc<Frame>, Vec<f32>) {
    let out = h.push_and_pull(buf).unwrap();
    let frame = Arc::clone(out.meta::<VlmFrameMeta>().unwrap().frame().unwrap());
    (frame, embeddings(&out).unwrap())
}

#[test]
fn vlmencode_raw_formats_match_the_rgb_path_within_tolerance() {
    init();
    let mut rgb = encode_harness(gst_video::VideoFormat::Rgb, 0);
    let (_, reference) = push_embeddings(&mut rgb, picture(gst_video::VideoFormat::Rgb, 3));
    for format in ["RGBA", "BGRx", "NV12", "I420"] {
        let mut h = Harness::new_parse(&format!(
            "videoconvert ! video/x-raw,format={format} ! vlmencode mmproj={} model={} interval=0",
            mmproj(),
            model()
        ));
        h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
        let (_, e) = push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 3));
        let norm = reference.iter().map(|x| x * x).sum::<f32>().sqrt();
        let diff = reference.iter().zip(&e).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt();
        // Declared tolerance: none for the RGB family; 4:2:0 chroma and 8-bit YUV rounding cost
        // a few percent.
        let tolerance = if format.starts_with(['N', 'I']) { 0.05 } else { 0.0 };
        assert!(diff / norm <= tolerance, "{format}: relative L2 difference {}", diff / norm);
    }
}

#[test]
fn vlmencode_cache_returns_the_same_handle_and_respects_its_limits() {
    init();
    let e = gst::ElementFactory::make("vlmencode")
        .property("mmproj", mmproj())
        .property("model", model())
        .property("interval", 0u64)
        // (The change gate would hold a repeated picture before the cache sees it.)
        .property("min-change", 0.0)
        .property("cache-entries", 2u32)
        .build()
        .unwrap();
    let mut h = Harness::with_element(&e, Some("sink"), Some("src"));
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    let (a, _) = push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 0));
    let (again, _) = push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 0));
    assert!(Arc::ptr_eq(&a, &again), "a repeated frame must reuse the cached embeddings");
    assert_eq!((e.property::<u64>("cache-hits"), e.property::<u64>("cache-misses")), (1, 1));
    drop((a, again));
    push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 1));
    push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 2));
    // Two entries: picture 0 was the least recently used and is gone.
    push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 0));
    assert_eq!((e.property::<u64>("cache-hits"), e.property::<u64>("cache-misses")), (1, 4));
    assert_eq!(e.property::<u64>("frames-encoded"), 4);

    // A byte limit below one frame's embeddings (36 x 576 floats) caches nothing.
    let small = gst::ElementFactory::make("vlmencode")
        .property("mmproj", mmproj())
        .property("model", model())
        .property("interval", 0u64)
        .property("min-change", 0.0)
        .property("cache-bytes", 1000u64)
        .build()
        .unwrap();
    let mut h = Harness::with_element(&small, Some("sink"), Some("src"));
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 0));
    push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 0));
    assert_eq!(small.property::<u64>("cache-hits"), 0);
}

#[test]
fn vlmencode_handles_a_resolution_change_mid_stream() {
    let mut h = encode_harness(gst_video::VideoFormat::Rgb, 0);
    let (_, a) = push_embeddings(&mut h, picture(gst_video::VideoFormat::Rgb, 0));
    h.set_src_caps(
        gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, 32, 24).build().unwrap().to_caps().unwrap(),
    );
    let small = gst::Buffer::from_mut_slice(vec![128u8; 32 * 24 * 3]);
    let (_, b) = push_embeddings(&mut h, small);
    assert_eq!(a.len(), b.len(), "the projector resizes every picture to its own input size");
    assert_ne!(a, b);
}

#[test]
fn vlmquery_flush_cancels_the_answer_in_progress_and_recovers() {
    init();
    let stream = runtime_stream("flush");
    let never = AtomicBool::new(false);
    let f = frame(&encoder(), 0);
    let number = stream.register(Arc::clone(&f), &never).unwrap().number;

    let mut h = Harness::with_padnames("vlmquery", Some("sink"), Some("src"));
    let element = h.element().unwrap();
    // 800 tokens: an answer still decoding long after the flush, unless the flush cancels it.
    element.set_property("max-tokens", 800u32);
    element.set_property("exact-tokens", true);
    // Its first piece tells when the answer is being generated.
    element.set_property("stream-tokens", true);
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    assert!(h.push_event(StreamEvent::event(stream.id(), "flush")));
    let mut buf = picture(gst_video::VideoFormat::Rgb, 0);
    VlmFrameMeta::add(buf.get_mut().unwrap(), f).set_position(stream.id(), number);
    assert_eq!(h.push(buf), Ok(gst::FlowSuccess::Ok));
    assert!(h.push_event(QuestionEvent::event("Tell me a long story about the picture.", Some("long"), None)));
    h.pull().expect("the long answer's first piece");
    assert!(h.push_event(gst::event::FlushStart::new()));
    assert!(h.push_event(gst::event::FlushStop::new(true)));
    // The question ended cancelled, none answered.
    assert_eq!(element.property::<u64>("answers-cancelled"), 1, "the flush cancels the answer in progress");
    assert_eq!(element.property::<u64>("answers"), 0, "the flushed answer is not pushed");
    // Pieces pushed before the flush; none of the cancelled answer comes after it.
    while h.try_pull().is_some() {}
    element.set_property("stream-tokens", false);
    element.set_property("exact-tokens", false);
    // After the flush the element answers again.
    assert!(h.push_event(StreamEvent::event(stream.id(), "flush")));
    assert!(h.push_event(QuestionEvent::event("What is shown?", Some("after"), Some(4))));
    let answer = h.pull().expect("an answer after the flush");
    assert!(answer.size() > 0);
    // The engine stopped the flushed answer: it never decoded beside the next one (its ~800
    // tokens would still have been going).
    assert_eq!(stream.engine().widest_step(), 1, "the flushed answer kept decoding after the flush");
    // A flush of the query pad alone leaves the element answering.
    let query = h.element().unwrap().static_pad("query").unwrap();
    assert!(query.send_event(gst::event::FlushStart::new()));
    assert!(query.send_event(gst::event::FlushStop::new(true)));
    assert!(h.push_event(QuestionEvent::event("And now?", Some("after-query-flush"), Some(4))));
    let answer = h.pull().expect("an answer after a flush of the query pad");
    assert!(answer.size() > 0);
}

/// A timed question from the query pad waits for the video to pass its time; meanwhile its
/// stream's demand counts it, so the stream's frames are encoded and ingested first (a
/// `vlmencode` learns the demand through the `vlm-demand` query). Once bound, it counts no more.
#[test]
fn a_timed_question_waiting_for_its_frame_puts_its_stream_first() {
    init();
    let stream = runtime_stream("timed");
    let never = AtomicBool::new(false);
    let enc = encoder();
    let mut h = playing_vlmquery(&stream, "timed", 4);
    let video = |variant: u32, seconds: u64| {
        let f = frame(&enc, variant);
        let number = stream.register(f.clone(), &never).unwrap().number;
        let mut buf = picture(gst_video::VideoFormat::Rgb, variant);
        let b = buf.get_mut().unwrap();
        b.set_pts(gst::ClockTime::from_seconds(seconds));
        VlmFrameMeta::add(b, f).set_position(stream.id(), number);
        buf
    };
    assert_eq!(h.push(video(0, 0)), Ok(gst::FlowSuccess::Ok));
    let query = h.element().unwrap().static_pad("query").unwrap();
    assert!(query.send_event(gst::event::StreamStart::new("questions")));
    assert!(query.send_event(gst::event::Caps::new(&gst::Caps::builder("text/x-raw").field("format", "utf8").build())));
    assert!(query.send_event(gst::event::Segment::new(&gst::FormattedSegment::<gst::ClockTime>::new())));
    let demand = stream.demand();
    let settles = |want: usize| {
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while demand.load(Ordering::Acquire) != want && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        demand.load(Ordering::Acquire)
    };
    std::thread::scope(|s| {
        let asked = s.spawn(|| {
            let mut q = gst::Buffer::from_slice(b"What is shown?".to_vec());
            q.get_mut().unwrap().set_pts(gst::ClockTime::from_seconds(2));
            query.chain(q)
        });
        let waiting = settles(1);
        // (The frame that lets the question go comes before any assertion: a failed one must
        // not leave it waiting for ever.)
        assert_eq!(h.push(video(1, 3)), Ok(gst::FlowSuccess::Ok));
        assert_eq!(asked.join().unwrap(), Ok(gst::FlowSuccess::Ok));
        assert_eq!(waiting, 1, "the question waiting for its frame does not count in the demand");
    });
    assert!(h.pull().unwrap().size() > 0, "the timed question is answered");
    assert_eq!(settles(0), 0, "the bound question still counts in the demand");
}

#[test]
fn vlmquery_streams_the_answer_so_far_frame_by_frame_where_it_is_drawn() {
    // With video_src linked (the answers drawn on that video) the text pad follows it: each
    // buffer holds the answer so far and ends where the newest frame ends, the next one starts
    // there; the whole answer is shown for answer-duration (1 s), then GAP events.
    init();
    let stream = runtime_stream("follow");
    let never = AtomicBool::new(false);
    let f = frame(&encoder(), 0);
    let number = stream.register(Arc::clone(&f), &never).unwrap().number;

    let mut h = Harness::with_padnames("vlmquery", Some("sink"), Some("src"));
    let element = h.element().unwrap();
    element.set_property("max-tokens", 24u32);
    element.set_property("exact-tokens", true);
    element.set_property("stream-tokens", true);
    element.set_property("answer-duration", 1_000_000_000u64);
    let video = gst::Pad::builder(gst::PadDirection::Sink)
        .chain_function(|_, _, _| Ok(gst::FlowSuccess::Ok))
        .event_function(|_, _, _| true)
        .build();
    element.static_pad("video_src").unwrap().link(&video).unwrap();
    video.set_active(true).unwrap();
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    assert!(h.push_event(StreamEvent::event(stream.id(), "follow")));
    let frame_at = |i: u64, registered: bool| {
        let mut buf = picture(gst_video::VideoFormat::Rgb, 0);
        {
            let b = buf.get_mut().unwrap();
            b.set_pts(gst::ClockTime::from_mseconds(100 * i));
            b.set_duration(gst::ClockTime::from_mseconds(100));
            if registered {
                VlmFrameMeta::add(b, Arc::clone(&f)).set_position(stream.id(), number);
            }
        }
        buf
    };
    assert_eq!(h.push(frame_at(0, true)), Ok(gst::FlowSuccess::Ok));
    assert!(h.push_event(QuestionEvent::event("Tell me about the picture.", Some("follow"), None)));
    // The video goes on, a frame every 20 ms, until the whole answer's display is over.
    let mut buffers: Vec<(String, String, gst::ClockTime, gst::ClockTime)> = vec![];
    let displayed = |b: &[(String, String, gst::ClockTime, gst::ClockTime)]| {
        let first = b.iter().find(|b| b.1 == "answered").map(|b| b.2);
        first.zip(b.last()).is_some_and(|(first, last)| last.2 + last.3 >= first + gst::ClockTime::from_seconds(1))
    };
    let mut i = 1;
    while !displayed(&buffers) {
        assert!(i < 3000, "no whole answer shown for 1 s after 300 s of video: {buffers:?}");
        assert_eq!(h.push(frame_at(i, false)), Ok(gst::FlowSuccess::Ok));
        std::thread::sleep(std::time::Duration::from_millis(20));
        while let Some(b) = h.try_pull() {
            let status = gst_vlm_elements::meta::answer_of(&b).unwrap().get::<String>("status").unwrap();
            let text = String::from_utf8(b.map_readable().unwrap().to_vec()).unwrap();
            buffers.push((text, status, b.pts().unwrap(), b.duration().expect("a display duration")));
        }
        i += 1;
    }
    // A few frames more: nothing shown after the display.
    for j in i..i + 5 {
        assert_eq!(h.push(frame_at(j, false)), Ok(gst::FlowSuccess::Ok));
    }
    assert!(h.push_event(gst::event::Eos::new()));
    while h.pull_event().expect("EOS").type_() != gst::EventType::Eos {}
    if let Some(b) = h.try_pull() {
        panic!("a text buffer after the display: {b:?} after {buffers:?}");
    }
    let frame_end = |t: gst::ClockTime| t.mseconds().is_multiple_of(100);
    assert!(buffers.windows(2).all(|w| w[0].2 + w[0].3 == w[1].2), "not back to back: {buffers:?}");
    assert!(buffers.iter().all(|b| frame_end(b.2 + b.3)), "a buffer ends between frames: {buffers:?}");
    let whole = buffers.iter().find(|b| b.1 == "answered").unwrap().0.clone();
    let partial: Vec<&str> =
        buffers.iter().take_while(|b| b.1 == "partial").map(|b| b.0.strip_suffix('\n').unwrap()).collect();
    assert!(buffers.iter().skip(partial.len()).all(|b| b.1 == "answered" && b.0 == whole), "{buffers:?}");
    assert!(partial.windows(2).all(|w| w[1].starts_with(w[0])), "the answer so far must grow: {partial:?}");
    assert!(partial.iter().all(|p| whole.starts_with(p)), "{partial:?} / {whole:?}");
    let distinct = partial.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(distinct >= 1, "24 tokens never showed the answer so far: {buffers:?}");
}

#[test]
fn vlmencode_answers_serialized_queries_after_the_frames_queued_before_them() {
    use gst_video::VideoFormat::Rgb;
    let mut h = encode_harness(Rgb, 0);
    h.play();
    let element = h.element().unwrap();
    let sinkpad = element.static_pad("sink").unwrap();
    // Frames that have left vlmencode, and how many had when each ALLOCATION or DRAIN query
    // passed its source pad.
    let left = Arc::new(AtomicUsize::new(0));
    let passed = Arc::new(Mutex::new(vec![]));
    let (l, p) = (Arc::clone(&left), Arc::clone(&passed));
    element.static_pad("src").unwrap().add_probe(
        // (PUSH: a query once, on its way downstream, not again with its answer.)
        gst::PadProbeType::BUFFER | gst::PadProbeType::QUERY_DOWNSTREAM | gst::PadProbeType::PUSH,
        move |_, info| {
            match &info.data {
                Some(gst::PadProbeData::Buffer(_)) => {
                    l.fetch_add(1, Ordering::SeqCst);
                }
                Some(gst::PadProbeData::Query(q))
                    if matches!(q.type_(), gst::QueryType::Allocation | gst::QueryType::Drain) =>
                {
                    p.lock().unwrap().push((q.type_(), l.load(Ordering::SeqCst)));
                }
                _ => (),
            }
            gst::PadProbeReturn::Ok
        },
    );
    // Every frame is encoded (the first one loads the projector): the queries come while
    // frames still wait for the encoder, and are answered only once those have left.
    for i in 0..3 {
        assert_eq!(h.push(picture(Rgb, i)), Ok(gst::FlowSuccess::Ok));
    }
    let mut allocation = gst::query::Allocation::new(Some(&caps(Rgb)), true);
    assert!(sinkpad.query(&mut allocation));
    assert_eq!(left.load(Ordering::SeqCst), 3, "ALLOCATION answered before the frames queued ahead of it left");
    for i in 3..5 {
        assert_eq!(h.push(picture(Rgb, i)), Ok(gst::FlowSuccess::Ok));
    }
    let mut drain = gst::query::Drain::new();
    assert!(sinkpad.query(&mut drain));
    assert_eq!(left.load(Ordering::SeqCst), 5, "DRAIN answered before the frames queued ahead of it left");
    assert_eq!(*passed.lock().unwrap(), [(gst::QueryType::Allocation, 3), (gst::QueryType::Drain, 5)]);
    // A query waiting behind queued frames is released by a flush (answered or not, it returns).
    for i in 5..7 {
        assert_eq!(h.push(picture(Rgb, i)), Ok(gst::FlowSuccess::Ok));
    }
    let pad = sinkpad.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(pad.query(&mut gst::query::Drain::new()));
    });
    assert!(h.push_event(gst::event::FlushStart::new()));
    rx.recv_timeout(Duration::from_secs(30)).expect("a DRAIN query waiting at a flush must return");
    assert!(h.push_event(gst::event::FlushStop::new(true)));
    assert!(h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<gst::ClockTime>::new())));
    let out = h.push_and_pull(picture(Rgb, 7)).expect("a frame after the flush");
    assert!(embeddings(&out).is_some());
}

/// `f` on a thread of its own, which must return within `limit`: a deadlock fails the test
/// instead of hanging it.
fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("{what} did not return within {limit:?}"))
}

/// Deactivating `pad` (on a thread of its own: a task that ignores it would hang it) stops its
/// task; activating it again starts the task again.
fn deactivate_and_activate(pad: &gst::Pad) {
    assert_eq!(pad.task_state(), gst::TaskState::Started, "{}: no task while active", pad.name());
    let p = pad.clone();
    within(Duration::from_secs(30), "deactivating the source pad", move || p.set_active(false)).unwrap();
    assert_eq!(pad.task_state(), gst::TaskState::Stopped, "{}: the task outlived its pad's activation", pad.name());
    pad.set_active(true).unwrap();
    assert_eq!(pad.task_state(), gst::TaskState::Started, "{}: activated again without its task", pad.name());
}

#[test]
fn vlmencode_task_follows_the_activation_of_its_source_pad() {
    use gst_video::VideoFormat::Rgb;
    let mut h = encode_harness(Rgb, 0);
    h.play();
    let out = h.push_and_pull(picture(Rgb, 0)).unwrap();
    assert!(embeddings(&out).is_some());
    deactivate_and_activate(&h.element().unwrap().static_pad("src").unwrap());
    // Frames are encoded again.
    let out = h.push_and_pull(picture(Rgb, 1)).expect("a frame after the source pad was activated again");
    assert!(embeddings(&out).is_some());
}

/// A vlmquery harness with a question about `stream`'s frame `f` pushed: the answer is pulled.
fn ask_vlmquery(h: &mut Harness, stream: &Stream, f: &Arc<Frame>, number: u64, id: &str) -> gst::Buffer {
    assert!(h.push_event(StreamEvent::event(stream.id(), stream.name())));
    let mut buf = picture(gst_video::VideoFormat::Rgb, 0);
    VlmFrameMeta::add(buf.get_mut().unwrap(), Arc::clone(f)).set_position(stream.id(), number);
    assert_eq!(h.push(buf), Ok(gst::FlowSuccess::Ok));
    assert!(h.push_event(QuestionEvent::event("What is shown?", Some(id), Some(4))));
    h.pull().unwrap_or_else(|_| panic!("no answer to {id}"))
}

#[test]
fn vlmquery_task_follows_the_activation_of_its_text_pad() {
    init();
    let stream = runtime_stream("activation");
    let f = frame(&encoder(), 0);
    let number = stream.register(Arc::clone(&f), &AtomicBool::new(false)).unwrap().number;
    let mut h = Harness::with_padnames("vlmquery", Some("sink"), Some("src"));
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    assert!(ask_vlmquery(&mut h, &stream, &f, number, "before").size() > 0);
    deactivate_and_activate(&h.element().unwrap().static_pad("src").unwrap());
    // Questions are answered again.
    assert!(ask_vlmquery(&mut h, &stream, &f, number, "after").size() > 0);
}

#[test]
fn vlmquery_answers_are_notified_and_start_again_at_paused_to_ready() {
    init();
    let stream = runtime_stream("answers");
    let f = frame(&encoder(), 0);
    let number = stream.register(Arc::clone(&f), &AtomicBool::new(false)).unwrap().number;
    let mut h = Harness::with_padnames("vlmquery", Some("sink"), Some("src"));
    let element = h.element().unwrap();
    let notified = Arc::new(Mutex::new(vec![]));
    let n = Arc::clone(&notified);
    element.connect_notify(Some("answers"), move |e, _| n.lock().unwrap().push(e.property::<u64>("answers")));
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    ask_vlmquery(&mut h, &stream, &f, number, "one");
    assert_eq!(element.property::<u64>("answers"), 1);
    assert_eq!(*notified.lock().unwrap(), [1], "the answer was not notified");
    element.set_state(gst::State::Ready).unwrap();
    assert_eq!(element.property::<u64>("answers"), 0, "PAUSED->READY must start the statistics again");
    assert_eq!(*notified.lock().unwrap(), [1, 0], "the reset was not notified");
}

#[test]
fn vlmcontext_statistics_are_notified_and_start_again_at_paused_to_ready() {
    init();
    // 512 cells, 256 kept for answers: a few frames fill the history, and under
    // history-policy=stop later ones are dropped (counted in frames-dropped).
    let e = gst::ElementFactory::make("vlmcontext")
        .property("model", model())
        .property("context-size", 512u32)
        .property_from_str("history-policy", "stop")
        .property_from_str("overload", "block")
        .build()
        .unwrap();
    let notified = Arc::new(Mutex::new(vec![]));
    let n = Arc::clone(&notified);
    e.connect_notify(Some("frames-dropped"), move |e, _| n.lock().unwrap().push(e.property::<u64>("frames-dropped")));
    let mut h = Harness::with_element(&e, Some("sink_0"), Some("src_0"));
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    let enc = encoder();
    let frames: Vec<Arc<Frame>> = (0..3).map(|i| frame(&enc, i)).collect();
    for i in 0..30 {
        if e.property::<u64>("frames-dropped") > 0 {
            break;
        }
        let mut buf = picture(gst_video::VideoFormat::Rgb, i % 3);
        VlmFrameMeta::add(buf.get_mut().unwrap(), Arc::clone(&frames[i as usize % 3]));
        h.push_and_pull(buf).unwrap();
    }
    let dropped = e.property::<u64>("frames-dropped");
    assert!(dropped > 0, "no frame dropped by a full history");
    assert_eq!(*notified.lock().unwrap(), (1..=dropped).collect::<Vec<_>>(), "each drop is notified");
    e.set_state(gst::State::Ready).unwrap();
    assert_eq!(e.property::<u64>("frames-dropped"), 0, "PAUSED->READY must start the statistics again");
    assert_eq!(notified.lock().unwrap().last(), Some(&0), "the reset was not notified");
}

#[test]
fn the_enums_of_the_elements_properties_are_plugin_api() {
    init();
    let enums = [
        "GstVlmEncodeBackend",
        "GstVlmHistoryPolicy",
        "GstVlmOverload",
        "GstVlmKvLayout",
        "GstVlmKvType",
        "GstVlmCommitAnswers",
        "GstVlmOutputFormat",
        "GstVlmDisplay",
    ];
    for name in enums {
        let t = gst::glib::Type::from_name(name).unwrap_or_else(|| panic!("{name} is not registered"));
        assert!(t.plugin_api_flags().is_some(), "{name} is not marked as plugin API");
    }
}

/// With ordered commits a question waits for the previous question *of its stream* (issue 32
/// item 5): after the video switches from stream A to stream B while A's question is still being
/// answered, B's first question is answered from B's frame, not held until B's history reaches
/// the version A's answer commits (which B's one frame never reaches: it would wait for EOS).
#[test]
fn vlmquery_ordered_commits_wait_only_on_the_same_streams_question() {
    init();
    let (a, b) = (runtime_stream("a"), runtime_stream("b"));
    let never = AtomicBool::new(false);
    let enc = encoder();
    let mut frames_a = vec![];
    for v in 0..3 {
        let f = frame(&enc, v);
        frames_a.push((a.register(Arc::clone(&f), &never).unwrap().number, f));
    }
    let f_b = frame(&enc, 3);
    let number_b = b.register(Arc::clone(&f_b), &never).unwrap().number;

    let mut h = Harness::with_padnames("vlmquery", Some("sink"), Some("src"));
    let element = h.element().unwrap();
    element.set_property("exact-tokens", true);
    element.set_property_from_str("commit-answers", "ordered");
    h.set_src_caps(caps(gst_video::VideoFormat::Rgb));
    h.play();
    assert!(h.push_event(StreamEvent::event(a.id(), "a")));
    for (number, f) in frames_a {
        let mut buf = picture(gst_video::VideoFormat::Rgb, 0);
        VlmFrameMeta::add(buf.get_mut().unwrap(), f).set_position(a.id(), number);
        assert_eq!(h.push(buf), Ok(gst::FlowSuccess::Ok));
    }
    // A long answer on A (seconds), and meanwhile the video switches to stream B.
    assert!(h.push_event(QuestionEvent::event("Tell me about stream A.", Some("qa"), Some(300))));
    assert!(h.push_event(StreamEvent::event(b.id(), "b")));
    let mut buf = picture(gst_video::VideoFormat::Rgb, 1);
    VlmFrameMeta::add(buf.get_mut().unwrap(), f_b).set_position(b.id(), number_b);
    assert_eq!(h.push(buf), Ok(gst::FlowSuccess::Ok));
    assert!(h.push_event(QuestionEvent::event("What is in stream B?", Some("qb"), Some(4))));
    // Answers go out in question order. No EOS is sent: the harness's pull gives up after 60 s,
    // which only a wait for stream A's commit version on stream B would take.
    assert!(h.pull().is_ok_and(|answer| answer.size() > 0), "A's answer");
    assert!(h.pull().is_ok_and(|answer| answer.size() > 0), "B's question waited for stream A's commit");
    assert_eq!(element.property::<u64>("answers"), 2);
}
