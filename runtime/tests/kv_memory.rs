//! KV memory against real llama.cpp (issue 18): with the unified layout a version read by eight
//! answers at once costs its prefix once, every answer's cells are released when it ends, a
//! shared prefix answers as a copied one does, and KV types are kept apart.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use common::*;
use vlm_runtime::{Engine, EngineConfig, Error, KvLayout, KvType, answer};

fn engine_kv(layout: KvLayout, kv_type: KvType, flash_attention: bool) -> vlm_runtime::Result<Arc<Engine>> {
    let config = EngineConfig {
        name: format!("{}-{}", layout.name(), kv_type.name()),
        context_per_sequence: 1024,
        max_streams: 1,
        max_branches: 8,
        kv_layout: layout,
        kv_type,
        flash_attention,
        answer_cells: 128,
        ..EngineConfig::default()
    };
    Engine::start(&model_path(), config)
}

/// Cells in use now, read on the engine thread between two steps.
fn cells_in_use(engine: &Arc<Engine>) -> usize {
    engine.call(|w| w.kv_memory().cells_in_use()).expect("engine")
}

/// Eight answers of 48 tokens at once over one version of three frames: the most cells in use
/// while they ran beyond the history's, and the cells in use after them.
fn eight_answers(layout: KvLayout) -> (usize, usize, usize) {
    let engine = engine_kv(layout, KvType::F16, false).expect("engine");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    let version = with_frames(&stream, &enc, 3);
    let history = cells_in_use(&engine);
    assert!(history as i32 >= version.cells, "{history} cells in use for a history of {}", version.cells);
    let q = vlm_runtime::Question { ignore_eos: true, ..question("Describe the picture.", 48) };
    let peak = std::thread::scope(|s| {
        let answers: Vec<_> = (0..8).map(|_| s.spawn(|| answer(&version, &q, &never, |_| {}))).collect();
        let mut peak = 0;
        while !answers.iter().all(|a| a.is_finished()) {
            peak = peak.max(engine.kv_memory().cells_in_use());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for a in answers {
            assert_eq!(a.join().unwrap().expect("answer").tokens, 48);
        }
        peak
    });
    assert!(engine.widest_step() >= 8, "the eight answers were not decoded together");
    (history, peak - history, cells_in_use(&engine))
}

#[test]
fn a_version_read_by_eight_answers_costs_its_prefix_once_in_a_unified_pool() {
    let (history, extra, after) = eight_answers(KvLayout::Unified);
    // Each answer holds its question and its 48 tokens, never a copy of the history.
    assert!(extra >= 8 * 48, "the answers took only {extra} cells: did they run at once?");
    assert!(extra <= 8 * (48 + 32), "eight answers took {extra} cells beyond a history of {history}");
    assert_eq!(after, history, "the answers' cells were not all released");
}

#[test]
fn per_sequence_answers_copy_the_prefix_and_release_it() {
    let (history, extra, after) = eight_answers(KvLayout::PerSequence);
    assert!(extra >= 8 * history, "eight branches took {extra} cells: a copy of {history} each was expected");
    assert_eq!(after, history, "the answers' cells were not all released");
}

#[test]
fn a_shared_prefix_answers_as_a_copied_one() {
    let enc = encoder();
    let never = Arc::new(AtomicBool::new(false));
    let texts: Vec<_> = [KvLayout::PerSequence, KvLayout::Unified]
        .into_iter()
        .map(|layout| {
            let engine = engine_kv(layout, KvType::F16, false).expect("engine");
            let stream = open(&engine, "s", true);
            let version = with_frames(&stream, &enc, 2);
            // One answer at a time on one stream: the pool holds the history's cells, then the
            // answer's, in position order, as a sequence of its own would.
            answer(&version, &question("What is in the picture?", 16), &never, |_| {}).expect("answer").text
        })
        .collect();
    assert!(!texts[0].is_empty());
    assert_eq!(texts[0], texts[1], "a branch sharing its prefix's cells answered differently");
}

#[test]
fn quantized_kv_needs_flash_attention_and_keeps_to_its_own_type() {
    let Err(refused) = engine_kv(KvLayout::PerSequence, KvType::Q8_0, false) else {
        panic!("q8_0 without flash attention started")
    };
    assert!(matches!(&refused, Error::Config(m) if m.contains("flash-attention")), "{refused}");
    let q8 = engine_kv(KvLayout::PerSequence, KvType::Q8_0, true).expect("q8_0 engine");
    let f16 = engine_kv(KvLayout::PerSequence, KvType::F16, true).expect("f16 engine");
    let why = f16.compat_tag().incompatibility(&q8.compat_tag()).expect("f16 KV into a q8_0 engine");
    assert!(why.contains("f16") && why.contains("q8_0"), "{why}");
    // A q8_0 engine answers.
    let stream = open(&q8, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    stream.register(frame(&encoder(), 0), &never).unwrap();
    let version = stream.wait_version(1, &never).expect("version");
    let a = answer(&version, &question("What is in the picture?", 8), &never, |_| {}).expect("answer");
    assert!(a.tokens > 0);
}
