//! Three VLM families end to end, with the generated test pairs of `scripts/make_test_family.py`
//! (`models/test-<family>-{lm,mmproj}.gguf`, random weights, each family's real shapes and
//! metadata): SmolVLM (`llama` + `idefics3`: a frame is several image chunks with text markers
//! between them), Qwen2-VL (`qwen2vl` + `qwen2vl_merger`: M-RoPE, an image fills more KV cells
//! than it advances positions) and Gemma 3 (`gemma3`: images decoded non-causally).
//!
//! For each family: frames encoded, ingested and published; the retained answer equal to a full
//! re-prefill; a snapshot imported into another engine and a replay there equal to the resident
//! answer; answers on branches unchanged while more frames arrive; and the positions and greedy
//! tokens equal to libmtmd's own helper (`mtmd_helper_eval_chunks`, what llama.cpp's mtmd-cli
//! runs) on the same prompt (`vlm_runtime::llama::reference`, the plain-libmtmd reference that
//! `examples/families.rs` prints too). A family whose pair is missing fails (`scripts/setup.sh`
//! makes them).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use common::{picture, question};
use vlm_runtime::encoder::{FrameEncoder, MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::llama::reference::Reference;
use vlm_runtime::llama::{Context, ContextParams, ImageEmbeddings, Model, Segment};
use vlm_runtime::prefix::PrefixKey;
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{
    Device, Engine, EngineConfig, Error, Frame, HistoryPolicy, PreparePath, Stream, StreamConfig, answer, answer_on,
    models,
};

const QUESTION: &str = "What do you see in the video?";
const TOKENS: u32 = 8;

/// The tests share two cores: one family at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The family's generated pair; a missing file fails the test (`scripts/setup.sh` makes them).
fn pair(family: &str) -> (PathBuf, PathBuf) {
    let dir = common::models_dir();
    let (lm, mmproj) = (dir.join(format!("test-{family}-lm.gguf")), dir.join(format!("test-{family}-mmproj.gguf")));
    for f in [&lm, &mmproj] {
        assert!(f.is_file(), "{family}: {} is missing (run scripts/setup.sh)", f.display());
    }
    (lm, mmproj)
}

fn threads() -> i32 {
    std::thread::available_parallelism().map_or(2, |n| n.get() as i32).min(2)
}

fn engine(lm: &Path, name: &str, cells: u32) -> Arc<Engine> {
    let config = EngineConfig {
        name: name.into(),
        threads: threads(),
        context_per_sequence: cells,
        max_streams: 2,
        max_branches: 2,
        ..EngineConfig::default()
    };
    Engine::start(lm, config).expect("engine")
}

fn stream(resident: &Arc<Engine>, peers: &[&Arc<Engine>], name: &str, retain: bool, reserve: i32) -> Arc<Stream> {
    stream_with(resident, peers, name, retain, reserve, HistoryPolicy::Stop)
}

fn stream_with(
    resident: &Arc<Engine>,
    peers: &[&Arc<Engine>],
    name: &str,
    retain: bool,
    answer_reserve: i32,
    history_policy: HistoryPolicy,
) -> Arc<Stream> {
    let prompt = Arc::new(Prompt::new(resident.model(), DEFAULT_SYSTEM_PROMPT).expect("prompt"));
    let peers = peers.iter().map(|e| Arc::clone(e)).collect();
    let config = StreamConfig { retain, answer_reserve, history_policy, peers, ..StreamConfig::new(name) };
    Stream::open(resident, prompt, config).expect("stream")
}

fn encoder(lm: &Path, mmproj: &Path) -> (Arc<Model>, MtmdEncoder) {
    let model = models::model(lm, &Device::Cpu).expect("model");
    let projector = models::projector(mmproj, &model, false, threads(), 1).expect("projector");
    (model, MtmdEncoder::new(projector))
}

fn frame(enc: &MtmdEncoder, variant: u32) -> Arc<Frame> {
    let rgb = picture(variant);
    Arc::new(enc.encode(&Picture::packed(&rgb, 64, 48, 64 * 3, PixelLayout::Rgb)).expect("encode"))
}

fn images(frame: &Frame) -> Vec<&ImageEmbeddings> {
    frame
        .segments
        .iter()
        .filter_map(|s| match s {
            Segment::Image(i) => Some(i),
            Segment::Text(_) => None,
        })
        .collect()
}

fn never() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

/// Every check of one family, in order.
fn family_end_to_end(family: &str) {
    let (lm, mmproj) = pair(family);
    let _serial = serial();
    let started = std::time::Instant::now();
    let (model, enc) = encoder(&lm, &mmproj);
    let frames: Vec<Arc<Frame>> = (0..5).map(|v| frame(&enc, v)).collect();

    // The family's shape, as libmtmd made it.
    let first = &frames[0];
    let imgs = images(first);
    match family {
        "idefics3" => assert!(imgs.len() > 1, "an idefics3 frame is several image chunks, got {}", imgs.len()),
        "qwen2vl" => assert!(imgs.iter().all(|i| i.n_pos < i.rows as i32 && !i.causal_rows), "M-RoPE: n_pos < rows"),
        "gemma3" => assert!(imgs.iter().all(|i| i.n_pos == i.rows as i32 && !i.causal_rows), "non-causal, whole"),
        _ => unreachable!(),
    }
    assert!(first.cells() >= first.n_pos());

    // Frames ingested and published on a retained stream and on the baseline (no retention).
    let (a, b) = (engine(&lm, "a", 1024), engine(&lm, "b", 1024));
    let s = stream(&a, &[&a, &b], family, true, 64);
    let baseline = stream(&a, &[], &format!("{family}-baseline"), false, 64);
    for f in &frames[..2] {
        s.register(Arc::clone(f), &never()).unwrap();
        baseline.register(Arc::clone(f), &never()).unwrap();
    }
    let v2 = s.wait_version(2, &never()).unwrap();
    let prefix = Prompt::new(&model, DEFAULT_SYSTEM_PROMPT).unwrap().prefix;
    assert_eq!((v2.number, v2.frames(), v2.history.len()), (2, 2, 2));
    assert_eq!(v2.end, prefix.len() as i32 + frames[0].n_pos() + frames[1].n_pos());
    assert_eq!(v2.cells, prefix.len() as i32 + frames[0].cells() + frames[1].cells());

    // Positions: libmtmd's own helper on the same prompt, after 1 and 2 frames.
    let reference = Reference::load(&lm, &mmproj, threads()).expect("reference");
    let v1 = s.wait_version(1, &never()).unwrap();
    for v in [&v1, &v2] {
        let history = reference.history(&model, v.number as usize, QUESTION).expect("reference history");
        assert_eq!(v.end, history.n_pos(), "{family}: end after {} frames: runtime vs mtmd_helper_get_n_pos", v.number);
    }

    // A question: resident branch, and the full re-prefill of the baseline.
    let q = question(QUESTION, TOKENS);
    let resident = answer_on(&v2, &q, &a, PreparePath::Resident, &never(), |_| {}).unwrap();
    let base = answer(&baseline.wait_version(2, &never()).unwrap(), &q, &never(), |_| {}).unwrap();
    assert_eq!((resident.path, base.path), (PreparePath::Resident, PreparePath::Replay));
    assert!(resident.tokens > 0, "{family}: no tokens");
    assert_eq!(base.token_ids, resident.token_ids, "{family}: retained vs full re-prefill");

    // libmtmd's helper over the whole prompt: the answer starts where the runtime's does and
    // continues with the same greedy tokens.
    let suffix = suffix_len(&model);
    let whole = reference.whole(&model, 2, QUESTION).expect("reference prompt");
    let (n_past, tokens) = reference.eval_and_generate(&whole, TOKENS).expect("reference answer");
    assert_eq!(n_past, v2.end + suffix, "{family}: answer start: runtime vs mtmd_helper_eval_chunks");
    assert_eq!(tokens, resident.token_ids, "{family}: greedy tokens: runtime vs mtmd_helper_eval_chunks");

    // Another engine: a snapshot imported and continued, and a replay of the embeddings.
    let imported = answer_on(&v2, &q, &b, PreparePath::Import, &never(), |_| {}).unwrap();
    let replayed = answer_on(&v2, &q, &b, PreparePath::Replay, &never(), |_| {}).unwrap();
    assert_eq!((imported.engine.as_str(), imported.path), ("b", PreparePath::Import));
    assert_eq!((replayed.engine.as_str(), replayed.path), ("b", PreparePath::Replay));
    assert_eq!(imported.token_ids, resident.token_ids, "{family}: imported snapshot");
    assert_eq!(replayed.token_ids, resident.token_ids, "{family}: replay on another engine");

    // Branches while more frames keep being registered.
    let over_one = answer(&v1, &q, &never(), |_| {}).unwrap();
    let arriving = {
        let (s, more) = (Arc::clone(&s), frames[2..].to_vec());
        std::thread::spawn(move || {
            for f in more {
                s.register(f, &AtomicBool::new(false)).unwrap();
            }
        })
    };
    let during = answer(&v2, &q, &never(), |_| {}).unwrap();
    let during_one = answer(&v1, &q, &never(), |_| {}).unwrap();
    arriving.join().unwrap();
    let v5 = s.wait_version(5, &never()).unwrap();
    assert_eq!(v5.end, reference.history(&model, 5, QUESTION).unwrap().n_pos(), "{family}: end after 5 frames");
    let after = answer(&v2, &q, &never(), |_| {}).unwrap();
    // The stream's sequence now holds 5 frames: the snapshot is trimmed back to version 2.
    let imported_after = answer_on(&v2, &q, &b, PreparePath::Import, &never(), |_| {}).unwrap();
    for (what, r) in [("during", &during), ("after", &after), ("imported after", &imported_after)] {
        assert_eq!(r.token_ids, resident.token_ids, "{family}: version 2 answered {what} more frames");
    }
    assert_eq!(during_one.token_ids, over_one.token_ids, "{family}: version 1 while frames arrived");
    assert_eq!(answer(&v5, &q, &never(), |_| {}).unwrap().frames, 5);
    eprintln!(
        "{family}: frame {} segments, {} positions, {} cells; end after 2 frames {}; answer {:?}; {:.1} s",
        first.segments.len(),
        first.n_pos(),
        first.cells(),
        v2.end,
        resident.text,
        started.elapsed().as_secs_f64()
    );
}

/// Tokens a question adds after a version's history, before its answer.
fn suffix_len(model: &Model) -> i32 {
    let prompt = Prompt::new(model, DEFAULT_SYSTEM_PROMPT).unwrap();
    prompt.question_tokens(model, QUESTION).unwrap().len() as i32
}

#[test]
fn idefics3_end_to_end() {
    family_end_to_end("idefics3");
}

#[test]
fn qwen2vl_end_to_end() {
    family_end_to_end("qwen2vl");
}

#[test]
fn gemma3_end_to_end() {
    family_end_to_end("gemma3");
}

#[test]
fn an_idefics3_frame_of_several_chunks_is_one_frame_in_the_history() {
    let (lm, mmproj) = pair("idefics3");
    let _serial = serial();
    let (model, enc) = encoder(&lm, &mmproj);
    let cache = FrameEncoder::new(Arc::new(enc), 8, 64 << 20);
    let encode = |rgb: &[u8]| cache.encode(&Picture::packed(rgb, 64, 48, 64 * 3, PixelLayout::Rgb)).unwrap();
    let (f, hit) = encode(&picture(0));
    let (again, hit_again) = encode(&picture(0));
    assert!(!hit && hit_again);
    assert!(Arc::ptr_eq(&f, &again), "a repeated picture is the same cached frame, all its chunks");
    let chunks = images(&f).len();
    assert!(chunks > 1, "{chunks} image chunks");
    let stats = cache.cache_stats();
    assert_eq!((stats.entries, stats.hits), (1, 1), "one embedding-cache entry for {chunks} chunks");
    let (other, _) = encode(&picture(1));
    assert_ne!(other.content_hash, f.content_hash);
    assert_eq!(cache.cache_stats().entries, 2);

    let e = engine(&lm, "cpu", 1024);
    let s = stream(&e, &[], "tiles", true, 64);
    s.register(Arc::clone(&f), &never()).unwrap();
    let v = s.wait_version(1, &never()).unwrap();
    assert_eq!((v.number, v.frames(), v.history.len()), (1, 1, 1), "one version, one entry");
    let prompt = Prompt::new(&model, DEFAULT_SYSTEM_PROMPT).unwrap();
    let key = PrefixKey::root(model.identity(), &prompt.prefix).then_frame(f.content_hash, f.n_pos());
    assert_eq!(v.key, key, "the prefix key takes the frame as one identity over all its chunks");
    assert_eq!(v.end, prompt.prefix.len() as i32 + f.n_pos());
    assert_eq!(s.published(), 1);
}

/// An engine that merges frames (as GPU engines do by default) takes an idefics3 frame, its
/// tiles and the wrapper text between them, as one batch of embedding rows: what it answers
/// equals what an engine taking the frame segment by segment answers, retained and replayed,
/// and libmtmd's own helper. A model whose rows do not decode as its tokens is found out by the
/// calibration run and keeps segments (Gemma 3: plain rows are refused).
#[test]
fn a_frame_merged_into_one_batch_of_rows_answers_as_segment_by_segment() {
    let _serial = serial();
    let merging = |lm: &Path, name: &str| {
        let config = EngineConfig {
            name: name.into(),
            threads: threads(),
            context_per_sequence: 1024,
            max_streams: 2,
            max_branches: 2,
            merge_frames: Some(true),
            ..EngineConfig::default()
        };
        Engine::start(lm, config).expect("engine")
    };
    let (lm, mmproj) = pair("idefics3");
    let (model, enc) = encoder(&lm, &mmproj);
    let frames: Vec<Arc<Frame>> = (0..2).map(|v| frame(&enc, v)).collect();
    assert!(frames[0].segments.len() > 2, "tiles with text between them");
    let (merged, apart) = (merging(&lm, "merged"), engine(&lm, "apart", 1024));
    assert!(merged.merges_frames() && !apart.merges_frames(), "the llama graph takes a token's row as the token");
    let q = question(QUESTION, TOKENS);
    let mut answers = vec![];
    for e in [&merged, &apart] {
        let s = stream(e, &[&merged, &apart], e.name(), true, 64);
        for f in &frames {
            s.register(Arc::clone(f), &never()).unwrap();
        }
        let v = s.wait_version(2, &never()).unwrap();
        let resident = answer_on(&v, &q, e, PreparePath::Resident, &never(), |_| {}).unwrap();
        let other = if Arc::ptr_eq(e, &merged) { &apart } else { &merged };
        let replayed = answer_on(&v, &q, other, PreparePath::Replay, &never(), |_| {}).unwrap();
        assert_eq!(replayed.token_ids, resident.token_ids, "{}: replayed on {}", e.name(), other.name());
        answers.push(resident.token_ids);
    }
    assert_eq!(answers[0], answers[1], "frames merged vs segment by segment");
    let reference = Reference::load(&lm, &mmproj, threads()).expect("reference");
    let whole = reference.whole(&model, 2, QUESTION).expect("reference prompt");
    assert_eq!(reference.eval_and_generate(&whole, TOKENS).expect("reference answer").1, answers[0]);

    let (gemma, _) = pair("gemma3");
    assert!(!merging(&gemma, "gemma").merges_frames(), "Gemma 3 takes no plain rows");
}

/// A Qwen2-VL image fills one KV cell per embedding row but advances fewer positions: the
/// history must be counted in cells, or a frame planned as fitting fails in llama.cpp.
#[test]
fn a_qwen2vl_stream_fills_its_cells_and_then_stops_or_restarts() {
    let (lm, mmproj) = pair("qwen2vl");
    let _serial = serial();
    let (_, enc) = encoder(&lm, &mmproj);
    let f = frame(&enc, 0);
    assert!(f.cells() > f.n_pos());
    let e = engine(&lm, "fill", 256);
    let capacity = e.n_ctx_per_seq() as i32 - 32;
    let q = question(QUESTION, TOKENS);

    // Stop: every registered frame is published, then HistoryFull (never a decode failure).
    let s = stream(&e, &[], "stop", true, 32);
    let mut n = 0;
    let refused = loop {
        match s.register(Arc::clone(&f), &never()) {
            Ok(r) => {
                n = s.wait_version(r.number, &never()).expect("a planned frame is published").number;
            }
            Err(err) => break err,
        }
        assert!(n < 100, "never full");
    };
    let last = s.wait_version(n, &never()).unwrap();
    assert!(matches!(refused, Error::HistoryFull { frames, .. } if frames == n), "{refused}");
    assert!(last.cells <= capacity && last.cells + f.cells() > capacity, "cells {} of {capacity}", last.cells);
    assert!(last.end + f.n_pos() <= capacity, "positions alone would have taken one more frame");
    let full = answer(&last, &q, &never(), |_| {}).expect("the reserve holds a question and its answer");
    assert!(full.tokens > 0);
    s.close();

    // Restart: the history starts again from the newest frames, every version published.
    let s = stream_with(&e, &[], "restart", true, 32, HistoryPolicy::Restart { keep: 2 });
    for _ in 0..n + 3 {
        let r = s.register(Arc::clone(&f), &never()).unwrap();
        let v = s.wait_version(r.number, &never()).expect("published");
        assert!(v.cells <= capacity);
    }
    assert_eq!(s.restarts(), 1);
    let newest = s.wait_version(n + 3, &never()).unwrap();
    assert!(answer(&newest, &q, &never(), |_| {}).unwrap().tokens > 0);
}

/// `history-policy=slide` on an M-RoPE model: llama.cpp cannot shift its positions, but they may
/// jump forward, so a slide drops the oldest frames' cells and leaves the rest where they are (a
/// gap of positions; the frames after it continue from the old end), up to the model's trained
/// context (then the kept frames are prefilled from position 0 again, as a restart). The slid
/// history answers; its agreement with a replay of the same frames (positions from 0, no gap) is
/// reported.
#[test]
fn a_qwen2vl_history_slides_by_leaving_a_gap_of_positions() {
    let (lm, mmproj) = pair("qwen2vl");
    let _serial = serial();
    let (_, enc) = encoder(&lm, &mmproj);
    let e = engine(&lm, "slide", 256);
    let limit = e.position_gap_limit().expect("an M-RoPE model takes gaps of positions");
    let s = stream_with(&e, &[], "slide", true, 32, HistoryPolicy::Slide);
    let q = vlm_runtime::Question { ignore_eos: true, ..question(QUESTION, 8) };
    let mut previous = s.wait_version(0, &never()).unwrap();
    let mut agreement = vec![];
    for v in 0..40u32 {
        let f = frame(&enc, v % 5);
        let r = s.register(Arc::clone(&f), &never()).unwrap();
        let version = s.wait_version(r.number, &never()).expect("every frame is published");
        if r.slid {
            // Positions continue from the old end; the oldest frames' cells are gone.
            assert_eq!(version.end, previous.end + f.n_pos(), "a gap slide moves no position");
            assert!(version.cells < previous.cells + f.cells());
            let resident = answer(&version, &q, &never(), |_| {}).unwrap();
            let replay = answer_on(&version, &q, &e, PreparePath::Replay, &never(), |_| {}).unwrap();
            assert_eq!((resident.path, resident.tokens, replay.tokens), (PreparePath::Resident, 8, 8));
            agreement.push(resident.token_ids.iter().zip(&replay.token_ids).take_while(|(a, b)| a == b).count());
        }
        previous = version;
    }
    eprintln!(
        "{} slides, {} restarts (positions up to {limit}); greedy tokens agreeing with a replay, of 8: {agreement:?}",
        s.slides(),
        s.restarts()
    );
    assert!(s.slides() >= 2, "the history slid {} times", s.slides());
    assert_eq!(s.restarts(), 0, "the positions stayed far below {limit}");
}

/// Decoding an image whole (M-RoPE positions, non-causal attention: libmtmd's helper) does not
/// take the projector's lock, which a vision encode holds for its whole run: with the encoder
/// held, a frame is still ingested and an answer over it generated on the same model.
#[test]
fn images_decode_while_the_vision_encoder_is_busy() {
    for family in ["qwen2vl", "gemma3"] {
        let (lm, mmproj) = pair(family);
        let _serial = serial();
        let (model, enc) = encoder(&lm, &mmproj);
        let f = frame(&enc, 1);
        assert!(images(&f).iter().all(|i| !i.causal_rows), "{family}: images are decoded whole");
        let e = engine(&lm, "busy", 512);
        let s = stream(&e, &[], "busy", true, 32);
        let projector = models::projector(&mmproj, &model, false, threads(), 1).unwrap();
        let held = projector.hold_encoder();
        // Before the fix this waits for the encoder forever: give up after a minute.
        let gave_up = never();
        let (timer, waiter) = (Arc::clone(&gave_up), Arc::clone(&s));
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(60));
            timer.store(true, std::sync::atomic::Ordering::Release);
            waiter.wake();
        });
        s.register(f, &never()).unwrap();
        let v = s.wait_version(1, &gave_up).unwrap_or_else(|e| panic!("{family}: not ingested: {e}"));
        let r = answer(&v, &question(QUESTION, TOKENS), &gave_up, |_| {}).expect("answered");
        assert!(r.tokens > 0, "{family}");
        drop(held);
    }
}

/// A frame encoded for another language model (another width, another vocabulary for its text
/// markers) is refused at registration with both files and widths named, before anything of it
/// reaches the engine (its rows would otherwise hit the batch's width assertion, or its marker
/// tokens llama.cpp's token check); the stream goes on with frames of its own model.
#[test]
fn a_frame_encoded_for_another_model_is_refused_naming_both() {
    let (lm, mmproj) = pair("idefics3");
    let _serial = serial();
    let (foreign_model, enc) = encoder(&lm, &mmproj);
    let foreign = frame(&enc, 1);
    let own_model = common::model_path();
    let e = engine(&own_model, "own", 512);
    assert_ne!(foreign_model.n_embd(), e.model().n_embd());
    let s = stream(&e, &[], "own", true, 32);
    let Err(err) = s.register(foreign, &never()) else { panic!("a frame of another model was registered") };
    let err = err.to_string();
    for name in [lm.display().to_string(), own_model.display().to_string()] {
        assert!(err.contains(&name), "{err} should name {name}");
    }
    assert!(err.contains(&format!("({} wide)", e.model().n_embd())), "{err}");
    s.register(common::frame(&common::encoder(), 1), &never()).unwrap();
    assert!(answer(&s.wait_version(1, &never()).unwrap(), &question(QUESTION, 4), &never(), |_| {}).is_ok());
}

/// Plain embedding rows (what the NPU gives: 1-D positions, causal) cannot feed an M-RoPE or a
/// non-causal model: refused with the reason, never decoded wrongly (or, for M-RoPE, read past
/// their position array by llama.cpp).
#[test]
fn plain_embeddings_are_refused_by_mrope_and_non_causal_models() {
    for family in ["qwen2vl", "gemma3"] {
        let (lm, _) = pair(family);
        let _serial = serial();
        let e = engine(&lm, "plain", 256);
        let width = e.model().n_embd();
        let refusal = e.model().plain_embeddings_refusal().expect("refused");
        assert!(refusal.contains("use backend=cpu|gpu") && refusal.contains(&lm.display().to_string()), "{refusal}");
        let rows = ImageEmbeddings::plain(vec![0.01; 4 * width].into(), 4, width).unwrap();
        let plain = Arc::new(Frame { segments: vec![Segment::Image(rows)], content_hash: 7 });
        let s = stream(&e, &[], "plain", true, 32);
        s.register(plain, &never()).unwrap();
        let err = s.wait_version(1, &never()).err().expect("refused");
        assert!(matches!(&err, Error::BadInput(m) if *m == refusal), "{family}: {err}");
    }
    // The LLaVA-style pair takes them.
    let (lm, _) = pair("idefics3");
    assert_eq!(models::model(&lm, &Device::Cpu).unwrap().plain_embeddings_refusal(), None);
}

/// The non-causal refusal comes from the projector: libmtmd's own answer for each family's
/// projector (`mtmd_decode_use_non_causal`) equals the runtime's rule for its projector type, and
/// a model refuses plain rows as non-causal exactly when its projector is (naming the type).
#[test]
fn the_non_causal_refusal_follows_libmtmds_answer_for_the_projector() {
    for family in ["idefics3", "qwen2vl", "gemma3"] {
        let (lm, mmproj) = pair(family);
        let _serial = serial();
        let model = models::model(&lm, &Device::Cpu).unwrap();
        let projector = models::projector(&mmproj, &model, false, threads(), 1).unwrap();
        let ty = vlm_runtime::llama::projector_type(&mmproj).unwrap();
        let libmtmd = projector.decodes_non_causally();
        assert_eq!(vlm_runtime::llama::projector_type_non_causal(&ty, model.n_embd()), libmtmd, "{family}: {ty}");
        assert_eq!(libmtmd, family == "gemma3", "{family}: {ty}");
        let refusal = model.plain_embeddings_refusal();
        if family != "qwen2vl" {
            // (Qwen2-VL is refused for its M-RoPE positions.)
            assert_eq!(refusal.is_some(), libmtmd, "{family}: {refusal:?}");
        }
        if libmtmd {
            assert!(refusal.as_deref().is_some_and(|r| r.contains(&ty) && r.contains("non-causally")), "{refusal:?}");
        }
    }
}

/// An image (decoded by libmtmd's helper, in batches) that finds no room in the unified pool is
/// refused as `PoolFull`, which the scheduler waits on, with none of its batches left behind, so
/// it can be decoded whole again later (it was an engine error: the stream failed for good).
#[test]
fn an_image_without_room_in_the_unified_pool_waits_and_leaves_nothing_behind() {
    let (lm, mmproj) = pair("qwen2vl");
    let _serial = serial();
    let (model, enc) = encoder(&lm, &mmproj);
    let f = frame(&enc, 0);
    let image = images(&f)[0];
    let rows = image.rows;
    let params = ContextParams {
        n_ctx_per_seq: 512,
        n_seq: 1,
        n_batch: (rows as u32).div_ceil(2),
        threads: 1,
        kv_unified: Some(512),
        kv_type: Default::default(),
        flash_attention: false,
    };
    let mut ctx = Context::new(Arc::clone(&model), &params).unwrap();
    // Room for the image's first batch, not for its second.
    let fill = ctx.n_ctx() - rows * 3 / 4;
    let tokens = vec![1; fill];
    ctx.decode_tokens(&tokens, 0, 0, false).unwrap();
    let err = ctx.decode_image(image, fill as i32, 0).expect_err("no room");
    assert!(matches!(err, Error::PoolFull(_)), "{err}");
    assert_eq!(ctx.seq_pos_max(0), fill as i32 - 1, "the batch that fitted was left in the pool");
    ctx.seq_truncate(0, fill as i32 - rows as i32);
    assert!(ctx.decode_image(image, fill as i32 - rows as i32, 0).is_ok(), "fits once cells are free");
}

/// libmtmd's helper would cut a non-causal image into batches of n_batch silently.
#[test]
fn a_non_causal_image_larger_than_the_batch_is_refused() {
    let (lm, mmproj) = pair("gemma3");
    let _serial = serial();
    let (model, enc) = encoder(&lm, &mmproj);
    let f = frame(&enc, 0);
    let image = images(&f)[0];
    let context = |n_batch: u32| {
        let params = ContextParams {
            n_ctx_per_seq: 256,
            n_seq: 1,
            n_batch,
            threads: 1,
            kv_unified: None,
            kv_type: Default::default(),
            flash_attention: false,
        };
        Context::new(Arc::clone(&model), &params).unwrap()
    };
    let n = image.rows as u32;
    let err = context(n - 1).decode_image(image, 0, 0).expect_err("refused");
    assert!(err.to_string().contains("does not fit in one batch"), "{err}");
    assert_eq!(context(n).decode_image(image, 0, 0).unwrap(), image.n_pos);
}

/// A token id outside the vocabulary (libmtmd's -1 for a wrapper token the language model
/// lacks, with a projector made for another model) has no text: llama.cpp threw through C on
/// it, aborting the process.
#[test]
fn a_token_outside_the_vocabulary_has_no_text() {
    let model = models::model(&common::model_path(), &Device::Cpu).unwrap();
    let n_vocab = model.n_vocab() as i32;
    for token in [-1, n_vocab, i32::MAX] {
        assert!(model.token_piece(token, true).is_empty(), "token {token}");
    }
    assert_eq!(model.token_piece(model.tokenize("cat", false, false).unwrap()[0], true), b"cat");
}
