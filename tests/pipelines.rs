//! Every file in pipelines/ through `gst::parse::launch`, plus the contract's end-to-end paths.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use gst::prelude::*;
use gst_vlm_elements::events::QuestionEvent;

const FIELDS: [&str; 11] = [
    "id",
    "question",
    "text",
    "stream",
    "engine",
    "path",
    "ttft-ms",
    "ttft-from-capture-ms",
    "wait-ms",
    "tokens",
    "total-ms",
];

fn check_answer(a: &gst::Structure) {
    for f in FIELDS.iter().chain(&["frames"]) {
        assert!(a.has_field(*f), "vlm-answer lacks {f}: {a}");
    }
    let (wait, ttft, total) =
        (a.get::<f64>("wait-ms").unwrap(), a.get::<f64>("ttft-ms").unwrap(), a.get::<f64>("total-ms").unwrap());
    assert!(0.0 <= wait && wait <= ttft && ttft <= total, "inconsistent timings: {a}");
    let from_capture = a.get::<f64>("ttft-from-capture-ms").unwrap();
    assert!(from_capture == -1.0 || from_capture >= 0.0, "{a}");
    // The model may end an answer at once (0 tokens); then its text is empty.
    assert_eq!(a.get::<u32>("tokens").unwrap() == 0, a.get::<String>("text").unwrap().is_empty(), "{a}");
    // ... and says so.
    assert_eq!(a.get::<u32>("tokens").unwrap() == 0, a.has_field("reason"), "{a}");
}

#[test]
fn every_pipeline_runs_to_eos_with_answers_and_no_error() {
    let mut files: Vec<_> = std::fs::read_dir(root().join("pipelines"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pipeline"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for file in files {
        let run = run(&launch(&std::fs::read_to_string(&file).unwrap()));
        assert!(run.errors.is_empty(), "{}: {:?}", file.display(), run.errors);
        assert!(!run.answers.is_empty(), "{}: no answer", file.display());
        run.answers.iter().for_each(check_answer);
    }
}

#[test]
fn timed_questions_bind_to_the_frames_before_their_time() {
    // Frames are encoded at 0, 1, 2, ... s; the questions come at 2.5, 5.5 and 9.5 s.
    let run = run(&launch(&std::fs::read_to_string(root().join("pipelines/demo.pipeline")).unwrap()));
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let frames: Vec<u64> = run.answers.iter().map(|a| a.get("frames").unwrap()).collect();
    assert_eq!(frames, vec![3, 6, 10]);
    run.answers.iter().for_each(check_answer);
    assert!(
        run.answers.iter().all(|a| !a.get::<String>("text").unwrap().is_empty()),
        "the demo must print model text for every question"
    );
    let questions: Vec<String> = run.answers.iter().map(|a| a.get("question").unwrap()).collect();
    assert_eq!(questions[1], "Is the ball moving?", "pango markup must be stripped");
}

/// [`SOURCE`] for 10 s (40 encoded frames), so that frames keep arriving while answers run.
const LONG_SOURCE: &str = "videotestsrc pattern=ball num-buffers=300 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
    ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf";

const SOURCE: &str = "videotestsrc pattern=ball num-buffers=60 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
    ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[test]
fn a_question_event_binds_to_the_frames_before_it() {
    let pipeline = launch(&format!("{SOURCE} ! vlmquery name=q max-tokens=6 ! fakesink sync=false"));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let sink = bin.by_name("q").unwrap().static_pad("sink").unwrap();
    // Just before the buffer of frame 4 reaches vlmquery, a question event is sent ahead of it.
    let sent = Arc::new(Mutex::new(false));
    sink.add_probe(gst::PadProbeType::BUFFER, move |pad, info| {
        let number = joined_frame(info);
        let mut sent = sent.lock().unwrap();
        if number == Some(4) && !*sent {
            *sent = true;
            assert!(pad.send_event(QuestionEvent::event("What happened?", Some("ev"), Some(5))));
        }
        gst::PadProbeReturn::Ok
    });
    let run = run(&pipeline);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 1);
    let a = &run.answers[0];
    check_answer(a);
    assert_eq!(a.get::<String>("id").unwrap(), "ev");
    assert_eq!(a.get::<u64>("frames").unwrap(), 3);
    assert!(a.get::<u32>("tokens").unwrap() <= 5, "the event's max-tokens applies");
}

#[test]
fn ask_binds_to_the_newest_registered_frame() {
    let pipeline = launch(&format!("{SOURCE} ! vlmquery name=q max-tokens=6 ! fakesink sync=false"));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let q = bin.by_name("q").unwrap();
    let asked = Arc::new(Mutex::new(None));
    let (asked2, q2) = (Arc::clone(&asked), q.clone());
    bin.by_name("ctx").unwrap().static_pad("src_0").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        let number = joined_frame(info);
        let mut asked = asked2.lock().unwrap();
        if number == Some(2) && asked.is_none() {
            *asked = q2.emit_by_name::<Option<String>>("ask", &[&"Is anything moving?"]);
        }
        gst::PadProbeReturn::Ok
    });
    let run = run(&pipeline);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let id = asked.lock().unwrap().clone().expect("ask returned an id");
    let a = run.answers.iter().find(|a| a.get::<String>("id").unwrap() == id).expect("an answer to the asked question");
    check_answer(a);
    assert_eq!(a.get::<u64>("frames").unwrap(), 2, "ask binds to the newest registered frame");
}

#[test]
fn retain_false_gives_the_same_answers_by_replay() {
    let questions = "filesrc location=pipelines/questions.srt ! subparse ! q.query";
    let texts = |retain: bool| {
        let run = run(&launch(&format!(
            "{SOURCE} retain={retain} ! vlmquery name=q max-tokens=8 ! fakesink sync=false {questions}"
        )));
        assert!(run.errors.is_empty(), "{:?}", run.errors);
        run.answers
            .iter()
            .map(|a| (a.get::<String>("text").unwrap(), a.get::<String>("path").unwrap()))
            .collect::<Vec<_>>()
    };
    let (retained, replayed) = (texts(true), texts(false));
    assert!(!retained.is_empty());
    assert!(retained.iter().all(|(_, p)| p == "resident") && replayed.iter().all(|(_, p)| p == "replay"));
    let strip = |v: Vec<(String, String)>| v.into_iter().map(|(t, _)| t).collect::<Vec<_>>();
    assert_eq!(strip(retained), strip(replayed));
}

/// The first error's message (not its debug text: the message itself must name the cause).
fn error_of(description: &str) -> String {
    let run = run(&launch(description));
    assert!(!run.errors.is_empty(), "{description} must fail");
    let first = run.errors.iter().find(|e| !e.starts_with("state change")).expect("an error message on the bus");
    // run() writes "{message} ({debug:?})".
    let message =
        first.rsplit_once(" (Some(").or_else(|| first.rsplit_once(" (None)")).map_or(first.as_str(), |(m, _)| m);
    message.to_owned()
}

#[test]
fn a_missing_model_is_an_error_naming_the_file() {
    let e = error_of(
        "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! vlmcontext model=/nonexistent/lm.gguf ! vlmquery ! fakesink",
    );
    assert!(e.contains("/nonexistent/lm.gguf"), "{e}");
    // A path that is there but cannot be read as a file.
    let e = error_of(
        "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! vlmcontext model=models ! vlmquery ! fakesink",
    );
    assert!(e.contains("models") && e.contains("not a regular file"), "{e}");
}

/// A language model without a chat template answers, its prompt laid out in ChatML (as llama.cpp
/// does), and a warning says so.
#[test]
fn a_model_without_a_chat_template_answers_in_chatml_with_a_warning() {
    let run = run(&launch(
        "videotestsrc num-buffers=90 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
         ! vlmencode mmproj=models/test-qwen2vl-mmproj.gguf interval=1000000000 \
         ! vlmcontext model=models/test-notemplate-lm.gguf ! vlmquery name=q max-tokens=4 ! fakesink sync=false \
         filesrc location=pipelines/questions.srt ! subparse ! q.query",
    ));
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(
        run.warnings.iter().any(|w| w.contains("test-notemplate-lm.gguf") && w.contains("no chat template")),
        "{:?}",
        run.warnings
    );
    assert_eq!(run.answers.len(), 3);
    run.answers.iter().for_each(check_answer);
    assert!(run.answers.iter().all(|a| a.get::<String>("status").unwrap() == "answered"));
}

#[test]
fn a_truncated_model_or_malformed_engines_is_an_error_naming_the_cause() {
    init();
    // The first MiB of the real model: a GGUF header whose tensors end early.
    let truncated = std::env::temp_dir().join(format!("vlm-truncated-{}.gguf", std::process::id()));
    let bytes = std::fs::read(model()).unwrap();
    std::fs::write(&truncated, &bytes[..1 << 20]).unwrap();
    let e = error_of(&format!(
        "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf model={model} \
         ! vlmcontext model={} ! vlmquery ! fakesink",
        truncated.display(),
        model = model()
    ));
    let _ = std::fs::remove_file(&truncated);
    assert!(e.contains(&truncated.display().to_string()), "{e}");
    for engines in ["a:tpu", "a,a", "a:cpu:0", "a:cpu:1:3-2"] {
        let e = error_of(&format!(
            "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
             ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf engines={engines} ! vlmquery ! fakesink"
        ));
        assert!(e.contains(&format!("engine \"{}\"", engines.split(',').next().unwrap())), "{engines}: {e}");
    }
    // A GPU that is not there (llama.cpp lists none here; with one, "no GPU 9: llama.cpp found
    // 1 (...)": runtime/tests/gpu.rs), and an RPC endpoint without an address.
    // Cores this process may not run on (the machine has far fewer than 1000).
    for (settings, says) in [
        ("engines=gpu gpu-device=9 gpu-layers=4", "no GPU"),
        ("engines=cpu,far:rpc:gpu-box", "bad RPC endpoint list"),
        ("engines=a:cpu:1:1000", "engine a: cores 1000 are not among"),
    ] {
        let e = error_of(&format!(
            "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
             ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf {settings} ! vlmquery ! fakesink"
        ));
        assert!(e.contains(says), "{settings}: {e}");
    }
}

#[test]
fn a_missing_or_wrong_mmproj_is_an_error_naming_the_file() {
    let e = error_of(
        "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=/nonexistent/proj.gguf ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery ! fakesink",
    );
    assert!(e.contains("/nonexistent/proj.gguf"), "{e}");
    // A projector whose output width does not match the language model.
    let e = error_of(
        "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp-w512.gguf ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery ! fakesink",
    );
    assert!(e.contains("test-mmproj-mlp-w512.gguf") && e.contains("576"), "{e}");
    // The language model given as the projector: refused before libmtmd sees it.
    let e = error_of(
        "videotestsrc num-buffers=5 ! videoconvert ! vlmencode mmproj=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery ! fakesink",
    );
    assert!(e.contains("not a projector"), "{e}");
}

/// The `vlm-history` messages of `pipeline`, collected as they are posted.
fn history_messages(pipeline: &gst::Element) -> Arc<Mutex<Vec<gst::Structure>>> {
    let history = Arc::new(Mutex::new(vec![]));
    let h = Arc::clone(&history);
    let bus = pipeline.bus().unwrap();
    bus.enable_sync_message_emission();
    bus.connect_sync_message(None, move |_, msg| {
        if let Some(s) = msg.structure().filter(|s| s.name() == "vlm-history") {
            h.lock().unwrap().push(s.to_owned());
        }
    });
    history
}

#[test]
fn a_full_history_restarts_under_the_policy_and_says_so() {
    let pipeline = launch(
        "videotestsrc pattern=ball num-buffers=150 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf context-size=512 history-policy=restart history-keep=2 \
         ! vlmquery name=q max-tokens=4 ! fakesink sync=false filesrc location=pipelines/questions.srt ! subparse ! q.query",
    );
    let history = history_messages(&pipeline);
    // The counters are read before PAUSED→READY, which starts them again at zero.
    let run = run_to_eos(&pipeline, 240);
    let ctx = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("ctx").unwrap();
    let (restarts, dropped) = (ctx.property::<u64>("history-restarts"), ctx.property::<u64>("frames-dropped"));
    pipeline.set_state(gst::State::Null).unwrap();
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let history = history.lock().unwrap();
    assert!(!history.is_empty(), "20 frames of 36 tokens cannot fit 512 cells: the history must restart");
    assert_eq!(restarts, history.len() as u64);
    assert!(history.iter().all(|s| s.get::<u32>("kept").unwrap() == 2));
    assert_eq!(dropped, 0);
    // Answers still bind to the frames before their time; their histories are short.
    let frames: Vec<u64> = run.answers.iter().map(|a| a.get("frames").unwrap()).collect();
    assert_eq!(frames.len(), 3);
    assert!(frames.iter().all(|&f| (1..=6).contains(&f)), "{frames:?}");
}

fn encode_run(extra: &str) -> gst::Element {
    let pipeline = launch(&format!(
        "videotestsrc pattern=ball num-buffers=60 ! video/x-raw,width=64,height=48 ! videoconvert \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
           interval=0 cache-entries=0 min-change=0 {extra} ! fakesink"
    ));
    let run = run(&pipeline);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("enc").unwrap()
}

#[test]
fn a_slow_encoder_blocks_upstream_instead_of_queueing() {
    // The source makes a 64x48 frame in microseconds, the encoder needs a millisecond or more:
    // without backpressure the frames would pile up in front of it.
    let enc = encode_run("max-pending=2");
    assert_eq!(enc.property::<u64>("frames-seen"), 60);
    assert_eq!(enc.property::<u64>("frames-encoded"), 60, "blocking, nothing is skipped");
    assert_eq!(enc.property::<u64>("frames-skipped"), 0);
    let peak = enc.property::<u32>("peak-pending");
    assert!((1..=2).contains(&peak), "peak pending {peak}");
}

#[test]
fn a_leaky_encoder_skips_frames_and_counts_them() {
    let enc = encode_run("max-pending=1 leaky=true");
    let (encoded, skipped) = (enc.property::<u64>("frames-encoded"), enc.property::<u64>("frames-skipped"));
    assert_eq!(encoded + skipped, 60, "every frame is either encoded or counted as skipped");
    assert!(skipped > 0, "a source 100x faster than the encoder must make a leaky encoder skip");
    // Never more than one frame waits for the encoder (none at all when every frame passed while
    // the projector loaded: a leaky encoder never holds frames for it).
    assert!(enc.property::<u32>("peak-pending") <= 1);
}

#[test]
fn committed_answers_make_later_questions_see_the_conversation() {
    let questions = "filesrc location=pipelines/questions.srt ! subparse ! q.query";
    let run_with = |commit: &str| {
        let run = run(&launch(&format!(
            "{SOURCE} ! vlmquery name=q max-tokens=6 commit-answers={commit} ! fakesink sync=false {questions}"
        )));
        assert!(run.errors.is_empty(), "{:?}", run.errors);
        assert!(run.warnings.is_empty(), "{:?}", run.warnings);
        run.answers
    };
    let (plain, committed) = (run_with("none"), run_with("ordered"));
    assert_eq!(plain.len(), 3);
    assert_eq!(committed.len(), 3);
    let text = |a: &gst::Structure| a.get::<String>("text").unwrap();
    let cells = |a: &gst::Structure| a.get::<u32>("history-cells").unwrap();
    // The first question has no earlier answer to see: the same either way.
    assert_eq!(text(&committed[0]), text(&plain[0]));
    assert_eq!(cells(&committed[0]), cells(&plain[0]));
    // Later ones see the same frames plus every earlier question and answer: their histories
    // are longer by at least the answers' tokens.
    for i in 1..3 {
        assert_eq!(committed[i].get::<u64>("frames").unwrap(), plain[i].get::<u64>("frames").unwrap());
        let answered: u32 = committed[..i].iter().map(|a| a.get::<u32>("tokens").unwrap()).sum();
        assert!(
            cells(&committed[i]) >= cells(&plain[i]) + answered,
            "question {i}: history of {} cells with commits, {} without, {answered} tokens answered before",
            cells(&committed[i]),
            cells(&plain[i])
        );
    }
}

/// Questions asked at the same moment (1 s into 10 s of video), with ordered commits: each sees
/// every earlier answer, although those were committed after frames newer than its own (the
/// video goes on while an answer is generated, and a commit is appended after the newest frame).
/// Bound to its own frame's newest record, the second question saw none of the first's answer.
#[test]
fn questions_asked_together_with_ordered_commits_see_each_others_answers() {
    let srt = std::env::temp_dir().join(format!("vlm-together-{}.srt", std::process::id()));
    let cue = |i: usize, q: &str| format!("{i}\n00:00:01,000 --> 00:00:02,000\n{q}\n\n");
    let text: String = ["What do you see?", "Is it moving?", "What colour is it?"]
        .iter()
        .enumerate()
        .map(|(i, q)| cue(i + 1, q))
        .collect();
    std::fs::write(&srt, text).unwrap();
    let run = run(&launch(&format!(
        "{LONG_SOURCE} ! vlmquery name=q max-tokens=16 exact-tokens=true commit-answers=ordered ! fakesink sync=false \
         filesrc location={} ! subparse ! q.query",
        srt.display()
    )));
    std::fs::remove_file(&srt).unwrap();
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 3);
    let cells = |a: &gst::Structure| a.get::<u32>("history-cells").unwrap();
    for i in 1..3 {
        let (before, now) = (&run.answers[i - 1], &run.answers[i]);
        let tokens = before.get::<u32>("tokens").unwrap();
        assert!(
            cells(now) >= cells(before) + tokens,
            "question {i}: {} cells, the previous question's {} and its {tokens} answered tokens",
            cells(now),
            cells(before)
        );
    }
}

/// Answers committed to a history that its frames do not fill (eight frames, then five answers
/// of 40 tokens in 512 cells) make the history policy slide it, keeping its newest frames: each
/// slide is counted in `history-slides` and announced by `vlm-history` with `cause=answer`, as
/// a frame's is.
#[test]
fn a_slide_caused_by_a_committed_answer_is_counted_and_announced() {
    let srt = std::env::temp_dir().join(format!("vlm-commit-slide-{}.srt", std::process::id()));
    let text: String = (1..=5)
        .map(|i| format!("{i}\n00:00:01,900 --> 00:00:01,950\nQuestion number {i}: what do you see?\n\n"))
        .collect();
    std::fs::write(&srt, text).unwrap();
    let pipeline = launch(&format!(
        "videotestsrc pattern=ball num-buffers=60 ! video/x-raw,width=160,height=120,framerate=30/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=250000000 \
         ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf context-size=512 \
         ! vlmquery name=q max-tokens=40 exact-tokens=true commit-answers=ordered ! fakesink sync=false \
         filesrc location={} ! subparse ! q.query",
        srt.display()
    ));
    let history = history_messages(&pipeline);
    let run = run_to_eos(&pipeline, 240);
    let ctx = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("ctx").unwrap();
    let counted = ctx.property::<u64>("history-slides") + ctx.property::<u64>("history-restarts");
    pipeline.set_state(gst::State::Null).unwrap();
    std::fs::remove_file(&srt).unwrap();
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 5);
    assert!(run.answers.iter().all(|a| a.get::<String>("status").unwrap() == "answered"));
    let history = history.lock().unwrap();
    let by_answers = history.iter().filter(|s| s.get::<String>("cause").unwrap() == "answer").count();
    // Eight frames of 36 cells fit the 384 cells left after the answers' reserve: only the
    // answers (about 50 cells each) can fill them, and a slide keeps the newest frames (every
    // answer sees one: none is answered from no picture).
    assert!(by_answers >= 1, "{history:?}");
    assert!(run.answers.iter().all(|a| a.get::<u64>("frames").unwrap() > 0), "{:?}", run.answers);
    assert_eq!(counted, history.len() as u64, "{history:?}");
}

/// A question source that stays open (an appsrc that never sends EOS) does not hold the
/// pipeline's EOS: the video's EOS ends the answers after a short grace, with the text pad
/// linked or not, and the question asked before is answered.
#[test]
fn the_videos_eos_ends_the_stream_while_the_question_source_stays_open() {
    for text_sink in ["q.src ! fakesink sync=false", ""] {
        let pipeline = launch(&format!(
            "{SOURCE} ! vlmquery name=q max-tokens=4 q.video_src ! fakesink sync=false {text_sink} \
             appsrc name=questions caps=text/x-raw,format=utf8 format=time ! q.query"
        ));
        let bus_pipeline = pipeline.downcast_ref::<gst::Bin>().unwrap();
        let src = bus_pipeline.by_name("questions").unwrap().downcast::<gst_app::AppSrc>().unwrap();
        let mut question = gst::Buffer::from_slice(b"What do you see?".to_vec());
        question.get_mut().unwrap().set_pts(gst::ClockTime::from_mseconds(500));
        src.push_buffer(question).unwrap();
        let run = run_for(&pipeline, 40);
        assert!(run.errors.is_empty(), "text sink {text_sink:?}: {:?}", run.errors);
        assert_eq!(run.answers.len(), 1, "{text_sink:?}");
        assert_eq!(run.answers[0].get::<String>("status").unwrap(), "answered");
    }
}

/// A stream named on its pad from the launch line (`sink_0::stream-name=door`) is reported by
/// that name; an unnamed one by its pad's.
#[test]
fn a_stream_named_on_its_pad_is_reported_by_that_name() {
    let text = std::fs::read_to_string(root().join("pipelines/two-streams.pipeline")).unwrap();
    let named = text.replacen("vlmcontext name=ctx", "vlmcontext name=ctx sink_0::stream-name=door", 1);
    assert_ne!(named, text);
    let run = run(&launch(&named));
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let mut streams: Vec<String> = run.answers.iter().map(|a| a.get::<String>("stream").unwrap()).collect();
    streams.sort();
    streams.dedup();
    assert_eq!(streams, ["door", "sink_1"]);
}

/// At NULL `vlmencode` lets its encoder go: the projector, and the language model copy it was
/// bound to, are freed (they stayed loaded, and the stopped element still counted as one of
/// the process's streams for automatic encoder contexts); its statistics stay readable.
#[test]
fn a_stopped_encoder_frees_its_projector_and_keeps_its_statistics() {
    init();
    // A copy of the model under a name of its own: no other test holds it.
    let dir = std::env::temp_dir().join(format!("vlm-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("model.gguf");
    std::fs::copy(model(), &copy).unwrap();
    let pipeline = launch(&format!(
        "videotestsrc num-buffers=3 ! videoconvert ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf model={} \
         interval=0 min-change=0 ! fakesink",
        copy.display()
    ));
    let run = run_to_eos(&pipeline, 240);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let enc = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("enc").unwrap();
    assert!(vlm_runtime::models::model_owners(&copy) > 0, "loaded while the pipeline runs");
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(vlm_runtime::models::model_owners(&copy), 0, "the stopped encoder still holds the model");
    assert_eq!(enc.property::<u64>("frames-encoded"), 3);
    assert_eq!(enc.property::<u32>("active-encoder-contexts"), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_npu_backend_falls_back_or_fails_clearly_in_a_build_without_it() {
    // auto with an RKNN model: this build has no NPU backend, so it says why and uses the CPU.
    let pipeline = launch(
        "videotestsrc num-buffers=3 ! videoconvert ! vlmencode name=enc backend=auto rknn-model=/nonexistent/vision.rknn \
         mmproj=models/test-mmproj-mlp.gguf model=models/SmolLM2-135M-Instruct.Q4_1.gguf interval=0 min-change=0 ! fakesink",
    );
    let run = run(&pipeline);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let enc = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("enc").unwrap();
    assert_eq!(enc.property::<String>("active-backend"), "cpu");
    assert_eq!(enc.property::<u64>("frames-encoded"), 3);
    // encoder-contexts=0 resolved: one context on the CPU.
    assert_eq!(enc.property::<u32>("active-encoder-contexts"), 1);
    // rknn asked for explicitly: a clear error naming what is missing, not a crash.
    let model = model();
    let e = error_of(&format!(
        "videotestsrc num-buffers=3 ! videoconvert ! vlmencode backend=rknn rknn-model={model} model={model} ! fakesink"
    ));
    assert!(e.contains("RKNN"), "{e}");
}

#[test]
fn a_downstream_error_stops_vlmencode_with_one_error_and_upstream_never_blocks() {
    // The sink refuses every buffer: vlmencode's task stops; upstream must get the error back
    // (not block on a full queue), and the bus must carry one error from vlmencode, not several.
    let pipeline = launch(
        "videotestsrc num-buffers=200 ! video/x-raw,width=64,height=48 ! videoconvert \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
           interval=0 max-pending=1 ! identity error-after=3 ! fakesink sync=false",
    );
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut errors = vec![];
    let started = std::time::Instant::now();
    for msg in bus.iter_timed(gst::ClockTime::from_seconds(30)) {
        match msg.view() {
            gst::MessageView::Error(e) => {
                errors.push(format!("{}: {}", msg.src().map(|s| s.name().to_string()).unwrap_or_default(), e.error()));
            }
            gst::MessageView::Eos(_) => break,
            _ => (),
        }
        if !errors.is_empty() && started.elapsed() > std::time::Duration::from_secs(2) {
            break;
        }
    }
    // Drain what is left for a moment, then shut down: NULL must return.
    while let Some(msg) = bus.timed_pop_filtered(gst::ClockTime::from_mseconds(500), &[gst::MessageType::Error]) {
        if let gst::MessageView::Error(e) = msg.view() {
            errors.push(format!("{}: {}", msg.src().map(|s| s.name().to_string()).unwrap_or_default(), e.error()));
        }
    }
    pipeline.set_state(gst::State::Null).unwrap();
    let from_enc = errors.iter().filter(|e| e.starts_with("enc:")).count();
    assert!(!errors.is_empty(), "the failure never reached the bus");
    assert!(from_enc <= 1, "vlmencode posted {from_enc} errors for one failure: {errors:?}");
}

#[test]
fn vlmencode_reports_max_pending_of_its_slowest_encoding_as_latency() {
    let pipeline = launch(
        "videotestsrc is-live=true num-buffers=10 ! video/x-raw,width=160,height=120,framerate=10/1 ! videoconvert \
         ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf model=models/SmolLM2-135M-Instruct.Q4_1.gguf interval=0 min-change=0 \
         ! fakesink",
    );
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut latency_messages = 0;
    for msg in bus.iter_timed(gst::ClockTime::from_seconds(60)) {
        match msg.view() {
            gst::MessageView::Latency(_) if msg.src().is_some_and(|s| s.name() == "enc") => latency_messages += 1,
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => panic!("{}", e.error()),
            _ => (),
        }
    }
    let enc = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("enc").unwrap();
    let query = |pad: gst::Pad| {
        let mut q = gst::query::Latency::new();
        assert!(pad.query(&mut q), "latency query on {}", pad.name());
        q.result()
    };
    let (live, upstream_min, _) = query(enc.static_pad("sink").unwrap().peer().unwrap());
    let (own_live, min, _) = query(enc.static_pad("src").unwrap());
    pipeline.set_state(gst::State::Null).unwrap();
    let mean_ms = enc.property::<f64>("mean-encode-ms");
    let (prepare_ms, wait_ms) = (enc.property::<f64>("mean-prepare-ms"), enc.property::<f64>("mean-context-wait-ms"));
    assert!(live && own_live);
    assert!(mean_ms > 0.0);
    // Its parts: the picture's preparation took time, and the parts fit in the whole.
    assert!(prepare_ms > 0.0 && wait_ms >= 0.0, "prepared in {prepare_ms} ms, waited {wait_ms} ms");
    assert!(prepare_ms + wait_ms < mean_ms, "{prepare_ms} + {wait_ms} ms of {mean_ms} ms");
    // A frame may leave after max-pending (2) encodes; the slowest is at least the mean one.
    let added_ms = (min - upstream_min).nseconds() as f64 / 1e6;
    assert!(added_ms >= 2.0 * mean_ms, "latency adds {added_ms:.2} ms, mean encoding {mean_ms:.2} ms");
    assert!(latency_messages >= 1, "no latency message as encoding times became known");
}

/// The three VLM families of models/test-<family>-* (SmolVLM's idefics3: several image chunks a
/// frame; Qwen2-VL: M-RoPE positions; Gemma 3: non-causal image attention) through the elements,
/// the language model named once on vlmcontext: every timed question answered over the frames
/// before its time, and the retained history answers as its full re-prefill does, token for token.
#[test]
fn every_vlm_family_answers_through_the_elements_as_its_replay_does() {
    for family in ["idefics3", "qwen2vl", "gemma3"] {
        let answers = |retain: bool| {
            let run = run(&launch(&format!(
                "videotestsrc pattern=ball num-buffers=330 ! video/x-raw,width=160,height=120,framerate=30/1 \
                 ! videoconvert ! vlmencode mmproj=models/test-{family}-mmproj.gguf interval=1000000000 \
                 ! vlmcontext model=models/test-{family}-lm.gguf retain={retain} \
                 ! vlmquery name=q max-tokens=8 ! fakesink sync=false \
                 filesrc location=pipelines/questions.srt ! subparse ! q.query"
            )));
            assert!(run.errors.is_empty(), "{family} retain={retain}: {:?}", run.errors);
            run.answers.iter().for_each(check_answer);
            let get = |a: &gst::Structure| {
                (a.get::<u64>("frames").unwrap(), a.get::<String>("path").unwrap(), a.get::<String>("text").unwrap())
            };
            run.answers.iter().map(get).collect::<Vec<_>>()
        };
        let (retained, replayed) = (answers(true), answers(false));
        let frames: Vec<u64> = retained.iter().map(|a| a.0).collect();
        assert_eq!(frames, vec![3, 6, 10], "{family}: questions bind to the frames before their time");
        assert!(retained.iter().all(|a| a.1 == "resident") && replayed.iter().all(|a| a.1 == "replay"), "{family}");
        let texts = |v: &[(u64, String, String)]| v.iter().map(|a| a.2.clone()).collect::<Vec<_>>();
        assert_eq!(texts(&retained), texts(&replayed), "{family}: retained vs full re-prefill");
        assert!(retained.iter().any(|a| !a.2.is_empty()), "{family}: no text at all");
    }
}

/// A quantized KV type needs flash attention in llama.cpp: it turns it on instead of failing the
/// pipeline, and the answers come.
#[test]
fn a_quantized_kv_type_answers_without_setting_flash_attention() {
    let questions = "filesrc location=pipelines/questions.srt ! subparse ! q.query";
    let run = run(&launch(&format!(
        "{SOURCE} kv-type=q8_0 ! vlmquery name=q max-tokens=4 ! fakesink sync=false {questions}"
    )));
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert!(!run.answers.is_empty());
    assert!(run.answers.iter().all(|a| a.get::<String>("status").as_deref() == Ok("answered")), "{:?}", run.answers);
}

/// A third camera on default settings: `max-streams` unset follows the sink pads requested
/// before the model loads, and every stream's questions are answered.
#[test]
fn a_third_stream_on_default_settings_is_answered() {
    let mut description = "vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf ".to_string();
    for s in 0..3 {
        description += &format!(
            "videotestsrc pattern=ball num-buffers=40 ! video/x-raw,width=64,height=48,framerate=10/1 ! videoconvert \
             ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=500000000 min-change=0 ! ctx.sink_{s} \
             ctx.src_{s} ! vlmquery name=q{s} max-tokens=3 ! fakesink sync=false \
             filesrc location=pipelines/questions.srt ! subparse ! q{s}.query "
        );
    }
    let run = run(&launch(&description));
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let mut streams: Vec<String> = run.answers.iter().map(|a| a.get::<String>("stream").unwrap()).collect();
    streams.sort();
    streams.dedup();
    assert_eq!(streams.len(), 3, "answers from every stream: {:?}", run.answers);
    assert!(run.answers.iter().all(|a| a.get::<String>("status").as_deref() == Ok("answered")), "{:?}", run.answers);
}

/// Recording the answers beside the video: `display=queue` straight into `matroskamux` (no queue
/// between, as a recorder is often written) runs to the end (a text buffer reaching past the
/// newest frame is followed by a GAP at its end, so the muxer goes on), and the file read back
/// holds one subtitle cue per answer with its display duration (the questions asked during the
/// 12 s of video).
#[test]
fn answers_recorded_with_display_queue_into_matroskamux_are_one_cue_each() {
    assert_one_cue_per_answer("display=queue", "q.src ! mux.subtitle_0");
}

/// `subtitle_src` records one cue per answer whatever `display` says: under `replace` (the
/// default), where the text pad follows the video with one buffer per frame shown, the file read
/// back still holds one subtitle cue per answer with its display duration.
#[test]
fn answers_recorded_from_subtitle_src_are_one_cue_each_under_display_replace() {
    assert_one_cue_per_answer(
        "display=replace",
        "q.src ! fakesink sync=false async=false q.subtitle_src ! mux.subtitle_0",
    );
}

/// A live camera's answers recorded into matroskamux (`display`, and `record`: the links of the
/// text pads, one of them to `mux.subtitle_0`), read back: one cue per answer, each lasting its
/// `answer-duration` of 1 s.
fn assert_one_cue_per_answer(display: &str, record: &str) {
    let file = std::env::temp_dir().join(format!(
        "gst-vlm-recording-{}-{}.mkv",
        std::process::id(),
        display.replace('=', "-")
    ));
    let run = run_for(
        &launch(&format!(
            "videotestsrc is-live=true pattern=ball num-buffers=120 ! video/x-raw,width=160,height=120,framerate=10/1 \
             ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=500000000 min-change=0 \
             ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q {display} max-tokens=4 \
             answer-duration=1000000000 q.video_src ! videoconvert ! jpegenc ! mux.video_0 {record} \
             matroskamux name=mux ! filesink location={} filesrc location=pipelines/questions.srt ! subparse ! q.query",
            file.display()
        )),
        120,
    );
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let answered = run.answers.iter().filter(|a| a.get::<String>("status").as_deref() == Ok("answered")).count();
    assert!(answered >= 1, "{:?}", run.answers);
    // Read it back: the subtitle track's cues.
    let reader = launch(&format!(
        "filesrc location={} ! matroskademux name=d d.video_0 ! fakesink sync=false async=false \
         d.subtitle_0 ! appsink name=cues sync=false async=false",
        file.display()
    ));
    let cues =
        reader.downcast_ref::<gst::Bin>().unwrap().by_name("cues").unwrap().downcast::<gst_app::AppSink>().unwrap();
    let got = Arc::new(Mutex::new(vec![]));
    let sink = Arc::clone(&got);
    cues.set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |s| {
                let sample = s.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let b = sample.buffer().unwrap();
                sink.lock().unwrap().push((b.pts(), b.duration(), b.size()));
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    let read = run_for(&reader, 60);
    assert!(read.errors.is_empty(), "{:?}", read.errors);
    let got = got.lock().unwrap().clone();
    let texts: Vec<_> = got.iter().filter(|(_, _, size)| *size > 0).collect();
    assert_eq!(texts.len(), answered, "one cue per answer: {got:?}");
    for (pts, duration, _) in texts {
        assert!(pts.is_some(), "{got:?}");
        assert_eq!(*duration, Some(gst::ClockTime::from_seconds(1)), "{got:?}");
    }
    let _ = std::fs::remove_file(&file);
}

/// The question statistics: accepted and refused questions, failed and cancelled answers, the
/// mean TTFT of the answered ones (read while the pipeline is still PLAYING, before they reset).
#[test]
fn the_question_statistics_count_what_happened() {
    let pipeline = launch(&format!("{SOURCE} ! vlmquery name=q max-tokens=4 ! fakesink sync=false"));
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let q = bin.by_name("q").unwrap();
    let sink = q.static_pad("sink").unwrap();
    // At frame 4: two questions, then the first one's id again (refused).
    let sent = Arc::new(Mutex::new(false));
    sink.add_probe(gst::PadProbeType::BUFFER, move |pad, info| {
        let number = joined_frame(info);
        let mut sent = sent.lock().unwrap();
        if number == Some(4) && !*sent {
            *sent = true;
            for (text, id) in [("What happened?", "a"), ("Anything moving?", "b"), ("Again?", "a")] {
                assert!(pad.send_event(QuestionEvent::event(text, Some(id), None)));
            }
        }
        gst::PadProbeReturn::Ok
    });
    let run = run_to_eos(&pipeline, 240);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 2, "{:?}", run.answers);
    let count = |name: &str| q.property::<u64>(name);
    assert_eq!(
        (count("questions-accepted"), count("questions-refused"), count("answers-failed"), count("answers-cancelled")),
        (2, 1, 0, 0)
    );
    let ttfts: Vec<f64> = run.answers.iter().map(|a| a.get::<f64>("ttft-ms").unwrap()).collect();
    let mean = ttfts.iter().sum::<f64>() / ttfts.len() as f64;
    assert!(
        (q.property::<f64>("mean-ttft-ms") - mean).abs() < 0.01,
        "{} against {mean}",
        q.property::<f64>("mean-ttft-ms")
    );
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(q.property::<u64>("questions-accepted"), 0, "reset at PAUSED->READY");
}

/// `scripts/pipeline.sh` from another folder: the repository's files found, an output file
/// (a filesink's, not there yet) written beside the caller, never into the checkout.
#[test]
fn pipeline_sh_resolves_inputs_to_their_files_and_outputs_to_the_callers_folder() {
    let dir = std::env::temp_dir().join(format!("gst-vlm-pipeline-sh-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("mine.pipeline");
    std::fs::write(
        &file,
        "# a user's pipeline\nvideotestsrc ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! vlmcontext \
         model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery ! filesink location=out/answers.txt\n",
    )
    .unwrap();
    let out = std::process::Command::new(root().join("scripts/pipeline.sh"))
        .arg(&file)
        .current_dir(&dir)
        .env_remove("VLM_MODEL")
        .env_remove("VLM_MMPROJ")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let value = |key: &str| text.split_whitespace().find_map(|w| w.strip_prefix(key)).unwrap().to_owned();
    let real = |p: &str| std::path::Path::new(p).canonicalize().unwrap();
    assert_eq!(real(&value("mmproj=")), real(root().join("models/test-mmproj-mlp.gguf").to_str().unwrap()));
    let location = std::path::PathBuf::from(value("location="));
    assert_eq!(location.file_name().unwrap(), "answers.txt");
    assert_eq!(real(location.parent().unwrap().parent().unwrap().to_str().unwrap()), real(dir.to_str().unwrap()));
    assert!(!text.contains('#'), "comments dropped: {text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `kv-layout=auto` (the default) loads the unified pool with flash attention, with
/// `history-policy=slide` too (the pool slides); an explicit `flash-attention` is kept. The
/// load says which in read-only properties.
#[test]
fn the_default_kv_layout_resolves_at_load_and_says_so() {
    for (extra, layout, flash) in [
        ("", "unified", true),
        ("history-policy=slide", "unified", true),
        ("kv-layout=unified flash-attention=false", "unified", false),
        ("kv-layout=per-sequence flash-attention=true", "per-sequence", true),
    ] {
        let pipeline = launch(&format!(
            "videotestsrc pattern=ball num-buffers=10 ! video/x-raw,width=64,height=48,framerate=10/1 ! videoconvert \
             ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 ! vlmcontext name=ctx \
             model=models/SmolLM2-135M-Instruct.Q4_1.gguf {extra} ! fakesink"
        ));
        let ctx = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("ctx").unwrap();
        assert_eq!(ctx.property::<String>("active-kv-layout"), "", "nothing loaded yet");
        let run = run_to_eos(&pipeline, 120);
        assert!(run.errors.is_empty(), "{extra}: {:?}", run.errors);
        assert_eq!(
            (ctx.property::<String>("active-kv-layout").as_str(), ctx.property::<bool>("active-flash-attention")),
            (layout, flash),
            "{extra}"
        );
        pipeline.set_state(gst::State::Null).unwrap();
    }
}

/// `ttft-from-capture-ms` on a live camera: each answer's first token comes after its frame's
/// capture (the frame's running time, which a live source stamps) and before the run's end on
/// the same clock; a source that is not live gives -1 or a time, never a negative one.
#[test]
fn an_answer_on_a_live_camera_counts_its_ttft_from_the_frames_capture() {
    let pipeline = launch(
        "videotestsrc is-live=true pattern=ball num-buffers=80 ! video/x-raw,width=160,height=120,framerate=10/1 \
         ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=500000000 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q max-tokens=4 ! fakesink \
         filesrc location=pipelines/questions.srt ! subparse ! q.query",
    );
    let run = run_to_eos(&pipeline, 120);
    let end = pipeline.current_running_time().expect("a live pipeline has a clock");
    pipeline.set_state(gst::State::Null).unwrap();
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let answered: Vec<_> =
        run.answers.iter().filter(|a| a.get::<String>("status").as_deref() == Ok("answered")).collect();
    assert!(answered.len() >= 2, "the questions at 2.5 s and 5.5 s at least: {:?}", run.answers);
    for a in answered {
        let from_capture = a.get::<f64>("ttft-from-capture-ms").unwrap();
        let pts = a.get::<Option<gst::ClockTime>>("pts").unwrap().expect("a timed frame");
        let bound_ms = (end - pts).nseconds() as f64 / 1e6;
        assert!(from_capture > 0.0 && from_capture <= bound_ms, "{from_capture} ms, at most {bound_ms}: {a}");
    }
}

/// Answers drawn by textoverlay, recorded from `subtitle_src`, and questions timed after the
/// video's end (a 1 s video, questions at 2 to 6 s) with one question pending at a time:
/// textoverlay keeps the first text buffer that reaches it after the video's EOS for ever and
/// takes no other, so the text pad's pushes stop there. Every question is still answered, the
/// recorder still gets its EOS, and the pipeline ends (the recorder's EOS waited for the text
/// pad, and the answers waiting for it held `max-questions`: the run never ended, and the
/// questions after the first two were neither answered nor refused).
#[test]
fn questions_after_the_video_drawn_by_textoverlay_are_all_answered_and_the_recorder_ends() {
    let srt = std::env::temp_dir().join(format!("vlm-after-video-{}.srt", std::process::id()));
    let text: String =
        (1..=5).map(|i| format!("{i}\n00:00:0{},000 --> 00:00:0{},500\nQuestion {i}?\n\n", i + 1, i + 1)).collect();
    std::fs::write(&srt, text).unwrap();
    let pipeline = launch(&format!(
        "videotestsrc num-buffers=30 ! video/x-raw,width=96,height=96,framerate=30/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery name=q max-tokens=8 max-questions=1 q.video_src ! textoverlay name=o ! fakesink \
         q.src ! o.text_sink q.subtitle_src ! fakesink name=cues \
         filesrc location={} ! subparse ! q.query",
        srt.display()
    ));
    let cues = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&cues);
    let sink = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("cues").unwrap();
    sink.static_pad("sink").unwrap().add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        counted.fetch_add(1, Ordering::Relaxed);
        gst::PadProbeReturn::Ok
    });
    let run = run_for(&pipeline, 120);
    std::fs::remove_file(&srt).unwrap();
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    assert_eq!(run.answers.len(), 5, "{:?} {:?}", run.answers, run.warnings);
    assert!(run.answers.iter().all(|a| a.get::<String>("status").as_deref() == Ok("answered")), "{:?}", run.answers);
    assert_eq!(cues.load(Ordering::Relaxed), 5, "one cue per answer on subtitle_src");
}
