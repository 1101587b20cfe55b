//! How many heaps glibc's `malloc` keeps: two, unless the environment says otherwise.
//!
//! glibc gives a thread that finds the heaps busy an arena of its own, up to eight per core, and
//! an arena keeps what is freed in it for its next allocations. A process of this runtime
//! allocates blocks of megabytes on many threads (a stream's frame embeddings on its streaming
//! thread, a picture's tiles on the encoder's, a batch of rows on each engine's), so each arena
//! ends up holding a few of every size, free: measured on an H100 with 32 live streams
//! (docs/benchmarks.md, "32 streams for 8 minutes, and the allocator's arenas"), the host RSS
//! climbed 5.5 to 7.3 GiB (+32%) over 480 s while the data in use stayed at 3.4 GiB; with two
//! arenas it held 4.4 GiB from the second tenth to the last (+8% first to last tenth), at the
//! same ingestion rate within 2% (a fixed mmap threshold cost a third of it).
//!
//! A user who sets `MALLOC_ARENA_MAX` (or `glibc.malloc.arena_max` in `GLIBC_TUNABLES`) keeps
//! that choice: glibc's own default is eight per core. glibc fixes its limit the first time a
//! thread wants a ninth arena, and a later `mallopt` does not change it: set at the first model
//! load, the limit did not hold in a 32-stream pipeline (its streams' threads made their arenas
//! while the model loaded; the RSS climbed +54% in 140 s as with glibc's defaults). So the
//! plugin's registration sets it (`gst_vlm_elements::register`), before any element of it
//! exists, and the first model load again for applications of the runtime alone
//! (`runtime/tests/arenas.rs`, `tests/arenas.rs`). An application that had already made more than
//! eight arenas keeps glibc's limit (logged as a warning): the environment variable is the way
//! to be sure.

/// Arenas the runtime asks for where the environment names none.
const ARENAS: i32 = 2;

/// Whether the environment chose the arenas itself (`MALLOC_ARENA_MAX`, or
/// `glibc.malloc.arena_max` in `GLIBC_TUNABLES`).
fn chosen_by_environment(arena_max: Option<&str>, tunables: Option<&str>) -> bool {
    arena_max.is_some()
        || tunables.is_some_and(|t| t.split(':').any(|s| s.trim().starts_with("glibc.malloc.arena_max")))
}

/// Limit glibc's arenas once per process (the plugin's registration, or the first model load)
/// and say so in the log.
pub fn limit_once() {
    static DONE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    DONE.get_or_init(|| match limit() {
        Some(n) => {
            super::log(
                super::LogLevel::Info,
                &format!("malloc: {n} arenas (MALLOC_ARENA_MAX unset; set it to choose)"),
            );
            if let Some(made) = count().filter(|&made| made > 8) {
                let text = format!(
                    "malloc: {made} arenas were made before the limit of {n} was set: glibc keeps its own \
                     limit (8 per core); set MALLOC_ARENA_MAX={n} in the environment"
                );
                super::log(super::LogLevel::Warn, &text);
            }
        }
        None => super::log(super::LogLevel::Debug, "malloc: the arenas the environment chose"),
    });
}

/// Whether this process's environment chose the arenas (the runtime then sets none).
pub fn environment_chose() -> bool {
    let arena_max = std::env::var("MALLOC_ARENA_MAX").ok();
    let tunables = std::env::var("GLIBC_TUNABLES").ok();
    chosen_by_environment(arena_max.as_deref(), tunables.as_deref())
}

/// Limit glibc's arenas to [`ARENAS`] unless the environment chose; returns the limit set.
fn limit() -> Option<i32> {
    if environment_chose() {
        return None;
    }
    set(ARENAS).then_some(ARENAS)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set(arenas: i32) -> bool {
    // SAFETY: mallopt only sets one of the allocator's parameters (under its lock).
    unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set(_: i32) -> bool {
    false
}

/// The arenas glibc has made: the `<heap nr=` entries of `malloc_info`'s report.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn count() -> Option<usize> {
    let (mut buf, mut len) = (std::ptr::null_mut(), 0);
    // SAFETY: open_memstream allocates the buffer it writes to; malloc_info writes its XML
    // there; after fclose the buffer holds `len` bytes, copied, then freed.
    let xml = unsafe {
        let stream = libc::open_memstream(&mut buf, &mut len);
        if stream.is_null() {
            return None;
        }
        libc::malloc_info(0, stream);
        libc::fclose(stream);
        let xml = std::slice::from_raw_parts(buf as *const u8, len).to_vec();
        libc::free(buf.cast());
        xml
    };
    Some(String::from_utf8_lossy(&xml).matches("<heap nr=").count())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn count() -> Option<usize> {
    None
}

#[cfg(test)]
mod tests {
    use super::chosen_by_environment;

    #[test]
    fn a_limit_in_the_environment_is_kept() {
        assert!(!chosen_by_environment(None, None));
        assert!(chosen_by_environment(Some("8"), None));
        assert!(chosen_by_environment(None, Some("glibc.malloc.check=0:glibc.malloc.arena_max=4")));
        assert!(!chosen_by_environment(None, Some("glibc.malloc.mmap_threshold=1048576")));
    }
}
