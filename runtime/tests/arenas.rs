//! glibc's malloc arenas under the runtime (`llama/arenas.rs`): once the backend is initialised,
//! new threads share at most two arenas unless the environment chose a count. A test binary of
//! its own: its arenas are counted before other tests' threads exist.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

use std::sync::{Arc, Barrier};

/// Arenas glibc has now: the `<heap nr=` entries of `malloc_info`'s report.
fn arenas() -> usize {
    let (mut buf, mut len) = (std::ptr::null_mut(), 0);
    // SAFETY: open_memstream allocates the buffer it writes to; malloc_info writes its XML
    // there; after fclose the buffer holds `len` bytes, then it is freed.
    let xml = unsafe {
        let stream = libc::open_memstream(&mut buf, &mut len);
        assert!(!stream.is_null());
        libc::malloc_info(0, stream);
        libc::fclose(stream);
        let xml = std::slice::from_raw_parts(buf as *const u8, len).to_vec();
        libc::free(buf.cast());
        String::from_utf8(xml).unwrap()
    };
    xml.matches("<heap nr=").count()
}

#[test]
fn threads_share_two_arenas_once_the_backend_is_up() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() || std::env::var_os("GLIBC_TUNABLES").is_some() {
        eprintln!("the environment chose the arenas: nothing to check");
        return;
    }
    vlm_runtime::llama::init_backend();
    let before = arenas();
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
    let after = arenas();
    barrier.wait();
    for h in handles {
        h.join().unwrap();
    }
    assert!(after <= before.max(2), "{threads} threads made {after} arenas (before: {before})");
}
