//! Shared helpers of the runtime's integration tests: the test models (set up by
//! `scripts/setup.sh`; `VLM_MODEL` / `VLM_MMPROJ` override them) and synthetic pictures.

#![allow(dead_code)]

use std::path::PathBuf;

mod rpc_server;
mod rss;
#[allow(unused_imports)] // only the RPC tests start one
pub use rpc_server::RpcServer;
#[allow(unused_imports)] // only the memory tests read it
pub use rss::{Heap, arenas_with_threads, heap_mib, peak_rss_mib, reset_peak_rss, rss_mib};
use std::sync::Arc;

use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::snapshot::PrefixCache;
use vlm_runtime::{
    Device, Engine, EngineConfig, Frame, HistoryPolicy, Question, Sampling, Stream, StreamConfig, Version, models,
};

/// The repository's models/: found from the package directory cargo names when it runs the
/// test (the one compiled in is only a fallback: a target directory shared by two checkouts
/// may hold a test binary built in the other).
pub fn models_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("../models")
}

pub fn model_path() -> PathBuf {
    std::env::var_os("VLM_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"))
}

pub fn mmproj_path() -> PathBuf {
    std::env::var_os("VLM_MMPROJ").map(PathBuf::from).unwrap_or_else(|| models_dir().join("test-mmproj-mlp.gguf"))
}

pub fn engine(name: &str) -> Arc<Engine> {
    engine_with(name, 1024)
}

pub fn engine_with(name: &str, cells: u32) -> Arc<Engine> {
    let config = EngineConfig {
        name: name.into(),
        context_per_sequence: cells,
        max_streams: 2,
        max_branches: 2,
        ..EngineConfig::default()
    };
    Engine::start(&model_path(), config).expect("engine")
}

pub fn encoder() -> MtmdEncoder {
    let model = models::model(&model_path(), &Device::Cpu).expect("model");
    MtmdEncoder::new(models::projector(&mmproj_path(), &model, false, 2, 1).expect("projector"))
}

/// A deterministic 64x48 RGB picture; different `variant`s give different pictures.
pub fn picture(variant: u32) -> Vec<u8> {
    let (w, h) = (64u32, 48u32);
    let mut v = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let on = ((x + variant * 7) / 8 + y / 8).is_multiple_of(2);
            v.extend_from_slice(&[(x * 4) as u8, (y * 5) as u8, if on { 230 } else { (20 + 30 * variant) as u8 }]);
        }
    }
    v
}

pub fn frame(encoder: &MtmdEncoder, variant: u32) -> Arc<Frame> {
    let rgb = picture(variant);
    Arc::new(encoder.encode(&Picture::packed(&rgb, 64, 48, 64 * 3, PixelLayout::Rgb)).expect("encode"))
}

/// Register `n` frames (picture variants 0, 1, ...) on `stream` and wait for the version that
/// holds them.
pub fn with_frames(stream: &Arc<Stream>, encoder: &MtmdEncoder, n: u32) -> Version {
    let never = std::sync::atomic::AtomicBool::new(false);
    for v in 0..n {
        stream.register(frame(encoder, v), &never).unwrap();
    }
    stream.wait_version(n as u64, &never).expect("version")
}

pub fn open(engine: &Arc<Engine>, name: &str, retain: bool) -> Arc<Stream> {
    open_with(engine, name, retain, HistoryPolicy::Stop)
}

pub fn open_with(engine: &Arc<Engine>, name: &str, retain: bool, history_policy: HistoryPolicy) -> Arc<Stream> {
    open_cached(engine, name, retain, history_policy, None)
}

pub fn open_cached(
    engine: &Arc<Engine>,
    name: &str,
    retain: bool,
    history_policy: HistoryPolicy,
    prefix_cache: Option<Arc<PrefixCache>>,
) -> Arc<Stream> {
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT).expect("prompt"));
    let config = StreamConfig { retain, history_policy, prefix_cache, ..StreamConfig::new(name) };
    Stream::open(engine, prompt, config).expect("stream")
}

pub fn question(text: &str, max_tokens: u32) -> Question {
    Question {
        id: "t".into(),
        text: text.into(),
        max_tokens,
        ignore_eos: false,
        sampling: Sampling::default(),
        arrival: std::time::Instant::now(),
    }
}

/// Wait (at most 60 s) until `engine` has more answers waiting to start than `before`
/// (`Engine::start_backlog_ms`): a question asked from another thread is queued there.
#[allow(dead_code)] // (not every test binary queues answers behind a held engine)
pub fn wait_queued(engine: &vlm_runtime::Engine, before: f64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while engine.start_backlog_ms() <= before {
        assert!(std::time::Instant::now() < deadline, "no answer was queued on engine {}", engine.name());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Hold `engine`'s thread in a call (it is inside when this returns) until the sender is used
/// or dropped, or 60 s pass (a test that needs the engine meanwhile is slow, never stuck).
pub fn hold(engine: &Arc<vlm_runtime::Engine>) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<Option<()>>) {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (entered, holding) = std::sync::mpsc::channel::<()>();
    let engine = Arc::clone(engine);
    let holder = std::thread::spawn(move || {
        engine
            .call(move |_| {
                let _ = entered.send(());
                held.recv_timeout(std::time::Duration::from_secs(60)).ok()
            })
            .unwrap()
    });
    holding.recv().unwrap();
    (release, holder)
}
