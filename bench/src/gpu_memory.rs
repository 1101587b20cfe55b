//! Each process's peak GPU memory while a configuration runs: `nvidia-smi`'s compute apps
//! (`pid, used_memory` in MiB), polled every 250 ms on a thread of its own. Nothing where
//! `nvidia-smi` does not answer (the CPU machines): the records then say nothing about GPU memory.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Polls `nvidia-smi` until [`GpuMemory::peak_mib`] stops it.
pub struct GpuMemory {
    stop: Arc<AtomicBool>,
    peaks: Arc<Mutex<HashMap<u32, u64>>>,
    thread: std::thread::JoinHandle<()>,
}

/// `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`: each
/// process's MiB now (lines it cannot read, such as `[N/A]`, are left out).
fn sample() -> Option<Vec<(u32, u64)>> {
    let out = Command::new("nvidia-smi")
        .args(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(parse(&String::from_utf8_lossy(&out.stdout)))
}

fn parse(csv: &str) -> Vec<(u32, u64)> {
    csv.lines()
        .filter_map(|line| {
            let (pid, mib) = line.split_once(',')?;
            Some((pid.trim().parse().ok()?, mib.trim().parse().ok()?))
        })
        .collect()
}

/// This process's GPU memory now (MiB), where `nvidia-smi` sees it use the GPU.
pub fn own_mib() -> Option<u64> {
    sample()?.into_iter().find(|&(pid, _)| pid == std::process::id()).map(|(_, mib)| mib)
}

impl GpuMemory {
    /// Start polling, where `nvidia-smi` answers.
    pub fn watch() -> Option<GpuMemory> {
        sample()?;
        let (stop, peaks) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(HashMap::new())));
        let (s, p) = (Arc::clone(&stop), Arc::clone(&peaks));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                for (pid, mib) in sample().unwrap_or_default() {
                    let mut peaks = p.lock().unwrap();
                    let peak = peaks.entry(pid).or_insert(0);
                    *peak = (*peak).max(mib);
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        Some(GpuMemory { stop, peaks, thread })
    }

    /// Stop polling; the peaks of `pids` summed (MiB), or none where none of them used the GPU.
    pub fn peak_mib(self, pids: &[u32]) -> Option<u64> {
        self.stop.store(true, Ordering::Release);
        let _ = self.thread.join();
        let peaks = self.peaks.lock().unwrap();
        let of: Vec<u64> = pids.iter().filter_map(|pid| peaks.get(pid).copied()).collect();
        (!of.is_empty()).then(|| of.iter().sum())
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn nvidia_smis_compute_apps_are_read_per_process() {
        let csv = "1234, 5572\n 99 , 1954\n4321, [N/A]\n\n";
        assert_eq!(parse(csv), [(1234, 5572), (99, 1954)]);
    }
}
