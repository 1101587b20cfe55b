//! The test process's resident memory (shared by the runtime's and the GStreamer tests).

/// The process's resident set (VmRSS), MiB.
pub fn rss_mib() -> f64 {
    status_mib("VmRSS:")
}

/// The process's peak resident set (VmHWM) since it started or [`reset_peak_rss`], MiB.
pub fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}

/// Start the peak resident set (VmHWM) again from the current one (Linux's `clear_refs` 5).
pub fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak RSS through /proc/self/clear_refs");
}

fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    kib / 1024.0
}

/// What glibc's allocator holds, MiB: allocated by the program (heap chunks and mmapped blocks,
/// resident or not: a KV cache's untouched pages count) and free inside its arenas (held, not
/// given back: fragmentation, or memory kept for reuse).
#[derive(Clone, Copy, Debug, Default)]
pub struct Heap {
    pub in_use: f64,
    pub free: f64,
}

/// glibc's `struct mallinfo2` (every field a `size_t`).
#[repr(C)]
#[derive(Default)]
struct MallInfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    fordblks: usize,
    keepcost: usize,
}

unsafe extern "C" {
    fn mallinfo2() -> MallInfo2;
}

/// The allocator's figures now, over all its arenas.
pub fn heap_mib() -> Heap {
    // SAFETY: mallinfo2 only reads the allocator's statistics (under each arena's lock).
    let m = unsafe { mallinfo2() };
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    Heap { in_use: mib(m.uordblks + m.hblkhd), free: mib(m.fordblks) }
}

/// The arenas glibc holds while `threads` new threads each allocate a block and stay alive (glibc
/// gives a new thread that finds the arenas busy one of its own, up to eight per core, unless
/// limited).
pub fn arenas_with_threads(threads: usize) -> usize {
    use std::sync::{Arc, Barrier};
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
    let arenas = vlm_runtime::llama::arenas::count().expect("malloc_info");
    barrier.wait();
    for h in handles {
        h.join().unwrap();
    }
    arenas
}
