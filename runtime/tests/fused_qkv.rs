//! SmolVLM's encoder layers read Q, K and V as one matrix (libmtmd as this project builds it,
//! scripts/llama/mtmd-edits.cmake: one product instead of three, the same bytes): the rows are
//! those of the three products. A test binary of its own: the switch,
//! `GST_VLM_MTMD_FUSE_QKV=0`, is read from the environment when weights load.

mod common;

use std::sync::Arc;

use vlm_runtime::llama::{Projector, Segment};
use vlm_runtime::{Device, models};

#[test]
fn a_layer_reading_one_qkv_matrix_encodes_the_rows_of_three_products() {
    let dir = common::models_dir();
    // Two copies of the idefics3 test projector: each file's weights load (and fuse) on their own.
    let tmp = std::env::temp_dir().join(format!("vlm-fused-qkv-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let (three, one) = (tmp.join("three.gguf"), tmp.join("one.gguf"));
    for path in [&three, &one] {
        std::fs::copy(dir.join("test-idefics3-mmproj.gguf"), path).unwrap();
    }
    let model = models::model(&dir.join("test-idefics3-lm.gguf"), &Device::Cpu).expect("model");
    let load = |path| Projector::load(path, Arc::clone(&model), false, 1, 1).map(Arc::new).unwrap();
    // SAFETY: this binary's one test, and no thread of this process reads the environment while
    // it changes (the model above loaded on this thread; no encode runs).
    unsafe { std::env::set_var("GST_VLM_MTMD_FUSE_QKV", "0") };
    let unfused = load(&three);
    // SAFETY: as above.
    unsafe { std::env::remove_var("GST_VLM_MTMD_FUSE_QKV") };
    let fused = load(&one);
    assert_eq!(Projector::fused_qkv_layers(&three).unwrap(), 0, "switched off");
    assert!(Projector::fused_qkv_layers(&one).unwrap() > 0, "the loader lays Q, K and V out in a row");
    let rows = |p: &Arc<Projector>, variant| -> Vec<Vec<f32>> {
        let segments = p.encode(&common::picture(variant), 64, 48).unwrap();
        segments
            .iter()
            .filter_map(|s| match s {
                Segment::Image(i) => Some(i.data.to_vec()),
                Segment::Text(_) => None,
            })
            .collect()
    };
    let same_rows = |unfused: &Arc<Projector>, fused: &Arc<Projector>, attention: &str| {
        for variant in 0..3 {
            let (a, b) = (rows(unfused, variant), rows(fused, variant));
            assert_eq!(a.len(), 5, "2x2 tiles and the overview");
            assert_eq!(a, b, "picture {variant}, {attention}: one product gives the rows of three");
        }
    };
    // libmtmd's choice on the CPU: flash attention (K and V from one F16 cast of the product).
    same_rows(&unfused, &fused, "flash attention");
    // Without it: contexts loaded now read the same weights (each file's, fused or not).
    vlm_runtime::llama::set_projector_flash_attention(Some(false));
    let (unfused_plain, fused_plain) = (load(&three), load(&one));
    vlm_runtime::llama::set_projector_flash_attention(None);
    same_rows(&unfused_plain, &fused_plain, "no flash attention");
    // (The switch took: F16 K and V round otherwise than F32 attention.)
    assert_ne!(rows(&fused_plain, 0), rows(&fused, 0), "the contexts loaded now compute without flash attention");
    drop((unfused, fused, unfused_plain, fused_plain));
    assert_eq!(Projector::fused_qkv_layers(&one).unwrap(), 0, "none left loaded");
    std::fs::remove_dir_all(&tmp).ok();
}
