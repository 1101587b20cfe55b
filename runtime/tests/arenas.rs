//! glibc's malloc arenas under the runtime (`llama/arenas.rs`): once the backend is initialised,
//! new threads share at most two arenas unless the environment chose a count. A test binary of
//! its own: its arenas are counted before other tests' threads exist.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

mod common;

#[test]
fn threads_share_two_arenas_once_the_backend_is_up() {
    if vlm_runtime::llama::arenas::environment_chose() {
        eprintln!("the environment chose the arenas: nothing to check");
        return;
    }
    vlm_runtime::llama::init_backend();
    let before = vlm_runtime::llama::arenas::count().unwrap();
    let after = common::arenas_with_threads(12);
    assert!(after <= before.max(2), "12 threads made {after} arenas (before: {before})");
}
