//! How many threads an engine's computations use: chosen by measurement at start and revised
//! while it runs.
//!
//! llama.cpp's CPU backend runs each computation on `n` threads that meet at barriers (OpenMP's,
//! which spin before they sleep). When other processes hold the cores, as on an edge box that
//! shares them between the camera, the encoder and the engine, a thread waiting at a barrier
//! spins on a core that the thread it waits for needs, and two threads end up slower than one.
//! Measured on the 2-core machine, the seed's workload (B1, 128-token answers), quiet and with
//! one busy process per core (`docs/benchmarks.md`): quiet, 2 threads answered 0.81/s and 1
//! thread 0.52/s; busy, 2 threads 0.21-0.22/s with start-ups up to 11.8 s, 1 thread 0.35-0.37/s
//! with 1.7-1.8 s. Neither count is right for both, so the engine measures: its calibration run
//! times each kind of computation with each candidate (the configured count and 1) and starts
//! with the faster, and every so often ([`Kind`]) it runs a few computations with the other
//! count and keeps whichever costs less per token (a prefill probe only on chunks nobody waits
//! for: a question's or an alert's prefill and a frame a question waits for keep the best count,
//! [`ThreadTuner::waited_threads`]). Decode steps and prefill chunks are tuned
//! apart, each computation run with its own kind's count: contention hurts the wide prefill
//! chunks most, and their cost per token is not a decode step's.
//!
//! Timing alone can be fooled: under contention the cost of spinning threads is heavy-tailed,
//! and a lucky window (both threads on a core at once) makes the wider count look good
//! (measured: 4 rounds in 5 of `scripts/contention.sh` fell below 0.4x of the quiet
//! throughput, down to 0.11x). So a [`CoreMeter`] also reads what the cores deliver: the share
//! of wall time the engine's computing thread was on a core during its computations, and the
//! machine's idle cores (`/proc/stat`). Threads that get only part of a core, with no core idle, are
//! contended: the count is capped to the cores they get (`threads x share + idle cores`), and the
//! wider candidate means at most that many threads (it is neither used nor probed while the cap
//! leaves it one thread, like the other). A cap taken on one thread (1 + the idle cores) is under
//! the configured count wherever anything else runs: the wider candidate then runs as many
//! threads as the cap allows, so an engine that went to one thread under a burst of contention
//! comes back to the cores left to it (an 8-core box whose camera takes two).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Most a losing probe's period grows (see `ThreadTuner::probe_every`).
const MAX_BACKOFF: u32 = 8;

/// What a tuner times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Batched decode steps (one token per answer): a probe of 6 steps every 64.
    Decode,
    /// Prefill chunks (frames, replays, questions; up to a step budget each): fewer and longer,
    /// a probe of 3 chunks every 16.
    Prefill,
}

impl Kind {
    /// (computations between two probes of the other count, computations a probe runs).
    fn probing(self) -> (u32, u32) {
        match self {
            Kind::Decode => (64, 6),
            Kind::Prefill => (16, 3),
        }
    }
}

/// A probe in progress: the candidate tried, the one it is compared with, what it measured.
struct Probe {
    index: usize,
    back_to: usize,
    steps: u32,
    ms: f64,
    tokens: usize,
}

pub(crate) struct ThreadTuner {
    /// Computations between two probes: the kind's period, doubled after each probe that loses
    /// (up to [`MAX_BACKOFF`] times), so that a probe of spinning threads under lasting
    /// contention costs less and less; back to the period when a probe wins.
    probe_every: u32,
    base_every: u32,
    probe_steps: u32,
    candidates: Vec<i32>,
    current: usize,
    /// Milliseconds per decoded token with each candidate (0: not measured yet).
    cost: Vec<f64>,
    since_probe: u32,
    probe: Option<Probe>,
    /// Most threads the cores deliver now ([`CoreMeter`]).
    cap: i32,
}

impl ThreadTuner {
    /// Candidates `threads` and 1; `tune` false (a GPU engine, where threads do little) keeps
    /// `threads` alone.
    pub(crate) fn new(kind: Kind, threads: i32, tune: bool) -> ThreadTuner {
        let candidates = if tune && threads > 1 { vec![threads, 1] } else { vec![threads] };
        let cost = vec![0.0; candidates.len()];
        let (probe_every, probe_steps) = kind.probing();
        ThreadTuner {
            probe_every,
            base_every: probe_every,
            probe_steps,
            candidates,
            current: 0,
            cost,
            since_probe: 0,
            probe: None,
            cap: i32::MAX,
        }
    }

    pub(crate) fn threads(&self) -> i32 {
        self.count(self.current)
    }

    /// The threads candidate `index` runs now: its count, at most the cap.
    fn count(&self, index: usize) -> i32 {
        self.candidates[index].min(self.cap)
    }

    /// Whether the candidates are the same count under the cap now: nothing to compare.
    fn alike(&self) -> bool {
        self.candidates.iter().all(|&c| c.min(self.cap) == self.count(self.current))
    }

    /// The count for a computation someone waits on (a question's or an alert's prefill, a frame
    /// a question waits for): never a probe's, which may be the slower count. Probes run on the
    /// work nobody waits for; measured on the alerts benchmark (test pair, one stream, 10 frames,
    /// 2 runs each way), a probe's three prefill chunks on one thread raised p95 from capture to
    /// the choice from 265-307 ms to 381-383 ms, p50 alike.
    pub(crate) fn waited_threads(&self) -> i32 {
        match &self.probe {
            Some(p) => self.candidates[p.back_to].min(self.cap),
            None => self.threads(),
        }
    }

    /// A computation run with [`ThreadTuner::waited_threads`] took `ms`: during a probe it
    /// updates the compared count's cost only (the probe goes on with the next computation
    /// nobody waits for); otherwise as [`ThreadTuner::observe`].
    pub(crate) fn observe_waited(&mut self, ms: f64, tokens: usize) {
        match &self.probe {
            Some(p) if tokens > 0 => {
                let cost = &mut self.cost[p.back_to];
                *cost = 0.8 * *cost + 0.2 * ms / tokens as f64;
            }
            Some(_) => (),
            None => {
                self.observe(ms, tokens);
            }
        }
    }

    /// At most `cap` threads from now on (a probe that the cap leaves the count it is compared
    /// with ends, lost).
    pub(crate) fn set_cap(&mut self, cap: i32) {
        self.cap = cap;
        if let Some(p) = self.probe.take_if(|p| {
            p.index != p.back_to && self.candidates[p.index].min(cap) == self.candidates[p.back_to].min(cap)
        }) {
            self.current = p.back_to;
        }
    }

    pub(crate) fn candidates(&self) -> &[i32] {
        &self.candidates
    }

    /// The calibration measured candidate `index` at `ms_per_token`.
    pub(crate) fn seed(&mut self, index: usize, ms_per_token: f64) {
        if ms_per_token.is_finite() {
            self.cost[index] = ms_per_token;
        }
    }

    /// Take the cheapest measured candidate; returns its thread count.
    pub(crate) fn choose_best(&mut self) -> i32 {
        let measured = (0..self.candidates.len()).filter(|&i| self.cost[i] > 0.0);
        if let Some(best) = measured.min_by(|&a, &b| self.cost[a].total_cmp(&self.cost[b])) {
            self.current = best;
        }
        self.threads()
    }

    /// A computation of `tokens` took `ms` with the current thread count. Returns the count to
    /// use from the next one on when it changes (a probe starts or ends).
    pub(crate) fn observe(&mut self, ms: f64, tokens: usize) -> Option<i32> {
        // Capped to one count for every candidate: nothing to tell apart.
        if self.candidates.len() < 2 || tokens == 0 || self.alike() {
            return None;
        }
        if let Some(p) = &mut self.probe {
            (p.steps, p.ms, p.tokens) = (p.steps + 1, p.ms + ms, p.tokens + tokens);
            if p.steps < self.probe_steps {
                return None;
            }
            let (tried, back_to, mean) = (p.index, p.back_to, p.ms / p.tokens as f64);
            self.probe = None;
            self.cost[tried] = mean;
            if mean < self.cost[back_to] {
                self.probe_every = self.base_every;
                return None; // keep the probed count: it is current already
            }
            self.probe_every = (self.probe_every * 2).min(self.base_every * MAX_BACKOFF);
            self.current = back_to;
            return Some(self.threads());
        }
        let per_token = ms / tokens as f64;
        let cost = &mut self.cost[self.current];
        *cost = if *cost <= 0.0 { per_token } else { 0.8 * *cost + 0.2 * per_token };
        self.since_probe += 1;
        if self.since_probe < self.probe_every {
            return None;
        }
        self.since_probe = 0;
        let other = (self.current + 1) % self.candidates.len();
        if self.count(other) == self.threads() {
            return None; // the cores do not deliver more now
        }
        self.probe = Some(Probe { index: other, back_to: self.current, steps: 0, ms: 0.0, tokens: 0 });
        self.current = other;
        Some(self.threads())
    }
}

/// Least time a [`CoreMeter`] reading spans (wall time, computations and gaps between them).
const METER_WINDOW: Duration = Duration::from_millis(500);
/// Least computation in a reading (ms): the share of a few short steps says little.
const METER_MIN_COMPUTE_MS: f64 = 100.0;

/// What the cores deliver to an engine's computations now (see the module doc).
pub(crate) struct CoreMeter {
    configured: i32,
    /// Sums over the reading: computation wall time, the computing thread's CPU time, and
    /// threads x wall time (ms).
    wall_ms: f64,
    cpu_ms: f64,
    thread_ms: f64,
    started: Instant,
    /// `/proc/stat` at the reading's start: (idle, total) jiffies and the CPUs counted.
    stat: Option<(u64, u64, usize)>,
    cap: i32,
}

impl CoreMeter {
    /// A meter for up to `configured` threads; `tune` false (a GPU engine) never caps.
    pub(crate) fn new(configured: i32, tune: bool) -> CoreMeter {
        let stat = if tune && configured > 1 { proc_stat() } else { None };
        CoreMeter {
            configured,
            wall_ms: 0.0,
            cpu_ms: 0.0,
            thread_ms: 0.0,
            started: Instant::now(),
            stat,
            cap: configured,
        }
    }

    pub(crate) fn cap(&self) -> i32 {
        self.cap
    }

    /// A computation on `threads` threads took `wall_ms`, its calling thread on a core for
    /// `cpu_ms` of it. Returns the new cap when a reading changed it.
    pub(crate) fn observe(&mut self, threads: i32, wall_ms: f64, cpu_ms: f64) -> Option<i32> {
        self.stat?;
        self.wall_ms += wall_ms;
        self.cpu_ms += cpu_ms.min(wall_ms);
        self.thread_ms += f64::from(threads) * wall_ms;
        (self.started.elapsed() >= METER_WINDOW && self.wall_ms >= METER_MIN_COMPUTE_MS).then(|| self.read()).flatten()
    }

    /// End the reading now (the calibration's, shorter than a window); returns the new cap
    /// when it changed.
    pub(crate) fn read(&mut self) -> Option<i32> {
        let (idle0, total0, cpus) = self.stat?;
        let now = proc_stat()?;
        let (idle, total) = (now.0.saturating_sub(idle0), now.1.saturating_sub(total0));
        let idle_cores = if total > 0 { idle as f64 / total as f64 * cpus as f64 } else { 0.0 };
        let cap = (self.wall_ms > 0.0)
            .then(|| cap_for(self.configured, self.thread_ms / self.wall_ms, self.cpu_ms / self.wall_ms, idle_cores));
        (self.wall_ms, self.cpu_ms, self.thread_ms, self.started, self.stat) =
            (0.0, 0.0, 0.0, Instant::now(), Some(now));
        let cap = cap?;
        (cap != self.cap).then(|| {
            self.cap = cap;
            cap
        })
    }
}

/// The threads the cores deliver: `threads` threads each on a core `share` of the time, plus
/// the cores nobody used, rounded, within 1..=`configured`.
fn cap_for(configured: i32, threads: f64, share: f64, idle_cores: f64) -> i32 {
    ((threads * share.min(1.0) + idle_cores).round() as i32).clamp(1, configured)
}

/// The CPU time of the calling thread (ms).
pub(crate) fn thread_cpu_ms() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec; CLOCK_THREAD_CPUTIME_ID is always valid.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
}

/// `/proc/stat`'s idle (idle + iowait) and total jiffies over every CPU, and the CPUs counted.
fn proc_stat() -> Option<(u64, u64, usize)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let mut lines = stat.lines();
    let fields: Vec<u64> =
        lines.next()?.strip_prefix("cpu ")?.split_whitespace().map_while(|f| f.parse().ok()).collect();
    let cpus = lines.filter(|l| l.starts_with("cpu")).count();
    // user nice system idle iowait irq softirq steal (guest time is in user already).
    (fields.len() >= 8 && cpus > 0).then(|| (fields[3] + fields[4], fields[..8].iter().sum(), cpus))
}

/// Threads of the vision encodes running on the CPU now, process-wide (libmtmd contexts without
/// a GPU: [`CpuEncode`]), and how many such encodes have ended. A CPU engine reads them to let a
/// due frame's encode have the cores (`EngineConfig::encode_first`).
static ENCODER_THREADS: AtomicUsize = AtomicUsize::new(0);
static ENCODES_ENDED: AtomicU64 = AtomicU64::new(0);
/// The cores the encoders and the engines share: the process's (affinity and CPU quota), read
/// by the first encode's thread, which no engine pinned.
static CORES: OnceLock<usize> = OnceLock::new();

/// A vision encode on `threads` CPU threads, counted from `begin` until dropped. libmtmd's
/// encodes on the CPU count themselves; an encoder of an application's own that runs on the
/// same cores can announce its work the same way, so that engines with
/// `EngineConfig::encode_first` give it the cores.
pub struct CpuEncode(usize);

impl CpuEncode {
    pub fn begin(threads: usize) -> CpuEncode {
        CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        ENCODER_THREADS.fetch_add(threads, Ordering::AcqRel);
        CpuEncode(threads)
    }
}

impl Drop for CpuEncode {
    fn drop(&mut self) {
        ENCODER_THREADS.fetch_sub(self.0, Ordering::AcqRel);
        ENCODES_ENDED.fetch_add(1, Ordering::AcqRel);
    }
}

/// Whether the CPU encodes running now and `threads` more threads ask for more threads than the
/// cores.
pub(crate) fn encoder_contends(threads: i32) -> bool {
    let encoding = ENCODER_THREADS.load(Ordering::Acquire);
    encoding > 0 && encoding + threads.max(1) as usize > CORES.get().copied().unwrap_or(usize::MAX)
}

/// CPU encodes ended so far.
pub(crate) fn encodes_ended() -> u64 {
    ENCODES_ENDED.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `steps` decode steps of one token at `ms` each; the thread counts switched to.
    fn run(t: &mut ThreadTuner, steps: u32, ms: impl Fn(i32) -> f64) -> Vec<i32> {
        (0..steps).filter_map(|_| t.observe(ms(t.threads()), 1)).collect()
    }

    /// A tuner of `kind` over 2 and 1 threads calibrated at `two` and `one` ms, and the count it
    /// chose.
    fn calibrated(kind: Kind, two: f64, one: f64) -> (ThreadTuner, i32) {
        let mut t = ThreadTuner::new(kind, 2, true);
        t.seed(0, two);
        t.seed(1, one);
        let best = t.choose_best();
        (t, best)
    }

    /// A decode probe's period: steps between two probes plus the probe's own.
    fn period() -> u32 {
        let (every, steps) = Kind::Decode.probing();
        every + steps
    }

    #[test]
    fn calibration_starts_with_the_faster_count() {
        assert_eq!(ThreadTuner::new(Kind::Decode, 2, true).candidates(), [2, 1]);
        // 2 threads while other processes hold the cores.
        assert_eq!(calibrated(Kind::Decode, 40.0, 15.0).1, 1);
        assert_eq!(calibrated(Kind::Decode, 8.0, 13.0).1, 2);
    }

    #[test]
    fn a_probe_switches_when_the_other_count_became_cheaper_and_returns_when_not() {
        let (mut t, best) = calibrated(Kind::Decode, 8.0, 13.0);
        assert_eq!(best, 2);
        // Quiet: the probe of 1 thread costs more, so it goes back to 2.
        assert_eq!(run(&mut t, period(), |n| if n == 2 { 8.0 } else { 13.0 }), [1, 2]);
        assert_eq!(t.threads(), 2);
        // Contention starts: 2 threads now cost 40 ms a token, 1 thread 15; the next probe (the
        // last one lost, so twice as late) moves.
        assert_eq!(run(&mut t, period() + Kind::Decode.probing().0, |n| if n == 2 { 40.0 } else { 15.0 }), [1]);
        assert_eq!(t.threads(), 1);
        // Contention ends: the probe of 2 threads finds them cheaper again.
        assert_eq!(run(&mut t, period(), |n| if n == 2 { 8.0 } else { 13.0 }), [2]);
        assert_eq!(t.threads(), 2);
    }

    #[test]
    fn prefill_chunks_are_probed_sooner_and_tuned_apart_from_decode_steps() {
        // Contention that hurts wide chunks: 2 threads cost 3 ms a token of prefill against 1.2
        // with 1 thread, while decode steps still favour 2 threads.
        let (mut prefill, mut decode) =
            (ThreadTuner::new(Kind::Prefill, 2, true), ThreadTuner::new(Kind::Decode, 2, true));
        for t in [&mut prefill, &mut decode] {
            t.seed(0, 1.0);
            t.seed(1, 2.0);
            assert_eq!(t.choose_best(), 2);
        }
        let (every, steps) = Kind::Prefill.probing();
        let ms = |t: &ThreadTuner| if t.threads() == 2 { 3.0 * 64.0 } else { 1.2 * 64.0 };
        let switched: Vec<i32> = (0..every + steps).filter_map(|_| prefill.observe(ms(&prefill), 64)).collect();
        assert_eq!(switched, [1], "the probe after {every} chunks keeps 1 thread");
        assert!(run(&mut decode, every + steps, |n| if n == 2 { 8.0 } else { 13.0 }).is_empty());
        assert_eq!(decode.threads(), 2);
    }

    #[test]
    fn computations_someone_waits_on_never_run_a_probe() {
        let (every, steps) = Kind::Prefill.probing();
        let (mut t, best) = calibrated(Kind::Prefill, 3.0, 5.0);
        assert_eq!(best, 2);
        let ms = |n: i32| if n == 2 { 3.0 * 36.0 } else { 5.0 * 36.0 };
        // Waited-on chunks count toward the next probe, and the probe begins...
        for _ in 0..every {
            let n = t.waited_threads();
            assert_eq!(n, 2);
            t.observe_waited(ms(n), 36);
        }
        assert_eq!(t.threads(), 1, "a probe of one thread began");
        // ...but waited-on chunks keep the best count while it lasts, however many come.
        for _ in 0..5 * every {
            let n = t.waited_threads();
            assert_eq!(n, 2, "a waited-on chunk ran the probe's count");
            t.observe_waited(ms(n), 36);
        }
        // The probe runs on chunks nobody waits for, loses, and the best count is back.
        let switched: Vec<i32> = (0..steps).filter_map(|_| t.observe(ms(t.threads()), 36)).collect();
        assert_eq!(switched, [2]);
        assert_eq!((t.threads(), t.waited_threads()), (2, 2));
    }

    #[test]
    fn losing_probes_come_less_often_and_a_winning_one_resets_the_period() {
        let (every, steps) = Kind::Decode.probing();
        let (mut t, best) = calibrated(Kind::Decode, 8.0, 13.0);
        assert_eq!(best, 2);
        let quiet = |n: i32| if n == 2 { 8.0 } else { 13.0 };
        // Each losing probe doubles the wait before the next: 64, 128, 256 steps.
        for wait in [every, 2 * every, 4 * every] {
            assert!(run(&mut t, wait - 1, quiet).is_empty(), "no probe before {wait} steps");
            assert_eq!(run(&mut t, 1 + steps, quiet), [1, 2], "a probe after {wait} steps");
        }
        // Contention: the next probe (after 512 steps) wins and the period is 64 again.
        let busy = |n: i32| if n == 2 { 40.0 } else { 15.0 };
        assert_eq!(run(&mut t, 8 * every + steps, busy), [1]);
        assert_eq!(run(&mut t, every + steps, busy), [2, 1], "probed again after {every} steps");
    }

    #[test]
    fn threads_that_get_part_of_a_core_with_none_idle_are_capped_to_what_they_get() {
        // Quiet: each thread on its core, or a core idle beside one thread.
        assert_eq!(cap_for(2, 2.0, 1.0, 0.0), 2);
        assert_eq!(cap_for(2, 1.0, 1.0, 1.0), 2);
        // One busy process per core: 2 threads get half a core each, 1 thread two thirds.
        assert_eq!(cap_for(2, 2.0, 0.5, 0.0), 1);
        assert_eq!(cap_for(2, 1.0, 0.67, 0.0), 1);
        // An 8-core box whose camera takes two cores: 4 threads keep their cores.
        assert_eq!(cap_for(4, 4.0, 1.0, 2.0), 4);
        assert_eq!(cap_for(8, 8.0, 0.5, 0.0), 4);
    }

    #[test]
    fn a_capped_tuner_neither_uses_nor_probes_the_wider_count() {
        // A lucky window made 2 threads look faster.
        let (mut t, best) = calibrated(Kind::Decode, 8.0, 13.0);
        assert_eq!(best, 2);
        t.set_cap(1);
        assert_eq!(t.threads(), 1);
        assert!(run(&mut t, 10 * period(), |_| 40.0).is_empty(), "no probe of 2 threads while capped");
        // The cores come back: 2 threads again, tuned as before.
        t.set_cap(2);
        assert_eq!(t.threads(), 2);
        assert_eq!(run(&mut t, period(), |n| if n == 2 { 8.0 } else { 13.0 }), [1, 2]);
        // A probe of 2 threads in progress when the cap drops ends there.
        let (mut t, best) = calibrated(Kind::Decode, 20.0, 13.0);
        assert_eq!(best, 1);
        assert_eq!(run(&mut t, Kind::Decode.probing().0, |_| 13.0), [2]);
        t.set_cap(1);
        assert_eq!(t.threads(), 1);
        assert!(run(&mut t, period(), |_| 13.0).is_empty());
    }

    /// An 8-core box whose camera takes some cores: the tuner that went to one thread under a
    /// burst of contention probes, and then uses, as many threads as the cap (under 8) allows.
    #[test]
    fn a_cap_under_the_configured_count_still_lets_the_wider_candidate_run_that_many() {
        let mut t = ThreadTuner::new(Kind::Decode, 8, true);
        t.seed(0, 30.0);
        t.seed(1, 13.0);
        assert_eq!(t.choose_best(), 1);
        t.set_cap(6);
        assert_eq!(run(&mut t, Kind::Decode.probing().0, |_| 13.0), [6], "the wider candidate probed at the cap");
        // It wins: kept (the next probe, of one thread, goes back to six).
        assert_eq!(run(&mut t, period() + 6, |n| if n == 6 { 4.0 } else { 13.0 }), [1, 6]);
        assert_eq!(t.threads(), 6);
        // The cap drops to one thread: the wider candidate runs one, and nothing is probed.
        t.set_cap(1);
        assert_eq!(t.threads(), 1);
        assert!(run(&mut t, 10 * period(), |_| 13.0).is_empty());
    }

    #[test]
    fn the_meter_reads_this_machine() {
        let mut m = CoreMeter::new(2, true);
        assert!(proc_stat().is_some(), "/proc/stat");
        let start = (Instant::now(), thread_cpu_ms());
        let mut x = 0u64;
        while start.0.elapsed() < METER_WINDOW {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1); // computing: on a core
        }
        std::hint::black_box(x);
        let (wall, cpu) = (start.0.elapsed().as_secs_f64() * 1e3, thread_cpu_ms() - start.1);
        assert!(cpu > 0.0 && cpu <= wall * 1.05, "thread CPU {cpu} ms in {wall} ms");
        m.observe(1, wall, cpu);
        assert!((1..=2).contains(&m.cap()));
        assert_eq!(CoreMeter::new(4, false).observe(4, 1e3, 1.0), None, "a GPU engine is never capped");
    }

    #[test]
    fn one_thread_or_a_gpu_engine_is_never_tuned() {
        for mut t in [ThreadTuner::new(Kind::Decode, 1, true), ThreadTuner::new(Kind::Decode, 4, false)] {
            assert!(run(&mut t, 10 * period(), |_| 5.0).is_empty());
        }
    }
}
