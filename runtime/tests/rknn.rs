//! The RKNN (NPU) vision encoder's glue. This machine has no Rockchip NPU: the tests link the
//! stand-in runtime `rknn-standin/librknnrt.c` (build with `VLM_RKNN_STANDIN=1 cargo test
//! -p vlm-runtime --features rknn`), which runs a deterministic toy encoder. They check the glue
//! (model checks, NHWC input, output shape, decoding the rows into real llama.cpp); NPU execution
//! itself is unverified on hardware.
#![cfg(feature = "rknn")]

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use common::*;
use vlm_runtime::encoder::{EncoderBackend, Picture, PixelLayout, VisionEncoder, open_encoder};
use vlm_runtime::llama::Segment;
use vlm_runtime::rknn::RknnEncoder;
use vlm_runtime::{Device, Engine, EngineConfig, Error, PreparePath, answer, models};

fn model_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gst-vlm-rknn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn rknn_frame(enc: &RknnEncoder, variant: u32) -> Arc<vlm_runtime::Frame> {
    let rgb = picture(variant);
    Arc::new(enc.encode(&Picture::packed(&rgb, 64, 48, 64 * 3, PixelLayout::Rgb)).unwrap())
}

#[test]
fn the_npu_encoder_checks_its_model_and_feeds_the_language_model() {
    let good = model_file("good.rknn", "RKNN-STANDIN width=64 height=64 rows=36 dim=576 seed=7");
    let enc = RknnEncoder::new(&good, 576).unwrap();
    let (a, a2, b) = (rknn_frame(&enc, 1), rknn_frame(&enc, 1), rknn_frame(&enc, 2));
    let rows = |f: &vlm_runtime::Frame| match &f.segments[..] {
        [Segment::Image(i)] => (i.rows, i.width, i.data.to_vec()),
        other => panic!("unexpected segments {other:?}"),
    };
    let (ra, rb) = (rows(&a), rows(&b));
    assert_eq!((ra.0, ra.1), (36, 576));
    assert_eq!(ra, rows(&a2), "deterministic");
    assert_ne!(ra.2, rb.2, "different pictures, different embeddings");

    // NPU embeddings through a real stream: retained and re-prefilled histories agree.
    let engine = engine("cpu");
    let never = Arc::new(AtomicBool::new(false));
    let (retained, baseline) = (open(&engine, "npu", true), open(&engine, "npu-baseline", false));
    for f in [&a, &b] {
        retained.register(Arc::clone(f), &never).unwrap();
        baseline.register(Arc::clone(f), &never).unwrap();
    }
    let q = question("What is in the picture?", 8);
    let r = answer(&retained.wait_version(2, &never).unwrap(), &q, &never, |_| {}).unwrap();
    let p = answer(&baseline.wait_version(2, &never).unwrap(), &q, &never, |_| {}).unwrap();
    assert_eq!((r.path, p.path), (PreparePath::Resident, PreparePath::Replay));
    assert!(r.tokens > 0);
    assert_eq!(r.text, p.text);
}

#[test]
fn a_bad_npu_model_is_an_error_not_a_crash() {
    let wrong_width = model_file("wide.rknn", "RKNN-STANDIN width=64 height=64 rows=36 dim=512 seed=7");
    let err = RknnEncoder::new(&wrong_width, 576).err().expect("width mismatch");
    assert!(err.to_string().contains("512") && err.to_string().contains("576"), "{err}");
    let garbage = model_file("garbage.rknn", "not a model");
    assert!(matches!(RknnEncoder::new(&garbage, 576), Err(Error::File { .. })));
    assert!(matches!(RknnEncoder::new(std::path::Path::new("/nonexistent.rknn"), 576), Err(Error::File { .. })));
}

/// The NPU gives plain rows on 1-D positions; an M-RoPE model (Qwen2-VL) needs the 2-D
/// positions libmtmd computes. The pairing is refused (`auto` falls back to libmtmd, saying
/// why), and rows that reach the model anyway are refused before llama.cpp sees them.
#[test]
fn the_npu_encoder_is_refused_for_an_mrope_model() {
    let dir = models_dir();
    let (lm, mmproj) = (dir.join("test-qwen2vl-lm.gguf"), dir.join("test-qwen2vl-mmproj.gguf"));
    if !lm.is_file() || !mmproj.is_file() {
        eprintln!("SKIPPED: the qwen2vl test pair is missing (run scripts/setup.sh)");
        return;
    }
    let model = models::model(&lm, &Device::Cpu).unwrap();
    let width = model.n_embd();
    let npu = model_file("qwen.rknn", &format!("RKNN-STANDIN width=64 height=64 rows=16 dim={width} seed=7"));
    let err = open_encoder(EncoderBackend::Rknn, &mmproj, Some(&npu), &model, 1, 1).err().expect("refused");
    let text = err.to_string();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert!(
        text.contains("M-RoPE") && text.contains("use backend=cpu|gpu") && text.contains("test-qwen2vl-lm"),
        "{text}"
    );
    let auto = open_encoder(EncoderBackend::Auto, &mmproj, Some(&npu), &model, 1, 1).unwrap();
    assert_ne!(auto.backend, "rknn");
    assert!(auto.fallback.as_deref().is_some_and(|f| f.contains("M-RoPE")), "{:?}", auto.fallback);

    // The encoder opened directly: its rows are refused where they meet the model.
    let enc = RknnEncoder::new(&npu, width).unwrap();
    let config = EngineConfig { name: "cpu".into(), threads: 1, context_per_sequence: 256, ..EngineConfig::default() };
    let engine = Engine::start(&lm, config).unwrap();
    let never = Arc::new(AtomicBool::new(false));
    let stream = open(&engine, "npu-qwen", true);
    stream.register(rknn_frame(&enc, 1), &never).unwrap();
    let err = stream.wait_version(1, &never).err().expect("refused");
    assert!(matches!(&err, Error::BadInput(m) if m.contains("M-RoPE")), "{err}");
}
