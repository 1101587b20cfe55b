//! `gpu-device` and `gpu-layers` (llama.cpp's `--device` and `--n-gpu-layers`) reach llama.cpp:
//! on Mesa's lavapipe (this machine has no GPU; it is a Vulkan device llama.cpp lists when
//! `GGML_VK_VISIBLE_DEVICES` names it, set here before the backends start, which is why these
//! checks have a test binary of their own), loading the model with 2 of its layers on the GPU
//! offloads 2, with none given all of them, and a GPU that is not there is an error naming the
//! ones found. Nothing is computed on lavapipe (it is ~25x slower than the CPU).

mod common;

use std::sync::{Arc, Mutex};

use common::model_path;
use vlm_runtime::llama::{self, LogLevel, Model};
use vlm_runtime::{Device, Gpu};

#[test]
fn gpu_layers_and_device_reach_llama_cpp() {
    // SAFETY: set before any thread of this test binary starts llama.cpp (the one test here).
    unsafe { std::env::set_var("GGML_VK_VISIBLE_DEVICES", "0") };
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = Arc::clone(&lines);
    llama::set_log_sink(move |_: LogLevel, line: &str| sink.lock().unwrap().push(line.to_owned()));
    assert!(llama::gpu_available(), "lavapipe (mesa-vulkan-drivers, installed by setup) must be listed");
    let offloaded = |layers: Option<u32>| {
        lines.lock().unwrap().clear();
        let model = Model::load(&model_path(), &Device::Gpu(Gpu { index: 0, layers })).expect("load on the GPU");
        drop(model);
        let lines = lines.lock().unwrap();
        lines
            .iter()
            .find(|l| l.contains("offloaded"))
            .cloned()
            .unwrap_or_else(|| panic!("no offload line in {lines:?}"))
    };
    let two = offloaded(Some(2));
    assert!(two.contains("offloaded 2/"), "{two}");
    let all = offloaded(None);
    let (done, total) =
        all.split_once("offloaded ").unwrap().1.split_once(" layers").unwrap().0.split_once('/').unwrap();
    assert_eq!(done, total, "every layer: {all}");
    let err = Model::load(&model_path(), &Device::Gpu(Gpu { index: 7, layers: None })).err().expect("no GPU 7");
    assert!(err.to_string().contains("no GPU 7: llama.cpp found 1"), "{err}");
}
