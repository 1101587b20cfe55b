//! glibc's malloc arenas under the runtime (`llama/arenas.rs`): once the backend is initialised,
//! new threads share at most two arenas unless the environment chose a count. A test binary of
//! its own: its arenas are counted before other tests' threads exist.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

use std::sync::{Arc, Barrier};

use vlm_runtime::llama::arenas::count as arenas;

#[test]
fn threads_share_two_arenas_once_the_backend_is_up() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() || std::env::var_os("GLIBC_TUNABLES").is_some() {
        eprintln!("the environment chose the arenas: nothing to check");
        return;
    }
    vlm_runtime::llama::init_backend();
    let before = arenas().unwrap();
    // Twelve threads, each allocating while all are alive: glibc gives each new thread an arena
    // of its own up to eight per core, unless limited.
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
    assert!(after <= before.max(2), "{threads} threads made {after} arenas (before: {before})");
}
