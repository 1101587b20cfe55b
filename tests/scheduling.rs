//! vlmquery and vlmcontext under a stream: questions answered together, every accepted question
//! answered before EOS (and refused after it), exact-length answers, the overload policy, and
//! the text and JSON outputs.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use gst::prelude::*;

/// 2 seconds of a 30 frames/s ball, a frame encoded every 250 ms (8 frames).
const SOURCE: &str = "videotestsrc pattern=ball num-buffers=60 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
    ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The number of buffers that reach the sink pad of element `name`, counted as they come.
fn count_buffers(bin: &gst::Bin, name: &str) -> Arc<Mutex<u32>> {
    let count = Arc::new(Mutex::new(0u32));
    let c2 = Arc::clone(&count);
    bin.by_name(name).unwrap().static_pad("sink").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        *c2.lock().unwrap() += 1;
        gst::PadProbeReturn::Ok
    });
    count
}

/// Run `pipeline`, calling `ask` on vlmquery `q` with each frame number that leaves vlmcontext;
/// returns the run and the ids `ask` returned (None: refused).
fn run_asking(
    pipeline: &gst::Element,
    ask: impl Fn(u64) -> Vec<&'static str> + Send + Sync + 'static,
) -> (Run, Arc<Mutex<Vec<Option<String>>>>) {
    let ran = ask_to_eos(pipeline, ask);
    pipeline.set_state(gst::State::Null).unwrap();
    ran
}

/// [`run_asking`], leaving the pipeline in PLAYING for the caller to read the elements'
/// statistics (zero again at PAUSED→READY) and stop it.
fn ask_to_eos(
    pipeline: &gst::Element,
    ask: impl Fn(u64) -> Vec<&'static str> + Send + Sync + 'static,
) -> (Run, Arc<Mutex<Vec<Option<String>>>>) {
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let q = bin.by_name("q").unwrap();
    let ids = Arc::new(Mutex::new(vec![]));
    let ids2 = Arc::clone(&ids);
    bin.by_name("ctx").unwrap().static_pad("src_0").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        let number = joined_frame(info);
        for text in number.map(&ask).unwrap_or_default() {
            let id = q.emit_by_name::<Option<String>>("ask", &[&text]);
            ids2.lock().unwrap().push(id);
        }
        gst::PadProbeReturn::Ok
    });
    (run_to_eos(pipeline, 240), ids)
}

fn answer_of<'a>(run: &'a Run, id: &str) -> &'a gst::Structure {
    run.answers.iter().find(|a| a.get::<String>("id").unwrap() == id).unwrap_or_else(|| panic!("no answer for {id}"))
}

#[test]
fn two_questions_of_one_stream_are_answered_together_in_question_order() {
    let pipeline = launch(&format!("{SOURCE} ! vlmquery name=q max-tokens=48 exact-tokens=true ! fakesink sync=false"));
    let (run, ids) =
        run_asking(&pipeline, |n| if n == 2 { vec!["Describe the picture.", "Is it moving?"] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let ids: Vec<String> = ids.lock().unwrap().iter().map(|i| i.clone().expect("accepted")).collect();
    let (first, second) = (answer_of(&run, &ids[0]), answer_of(&run, &ids[1]));
    for a in [first, second] {
        assert_eq!(a.get::<String>("status").unwrap(), "answered");
        assert_eq!(a.get::<u32>("tokens").unwrap(), 48, "exact-tokens generates max-tokens: {a}");
    }
    // Both were asked at the same moment: the second's first token came before the first's last.
    let (ttft2, total1) = (second.get::<f64>("ttft-ms").unwrap(), first.get::<f64>("total-ms").unwrap());
    assert!(ttft2 < total1, "the second question waited for the first answer ({ttft2:.0} ms >= {total1:.0} ms)");
    let order: Vec<String> = run.answers.iter().map(|a| a.get::<String>("id").unwrap()).collect();
    let (i1, i2) = (order.iter().position(|i| *i == ids[0]), order.iter().position(|i| *i == ids[1]));
    assert!(i1 < i2, "answers go out in question order: {order:?}");
}

/// A downstream that ends early (`fakesink num-buffers=1` returns EOS from its first buffer) on
/// the text pad or on `subtitle_src`: that output gets nothing more but still its EOS event, so
/// the pipeline posts EOS, and every question ends in one `vlm-answer`; with only the ended
/// output linked, upstream gets EOS too, and `vlmencode` passes the EOS that follows.
#[test]
fn an_output_whose_downstream_ends_early_still_lets_the_pipeline_reach_eos() {
    // vlmencode alone: its task held the EOS behind the frames it no longer pushed.
    let pipeline = launch(
        "videotestsrc num-buffers=100 ! video/x-raw,width=64,height=48 ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
         model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! fakesink num-buffers=1",
    );
    let run = run_to_eos(&pipeline, 60);
    pipeline.set_state(gst::State::Null).unwrap();
    assert!(run.errors.is_empty(), "vlmencode ! fakesink num-buffers=1: {:?}", run.errors);
    let srt = std::env::temp_dir().join(format!("vlm-ends-early-{}.srt", std::process::id()));
    std::fs::write(&srt, "1\n00:00:00,500 --> 00:00:01,000\nWhat is it?\n\n2\n00:00:01,000 --> 00:00:01,500\nAnd now?\n\n3\n00:00:01,500 --> 00:00:02,000\nAnd then?\n").unwrap();
    for outputs in [
        "q.src ! fakesink num-buffers=1 q.subtitle_src ! fakesink q.video_src ! fakesink",
        "q.src ! fakesink q.subtitle_src ! fakesink num-buffers=1 q.video_src ! fakesink",
        "q.src ! fakesink num-buffers=1",
    ] {
        let pipeline = launch(&format!(
            "{SOURCE} ! vlmquery name=q max-tokens=8 {outputs} filesrc location={} ! subparse ! q.query",
            srt.display()
        ));
        let run = run_to_eos(&pipeline, 120);
        pipeline.set_state(gst::State::Null).unwrap();
        assert!(run.errors.is_empty(), "{outputs}: {:?}", run.errors);
        let ids: std::collections::HashSet<String> =
            run.answers.iter().map(|a| a.get::<String>("id").unwrap()).collect();
        assert_eq!(ids.len(), run.answers.len(), "{outputs}: one vlm-answer per question: {:?}", run.answers);
        assert!(!run.answers.is_empty(), "{outputs}: no question answered");
    }
    let _ = std::fs::remove_file(&srt);
}

#[test]
fn a_question_asked_at_the_last_frame_is_answered_before_eos_and_one_after_eos_is_refused() {
    let pipeline = launch(&format!("{SOURCE} ! vlmquery name=q max-tokens=24 ! fakesink name=out sync=false"));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    // After EOS has gone downstream, ask again: it must be refused (no id).
    let after_eos = Arc::new(Mutex::new(None));
    let (after2, q) = (Arc::clone(&after_eos), bin.by_name("q").unwrap());
    bin.by_name("out").unwrap().static_pad("sink").unwrap().add_probe(
        gst::PadProbeType::EVENT_DOWNSTREAM,
        move |_, info| {
            if let Some(gst::PadProbeData::Event(e)) = &info.data
                && e.type_() == gst::EventType::Eos
            {
                *after2.lock().unwrap() = Some(q.emit_by_name::<Option<String>>("ask", &[&"Too late?"]));
            }
            gst::PadProbeReturn::Ok
        },
    );
    let (run, ids) = run_asking(&pipeline, |n| if n == 8 { vec!["What is at the end?"] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let id = ids.lock().unwrap()[0].clone().expect("the last frame's question is accepted");
    let a = answer_of(&run, &id);
    assert_eq!(a.get::<String>("status").unwrap(), "answered", "{a}");
    assert_eq!(a.get::<u64>("frames").unwrap(), 8);
    assert_eq!(*after_eos.lock().unwrap(), Some(None), "a question after EOS must be refused");
    assert!(run.warnings.iter().any(|w| w.contains("refused")), "a warning names the refusal: {:?}", run.warnings);
    assert_eq!(run.answers.len(), 1, "exactly one vlm-answer per accepted question");
}

#[test]
fn a_stream_faster_than_its_ingestion_skips_frames_under_the_overload_policy() {
    // Every frame encoded, as fast as the source goes: far more than the engine ingests.
    let pipeline = launch(
        "videotestsrc pattern=ball num-buffers=100 ! video/x-raw,width=64,height=48 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf overload=skip max-pending=1 \
         ! vlmquery name=q max-tokens=4 ! fakesink sync=false",
    );
    let (run, _) = ask_to_eos(&pipeline, |n| if n == 1 { vec!["What is it?"] } else { vec![] });
    let ctx = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("ctx").unwrap();
    let skipped = ctx.property::<u64>("frames-skipped");
    let stats = ctx.property::<gst::Array>("engine-stats");
    pipeline.set_state(gst::State::Null).unwrap();
    // Where the engine's time went: ingestion ran, and the parts do not exceed the whole.
    assert_eq!(stats.len(), 1, "one engine: {stats:?}");
    let s = stats.first().unwrap().get::<gst::Structure>().unwrap();
    let ms = |f: &str| s.get::<f64>(f).unwrap();
    assert!(s.get::<u64>("ingest-inputs").unwrap() > 0 && ms("ingest-ms") > 0.0, "{s}");
    let parts: f64 =
        ["decode-ms", "start-ms", "ingest-ms", "jobs-ms", "idle-ms", "other-ms"].iter().map(|f| ms(f)).sum();
    assert!((parts - ms("wall-ms")).abs() < 1.0 + ms("wall-ms") * 1e-6, "{s}");
    assert!(s.get::<i32>("threads").unwrap() >= 1 && s.get::<bool>("merge-frames").is_ok(), "{s}");
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(skipped > 0, "no frame skipped out of 100 encoded back to back");
    assert_eq!(run.answers.len(), 1, "{:?} {:?}", run.warnings, run.messages);
    let overload = run.messages.iter().find(|m| m.name() == "vlm-overload").expect("a vlm-overload message");
    assert!(overload.get::<u64>("skipped").unwrap() >= 1, "{overload}");
}

#[test]
fn answers_come_out_as_text_lines_or_json_objects() {
    let out = |format: &str| {
        let path = std::env::temp_dir().join(format!("vlm-answers-{}-{format}.txt", std::process::id()));
        let pipeline = launch(&format!(
            "{SOURCE} ! vlmquery name=q max-tokens=6 output-format={format} ! filesink location={}",
            path.display()
        ));
        let (run, ids) = run_asking(&pipeline, |n| if n == 2 || n == 4 { vec!["What is it?"] } else { vec![] });
        assert!(run.errors.is_empty(), "{:?}", run.errors);
        let ids: Vec<String> = ids.lock().unwrap().iter().map(|i| i.clone().expect("accepted")).collect();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        (run, ids, text)
    };
    let (run, _, text) = out("text");
    let answers: Vec<String> = run.answers.iter().map(|a| a.get::<String>("text").unwrap() + "\n").collect();
    assert_eq!(answers.len(), 2);
    assert_eq!(text, answers.concat(), "each answer and a newline, in order");
    let (run, ids, text) = out("json");
    let objects: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str(l).expect("a JSON object")).collect();
    assert_eq!(objects.len(), run.answers.len());
    for (o, id) in objects.iter().zip(&ids) {
        assert_eq!(o["id"], id.as_str());
        assert_eq!(o["status"], "answered");
        assert!(o["ttft-ms"].as_f64().unwrap() > 0.0 && o["frames"].as_u64().unwrap() > 0, "{o}");
        assert!(o["text"].is_string() && o["engine"] == "cpu" && o["path"] == "resident", "{o}");
    }
}

#[test]
fn stream_tokens_pushes_each_answer_as_it_is_generated_with_its_question_id() {
    let pipeline =
        launch(&format!("{SOURCE} ! vlmquery name=q max-tokens=32 exact-tokens=true stream-tokens=true ! fakesink"));
    // (text, id, status) of every buffer on the text pad, from the answer meta.
    let pushed = Arc::new(Mutex::new(Vec::<(String, String, String)>::new()));
    let pushed2 = Arc::clone(&pushed);
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    bin.by_name("q").unwrap().static_pad("src").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        let buffer = info.buffer().unwrap();
        let text = String::from_utf8(buffer.map_readable().unwrap().to_vec()).unwrap();
        let meta =
            gst::meta::CustomMeta::from_buffer(buffer, gst_vlm_elements::meta::ANSWER_META).expect("answer meta");
        let field = |name| meta.structure().get::<String>(name).unwrap();
        pushed2.lock().unwrap().push((text, field("id"), field("status")));
        gst::PadProbeReturn::Ok
    });
    let (run, ids) = run_asking(&pipeline, |n| if n == 2 || n == 4 { vec!["Describe the picture."] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let pushed = pushed.lock().unwrap();
    for id in ids.lock().unwrap().iter().map(|i| i.clone().expect("accepted")) {
        let answer = answer_of(&run, &id);
        let whole = answer.get::<String>("text").unwrap();
        let mine: Vec<_> = pushed.iter().filter(|(_, i, _)| *i == id).collect();
        let (last, pieces) = mine.split_last().expect("buffers for the answer");
        assert_eq!(
            (last.0.as_str(), last.2.as_str()),
            (format!("{whole}\n").as_str(), "answered"),
            "the whole answer last"
        );
        assert!(pieces.len() >= 2, "32 tokens came out in one piece: {mine:?}");
        assert!(pieces.iter().all(|(_, _, status)| status == "partial"));
        // Each piece is the answer so far, a line: growing, each a beginning of the answer.
        let mut so_far = "";
        for (text, _, _) in pieces {
            let text = text.strip_suffix('\n').expect("a line");
            assert!(text.len() > so_far.len() && text.starts_with(so_far), "{text:?} after {so_far:?}");
            assert!(whole.starts_with(text), "{text:?} does not begin {whole:?}");
            so_far = text;
        }
    }
    // One answer's buffers are not interleaved with another's.
    let order: Vec<&String> = pushed.iter().map(|(_, id, _)| id).collect();
    let switches = order.windows(2).filter(|w| w[0] != w[1]).count();
    assert_eq!(switches, 1, "answers went out interleaved: {order:?}");
}

#[test]
fn video_leaves_vlmquery_and_textoverlay_draws_answers_with_its_defaults() {
    // No tee, textoverlay's default wait-text=true: the text pad's GAP events keep the video
    // moving, the answer arrives timestamped where it completed and is shown for its display
    // duration: with `display=replace` (the default) one buffer per frame it is on, each ending
    // where that frame ends; with `queue` one buffer.
    for display in ["replace", "queue"] {
        let pipeline = launch(&format!(
            "{SOURCE} ! vlmquery name=q max-tokens=6 answer-duration=500000000 display={display} \
             q.video_src ! queue ! o.video_sink q.src ! queue ! o.text_sink \
             textoverlay name=o ! fakesink name=out sync=false"
        ));
        let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
        let frames = count_buffers(bin, "out");
        let texts = Arc::new(Mutex::new(vec![]));
        let t2 = Arc::clone(&texts);
        bin.by_name("o").unwrap().static_pad("text_sink").unwrap().add_probe(
            gst::PadProbeType::BUFFER,
            move |_, info| {
                if let Some(b) = info.buffer() {
                    t2.lock().unwrap().push((b.pts().unwrap(), b.duration().unwrap()));
                }
                gst::PadProbeReturn::Ok
            },
        );
        let (run, ids) = run_asking(&pipeline, |n| if n == 3 { vec!["What is it?"] } else { vec![] });
        assert!(run.errors.is_empty(), "{display}: {:?}", run.errors);
        assert!(ids.lock().unwrap()[0].is_some());
        assert_eq!(*frames.lock().unwrap(), 60, "{display}: every video frame went through textoverlay");
        let texts = texts.lock().unwrap();
        let (pts, _) = texts[0];
        assert!(pts >= gst::ClockTime::from_mseconds(750), "{display}: shown from where it completed: {pts:?}");
        let half_second = gst::ClockTime::from_mseconds(500);
        if display == "queue" {
            assert_eq!(*texts, [(pts, half_second)], "{display}: one answer buffer");
        } else {
            // Back to back, at most the display duration (the video may end first: 2 s).
            assert!(texts.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0), "{display}: {texts:?}");
            let (last, last_duration) = *texts.last().unwrap();
            let shown = last + last_duration - pts;
            assert!(shown > gst::ClockTime::ZERO && shown <= half_second, "{display}: {texts:?}");
            assert!(
                // (the video's last frame may leave before the answer's piece for it: 1.9 s)
                shown == half_second || last + last_duration >= gst::ClockTime::from_mseconds(1900),
                "{display}: cut short before the video ended: {texts:?}"
            );
        }
    }
}

#[test]
fn video_without_buffer_durations_goes_through_textoverlay() {
    // A camera whose decoder leaves durations unset (RTSP without timing, appsrc with PTS only):
    // a frame lasts one frame of the caps' rate, as textoverlay counts it, so the text pad's GAP
    // reaches past its start and textoverlay (wait-text=true) lets it through. (The text pad
    // ended at the frame's start before: textoverlay, with no queue before its video pad to
    // let the next frame come, waited there for good, at the first frame.)
    let pipeline = launch(&format!(
        "{SOURCE} ! vlmquery name=q max-tokens=6 \
         q.video_src ! o.video_sink q.src ! queue ! o.text_sink \
         textoverlay name=o ! fakesink name=out sync=false"
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    bin.by_name("q").unwrap().static_pad("sink").unwrap().add_probe(gst::PadProbeType::BUFFER, |_, info| {
        if let Some(gst::PadProbeData::Buffer(b)) = info.data.as_mut() {
            b.make_mut().set_duration(gst::ClockTime::NONE);
        }
        gst::PadProbeReturn::Ok
    });
    let frames = count_buffers(bin, "out");
    let (run, ids) = run_asking(&pipeline, |n| if n == 3 { vec!["What is it?"] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(ids.lock().unwrap()[0].is_some());
    assert_eq!(run.answers.len(), 1);
    assert_eq!(*frames.lock().unwrap(), 60, "every video frame went through textoverlay");
}

#[test]
fn the_text_pads_segment_is_open_ended_after_a_seek_with_a_stop() {
    // A seek with a stop: an answer completing after the video's last frame starts at the
    // segment's stop, where a sink drops a buffer of a segment that ends there (vlmpublish and
    // filesink lose the line). The text pad takes the video's segment without its stop.
    let pipeline = launch(&format!("{SOURCE} ! vlmquery name=q max-tokens=4 ! fakesink name=text sync=false"));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let stops = Arc::new(Mutex::new(vec![]));
    let s2 = Arc::clone(&stops);
    bin.by_name("text").unwrap().static_pad("sink").unwrap().add_probe(
        gst::PadProbeType::EVENT_DOWNSTREAM,
        move |_, info| {
            if let Some(gst::EventView::Segment(s)) = info.event().map(|e| e.view()) {
                let segment = s.segment().downcast_ref::<gst::ClockTime>().unwrap();
                s2.lock().unwrap().push(segment.stop());
            }
            gst::PadProbeReturn::Ok
        },
    );
    pipeline.set_state(gst::State::Paused).unwrap();
    let (changed, _, _) = pipeline.state(gst::ClockTime::from_seconds(120));
    assert!(changed.is_ok(), "prerolled");
    let flags = gst::SeekFlags::FLUSH | gst::SeekFlags::ACCURATE;
    let stop = gst::ClockTime::from_mseconds(1500);
    pipeline.seek(1.0, flags, gst::SeekType::Set, gst::ClockTime::ZERO, gst::SeekType::Set, stop).unwrap();
    let asked = std::sync::atomic::AtomicBool::new(false);
    let once = move |n: u64| n >= 2 && !asked.swap(true, std::sync::atomic::Ordering::AcqRel);
    let (run, _) = run_asking(&pipeline, move |n| if once(n) { vec!["What is it?"] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 1);
    let stops = stops.lock().unwrap();
    assert!(stops.len() >= 2, "a segment after the seek: {stops:?}");
    assert!(stops.iter().all(Option::is_none), "the text pad's segment ends: {stops:?}");
}

#[test]
fn an_answer_of_no_display_duration_still_reaches_the_text_pad() {
    // `answer-duration=0` under `display=replace` (following the video): the answer was dropped
    // unseen (its display ended where it began), though counted in `answers`; now it is on one
    // frame.
    let pipeline = launch(&format!(
        "{SOURCE} ! vlmquery name=q max-tokens=6 answer-duration=0 \
         q.video_src ! queue ! o.video_sink q.src ! queue ! o.text_sink \
         textoverlay name=o ! fakesink sync=false"
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let texts = Arc::new(Mutex::new(0u32));
    let t2 = Arc::clone(&texts);
    bin.by_name("o").unwrap().static_pad("text_sink").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        *t2.lock().unwrap() += 1;
        gst::PadProbeReturn::Ok
    });
    let (run, ids) = run_asking(&pipeline, |n| if n == 3 { vec!["What is it?"] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(ids.lock().unwrap()[0].is_some());
    assert_eq!(run.answers.len(), 1);
    assert_eq!(run.answers[0].get::<String>("status").unwrap(), "answered");
    assert!(*texts.lock().unwrap() >= 1, "no text buffer for the answer");
}

#[test]
fn an_answer_on_screen_ends_with_its_segment() {
    // Two clips one after the other (`concat`: a new segment without a flush, its times from 0
    // again), in real time, an answer shown for 2 s asked some 1.6 s before the first clip's
    // end: its display ends at most 2 s after it began. (It kept its end in the first clip's time
    // and stayed on every frame of the second, whose times are all before it: 5.2 s.)
    let clip = |pattern: &str| {
        format!("videotestsrc pattern={pattern} num-buffers=40 ! video/x-raw,width=160,height=120,framerate=10/1 ! c. ")
    };
    let pipeline = launch(&format!(
        "concat name=c ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q max-tokens=6 answer-duration=2000000000 q.video_src ! fakesink sync=true \
         q.src ! fakesink sync=false {} {}",
        clip("ball"),
        clip("smpte")
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let items = record_text(&bin.by_name("q").unwrap().static_pad("src").unwrap());
    let (run, ids) = run_asking(&pipeline, |n| if n == 9 { vec!["What is it?"] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let id = ids.lock().unwrap()[0].clone().expect("accepted");
    let items = items.lock().unwrap();
    let shown: gst::ClockTime = text_buffers(&items).iter().filter(|b| b.0 == id).map(|b| b.4.unwrap()).sum();
    assert!(shown > gst::ClockTime::ZERO && shown <= gst::ClockTime::from_seconds(2), "shown for {shown}");
}

#[test]
fn a_failed_answer_still_covers_its_time_so_textoverlay_goes_on() {
    // A question longer than the 512-cell context fails: nothing is drawn, but the text pad
    // still covers the answer's display time (5 s, past the 2 s of video) with a GAP, so
    // textoverlay (wait-text=true) lets every frame and EOS through instead of waiting for text.
    // The video plays in real time (sync=true), so the failure comes while frames still flow.
    // (`display=queue`: under `replace`, the default, what is shown stays and the per-frame
    // GAPs go on.)
    let long: &'static str = Box::leak(format!("Count{}?", " very".repeat(600)).into_boxed_str());
    let pipeline = launch(&format!(
        "{SOURCE} context-size=512 ! vlmquery name=q max-tokens=6 display=queue \
         q.video_src ! queue ! o.video_sink q.src ! queue ! o.text_sink \
         textoverlay name=o ! fakesink name=out sync=true"
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let frames = count_buffers(bin, "out");
    let gaps = Arc::new(Mutex::new(vec![]));
    let g2 = Arc::clone(&gaps);
    let src = bin.by_name("q").unwrap().static_pad("src").unwrap();
    src.add_probe(gst::PadProbeType::EVENT_DOWNSTREAM, move |_, info| {
        if let Some(gst::EventView::Gap(g)) = info.event().map(|e| e.view()) {
            g2.lock().unwrap().push(g.get().1);
        }
        gst::PadProbeReturn::Ok
    });
    let (run, ids) = run_asking(&pipeline, move |n| if n == 3 { vec![long] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(ids.lock().unwrap()[0].is_some());
    assert_eq!(run.answers.len(), 1);
    assert_eq!(run.answers[0].get::<String>("status").unwrap(), "failed", "{}", run.answers[0]);
    let answer_duration = Some(gst::ClockTime::from_seconds(5));
    assert!(gaps.lock().unwrap().contains(&answer_duration), "no GAP for the failed answer's time: {gaps:?}");
    assert_eq!(*frames.lock().unwrap(), 60, "every video frame went through textoverlay");
}

#[test]
fn the_text_pad_follows_a_new_video_segment_without_a_flush() {
    // concat starts a second segment (a later base) without flushing: the text pad's GAPs and
    // answers must be read in that segment, so it sends it too; and `subtitle_src` covers the
    // second segment's frames with GAPs in its time (which starts at 0 again), or a recorder
    // waiting for it would wait until that segment passed where the first ended.
    let pipeline = launch(
        "concat name=c ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q ! fakesink sync=false \
         q.subtitle_src ! fakesink sync=false async=false q.video_src ! fakesink sync=true \
         videotestsrc num-buffers=15 ! video/x-raw,width=160,height=120,framerate=30/1 ! c. \
         videotestsrc num-buffers=15 ! video/x-raw,width=160,height=120,framerate=30/1 ! c.",
    );
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let bases = Arc::new(Mutex::new(vec![]));
    let b2 = Arc::clone(&bases);
    bin.by_name("q").unwrap().static_pad("src").unwrap().add_probe(
        gst::PadProbeType::EVENT_DOWNSTREAM,
        move |_, info| {
            if let Some(gst::EventView::Segment(s)) = info.event().map(|e| e.view()) {
                b2.lock().unwrap().push(s.segment().base().value());
            }
            gst::PadProbeReturn::Ok
        },
    );
    // subtitle_src's segments (their count when each GAP came) and GAPs.
    let gaps = Arc::new(Mutex::new((0, vec![])));
    let g2 = Arc::clone(&gaps);
    bin.by_name("q").unwrap().static_pad("subtitle_src").unwrap().add_probe(
        gst::PadProbeType::EVENT_DOWNSTREAM,
        move |_, info| {
            let mut g = g2.lock().unwrap();
            match info.event().map(|e| e.view()) {
                Some(gst::EventView::Segment(_)) => g.0 += 1,
                Some(gst::EventView::Gap(gap)) => {
                    let (start, duration) = gap.get();
                    let segment = g.0;
                    g.1.push((segment, start, start + duration.unwrap_or_default()));
                }
                _ => (),
            }
            gst::PadProbeReturn::Ok
        },
    );
    let run = run(&pipeline);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let bases = bases.lock().unwrap();
    assert_eq!(bases.len(), 2, "one segment per video segment on the text pad: {bases:?}");
    assert!(bases[1] > bases[0], "the second segment starts later: {bases:?}");
    // 15 frames of 33 ms in each segment, played in real time: GAPs cover the second's frames
    // too (its times are those of the first again: 0 to 0.5 s).
    let (segments, gaps) = &*gaps.lock().unwrap();
    assert_eq!(*segments, 2, "{gaps:?}");
    assert!(gaps.iter().any(|(s, ..)| *s == 2), "no GAP on subtitle_src in the second segment: {gaps:?}");
}

#[test]
fn periodic_captions_ask_the_prompt_at_the_interval() {
    // 8 frames 250 ms apart, a caption every 500 ms of running time: frames 1, 3, 5, 7.
    let run = run(&launch(&format!(
        "{SOURCE} ! vlmquery name=q max-tokens=4 caption-prompt=\"Describe the scene.\" caption-interval=500000000 \
         ! fakesink sync=false"
    )));
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let frames: Vec<u64> = run.answers.iter().map(|a| a.get::<u64>("frames").unwrap()).collect();
    assert_eq!(frames, [1, 3, 5, 7], "{:?}", run.answers);
    assert!(run.answers.iter().all(|a| a.get::<String>("question").unwrap() == "Describe the scene."));
}

#[test]
fn textoverlay_draws_the_answer_on_the_frames_of_its_display_duration() {
    // Black frames: any light pixel on a frame is drawn text. The answer must be drawn on the
    // frames of [its timestamp, + answer-duration) and on no frame before it. The frames are
    // also written as PNGs; VLM_OVERLAY_PNG=path keeps one with the answer on it (the README's).
    let dir = std::env::temp_dir().join(format!("vlm-overlay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pipeline = launch(&format!(
        "videotestsrc pattern=black num-buffers=40 ! video/x-raw,width=320,height=240,framerate=10/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=500000000 min-change=0 \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q max-tokens=8 answer-duration=1000000000 \
         q.video_src ! textoverlay name=o font-desc=\"Sans 12\" ! videoconvert ! video/x-raw,format=RGB ! tee name=t \
         t. ! queue ! appsink name=frames sync=false t. ! queue ! pngenc ! multifilesink location={}/frame-%03d.png \
         q.src ! o.text_sink",
        dir.display()
    ));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let drawn = Arc::new(Mutex::new(vec![]));
    let d2 = Arc::clone(&drawn);
    let appsink = bin.by_name("frames").unwrap();
    appsink.set_property("emit-signals", true);
    appsink.connect("new-sample", false, move |args| {
        let sink = args[0].get::<gst::Element>().unwrap();
        let sample = sink.emit_by_name::<gst::Sample>("pull-sample", &[]);
        let buffer = sample.buffer().unwrap();
        let map = buffer.map_readable().unwrap();
        let light = map.chunks(3).filter(|p| p.iter().any(|&c| c > 128)).count();
        d2.lock().unwrap().push((buffer.pts().unwrap(), light));
        Some(gst::FlowReturn::Ok.to_value())
    });
    // (Where the answer's display starts, and how long it lasts: one buffer per frame it is on.)
    let shown = Arc::new(Mutex::new(None));
    let s2 = Arc::clone(&shown);
    bin.by_name("o").unwrap().static_pad("text_sink").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        if let Some(b) = info.buffer() {
            let (pts, end) = (b.pts().unwrap(), b.pts().unwrap() + b.duration().unwrap());
            let mut shown = s2.lock().unwrap();
            let at = shown.map_or(pts, |(at, _)| at);
            *shown = Some((at, end - at));
        }
        gst::PadProbeReturn::Ok
    });
    let (run, _) = run_asking(&pipeline, |n| if n == 2 { vec!["What is it?"] } else { vec![] });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let (at, duration) = shown.lock().unwrap().expect("an answer buffer reached textoverlay");
    let drawn = drawn.lock().unwrap();
    assert_eq!(drawn.len(), 40);
    let (before, during): (Vec<_>, Vec<_>) =
        drawn.iter().filter(|(pts, _)| *pts < at + duration).partition(|(pts, _)| *pts < at);
    assert!(before.iter().all(|(_, light)| *light == 0), "text before the answer: {before:?}");
    // The frame at exactly `at` may pass the overlay a moment before the answer buffer reaches
    // it (the video is not held for text that is not due yet); every later one shows it.
    assert!(during.len() > 1 && during[1..].iter().all(|(_, light)| *light > 100), "answer not drawn: {during:?}");
    if let Some(keep) = std::env::var_os("VLM_OVERLAY_PNG") {
        let index = drawn.iter().position(|(pts, _)| *pts >= at).unwrap();
        std::fs::copy(dir.join(format!("frame-{index:03}.png")), keep).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What reached a pad: text buffers (with their answer meta) and the events between them, in
/// the order they came.
#[derive(Debug, Clone)]
enum TextItem {
    Buffer { id: String, status: String, text: String, pts: Option<gst::ClockTime>, duration: Option<gst::ClockTime> },
    Event(gst::EventType),
}

/// Record the text buffers and downstream events reaching `pad`.
fn record_text(pad: &gst::Pad) -> Arc<Mutex<Vec<TextItem>>> {
    let items = Arc::new(Mutex::new(vec![]));
    let i2 = Arc::clone(&items);
    pad.add_probe(gst::PadProbeType::BUFFER | gst::PadProbeType::EVENT_DOWNSTREAM, move |_, info| {
        let item = match &info.data {
            Some(gst::PadProbeData::Buffer(b)) => {
                let answer = gst_vlm_elements::meta::answer_of(b).expect("answer meta");
                let field = |name| answer.get::<String>(name).unwrap();
                TextItem::Buffer {
                    id: field("id"),
                    status: field("status"),
                    text: String::from_utf8(b.map_readable().unwrap().to_vec()).unwrap(),
                    pts: b.pts(),
                    duration: b.duration(),
                }
            }
            Some(gst::PadProbeData::Event(e)) => TextItem::Event(e.type_()),
            _ => return gst::PadProbeReturn::Ok,
        };
        i2.lock().unwrap().push(item);
        gst::PadProbeReturn::Ok
    });
    items
}

/// (id, status, text, pts, duration) of the buffers among `items`.
#[allow(clippy::type_complexity)]
fn text_buffers(items: &[TextItem]) -> Vec<(&str, &str, &str, Option<gst::ClockTime>, Option<gst::ClockTime>)> {
    items
        .iter()
        .filter_map(|i| match i {
            TextItem::Buffer { id, status, text, pts, duration } => {
                Some((id.as_str(), status.as_str(), text.as_str(), *pts, *duration))
            }
            TextItem::Event(_) => None,
        })
        .collect()
}

#[test]
fn streamed_answers_reach_textoverlay_as_growing_text_and_every_question_is_answered_before_eos() {
    // Live captions drawn on the video, as a user writes it: textoverlay with its defaults, the
    // video in real time (sync=true, 5 s), three periodic captions (0, 2 and 4 s) and a question
    // at the last encoded frame, still being answered when the video ends.
    let pipeline = launch(
        "videotestsrc pattern=ball num-buffers=150 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q max-tokens=12 stream-tokens=true caption-prompt=\"Describe the scene.\" caption-interval=2000000000 \
         q.video_src ! queue ! o.video_sink q.src ! o.text_sink textoverlay name=o ! fakesink name=out sync=true",
    );
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let frames = count_buffers(bin, "out");
    let items = record_text(&bin.by_name("o").unwrap().static_pad("text_sink").unwrap());
    let asked = std::sync::atomic::AtomicBool::new(false);
    let (run, ids) = run_asking(&pipeline, move |n| {
        let last = n >= 18 && !asked.swap(true, std::sync::atomic::Ordering::Relaxed);
        if last { vec!["What is at the end?"] } else { vec![] }
    });
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(*frames.lock().unwrap(), 150, "every video frame went through textoverlay");
    // Every caption and the question: answered, on the bus before the pipeline's EOS (nothing
    // is left to be cancelled unseen when the pipeline stops).
    let asked = ids.lock().unwrap()[0].clone().expect("accepted");
    let captions = run.answers.iter().filter(|a| a.get::<String>("question").unwrap() == "Describe the scene.").count();
    assert_eq!(captions, 3, "{:?}", run.answers);
    assert_eq!(run.answers.len(), 4, "{:?}", run.answers);
    assert!(run.answers.iter().all(|a| a.get::<String>("status").unwrap() == "answered"), "{:?}", run.answers);
    assert_eq!(answer_of(&run, &asked).get::<String>("status").unwrap(), "answered");
    let items = items.lock().unwrap();
    let buffers = text_buffers(&items);
    // Each buffer is the answer so far: growing, and then the whole answer. (textoverlay keeps
    // the first text buffer that reaches it after the video's EOS for ever and takes no other,
    // so an answer still being generated then may end with a piece, and later ones reach it not
    // at all.)
    let video_end = gst::ClockTime::from_seconds(5);
    for answer in &run.answers {
        let id = answer.get::<String>("id").unwrap();
        // The text pad's lines: the answer with its line breaks folded (`output-format=text`).
        let whole = gst_vlm_elements::text::one_line(&answer.get::<String>("text").unwrap()).into_owned();
        let mine: Vec<_> = buffers.iter().filter(|b| b.0 == id).collect();
        let done = mine.iter().position(|b| b.1 == "answered").unwrap_or(mine.len());
        let ended = mine.last().is_none_or(|b| b.3.is_some_and(|pts| pts >= video_end));
        assert!(done < mine.len() || ended, "{id}: its text stopped short while the video ran: {mine:?}");
        assert!(mine[..done].iter().all(|b| b.1 == "partial"), "{id}: {mine:?}");
        assert!(
            mine[done..].iter().all(|b| b.1 == "answered" && b.2 == format!("{whole}\n")),
            "{id}: {mine:?}, the answer {whole:?}"
        );
        let mut so_far = "";
        for b in &mine[..done] {
            let text = b.2.strip_suffix('\n').expect("a line");
            assert!(
                text.starts_with(so_far) && whole.starts_with(text),
                "{id}: {text:?} after {so_far:?}, answer {whole:?}"
            );
            so_far = text;
        }
    }
    // The first caption (asked at 0 s) was drawn whole while the video ran.
    let first = &run.answers[0].get::<String>("id").unwrap();
    assert!(
        buffers.iter().any(|b| b.0 == first && b.1 == "answered" && b.3.is_some_and(|pts| pts < video_end)),
        "{first}: never drawn whole: {buffers:?}"
    );
    // While the video runs (5 s), a buffer ends where the next begins: textoverlay, which holds
    // a text buffer until the video passes its end, never holds one piece while the next waits.
    for w in buffers.windows(2) {
        if let ((_, _, _, Some(pts), Some(duration)), (_, _, _, Some(next), _)) = (w[0], w[1])
            && pts < video_end
        {
            assert!(pts + duration <= next, "overlapping text buffers: {w:?}");
        }
    }
}

#[test]
fn display_replace_shows_a_newer_answer_at_once_and_queue_keeps_each_for_its_duration() {
    // Questions far closer than answer-duration (60 s, longer than the video): with `replace`
    // the second answer goes to textoverlay as soon as it is there and cuts the first one's
    // display short; with `queue` each answer is one buffer lasting 60 s, the second waiting
    // behind the first.
    for display in ["replace", "queue"] {
        let pipeline = launch(&format!(
            "videotestsrc pattern=ball num-buffers=120 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
             ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 \
             ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
             ! vlmquery name=q max-tokens=6 answer-duration=60000000000 display={display} \
             q.video_src ! queue ! o.video_sink q.src ! o.text_sink textoverlay name=o ! fakesink name=out sync=true"
        ));
        let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
        let items = record_text(&bin.by_name("o").unwrap().static_pad("text_sink").unwrap());
        let (run, ids) = run_asking(&pipeline, |n| match n {
            2 => vec!["What is it?"],
            4 => vec!["Describe the colours."],
            _ => vec![],
        });
        assert!(run.errors.is_empty(), "{display}: {:?}", run.errors);
        let ids: Vec<String> = ids.lock().unwrap().iter().map(|i| i.clone().expect("accepted")).collect();
        for id in &ids {
            assert_eq!(answer_of(&run, id).get::<String>("status").unwrap(), "answered", "{display}");
        }
        let items = items.lock().unwrap();
        let buffers = text_buffers(&items);
        let first: Vec<_> = buffers.iter().filter(|b| b.0 == ids[0]).collect();
        let second: Vec<_> = buffers.iter().filter(|b| b.0 == ids[1]).collect();
        assert!(!first.is_empty() && !second.is_empty(), "{display}: {buffers:?}");
        let end = |b: &&(&str, &str, &str, Option<gst::ClockTime>, Option<gst::ClockTime>)| b.3.unwrap() + b.4.unwrap();
        let (first_end, second_start) = (end(first.last().unwrap()), second[0].3.unwrap());
        if display == "replace" {
            // The first answer's display ends where the second's begins.
            assert!(first_end <= second_start, "{display}: the first answer still shown under the second: {buffers:?}");
            // textoverlay took the second answer while the video ran: the text pad went on
            // after it (a push held until the first answer's 60 s ended would never return).
            let at = items
                .iter()
                .position(|i| matches!(i, TextItem::Buffer { id, .. } if *id == ids[1]))
                .expect("the second answer");
            let after = |i: &TextItem| {
                matches!(i, TextItem::Buffer { .. } | TextItem::Event(gst::EventType::Gap | gst::EventType::Eos))
            };
            assert!(
                items[at + 1..].iter().any(after),
                "{display}: nothing reached textoverlay after the second answer: {items:?}"
            );
        } else {
            assert_eq!((first.len(), second.len()), (1, 1), "{display}: one buffer per answer: {buffers:?}");
            assert_eq!(first[0].4, Some(gst::ClockTime::from_seconds(60)), "{display}");
            // The second waits behind the first: it starts where the first ends, so it too is
            // shown for its whole duration (from where it completed, textoverlay would show it
            // only once the first has ended, for less than 60 s).
            assert_eq!(second_start, first_end, "{display}: the second answer waits behind the first: {buffers:?}");
            assert_eq!(second[0].4, Some(gst::ClockTime::from_seconds(60)), "{display}");
        }
    }
}

#[test]
fn each_answer_rides_on_the_next_video_buffer_as_a_meta_that_agrees_with_json() {
    // Frames fed one at a time: two questions (one that fails: longer than the context), their
    // answers on the bus, then three more frames. The first two of them carry the answers, in
    // question order; the JSON lines, the vlm-answer messages and the metas agree.
    init();
    let long: String = format!("Count{}?", " very".repeat(600));
    let pipeline = launch(
        "appsrc name=src format=time caps=video/x-raw,format=RGB,width=64,height=48,framerate=10/1 \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf context-size=512 \
         ! vlmquery name=q max-tokens=4 output-format=json ! appsink name=json sync=false \
         q.video_src ! appsink name=video sync=false",
    );
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let src = bin.by_name("src").unwrap().downcast::<gst_app::AppSrc>().unwrap();
    let q = bin.by_name("q").unwrap();
    // The video appsink: each buffer's pts and the answer it carries.
    let video =
        Arc::new((Mutex::new(Vec::<(gst::ClockTime, Option<gst::Structure>)>::new()), std::sync::Condvar::new()));
    let v2 = Arc::clone(&video);
    bin.by_name("video").unwrap().downcast::<gst_app::AppSink>().unwrap().set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let buffer = sample.buffer().unwrap();
                let metas =
                    buffer.iter_meta::<gst::Meta>().filter(|m| m.api().name().starts_with("VlmAnswerMeta")).count();
                assert!(metas <= 1, "one answer per video buffer");
                v2.0.lock().unwrap().push((buffer.pts().unwrap(), gst_vlm_elements::meta::answer_of(buffer)));
                v2.1.notify_all();
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    let json = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
    let j2 = Arc::clone(&json);
    bin.by_name("json").unwrap().downcast::<gst_app::AppSink>().unwrap().set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let map = sample.buffer().unwrap().map_readable().unwrap();
                j2.lock().unwrap().push(serde_json::from_slice(&map).expect("a JSON line"));
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    let push_frames = |from: u64, n: u64| {
        for i in from..from + n {
            let mut buffer = gst::Buffer::from_mut_slice(vec![(i * 40 % 256) as u8; 64 * 48 * 3]);
            buffer.get_mut().unwrap().set_pts(gst::ClockTime::from_mseconds(100 * i));
            assert_eq!(src.push_buffer(buffer), Ok(gst::FlowSuccess::Ok));
        }
        let (seen, timeout) = video
            .1
            .wait_timeout_while(video.0.lock().unwrap(), std::time::Duration::from_secs(60), |v| {
                (v.len() as u64) < from + n
            })
            .unwrap();
        assert!(!timeout.timed_out(), "{} of {} frames left vlmquery", seen.len(), from + n);
    };
    let bus = pipeline.bus().unwrap();
    // Read the bus (bounded) until `done` says so or EOS; vlm-answer messages into `answers`.
    let pump = |answers: &mut Vec<gst::Structure>, done: &dyn Fn(&[gst::Structure]) -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !done(answers) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let msg = bus.timed_pop(gst::ClockTime::from_nseconds(left.as_nanos() as u64)).expect("bus: timed out");
            match msg.view() {
                gst::MessageView::Error(e) => panic!("{} ({:?})", e.error(), e.debug()),
                gst::MessageView::Eos(_) => return,
                gst::MessageView::Element(e) if e.structure().is_some_and(|s| s.name() == "vlm-answer") => {
                    answers.push(e.structure().unwrap().to_owned())
                }
                _ => (),
            }
        }
    };
    let mut answers = vec![];
    pipeline.set_state(gst::State::Playing).unwrap();
    push_frames(0, 2);
    let asked: Vec<String> =
        [q.emit_by_name::<Option<String>>("ask", &[&"What is it?"]), q.emit_by_name::<Option<String>>("ask", &[&long])]
            .into_iter()
            .map(|id| id.expect("accepted"))
            .collect();
    pump(&mut answers, &|a| a.len() == 2);
    push_frames(2, 3);
    assert_eq!(src.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    pump(&mut answers, &|_| false);
    pipeline.set_state(gst::State::Null).unwrap();

    let statuses: Vec<String> = answers.iter().map(|a| a.get::<String>("status").unwrap()).collect();
    assert_eq!(statuses, ["answered", "failed"], "{answers:?}");
    let video = video.0.lock().unwrap();
    assert_eq!(video.len(), 5);
    assert!(video[..2].iter().all(|(_, a)| a.is_none()), "an answer before it was there: {video:?}");
    assert!(video[4].1.is_none(), "{video:?}");
    let json = json.lock().unwrap();
    for (i, id) in asked.iter().enumerate() {
        let meta = video[2 + i].1.as_ref().unwrap_or_else(|| panic!("no answer on the frame after {id}'s: {video:?}"));
        let message = answers.iter().find(|a| a.get::<String>("id").unwrap() == *id).unwrap();
        let line = json.iter().find(|l| l["id"] == id.as_str()).unwrap_or_else(|| panic!("no JSON line for {id}"));
        for field in ["id", "stream", "status", "text"] {
            let value = meta.get::<String>(field).unwrap_or_else(|_| panic!("{field} missing: {meta}"));
            assert_eq!(value, message.get::<String>(field).unwrap(), "{field}: {meta} / {message}");
            assert_eq!(line[field], value.as_str(), "{field}: {meta} / {line}");
        }
    }
    let failed = video[3].1.as_ref().unwrap();
    assert!(failed.get::<String>("reason").is_ok_and(|r| !r.is_empty()), "{failed}");
}
