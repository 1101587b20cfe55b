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
