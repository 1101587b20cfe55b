//! The KV costs the memory its cells use, not what it reserves (issue 18; `llama::kv_pages`):
//! an engine's start makes a small part of its KV resident, and an answer's per-sequence branch
//! (a whole copy of its stream's block while it lives) gives its pages back when it ends.
//! One test in its own binary: it reads the process's resident memory, which other tests
//! running beside it would move.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use common::*;
use vlm_runtime::{Engine, EngineConfig, KvLayout, answer};

const MIB: f64 = 1024.0 * 1024.0;

fn start(layout: KvLayout, context: u32) -> Arc<Engine> {
    let config = EngineConfig {
        name: layout.name().into(),
        context_per_sequence: context,
        max_streams: 1,
        max_branches: 4,
        kv_layout: layout,
        flash_attention: true,
        ..EngineConfig::default()
    };
    Engine::start(&model_path(), config).expect("engine")
}

#[test]
fn kv_pages_are_resident_only_where_cells_were_written() {
    // The weights (shared by every engine of the model) and the encoder first, so that what
    // an engine's start adds is its context.
    let warm = start(KvLayout::Unified, 256);
    let enc = encoder();
    for layout in [KvLayout::Unified, KvLayout::PerSequence] {
        let before = rss_mib();
        reset_peak_rss();
        let engine = start(layout, 4096);
        let allocated = engine.kv_memory().allocated_bytes() as f64 / MIB;
        let (started, peak) = (rss_mib() - before, peak_rss_mib() - before);
        // llama.cpp clears the whole KV at creation; that must not make it resident, not even
        // until the engine's calibration run has ended and its cells are given back (the peak).
        assert!(allocated >= 150.0, "{layout:?}: only {allocated:.0} MiB of KV allocated");
        assert!(
            started < allocated / 4.0,
            "{layout:?}: starting the engine made {started:.0} MiB resident for {allocated:.0} MiB of KV"
        );
        assert!(
            peak < allocated / 2.0,
            "{layout:?}: the engine's start peaked at +{peak:.0} MiB for {allocated:.0} MiB of KV"
        );

        let stream = open(&engine, "s", true);
        let never = Arc::new(AtomicBool::new(false));
        let version = with_frames(&stream, &enc, 2);
        let q = vlm_runtime::Question { ignore_eos: true, ..question("Describe the picture.", 8) };
        let before_answer = rss_mib();
        assert_eq!(answer(&version, &q, &never, |_| {}).expect("answer").tokens, 8);
        engine.call(|_| ()).expect("engine"); // after the step that ended the answer
        let after_answer = rss_mib() - before_answer;
        let block = allocated / 5.0; // one sequence's block: 1 stream + 4 branches
        match layout {
            // A branch shares its prefix's cells: it costs its suffix.
            KvLayout::Unified => assert!(after_answer < 16.0, "an answer left {after_answer:.0} MiB resident"),
            // A branch copies its stream's whole block (llama.cpp copies streams whole), and
            // gives it back when the answer ends.
            KvLayout::PerSequence => assert!(
                after_answer < block / 4.0,
                "an answer left {after_answer:.0} MiB resident (a block is {block:.0} MiB)"
            ),
        }
        println!(
            "{layout:?}: KV {allocated:.0} MiB, start +{started:.1} MiB (peak +{peak:.1}), after an answer +{after_answer:.1} MiB"
        );
        drop(stream);
        engine.stop();
    }
    warm.stop();
}
