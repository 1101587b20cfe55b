//! Shared helpers of the GStreamer tests: static plugin registration, the test models
//! (`VLM_MODEL` / `VLM_MMPROJ` override the defaults in models/), and running a pipeline to EOS.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Once;

use gst::prelude::*;

/// The repository root: from the package directory cargo names when it runs the test (the one
/// compiled in is only a fallback: a shared target directory may hold a binary built elsewhere).
pub fn root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("..")
}

pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        gst::init().unwrap();
        gstvlm::plugin_register_static().expect("register the vlm plugin");
        // Pipeline files name models/ and pipelines/ relative to the repository root.
        std::env::set_current_dir(root()).unwrap();
    });
}

pub fn model() -> String {
    std::env::var("VLM_MODEL").unwrap_or_else(|_| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into())
}

pub fn mmproj() -> String {
    std::env::var("VLM_MMPROJ").unwrap_or_else(|_| "models/test-mmproj-mlp.gguf".into())
}

/// A pipeline description with the default model paths replaced by the configured ones.
pub fn description(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join(" ")
        .replace("models/SmolLM2-135M-Instruct.Q4_1.gguf", &model())
        .replace("models/test-mmproj-mlp.gguf", &mmproj())
}

/// What a pipeline run left on its bus.
#[derive(Debug, Default)]
pub struct Run {
    pub answers: Vec<gst::Structure>,
    /// Every element message (answers included), in order.
    pub messages: Vec<gst::Structure>,
    pub errors: Vec<String>,
    pub warnings: Vec<String>,
}

/// Run `pipeline` until EOS or an error, collecting answers, errors and warnings; no EOS
/// within 240 s is an error.
pub fn run(pipeline: &gst::Element) -> Run {
    run_for(pipeline, 240)
}

/// [`run`], with no EOS within `seconds` an error.
pub fn run_for(pipeline: &gst::Element, seconds: u64) -> Run {
    let run = run_to_eos(pipeline, seconds);
    pipeline.set_state(gst::State::Null).unwrap();
    run
}

/// [`run_for`], leaving the pipeline where it ended (PLAYING) for the caller to read what the
/// elements counted (their statistics start again at zero at PAUSED→READY) and stop it.
pub fn run_to_eos(pipeline: &gst::Element, seconds: u64) -> Run {
    let bus = pipeline.bus().unwrap();
    let mut run = Run::default();
    if pipeline.set_state(gst::State::Playing).is_err() {
        run.errors.push("state change to PLAYING failed".into());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let Some(msg) = bus.timed_pop(gst::ClockTime::from_nseconds(left.as_nanos() as u64)) else {
            run.errors.push(format!("no EOS within {seconds} s"));
            break;
        };
        use gst::MessageView;
        match msg.view() {
            MessageView::Eos(_) => break,
            MessageView::Error(e) => {
                run.errors.push(format!("{} ({:?})", e.error(), e.debug()));
                break;
            }
            MessageView::Warning(w) => run.warnings.push(format!("{} ({:?})", w.error(), w.debug())),
            MessageView::Element(e) => {
                if let Some(s) = e.structure() {
                    if s.name() == "vlm-answer" {
                        run.answers.push(s.to_owned());
                    }
                    run.messages.push(s.to_owned());
                }
            }
            _ => (),
        }
    }
    run
}

pub fn launch(text: &str) -> gst::Element {
    init();
    gst::parse::launch(&description(text)).unwrap_or_else(|e| panic!("cannot parse {text}: {e}"))
}

/// llama.cpp's `rpc-server` for the `rpc` engine's tests (shared with the runtime's tests).
#[path = "../../runtime/tests/common/rpc_server.rs"]
mod rpc_server;
#[allow(unused_imports)] // only the RPC tests start one
pub use rpc_server::RpcServer;

#[path = "../../runtime/tests/common/rss.rs"]
mod rss;
#[allow(unused_imports)] // only the memory tests read it
pub use rss::{Heap, arenas_with_threads, heap_mib, peak_rss_mib, reset_peak_rss, rss_mib};

/// The number of the frame a probed buffer brought into its stream's history: none for a buffer
/// without a registered frame, nor for one the gate held (it carries the number of the frame
/// that stands for it).
pub fn joined_frame(info: &gst::PadProbeInfo) -> Option<u64> {
    let meta = info.buffer()?.meta::<gst_vlm_elements::meta::VlmFrameMeta>()?;
    meta.position().filter(|_| !meta.held()).map(|p| p.1)
}
