//! The workload every configuration runs: streams of synthetic pictures fed in real time, and
//! questions asked right after given frames are registered.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One benchmark run's parameters, shared by the orchestrator and its worker processes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Workload {
    pub streams: usize,
    pub frames: usize,
    /// Frames per second of each live source.
    pub fps: f64,
    /// A question is asked right after each of these frames (1-based) is registered.
    pub ask_after: Vec<usize>,
    /// Exact answer length (tokens).
    pub tokens: u32,
    pub width: u32,
    pub height: u32,
    pub model: PathBuf,
    pub mmproj: PathBuf,
    /// The engine of B0 and B1 (`NAME:DEVICE:THREADS[:CORES]`).
    pub engine: String,
    /// The two engines of P; B2 runs on the second, B3's process i on engine i mod 2.
    pub engines: String,
    /// Answers generated at once per engine.
    pub max_answers: u32,
    /// Least KV cells per sequence (raised when the workload needs more).
    pub context: u32,
    /// Frames registered but not yet ingested before the overload policy applies.
    pub max_pending: usize,
    /// Skip frames past `max_pending` (a live source's choice) instead of blocking.
    pub skip_on_overload: bool,
    /// Spread the streams' frames over a frame interval (stream i starts i/(S x fps) later),
    /// as unsynchronised cameras would; off, every stream's frame n is due at once.
    #[serde(default)]
    pub stagger: bool,
    /// KV cells one frame fills, once a runtime worker has measured it (sizes the server's
    /// slots like the runtime's sequences).
    #[serde(default)]
    pub frame_cells: Option<u32>,
    /// The runtime's vision encoder: libmtmd on the GPU (as the server's) instead of the CPU.
    #[serde(default)]
    pub encoder_gpu: bool,
    /// The engines' KV layout, element type and flash attention (vlmcontext's `kv-layout`,
    /// `kv-type`, `flash-attention`); the server gets `--cache-type-k/-v` and `-fa` to match.
    #[serde(default = "per_sequence")]
    pub kv_layout: String,
    #[serde(default = "f16")]
    pub kv_type: String,
    #[serde(default)]
    pub flash_attention: bool,
    /// `auto`, `on` or `off`: the engines' `merge_frames`.
    #[serde(default = "auto")]
    pub merge_frames: String,
    /// The engines' `encode_first` (vlmcontext's `encode-first`).
    #[serde(default)]
    pub encode_first: bool,
    /// Threads of the runtime's CPU vision encoder (vlmencode's `threads`).
    #[serde(default = "one")]
    pub encoder_threads: u32,
    /// The runtime's encoder contexts (0: automatic, resolved by each worker for its streams).
    #[serde(default = "one")]
    pub encoder_contexts: usize,
    /// Threads resizing each picture of a tiled projector before libmtmd (`None`: the
    /// projector's default; 0: libmtmd resizes it).
    #[serde(default)]
    pub prepare_threads: Option<usize>,
}

fn auto() -> String {
    "auto".into()
}

fn one<T: From<u8>>() -> T {
    T::from(1)
}

fn per_sequence() -> String {
    "per-sequence".into()
}

fn f16() -> String {
    "f16".into()
}

/// The history curve (`vlm-bench capacity`): one stream whose frames are given as fast as they
/// are taken; once the history holds each of `points` frames (and is ready), `reps` questions
/// are asked one after another, `settle_ms` apart, and timed from their arrival.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HistorySpec {
    pub points: Vec<usize>,
    pub reps: usize,
    pub settle_ms: u64,
}

/// Questions, taken in turn; the same for every configuration.
const QUESTIONS: [&str; 4] = [
    "What do you see in the video?",
    "Is the ball moving?",
    "Describe the scene in one sentence.",
    "What changed since the previous frames?",
];

pub fn question_text(index: usize) -> &'static str {
    QUESTIONS[index % QUESTIONS.len()]
}

impl Workload {
    /// When frame `number` (1-based) of `stream` arrives, `t0` being the first frame's time.
    pub fn frame_due(&self, t0: Instant, stream: usize, number: usize) -> Instant {
        let offset = if self.stagger { stream as f64 / self.streams as f64 } else { 0.0 };
        t0 + Duration::from_secs_f64((number - 1) as f64 / self.fps + offset / self.fps)
    }

    /// KV cells a sequence (or a server slot) needs for the whole window: the prompt, every
    /// frame and one answer, to the next power of two, at least `context`. Frames the runtime
    /// has not measured count 128 cells.
    pub fn sequence_cells(&self) -> u32 {
        let per_frame = self.frame_cells.map_or(128, |c| c + 8);
        self.context.max((256 + self.frames as u32 * per_frame + self.tokens + 64).next_power_of_two())
    }

    pub fn total_questions(&self) -> usize {
        self.streams * self.ask_after.len()
    }
}

/// A deterministic RGB picture: a gradient that differs per stream and a ball that moves from
/// frame to frame, so every frame's content (and its hash) is new.
pub fn picture(stream: usize, frame: usize, width: u32, height: u32) -> Vec<u8> {
    let (w, h) = (width as f64, height as f64);
    let t = frame as f64 * 0.35 + stream as f64 * 1.7;
    let (cx, cy) = (w * (0.5 + 0.35 * t.cos()), h * (0.5 + 0.35 * (1.3 * t).sin()));
    let r2 = (0.12 * w.min(h)).powi(2);
    let mut rgb = Vec::with_capacity((width * height * 3) as usize);
    for y in 0..height {
        for x in 0..width {
            let (fx, fy) = (x as f64, y as f64);
            if (fx - cx).powi(2) + (fy - cy).powi(2) < r2 {
                rgb.extend_from_slice(&[240, 240, 240]);
            } else {
                rgb.extend_from_slice(&[
                    (fx / w * 200.0) as u8,
                    (fy / h * 200.0) as u8,
                    (40 + 50 * (stream % 4)) as u8,
                ]);
            }
        }
    }
    rgb
}

/// Milliseconds since the Unix epoch: how processes agree on a start time.
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The local `Instant` of a start time given in Unix milliseconds.
pub fn instant_of_unix_ms(at: u64) -> Instant {
    let now_ms = unix_ms();
    let now = Instant::now();
    if at >= now_ms { now + Duration::from_millis(at - now_ms) } else { now - Duration::from_millis(now_ms - at) }
}

pub fn sleep_until(at: Instant) {
    let now = Instant::now();
    if at > now {
        std::thread::sleep(at - now);
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Peak resident set size of a process (VmHWM, KiB), `None` if unreadable.
pub fn peak_rss_kib(pid: Option<u32>) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

/// This process's resident set size now (VmRSS, KiB), `None` if unreadable.
pub fn rss_kib() -> Option<u64> {
    status_kib(None, "VmRSS:")
}

fn status_kib(pid: Option<u32>, key: &str) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".into(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    status.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU time (clock ticks) the whole machine was busy, and what this process and the children
/// it has waited for used, so far: what other processes used in between is the difference.
#[derive(Debug, Clone, Copy)]
pub struct CpuTicks {
    at: Instant,
    machine_busy: u64,
    own: u64,
}

impl CpuTicks {
    pub fn now() -> Option<CpuTicks> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> =
            stat.lines().next()?.strip_prefix("cpu ")?.split_whitespace().filter_map(|v| v.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
        let machine_busy = cpu.iter().take(8).sum::<u64>() - cpu.get(3)? - cpu.get(4)?;
        // utime stime cutime cstime are fields 14-17, counted after the parenthesised name.
        let own_stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let fields: Vec<u64> =
            own_stat.rsplit_once(')')?.1.split_whitespace().skip(11).take(4).filter_map(|v| v.parse().ok()).collect();
        Some(CpuTicks { at: Instant::now(), machine_busy, own: fields.iter().sum() })
    }

    /// Share of the machine's CPU (percent of all cores) that other processes used since
    /// `self` (this process's children count as its own once waited for).
    pub fn foreign_pct_since(&self, cores: usize) -> Option<f64> {
        let now = CpuTicks::now()?;
        let hz = 100.0; // USER_HZ on Linux
        let wall = now.at.duration_since(self.at).as_secs_f64();
        let foreign = now.machine_busy.saturating_sub(self.machine_busy).saturating_sub(now.own - self.own);
        (wall > 0.0).then(|| 100.0 * foreign as f64 / hz / wall / cores as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pictures_differ_by_stream_and_frame() {
        let a = picture(0, 1, 32, 24);
        assert_eq!(a.len(), 32 * 24 * 3);
        assert_eq!(a, picture(0, 1, 32, 24));
        assert_ne!(a, picture(0, 2, 32, 24));
        assert_ne!(a, picture(1, 1, 32, 24));
    }

    #[test]
    fn foreign_cpu_is_measured() {
        let start = CpuTicks::now().expect("Linux /proc");
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_millis(50) {}
        let pct = start.foreign_pct_since(1).unwrap();
        assert!((0.0..=100.0 * 64.0).contains(&pct), "{pct}");
    }

    #[test]
    fn own_peak_rss_is_readable() {
        assert!(peak_rss_kib(None).is_some_and(|k| k > 0));
    }
}
