//! glibc's malloc arenas under the plugin (`runtime/src/llama/arenas.rs`): registering it limits
//! them to two (unless the environment chose), before any element exists. glibc fixes its limit
//! the first time a thread wants a ninth arena, so the first model load was too late in a
//! pipeline whose streams' threads were already allocating. A test binary of its own: its arenas
//! are counted before other tests' threads exist.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

use std::sync::{Arc, Barrier};

use vlm_runtime::llama::arenas::count as arenas;

#[test]
fn registering_the_plugin_limits_the_arenas_before_any_model_loads() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() || std::env::var_os("GLIBC_TUNABLES").is_some() {
        eprintln!("the environment chose the arenas: nothing to check");
        return;
    }
    gst::init().unwrap();
    gstvlm::plugin_register_static().expect("register the vlm plugin");
    let before = arenas().unwrap();
    // Twelve threads allocating while all are alive (a pipeline's streaming threads): glibc
    // gives each new one an arena of its own up to eight per core, unless limited.
    let threads = 12;
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let block = vec![1u8; 1 << 20];
                barrier.wait(); // all allocated
                barrier.wait(); // counted
                block.len()
            })
        })
        .collect();
    barrier.wait();
    let after = arenas().unwrap();
    barrier.wait();
    for h in handles {
        h.join().unwrap();
    }
    assert!(after <= before.max(2), "{threads} threads made {after} arenas after the registration (before: {before})");
}
