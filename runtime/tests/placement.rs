//! Several engines: snapshot import, replay, and the placer's choice, against real llama.cpp.
//! Two 1-thread CPU engines stand for two engines of comparable speed sharing one memory system
//! (as the RK3588's CPU and GPU do, or its big and little cores).

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use common::*;
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Engine, EngineConfig, Error, KvLayout, PreparePath, Stream, StreamConfig};
use vlm_runtime::{answer_frame, answer_on, answer_placed};

/// The placer compares measured rates: tests running side by side would skew each other's
/// measurements, so these run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Seed `to` with `from`'s measured rates: between two identical engines the placer's choice then
/// turns on the paths (where the history is, what waits on each engine), not on calibration
/// noise (on a loaded machine `a`'s decode step once measured 1.5x `b`'s, and an idle resident
/// engine lost to an import).
fn same_rates(from: &Engine, to: &Engine) {
    use vlm_runtime::engine::Stage;
    let r = from.rates();
    to.call(move |w| {
        w.set_rate(Stage::Prefill, r.prefill_ms_per_token);
        w.set_rate(Stage::DecodeStep, r.decode_ms_per_step);
        w.set_rate(Stage::Export, r.export_ms_per_token);
        w.set_rate(Stage::Import, r.import_ms_per_token);
    })
    .unwrap();
}

fn engine_named(name: &str, flash_attention: bool) -> Arc<Engine> {
    let config = EngineConfig {
        name: name.into(),
        threads: 1,
        context_per_sequence: 1024,
        max_streams: 3,
        flash_attention,
        ..EngineConfig::default()
    };
    Engine::start(&model_path(), config).unwrap()
}

fn stream_on(
    resident: &Arc<Engine>,
    peers: &[&Arc<Engine>],
    name: &str,
    max_pending: usize,
    retain: bool,
) -> Arc<Stream> {
    let prompt = Arc::new(Prompt::new(resident.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    let peers = peers.iter().map(|e| Arc::clone(e)).collect();
    let config = StreamConfig { retain, max_pending, peers, ..StreamConfig::new(name) };
    Stream::open(resident, prompt, config).unwrap()
}

fn never() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

/// Engines `a` and `b` (`b` with flash attention when `flash_b`), and a stream resident on `a`
/// that may be answered on both, holding `frames` frames.
fn two_engines(flash_b: bool, frames: u32) -> (Arc<Engine>, Arc<Engine>, vlm_runtime::Version) {
    let (a, b) = (engine_named("a", false), engine_named(if flash_b { "fa" } else { "b" }, flash_b));
    let enc = encoder();
    let s = stream_on(&a, &[&a, &b], "s", 4, true);
    for v in 0..frames {
        s.register(frame(&enc, v), &never()).unwrap();
    }
    let version = s.wait_version(frames as u64, &never()).unwrap();
    (a, b, version)
}

#[test]
fn import_and_replay_answer_on_the_other_engine_like_the_resident_one() {
    let _serial = serial();
    let (a, b, version) = two_engines(false, 3);
    let q = question("What is in the picture?", 12);
    let resident = answer_on(&version, &q, &a, PreparePath::Resident, &never(), |_| {}).unwrap();
    let imported = answer_on(&version, &q, &b, PreparePath::Import, &never(), |_| {}).unwrap();
    let replayed = answer_on(&version, &q, &b, PreparePath::Replay, &never(), |_| {}).unwrap();
    assert_eq!((resident.engine.as_str(), resident.path), ("a", PreparePath::Resident));
    assert_eq!((imported.engine.as_str(), imported.path), ("b", PreparePath::Import));
    assert_eq!((replayed.engine.as_str(), replayed.path), ("b", PreparePath::Replay));
    assert!(resident.tokens > 0);
    assert_eq!(imported.text, resident.text, "an imported prefix answered differently on the same backend");
    assert_eq!(replayed.text, resident.text, "a replayed prefix answered differently on the same backend");
}

#[test]
fn a_snapshot_round_trip_preserves_bytes_positions_and_boundaries() {
    let _serial = serial();
    let (_a, b, version) = two_engines(false, 2);
    let exported = vlm_runtime::answer::snapshot(&version).unwrap();
    assert_eq!(exported.end, version.end);
    let bytes = exported.bytes.clone();
    // a → b (into b's first stream sequence, unused) → back out of b.
    let round = b
        .call(move |w| {
            w.ctx.seq_restore(0, &bytes).unwrap();
            let pos_max = w.ctx.seq_pos_max(0);
            let again = w.ctx.seq_snapshot(0).unwrap();
            w.ctx.seq_clear(0);
            (pos_max, again)
        })
        .unwrap();
    assert_eq!(round.0, version.end - 1, "positions survive the transfer");
    assert_eq!(round.1, exported.bytes, "the snapshot changed on its way through the other engine");
    // … and back into `a`, in another sequence (its own holds the stream): compared with the
    // original snapshot restored into that same sequence, byte for byte.
    let (original, via_b) = (exported.bytes.clone(), round.1);
    let (direct, back) = _a
        .call(move |w| {
            let mut as_seq_1 = |bytes: &[u8]| {
                w.ctx.seq_restore(1, bytes).unwrap();
                let again = w.ctx.seq_snapshot(1).unwrap();
                w.ctx.seq_clear(1);
                again
            };
            (as_seq_1(&original), as_seq_1(&via_b))
        })
        .unwrap();
    assert_eq!(back, direct, "the round trip a -> b -> a changed the cells");
}

#[test]
fn the_placer_stays_resident_when_idle_and_moves_when_the_resident_engine_is_busy() {
    let _serial = serial();
    let (a, b, version) = two_engines(false, 3);
    let enc = encoder();
    let q = question("What is in the picture?", 8);
    same_rates(&a, &b);
    let paths = vlm_runtime::placer::estimate(&version, 20, 8, false);
    let idle = answer_placed(&version, &q, "auto", &never(), |_| {}).unwrap();
    assert_eq!(
        (idle.engine.as_str(), idle.path),
        ("a", PreparePath::Resident),
        "idle resident engine; rates a {:?}, b {:?}; paths {:?}",
        a.rates(),
        b.rates(),
        paths
            .iter()
            .map(|p| (
                p.engine.name().to_owned(),
                p.path,
                p.queue_ms,
                p.prepare_ms,
                p.suffix_ms,
                p.decode_ms,
                p.ingest_delay_ms
            ))
            .collect::<Vec<_>>()
    );
    assert!(idle.estimate_ms.is_some());

    // Frames waiting for ingestion on `a`: an answer there would delay them (answers go first),
    // so the cheapest complete path imports the history into `b` (a replay would cost more).
    let ingesting = stream_on(&a, &[&a, &b], "ingesting", 16, true);
    for v in 10..16 {
        ingesting.register(frame(&enc, v), &never()).unwrap();
    }
    assert!(a.ingest_backlog_ms() > 0.0);
    let q2 = question("What is in the picture?", 8);
    same_rates(&a, &b);
    let imported = answer_placed(&version, &q2, "auto", &never(), |_| {}).unwrap();
    assert_eq!((imported.engine.as_str(), imported.path), ("b", PreparePath::Import), "{imported:?}");
    assert_eq!(imported.text, idle.text);

    // Keep `a` busy for real: its thread is held (until the answer below is placed) and a
    // re-prefill of a 12-frame history waits behind it, counted in `a`'s answer starts (without
    // the hold it could start at once, and the placement see `a` idle again: a race a fast
    // machine lost).
    let (placed, holder) = hold(&a);
    let long = stream_on(&a, &[&a, &b], "long", 16, false);
    for v in 20..32 {
        long.register(frame(&enc, v), &never()).unwrap();
    }
    let long_version = long.wait_version(12, &never()).unwrap();
    let busy =
        std::thread::spawn(move || vlm_runtime::answer(&long_version, &question("Describe it.", 4), &never(), |_| {}));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.start_backlog_ms() < 1000.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(a.start_backlog_ms() > 1000.0, "a: {} ms of answer starts ahead", a.start_backlog_ms());
    same_rates(&a, &b);
    let moved = answer_placed(&version, &question("What is in the picture?", 8), "auto", &never(), |_| {}).unwrap();
    let _ = placed.send(());
    holder.join().unwrap();
    assert_eq!(moved.engine, "b", "waiting for a cost more: {moved:?}");
    assert_ne!(moved.path, PreparePath::Resident);
    assert_eq!(moved.text, idle.text);
    busy.join().unwrap().unwrap();
}

#[test]
fn a_question_behind_a_lagging_engine_replays_its_frames_on_an_idle_one() {
    let _serial = serial();
    let (a, b) = (engine_named("a", false), engine_named("b", false));
    let enc = encoder();
    // Six frames of another stream queued on `a` ahead of the one the question needs.
    let busy = stream_on(&a, &[&a], "busy", 16, true);
    for v in 0..6 {
        busy.register(frame(&enc, 40 + v), &never()).unwrap();
    }
    let s = stream_on(&a, &[&a, &b], "s", 4, true);
    s.register(frame(&enc, 1), &never()).unwrap();
    assert!(s.pending_version(1).is_some(), "frame 1 was already published");
    let q = question("What is in the picture?", 8);
    let moved = answer_frame(&s, 1, &q, "auto", &never(), |_| {}).unwrap();
    assert_eq!((moved.engine.as_str(), moved.path, moved.frames), ("b", PreparePath::Replay, 1), "{moved:?}");

    // The same version, once `a` has ingested it, answers the same on `a`: the replay used the
    // record that was then published.
    let published = s.wait_version(1, &never()).unwrap();
    assert!(s.pending_version(1).is_none());
    let resident = answer_on(&published, &q, &a, PreparePath::Resident, &never(), |_| {}).unwrap();
    assert_eq!(resident.text, moved.text);
    // Nothing queued (the waited-for frame went before the other stream's backlog: let that
    // finish too): the question stays resident.
    busy.wait_version(6, &never()).unwrap();
    let idle = answer_frame(&s, 1, &q, "auto", &never(), |_| {}).unwrap();
    assert_eq!((idle.engine.as_str(), idle.path), ("a", PreparePath::Resident), "{idle:?}");
}

#[test]
fn forced_placement_is_obeyed_and_an_unknown_engine_is_refused() {
    let _serial = serial();
    let (_a, _b, version) = two_engines(false, 1);
    let on_b = answer_placed(&version, &question("Describe it.", 4), "b", &never(), |_| {}).unwrap();
    assert_eq!(on_b.engine, "b");
    let err = answer_placed(&version, &question("Describe it.", 4), "gpu", &never(), |_| {}).unwrap_err();
    assert!(matches!(&err, Error::Config(m) if m.contains("gpu") && m.contains("a, b")), "{err}");
}

#[test]
fn an_incompatible_snapshot_is_refused_with_its_reason() {
    let _serial = serial();
    let (_a, fa, version) = two_engines(true, 1);
    let err =
        answer_on(&version, &question("Describe it.", 4), &fa, PreparePath::Import, &never(), |_| {}).unwrap_err();
    assert!(matches!(&err, Error::Incompatible(why) if why.contains("layout")), "{err}");
    // The placer never proposes that import; replay on that engine still works.
    let paths = vlm_runtime::placer::estimate(&version, 10, 4, false);
    assert!(!paths.iter().any(|p| p.engine.name() == "fa" && p.path == PreparePath::Import));
    let replayed =
        answer_on(&version, &question("Describe it.", 4), &fa, PreparePath::Replay, &never(), |_| {}).unwrap();
    assert_eq!(replayed.engine, "fa");
}

#[test]
fn an_engine_runs_on_the_cores_it_names() {
    let _serial = serial();
    let config = EngineConfig { name: "little".into(), threads: 1, cores: vec![0], ..EngineConfig::default() };
    let little = Engine::start(&model_path(), config).unwrap();
    assert_eq!(little.call(|_| vlm_runtime::llama::current_thread_cores()).unwrap(), vec![0]);
    let anywhere = engine_named("any", false);
    assert!(anywhere.call(|_| vlm_runtime::llama::current_thread_cores()).unwrap().len() >= 2);
}

/// With per-sequence KV, llama.cpp copies a branch's stream (`seq_copy_prefix`) at the next
/// decode, whatever happened to the two sequences meanwhile. A snapshot restored into the
/// branch before that decode (an import into a branch whose answer was cancelled before its
/// first decode) would be overwritten by the other stream's history: the restore is refused
/// until a decode has run (the answer replays instead), and the branch then holds what the
/// snapshot holds.
#[test]
fn a_snapshot_is_not_restored_where_a_kv_copy_waits_for_the_next_decode() {
    use vlm_runtime::llama::{Batch, Context, ContextParams};
    let model = vlm_runtime::models::model(&model_path(), &vlm_runtime::Device::Cpu).unwrap();
    let params = ContextParams {
        n_ctx_per_seq: 256,
        n_seq: 3,
        n_batch: 256,
        threads: 1,
        kv_unified: None,
        kv_type: Default::default(),
        flash_attention: false,
    };
    let mut ctx = Context::new(Arc::clone(&model), &params).unwrap();
    let prefill = |ctx: &mut Context, seq: i32, text: &str| {
        let tokens = model.tokenize(text, false, false).unwrap();
        let mut batch = Batch::tokens(tokens.len());
        for (i, &t) in tokens.iter().enumerate() {
            batch.push_token(t, i as i32, seq, i + 1 == tokens.len());
        }
        ctx.decode(&batch).unwrap();
        tokens.len() as i32
    };
    // What comes after `seq`'s history: the logits of one more token.
    let probe = |ctx: &mut Context, seq: i32, pos: i32| {
        let mut batch = Batch::tokens(1);
        batch.push_token(model.tokenize(" the", false, false).unwrap()[0], pos, seq, true);
        ctx.decode(&batch).unwrap();
        ctx.last_logits().unwrap().to_vec()
    };
    prefill(&mut ctx, 0, "The cat sat on the mat and looked at the red ball for a long time.");
    let end = prefill(&mut ctx, 2, "A train crossed the bridge over the river at night, its lights on.");
    let snapshot = ctx.seq_snapshot(2).unwrap();
    // Stream 0 branched into sequence 1, and the branch let go before any decode.
    ctx.seq_copy_prefix(0, 1, 10);
    ctx.seq_clear(1);
    // Refused: the answer replays what the snapshot holds instead.
    if ctx.seq_restore(1, &snapshot).is_err() {
        prefill(&mut ctx, 1, "A train crossed the bridge over the river at night, its lights on.");
    }
    let branch = probe(&mut ctx, 1, end);
    let train = probe(&mut ctx, 2, end);
    assert_eq!(branch, train, "the branch does not hold the restored history");
    // Once a decode has run, the restore is taken.
    ctx.seq_clear(1);
    ctx.seq_restore(1, &snapshot).expect("restored after a decode");
}

/// Imports admitted at once into a unified pool with room for one at a time: each waits for the
/// one before it to end and free its cells (with no answer decoding, nothing was counted: the
/// third's snapshot found no room and its answer failed).
#[test]
fn imports_that_fit_the_unified_pool_one_at_a_time_wait_for_each_other() {
    let _serial = serial();
    // (Snapshots move between engines of one layout.)
    let unified = |name: &str| EngineConfig {
        name: name.into(),
        threads: 1,
        context_per_sequence: 1024,
        max_streams: 1,
        max_branches: 3,
        answer_cells: 64,
        kv_layout: KvLayout::Unified,
        flash_attention: true,
        ..EngineConfig::default()
    };
    let a = Engine::start(&model_path(), unified("a")).unwrap();
    let b = Engine::start(&model_path(), unified("b")).unwrap(); // a pool of (1 + 1) x 1024 + 3 x 64 cells
    let enc = encoder();
    let s = stream_on(&a, &[&a, &b], "s", 4, true);
    for v in 0..22 {
        s.register(frame(&enc, v), &never()).unwrap();
    }
    let version = s.wait_version(22, &never()).unwrap();
    assert!(version.cells > 700 && 3 * version.cells > 2240, "{} cells", version.cells);
    let (release, holder) = hold(&b);
    // (Each queued on b before the next is asked, all three before b goes on.)
    let asked: Vec<_> = (0..3)
        .map(|_| {
            let (version, on) = (version.clone(), Arc::clone(&b));
            let before = b.start_backlog_ms();
            let asked = std::thread::spawn(move || {
                answer_on(&version, &question("Describe it.", 4), &on, PreparePath::Import, &never(), |_| {})
            });
            wait_queued(&b, before);
            asked
        })
        .collect();
    release.send(()).unwrap();
    holder.join().unwrap();
    for answer in asked {
        let report = answer.join().unwrap().expect("each import waits for room");
        assert_eq!(report.path, PreparePath::Import);
    }
}
