//! The versioned history against real llama.cpp: retention must not change answers, a question
//! waits for its frame, a version never changes under a reader, streams do not mix.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::*;
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::stream::Entry;
use vlm_runtime::{Engine, EngineConfig, Error, HistoryPolicy, KvLayout, PreparePath, Stream, StreamConfig, answer};

/// A CPU engine of `cells` per sequence with `kv_layout`.
fn engine_laid_out(cells: u32, kv_layout: KvLayout) -> Arc<Engine> {
    let config = EngineConfig {
        name: "cpu".into(),
        context_per_sequence: cells,
        max_streams: 2,
        max_branches: 2,
        kv_layout,
        ..EngineConfig::default()
    };
    Engine::start(&model_path(), config).expect("engine")
}

fn ask(stream: &Arc<vlm_runtime::Stream>, frames: u64, text: &str) -> vlm_runtime::AnswerReport {
    let never = Arc::new(AtomicBool::new(false));
    let version = stream.wait_version(frames, &never).expect("version");
    answer(&version, &question(text, 12), &never, |_| {}).expect("answer")
}

#[test]
fn retained_prefix_and_full_reprefill_give_identical_greedy_tokens() {
    let engine = engine("cpu");
    let enc = encoder();
    let retained = open(&engine, "retained", true);
    let baseline = open(&engine, "baseline", false);
    let never = AtomicBool::new(false);
    for v in 0..3 {
        let f = frame(&enc, v);
        retained.register(Arc::clone(&f), &never).unwrap();
        baseline.register(f, &never).unwrap();
    }
    for frames in [1, 3] {
        let a = ask(&retained, frames, "What is in the picture?");
        let b = ask(&baseline, frames, "What is in the picture?");
        assert_eq!(a.path, PreparePath::Resident);
        assert_eq!(b.path, PreparePath::Replay);
        assert!(a.tokens > 0, "no tokens generated");
        assert_eq!(a.text, b.text, "retained and re-prefilled histories of {frames} frames answered differently");
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.frames, frames);
    }
}

#[test]
fn a_question_waits_for_its_registered_frame() {
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    stream.register(frame(&enc, 0), &never).unwrap();
    assert_eq!(stream.wait_version(1, &never).unwrap().number, 1);
    // Hold the engine so the next frames are registered but cannot be prefilled yet.
    let (release, held) = std::sync::mpsc::channel::<()>();
    engine
        .submit(move |_| {
            let _ = held.recv();
        })
        .unwrap();
    for v in 1..3 {
        stream.register(frame(&enc, v), &never).unwrap();
    }
    let waiter = {
        let (stream, never) = (Arc::clone(&stream), Arc::clone(&never));
        std::thread::spawn(move || stream.wait_version(3, &never).map(|v| v.number))
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(stream.registered(), 3);
    assert_eq!(stream.published(), 1);
    assert!(!waiter.is_finished(), "the question bound to an older version instead of waiting for frame 3");
    release.send(()).unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), 3);
    assert_eq!(stream.published(), 3);
    let report = ask(&stream, 3, "Describe it.");
    assert_eq!(report.frames, 3);
}

#[test]
fn a_version_is_unchanged_while_ten_more_frames_are_ingested() {
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    for v in 0..2 {
        stream.register(frame(&enc, v), &never).unwrap();
    }
    let reference = ask(&stream, 2, "What changed?");
    let version = stream.wait_version(2, &never).unwrap();
    let frames: Vec<_> = (2..12).map(|v| frame(&enc, v)).collect();
    let ingest = {
        let stream = Arc::clone(&stream);
        std::thread::spawn(move || {
            let never = AtomicBool::new(false);
            for f in frames {
                stream.register(f, &never).unwrap();
            }
        })
    };
    let during = answer(&version, &question("What changed?", 12), &never, |_| {}).unwrap();
    ingest.join().unwrap();
    let after = ask(&stream, 2, "What changed?");
    assert_eq!(stream.wait_version(12, &never).unwrap().frames(), 12);
    assert_eq!(during.text, reference.text);
    assert_eq!(after.text, reference.text);
    // And the newest version really is different history.
    let newest = ask(&stream, 12, "What changed?");
    assert_eq!(newest.frames, 12);
}

#[test]
fn interleaved_streams_answer_as_they_would_alone() {
    let enc = encoder();
    let never = AtomicBool::new(false);
    let alone = |variants: [u32; 2]| {
        let engine = engine("alone");
        let s = open(&engine, "alone", true);
        for v in variants {
            s.register(frame(&enc, v), &never).unwrap();
        }
        ask(&s, 2, "What do you see?").text
    };
    let (ref_a, ref_b) = (alone([1, 2]), alone([5, 6]));
    let engine = engine("shared");
    let a = open(&engine, "a", true);
    let b = open(&engine, "b", true);
    a.register(frame(&enc, 1), &never).unwrap();
    b.register(frame(&enc, 5), &never).unwrap();
    a.register(frame(&enc, 2), &never).unwrap();
    b.register(frame(&enc, 6), &never).unwrap();
    assert_eq!(ask(&b, 2, "What do you see?").text, ref_b);
    assert_eq!(ask(&a, 2, "What do you see?").text, ref_a);
}

#[test]
fn a_missing_model_is_an_error_naming_the_file() {
    let config = vlm_runtime::EngineConfig::default();
    let err =
        vlm_runtime::Engine::start(std::path::Path::new("/nonexistent/model.gguf"), config).expect_err("must fail");
    assert!(matches!(err, Error::File { .. }), "{err:?}");
    assert!(err.to_string().contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn a_language_model_given_as_projector_is_refused() {
    let model = vlm_runtime::models::model(&model_path(), &vlm_runtime::Device::Cpu).unwrap();
    let err = vlm_runtime::models::projector(&model_path(), &model, false, 1, 1).err().expect("must fail");
    assert!(err.to_string().contains("not a projector"), "{err}");
}

#[test]
fn weights_are_shared_between_engines() {
    let a = engine("a");
    let b = engine("b");
    assert!(Arc::ptr_eq(a.model(), b.model()));
    assert!(vlm_runtime::models::model_owners(&model_path()) >= 2);
}

/// A model file replaced on disk is loaded anew for whoever asks for it now, while the copy of
/// the old one stays with those holding it (an application updating its models in place).
#[test]
fn a_model_file_replaced_on_disk_is_loaded_anew() {
    let dir = std::env::temp_dir().join(format!("vlm-replaced-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lm.gguf");
    let original = common::models_dir().join("test-idefics3-lm.gguf");
    std::fs::copy(&original, &path).unwrap();
    let old = vlm_runtime::models::model(&path, &vlm_runtime::Device::Cpu).unwrap();
    let same = vlm_runtime::models::model(&path, &vlm_runtime::Device::Cpu).unwrap();
    assert!(Arc::ptr_eq(&old, &same), "one copy while the file is unchanged");
    // (Replaced as a deployment should: a new file renamed over the path.)
    std::fs::copy(&original, dir.join("new.gguf")).unwrap();
    std::fs::rename(dir.join("new.gguf"), &path).unwrap();
    let new = vlm_runtime::models::model(&path, &vlm_runtime::Device::Cpu).unwrap();
    assert!(!Arc::ptr_eq(&old, &new), "the replaced file is loaded anew");
    assert_eq!(vlm_runtime::models::model_owners(&path), 3, "the old copy held twice, the new once");
    drop((old, same, new));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A closed stream gives its sequence back at once, though a reader still holds it: a new
/// stream opens in its place (a camera reconnecting on an engine of `max-streams` streams was
/// refused while anything downstream held the old stream), and an answer still asked over the
/// closed stream's version replays it, as a full recompute gives it.
#[test]
fn a_closed_stream_gives_its_sequence_back_while_a_reader_holds_it() {
    let engine = engine("cpu"); // max_streams 2
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let (a, b) = (open(&engine, "a", true), open(&engine, "b", true));
    for v in 0..3 {
        a.register(frame(&enc, v), &never).unwrap();
    }
    let held = a.wait_version(3, &never).unwrap();
    let resident = answer(&held, &question("What changed?", 10), &never, |_| {}).unwrap();
    assert_eq!(resident.path, PreparePath::Resident);
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    assert!(Stream::open(&engine, prompt, StreamConfig::new("c")).is_err(), "both sequences taken");
    a.close();
    let c = open(&engine, "c", true);
    c.register(frame(&enc, 7), &never).unwrap();
    assert_eq!(ask(&c, 1, "What changed?").path, PreparePath::Resident);
    let after = answer(&held, &question("What changed?", 10), &never, |_| {}).unwrap();
    assert_eq!(after.path, PreparePath::Replay, "the closed stream's sequence is another stream's now");
    assert_eq!(after.text, resident.text);
    drop(b);
}

/// An answer over a closed stream's version that starts before the job ending its residence
/// (queued behind the engine's work) replays it: the stream's sequence is given back (-1), and
/// branching from it aborted the process in llama.cpp (`seq_id_src >= 0`).
#[test]
fn an_answer_starting_right_after_its_stream_closed_replays() {
    let engine = engine("cpu");
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let a = open(&engine, "a", true);
    for v in 0..2 {
        a.register(frame(&enc, v), &never).unwrap();
    }
    let version = a.wait_version(2, &never).unwrap();
    let resident = answer(&version, &question("What changed?", 10), &never, |_| {}).unwrap();
    assert_eq!(resident.path, PreparePath::Resident);
    let (release, holder) = hold(&engine);
    a.close();
    let before = engine.start_backlog_ms();
    let asked = std::thread::spawn(move || answer(&version, &question("What changed?", 10), &never, |_| {}));
    wait_queued(&engine, before); // (queued before the held engine goes on)
    release.send(()).unwrap();
    holder.join().unwrap();
    let after = asked.join().unwrap().unwrap();
    assert_eq!(after.path, PreparePath::Replay);
    assert_eq!(after.text, resident.text);
}

/// A restart asked to keep more frames than the context holds keeps what leaves a quarter of it
/// free, so the frames after it join the history (it restarted on every frame: each re-prefilled
/// the whole context).
#[test]
fn a_restart_keeping_more_frames_than_fit_leaves_room_for_the_next_ones() {
    // 9 frames of 36 cells fit (see below).
    let engine = engine_with("cpu", 512);
    let enc = encoder();
    let stream = open_with(&engine, "s", true, vlm_runtime::HistoryPolicy::Restart { keep: 100 });
    let never = Arc::new(AtomicBool::new(false));
    let restarts: Vec<bool> =
        (0..16).map(|v| stream.register(frame(&enc, v), &never).unwrap().restart.is_some()).collect();
    assert!(restarts.iter().any(|&r| r), "the history restarted: {restarts:?}");
    assert!(!restarts.windows(2).any(|w| w[0] && w[1]), "a restart on two frames in a row: {restarts:?}");
    stream.wait_version(16, &never).unwrap();
}

#[test]
fn a_full_history_restarts_from_its_newest_frames_without_changing_pinned_versions() {
    // 512 cells - 128 reserved for the answer leave room for the prompt and 9 frames of 36.
    let engine = engine_with("cpu", 512);
    let enc = encoder();
    let stream = open_with(&engine, "s", true, vlm_runtime::HistoryPolicy::Restart { keep: 3 });
    let never = Arc::new(AtomicBool::new(false));
    let frames: Vec<_> = (0..12).map(|v| frame(&enc, v)).collect();
    let register = |range: std::ops::Range<usize>| {
        range.map(|i| stream.register(Arc::clone(&frames[i]), &never).unwrap()).collect::<Vec<_>>()
    };
    register(0..5);
    let v5 = stream.wait_version(5, &never).unwrap();
    let before = answer(&v5, &question("What changed?", 10), &never, |_| {}).unwrap();
    assert_eq!(before.path, PreparePath::Resident);

    let registrations = register(5..12);
    let restart = registrations.iter().find(|r| r.restart.is_some()).expect("the history restarted");
    let (kept, dropped) = restart.restart.unwrap();
    assert_eq!(kept, 3);
    assert_eq!(restart.number as usize, dropped + kept + 1, "the restart keeps the newest frames");
    assert_eq!(stream.restarts() as usize, registrations.iter().filter(|r| r.restart.is_some()).count());

    // Once the restart has run, the pinned version of the old epoch answers from its own
    // frames, by replay, unchanged.
    stream.wait_version(12, &never).unwrap();
    let after = answer(&v5, &question("What changed?", 10), &never, |_| {}).unwrap();
    assert_eq!(after.path, PreparePath::Replay);
    assert_eq!(after.frames, 5);
    assert_eq!(after.text, before.text, "a restart changed the history under a pinned version");

    // The newest version is resident again and holds exactly the kept frames plus the new one.
    let newest = ask(&stream, 12, "What changed?");
    assert_eq!(newest.path, PreparePath::Resident);
    let v12 = stream.wait_version(12, &never).unwrap();
    let kept: Vec<_> =
        v12.history.iter().map(|e| if let Entry::Frame(f) = e { Arc::clone(f) } else { panic!() }).collect();
    assert!(kept.len() < 12 && Arc::ptr_eq(kept.last().unwrap(), &frames[11]));
    let baseline = open(&engine, "baseline", false);
    for f in kept {
        baseline.register(f, &never).unwrap();
    }
    assert_eq!(newest.text, ask(&baseline, v12.frames(), "What changed?").text);
}

#[test]
fn concurrent_answers_share_decode_steps_and_equal_the_serial_reference() {
    let engine = engine("cpu");
    let enc = encoder();
    let (a, b) = (open(&engine, "a", true), open(&engine, "b", true));
    let never = Arc::new(AtomicBool::new(false));
    for v in 0..3 {
        a.register(frame(&enc, v), &never).unwrap();
        b.register(frame(&enc, v + 10), &never).unwrap();
    }
    let questions =
        [(&a, 3, "What is in the picture?"), (&b, 3, "What is in the picture?"), (&a, 2, "Describe the colours.")];
    let serial: Vec<_> = questions.iter().map(|(s, n, q)| ask(s, *n, q).text).collect();
    // Now all three at once: they share the engine's decode steps.
    let concurrent: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = questions.iter().map(|(s, n, q)| scope.spawn(move || ask(s, *n, q).text)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(concurrent, serial, "concurrent execution differs from the serial reference");
    assert!(engine.widest_step() >= 2, "the answers were not decoded together");
}

#[test]
fn an_identical_history_imports_cached_kv_and_a_different_one_does_not() {
    let engine = engine("cpu");
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let cache = Arc::new(vlm_runtime::snapshot::PrefixCache::new(16, 256 << 20));
    let stop = vlm_runtime::HistoryPolicy::Stop;
    let frames: Vec<_> = [0, 1, 2, 5].iter().map(|&v| frame(&enc, v)).collect();
    let first = open_cached(&engine, "first", true, stop, Some(Arc::clone(&cache)));
    for f in &frames[..3] {
        first.register(Arc::clone(f), &never).unwrap();
    }
    let reference = ask(&first, 3, "What is in the picture?");
    let after_first = cache.stats();
    assert_eq!((after_first.hits, after_first.misses, after_first.entries), (0, 4, 4), "prompt + 3 frames, all misses");
    drop(first);

    // A new stream with the same history [sys, A, B, C]: every version comes from the cache.
    let second = open_cached(&engine, "second", true, stop, Some(Arc::clone(&cache)));
    for f in &frames[..3] {
        second.register(Arc::clone(f), &never).unwrap();
    }
    assert_eq!(ask(&second, 3, "What is in the picture?").text, reference.text);
    assert_eq!(cache.stats().hits, 4);

    // [sys, A, D, C]: the prompt and A hit; D and the same C after a different history miss.
    let third = open_cached(&engine, "third", true, stop, Some(Arc::clone(&cache)));
    for f in [&frames[0], &frames[3], &frames[2]] {
        third.register(Arc::clone(f), &never).unwrap();
    }
    third.wait_version(3, &never).unwrap();
    let s = cache.stats();
    assert_eq!((s.hits, s.misses), (6, 6), "{s:?}");
    let v3 = third.wait_version(3, &never).unwrap();
    assert_ne!(v3.key, second.wait_version(3, &never).unwrap().key);
}

#[test]
fn committed_answers_become_history_in_question_order() {
    let engine = engine("cpu");
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let stream = open(&engine, "s", true);
    let v2 = with_frames(&stream, &enc, 2);
    let q1 = answer(&v2, &question("What is in the picture?", 8), &never, |_| {}).unwrap();
    let r = stream.commit("What is in the picture?", &q1.token_ids, &never).unwrap();
    assert_eq!(r.number, 2, "a commit adds no frame");
    // The next question on frame 2 waits for the commit and sees it: a new, longer version.
    let v2c = stream.wait_version(2, &never).unwrap();
    assert_eq!(v2c.frames(), 2);
    assert!(v2c.end > v2.end && v2c.key != v2.key);
    assert!(matches!(v2c.history.last(), Some(Entry::Text(_))));
    let q2 = answer(&v2c, &question("And what colour is it?", 8), &never, |_| {}).unwrap();
    // The same conversation replayed from scratch (the baseline) answers the same.
    let baseline = open(&engine, "baseline", false);
    for v in 0..2 {
        baseline.register(frame(&enc, v), &never).unwrap();
    }
    baseline.commit("What is in the picture?", &q1.token_ids, &never).unwrap();
    let b2 = baseline.wait_version(2, &never).unwrap();
    assert_eq!(b2.key, v2c.key, "the same conversation has the same prefix key");
    let b = answer(&b2, &question("And what colour is it?", 8), &never, |_| {}).unwrap();
    assert_eq!(b.text, q2.text);
    // Frames after the commit continue the same conversation.
    stream.register(frame(&enc, 2), &never).unwrap();
    let v3 = stream.wait_version(3, &never).unwrap();
    assert_eq!((v3.frames(), v3.history.len()), (3, 4));
    assert_eq!(ask(&stream, 3, "What changed?").frames, 3);
}

#[test]
fn the_prompt_version_is_waited_for_and_stays_bindable() {
    let engine = engine("cpu");
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    // Hold the engine: nothing, not even the prompt, is published yet.
    let (release, held) = std::sync::mpsc::channel::<()>();
    engine
        .submit(move |_| {
            let _ = held.recv();
        })
        .unwrap();
    let stream = open(&engine, "s", true);
    stream.register(frame(&enc, 0), &never).unwrap();
    let waiter = {
        let (stream, never) = (Arc::clone(&stream), Arc::clone(&never));
        std::thread::spawn(move || stream.wait_version(0, &never).map(|v| (v.number, v.frames())))
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!waiter.is_finished(), "version 0 was handed out before its prefill");
    release.send(()).unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), (0, 0));
    assert_eq!(stream.wait_version(1, &never).unwrap().number, 1);
    assert_eq!(stream.wait_version(0, &never).unwrap().number, 0, "older versions stay bindable");
}

/// A model's identity (part of every prefix key and compatibility tag) is read once, at load: a
/// file replaced on disk while it runs changes neither, so keys stay comparable within a run.
#[test]
fn a_model_file_replaced_while_running_keeps_its_identity() {
    let dir = std::env::temp_dir().join(format!("vlm-identity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    std::fs::copy(model_path(), &path).unwrap();
    let model = vlm_runtime::models::model(&path, &vlm_runtime::Device::Cpu).unwrap();
    let before = model.identity().to_owned();
    // Another file of another size renamed over it (how a deployment updates a model; the
    // loaded weights stay mapped from the old file).
    std::fs::write(dir.join("new.gguf"), b"not the model any more").unwrap();
    std::fs::rename(dir.join("new.gguf"), &path).unwrap();
    assert_eq!(model.identity(), before);
    drop(model);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model's token rows (its input embedding table, read from its file) come from the file it
/// was loaded from, opened and checked at load: a file renamed over its path later (here another
/// model, of another width) is not read.
#[test]
fn a_model_file_replaced_while_running_keeps_its_token_rows() {
    let dir = std::env::temp_dir().join(format!("vlm-token-rows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    std::fs::copy(model_path(), &path).unwrap();
    let model = vlm_runtime::models::model(&path, &vlm_runtime::Device::Cpu).unwrap();
    std::fs::copy(models_dir().join("test-idefics3-lm.gguf"), dir.join("new.gguf")).unwrap();
    std::fs::rename(dir.join("new.gguf"), &path).unwrap();
    let tokens = model.tokenize("<|im_start|>user", false, true).unwrap();
    let mut rows = vec![];
    model.token_rows(&tokens, &mut rows).expect("the loaded model's token rows");
    let original = vlm_runtime::models::model(&model_path(), &vlm_runtime::Device::Cpu).unwrap();
    let mut expected = vec![];
    original.token_rows(&tokens, &mut expected).unwrap();
    assert_eq!(rows.len(), tokens.len() * model.n_embd());
    assert_eq!(rows, expected, "token rows read from the file renamed over the model");
    drop(model);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_slid_history_shifts_in_place_keeps_old_versions_and_agrees_with_a_reprefill() {
    slide_in_place(KvLayout::PerSequence);
}

/// The same in a unified pool, where a branch shares the stream's cells: with no reader holding
/// them when the slide begins, the cells are shifted in place there too.
#[test]
fn a_slid_history_shifts_in_place_in_a_unified_pool() {
    slide_in_place(KvLayout::Unified);
}

fn slide_in_place(kv_layout: KvLayout) {
    // 512 cells - 128 reserved: the prompt and 9 frames of 36; a slide keeps what leaves a
    // quarter of the 384 free.
    let engine = engine_laid_out(512, kv_layout);
    let enc = encoder();
    let cache = Arc::new(vlm_runtime::snapshot::PrefixCache::new(64, 1 << 30));
    let stream = open_cached(&engine, "s", true, vlm_runtime::HistoryPolicy::Slide, Some(Arc::clone(&cache)));
    let never = Arc::new(AtomicBool::new(false));
    let frames: Vec<_> = (0..12).map(|v| frame(&enc, v)).collect();
    for f in &frames[..5] {
        stream.register(Arc::clone(f), &never).unwrap();
    }
    let v5 = stream.wait_version(5, &never).unwrap();
    let cached_at_v5 = cache.stats().entries;
    let before = answer(&v5, &question("What changed?", 10), &never, |_| {}).unwrap();

    let registrations: Vec<_> = frames[5..].iter().map(|f| stream.register(Arc::clone(f), &never).unwrap()).collect();
    let slide = registrations.iter().find(|r| r.restart.is_some()).expect("the history slid");
    assert!(slide.slid, "the model shifts: the history must slide, not restart");
    assert_eq!((stream.restarts(), stream.slides(), stream.slides_prefilled()), (0, 1, 0));
    let (kept, dropped) = slide.restart.unwrap();
    assert_eq!(slide.number as usize, dropped + kept + 1, "a slide drops the oldest frames");

    // The pinned version of the old epoch answers from its own frames, unchanged.
    let v12 = stream.wait_version(12, &never).unwrap();
    // The versions before the slide were stored in the prefix cache as they were prefilled; the
    // slid ones are not what a prefill of their frames gives, so none of them was.
    assert_eq!(cache.stats().entries, cached_at_v5 + (slide.number as usize - 1 - 5), "a slid version was cached");
    let after = answer(&v5, &question("What changed?", 10), &never, |_| {}).unwrap();
    assert_eq!((after.path, after.frames), (PreparePath::Replay, 5));
    assert_eq!(after.text, before.text, "a slide changed the history under a pinned version");

    // The slid cells answer; a re-prefill of the same frames is the reference. The kept cells
    // were computed next to the dropped frames, so the two agree, not bit for bit: the first
    // greedy token is asserted, the agreement is reported.
    let q = vlm_runtime::Question { ignore_eos: true, ..question("What is in the picture?", 16) };
    let slid = answer(&v12, &q, &never, |_| {}).unwrap();
    assert_eq!((slid.path, slid.tokens), (PreparePath::Resident, 16));
    let fresh = vlm_runtime::answer_on(&v12, &q, &engine, PreparePath::Replay, &never, |_| {}).unwrap();
    assert_eq!(fresh.path, PreparePath::Replay);
    let agree = slid.token_ids.iter().zip(&fresh.token_ids).take_while(|(a, b)| a == b).count();
    eprintln!("slid vs re-prefilled: the first {agree} of 16 greedy tokens agree");
    assert!(agree >= 1, "the slid history's first token differs from a re-prefill's");
}

/// In a unified pool a reader's branch shares the stream's cells, so shifting them would move
/// the reader's positions under it: a slide that begins while an answer reads the stream's
/// cells waits for it to end (`slide_wait`) and then shifts in place; past that wait it prefills
/// the kept frames instead (counted in `slides_prefilled`). Either way the answer ends as it
/// would have, and the slid history answers as a prefill of its kept frames does.
#[test]
fn a_slide_while_a_reader_shares_the_cells_waits_for_it_then_shifts() {
    assert_eq!(slide_under_a_reader(Duration::from_secs(600)), 0, "the slide shifted after the reader");
}

#[test]
fn a_slide_that_waited_its_time_for_a_reader_prefills_instead() {
    assert_eq!(slide_under_a_reader(Duration::ZERO), 1, "the shift would have moved the reader's cells");
}

/// The slides that prefilled, for a slide registered while a 100-token answer reads the cells.
fn slide_under_a_reader(slide_wait: Duration) -> u64 {
    let engine = engine_laid_out(512, KvLayout::Unified);
    let enc = encoder();
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    let config = StreamConfig { history_policy: HistoryPolicy::Slide, slide_wait, ..StreamConfig::new("s") };
    let stream = Stream::open(&engine, prompt, config).unwrap();
    let never = Arc::new(AtomicBool::new(false));
    // Frames until the next one slides (every frame takes the same cells; the stream keeps
    // `answer_reserve` of the engine's cells for answers).
    let capacity = engine.n_ctx_per_seq() as i32 - StreamConfig::new("s").answer_reserve;
    let mut n = 0;
    let (before, v) = loop {
        n += 1;
        stream.register(frame(&enc, n as u32), &never).unwrap();
        let v = stream.wait_version(n, &never).unwrap();
        let per_frame = v.cells - stream.wait_version(n - 1, &never).unwrap().cells;
        if v.cells + per_frame > capacity {
            break (n, v);
        }
    };
    // A long answer on the stream's cells; the frame that slides is registered once it decodes.
    // Waiting for its version at once makes it demanded, so its ingestion begins at the next
    // step: a step or two into the answer's 100, whatever the machine's speed.
    let q = vlm_runtime::Question { ignore_eos: true, ..question("Tell me about the picture.", 100) };
    let (started, decoding) = std::sync::mpsc::channel::<()>();
    let reader = {
        let (v, q, never) = (v.clone(), q.clone(), Arc::clone(&never));
        std::thread::spawn(move || {
            let mut first = Some(started);
            answer(&v, &q, &never, |_| drop(first.take())).unwrap()
        })
    };
    let _ = decoding.recv();
    let slide = stream.register(frame(&enc, before as u32 + 1), &never).unwrap();
    assert!(slide.slid, "the frame that does not fit slides the history");
    let slid = stream.wait_version(before + 1, &never).unwrap();
    let read = reader.join().unwrap();
    assert_eq!((read.path, read.tokens), (PreparePath::Resident, 100));
    // The reader read its own version whole, and the slid history is a prefill of its frames:
    // each agrees with a replay (in a unified pool cells sit elsewhere and sums round apart, so
    // the first greedy token is asserted, the agreement reported). A shift under the reader
    // would have failed the engine (`Context::seq_shift_out` asserts that no branch shares).
    let replayed = vlm_runtime::answer_on(&v, &q, &engine, PreparePath::Replay, &never, |_| {}).unwrap();
    let q = vlm_runtime::Question { ignore_eos: true, ..question("What is in the picture?", 16) };
    let resident = answer(&slid, &q, &never, |_| {}).unwrap();
    assert_eq!(resident.path, PreparePath::Resident);
    let fresh = vlm_runtime::answer_on(&slid, &q, &engine, PreparePath::Replay, &never, |_| {}).unwrap();
    for (what, a, b) in [("reader", &read, &replayed), ("slid history", &resident, &fresh)] {
        let agree = a.token_ids.iter().zip(&b.token_ids).take_while(|(x, y)| x == y).count();
        eprintln!("{what} vs a replay: the first {agree} of {} greedy tokens agree", a.tokens);
        assert!(agree >= 1, "the {what}'s first token differs from a replay's");
    }
    stream.slides_prefilled()
}

/// One stream's slide that waits for a reader of its cells (a unified pool) does not hold up
/// another stream's frames on the same engine: they pass it and are published while the reader
/// still decodes (before, every later ingestion waited behind the slide).
#[test]
fn a_slide_waiting_for_its_reader_lets_another_streams_frames_pass() {
    // Ingestion earns 9 ms for each ms of decoding (0.25 by default: 1 for 3), so that whether
    // b's frame passes shows within the reader's first few steps, however loaded the machine.
    let config = EngineConfig {
        name: "cpu".into(),
        context_per_sequence: 512,
        max_streams: 2,
        max_branches: 2,
        kv_layout: KvLayout::Unified,
        ingest_share: 0.9,
        ..EngineConfig::default()
    };
    let engine = Engine::start(&model_path(), config).expect("engine");
    let enc = encoder();
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    let open = |name: &str| {
        let config = StreamConfig {
            history_policy: HistoryPolicy::Slide,
            slide_wait: Duration::from_secs(600),
            ..StreamConfig::new(name)
        };
        Stream::open(&engine, Arc::clone(&prompt), config).unwrap()
    };
    let (a, b) = (open("a"), open("b"));
    let never = Arc::new(AtomicBool::new(false));
    // Stream a up to the frame that slides (as in `slide_under_a_reader`).
    let capacity = engine.n_ctx_per_seq() as i32 - StreamConfig::new("a").answer_reserve;
    let mut n = 0;
    let v = loop {
        n += 1;
        a.register(frame(&enc, n as u32), &never).unwrap();
        let v = a.wait_version(n, &never).unwrap();
        if v.cells + (v.cells - a.wait_version(n - 1, &never).unwrap().cells) > capacity {
            break v;
        }
    };
    // A long answer reads a's cells; a's sliding frame waits for it to end.
    let q = vlm_runtime::Question { ignore_eos: true, ..question("Tell me about the picture.", 100) };
    let (started, decoding) = std::sync::mpsc::channel::<()>();
    let reading = Arc::new(AtomicBool::new(true));
    let reader = {
        let (v, q, never, reading) = (v.clone(), q.clone(), Arc::clone(&never), Arc::clone(&reading));
        std::thread::spawn(move || {
            let mut first = Some(started);
            let read = answer(&v, &q, &never, |_| drop(first.take())).unwrap();
            reading.store(false, std::sync::atomic::Ordering::Release);
            read
        })
    };
    let _ = decoding.recv();
    assert!(a.register(frame(&enc, 100), &never).unwrap().slid, "a's frame slides its history");
    // b's frame, submitted after a's sliding one, is published while the reader decodes. (Polled,
    // not waited for: a question waiting for it would put b's frame first anyway.)
    b.register(frame(&enc, 200), &never).unwrap();
    let passed = loop {
        if b.published() >= 1 {
            break true;
        }
        if !reading.load(std::sync::atomic::Ordering::Acquire) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let read = reader.join().unwrap();
    assert_eq!(read.tokens, 100);
    assert!(passed, "b's frame waited for a's slide, which waited for a's reader (100 tokens)");
    a.wait_version(n + 1, &never).expect("a's slide runs once its reader has ended");
}

/// Old versions pin their frames' embeddings: once a frame has slid out of the history, the
/// versions it is the newest frame of stay bindable only among the newest eight, so an endless
/// stream pins about two histories' frames, not 64 versions' (a question bound to a frame that
/// left long ago is refused with the reason); every frame still in the history stays bindable.
#[test]
fn versions_of_frames_that_slid_out_long_ago_are_no_longer_retained() {
    let engine = engine_laid_out(512, KvLayout::PerSequence);
    let enc = encoder();
    let stream = open_cached(&engine, "s", true, HistoryPolicy::Slide, None);
    let never = Arc::new(AtomicBool::new(false));
    let newest = with_frames(&stream, &enc, 30);
    let in_history = newest.frames();
    assert!(stream.slides() >= 2 && in_history < 12, "{in_history} frames after {} slides", stream.slides());
    let oldest = 30 - in_history + 1;
    for n in oldest.min(23)..=30 {
        assert_eq!(stream.wait_version(n, &never).expect("a recent version").number, n);
    }
    match stream.wait_version(5, &never) {
        Err(Error::BadInput(reason)) => assert!(reason.contains("no longer retained"), "{reason}"),
        other => panic!("frame 5 left the history 20 frames ago: {:?}", other.map(|v| v.number)),
    }
}

/// A unified pool that has no room for a stream's next entry while answers hold its cells: the
/// entry waits for them to end instead of failing the stream for good, and leaves the answers
/// decoding the cells they still need instead of failing them. Two answers replay a long
/// history on cells of their own (the pool's spare sequence holds one such, not two), and
/// another stream commits a long answer meanwhile: its prefill runs out of room until they end.
#[test]
fn an_entry_the_unified_pool_has_no_room_for_waits_for_the_answers_holding_it() {
    // 2 streams + 1 spare of 1024 cells and 2 x 256 answer cells: 3584. The long history takes
    // ~900, each replay as much again and its tokens, so ~800 are free for the 950-token commit.
    let config = EngineConfig {
        name: "cpu".into(),
        context_per_sequence: 1024,
        max_streams: 2,
        max_branches: 2,
        kv_layout: KvLayout::Unified,
        answer_cells: 256,
        ..EngineConfig::default()
    };
    let engine = Engine::start(&model_path(), config).expect("engine");
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    let long = Stream::open(&engine, Arc::clone(&prompt), StreamConfig::new("long")).unwrap();
    let config = StreamConfig { answer_reserve: 0, ..StreamConfig::new("talk") };
    let talk = Stream::open(&engine, prompt, config).unwrap();
    // The long history: frames until the next would not fit its sequence.
    let capacity = engine.n_ctx_per_seq() as i32 - StreamConfig::new("long").answer_reserve;
    let mut n = 0;
    let version = loop {
        n += 1;
        long.register(frame(&enc, n as u32), &never).unwrap();
        let v = long.wait_version(n, &never).unwrap();
        if v.cells + 36 > capacity {
            break v;
        }
    };
    // Two answers replaying it, each on cells of its own, as long as their cells allow.
    let (started, decoding) = std::sync::mpsc::channel::<()>();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (v, e, never, started) = (version.clone(), Arc::clone(&engine), Arc::clone(&never), started.clone());
            std::thread::spawn(move || {
                let q = vlm_runtime::Question { ignore_eos: true, ..question("Tell me about the picture.", 1000) };
                let mut first = Some(started);
                vlm_runtime::answer_on(&v, &q, &e, PreparePath::Replay, &never, |_| {
                    if let Some(started) = first.take() {
                        let _ = started.send(());
                    }
                })
            })
        })
        .collect();
    for _ in 0..2 {
        decoding.recv_timeout(Duration::from_secs(120)).expect("an answer started");
    }
    // 950 tokens committed on the other stream while both decode.
    let words = engine.model().tokenize(&" the picture".repeat(950), false, false).unwrap();
    let committed = talk.commit("What did you see?", &words[..950], &never).unwrap();
    let published = talk.wait_version(committed.number, &never);
    // The answers end answered, up to their cells: the entry took none they still needed.
    for r in readers {
        let report = r.join().unwrap().expect("an answer failed for want of a cell");
        assert!(report.tokens > 0);
    }
    assert!(published.is_ok(), "the entry failed its stream: {:?}", published.err());
    engine.stop();
}

/// A question about a frame older than the frames whose order the stream still counts (64)
/// binds once that frame's records are published, not once every registered frame is (with a
/// source that keeps ingestion busy, that was never, or at its end).
#[test]
fn a_question_about_an_old_frame_does_not_wait_for_ingestion_to_catch_up() {
    const FRAMES: u64 = 70;
    let engine = engine_with("cpu", 4096);
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    let config = StreamConfig { retain: true, max_pending: FRAMES as usize, ..StreamConfig::new("old") };
    let stream = Stream::open(&engine, prompt, config).unwrap();
    let never = AtomicBool::new(false);
    let f = frame(&encoder(), 0);
    let (release, holder) = hold(&engine);
    for _ in 0..FRAMES {
        stream.register(Arc::clone(&f), &never).unwrap();
    }
    let _ = release.send(());
    holder.join().unwrap();
    // Frames 1 and 2 published, 68 still to come.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while stream.lag().frames > FRAMES - 2 {
        assert!(std::time::Instant::now() < deadline, "nothing was published");
        std::thread::sleep(Duration::from_millis(1));
    }
    let version = stream.wait_version(1, &never).expect("version 1");
    let pending = stream.lag().frames;
    assert_eq!(version.number, 1);
    assert!(pending > 0, "bound only once all {FRAMES} frames were published");
    stream.wait_version(FRAMES, &never).expect("the newest");
}

/// A frame larger than a whole history may be is refused as such, not as a full history, and
/// under a policy that makes room (slide) nothing is dropped for it: the stream goes on.
#[test]
fn a_frame_larger_than_the_context_is_refused_as_such() {
    let engine = engine_with("cpu", 256);
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    let f = frame(&encoder(), 0);
    let cells = Entry::Frame(Arc::clone(&f)).cells();
    let prefix = prompt.prefix.len() as i32;
    // Room after the prompt for a little less than one frame.
    let answer_reserve = 256 - prefix - (cells - 4);
    let config = StreamConfig { answer_reserve, history_policy: HistoryPolicy::Slide, ..StreamConfig::new("small") };
    let stream = Stream::open(&engine, prompt, config).unwrap();
    let never = AtomicBool::new(false);
    let err = stream.register(Arc::clone(&f), &never).expect_err("a frame that cannot fit");
    assert!(
        matches!(err, Error::EntryTooLarge { cells: c, room } if c == cells as u32 && room == (cells - 4) as u32),
        "{err}"
    );
    assert_eq!(stream.wait_version(0, &never).unwrap().number, 0, "the stream goes on");
}

/// A still scene (one frame, the gate holding the rest) and a long conversation: answers
/// committed after the frame fill the history until it must slide. The answer whose slide would
/// drop that frame is not committed (the questions after it would be answered from no
/// picture), and the history keeps its frame.
#[test]
fn a_committed_answer_never_slides_the_last_frame_out() {
    let engine = engine_with("cpu", 512);
    let stream = open_with(&engine, "still", true, HistoryPolicy::Slide);
    let never = AtomicBool::new(false);
    stream.register(frame(&encoder(), 0), &never).unwrap();
    let words = engine.model().tokenize(&" the picture".repeat(40), false, false).unwrap();
    let mut committed = 0;
    let refused = loop {
        match stream.commit("What did you see?", &words[..40], &never) {
            Ok(_) => committed += 1,
            Err(e) => break e,
        }
        assert!(committed < 20, "512 cells never filled");
    };
    assert!(committed > 0, "the first answers fit without a slide");
    assert!(matches!(refused, Error::HistoryFull { .. }), "{refused}");
    let report = ask(&stream, 1, "What is in the picture?");
    assert_eq!(report.frames, 1, "the history lost its frame");
    assert_eq!(stream.slides(), 0, "nothing slid");
    engine.stop();
}

/// A system prompt that leaves a stream's sequence no room for a frame is refused when the
/// stream opens, naming it, instead of refusing every frame after it.
#[test]
fn a_system_prompt_that_fills_the_sequence_is_refused_at_the_start() {
    let engine = engine_with("cpu", 256);
    let long = "Describe what the camera shows. ".repeat(40);
    let prompt = Arc::new(Prompt::new(engine.model(), &long).unwrap());
    let refused = Stream::open(&engine, prompt, StreamConfig::new("long")).map(|_| ()).unwrap_err();
    assert!(matches!(&refused, Error::Config(m) if m.contains("system prompt")), "{refused}");
    // A short one opens on the same engine.
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    Stream::open(&engine, prompt, StreamConfig::new("short")).expect("a short prompt");
    engine.stop();
}
