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
    /// When frame `number` (1-based) of any stream arrives, `t0` being the first frame's time.
    pub fn frame_due(&self, t0: Instant, number: usize) -> Instant {
        t0 + Duration::from_secs_f64((number - 1) as f64 / self.fps)
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
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".into(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
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
    fn own_peak_rss_is_readable() {
        assert!(peak_rss_kib(None).is_some_and(|k| k > 0));
    }
}
