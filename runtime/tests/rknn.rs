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
use vlm_runtime::encoder::{Picture, PixelLayout, VisionEncoder};
use vlm_runtime::llama::Segment;
use vlm_runtime::rknn::RknnEncoder;
use vlm_runtime::{Error, PreparePath, answer};

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
