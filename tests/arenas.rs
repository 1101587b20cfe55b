//! glibc's malloc arenas under the plugin (`runtime/src/llama/arenas.rs`): registering it limits
//! them to two (unless the environment chose), before any element exists. glibc fixes its limit
//! the first time a thread wants a ninth arena, so the first model load was too late in a
//! pipeline whose streams' threads were already allocating. A test binary of its own: its arenas
//! are counted before other tests' threads exist.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

mod common;

#[test]
fn registering_the_plugin_limits_the_arenas_before_any_model_loads() {
    if vlm_runtime::llama::arenas::environment_chose() {
        eprintln!("the environment chose the arenas: nothing to check");
        return;
    }
    gst::init().unwrap();
    gstvlm::plugin_register_static().expect("register the vlm plugin");
    let before = vlm_runtime::llama::arenas::count().unwrap();
    // (Twelve threads allocating at once, as a pipeline's streaming threads do.)
    let after = common::arenas_with_threads(12);
    assert!(after <= before.max(2), "12 threads made {after} arenas after the registration (before: {before})");
}
