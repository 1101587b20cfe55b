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
//! count and keeps whichever costs less per token. Decode steps and prefill chunks are tuned
//! apart, each computation run with its own kind's count: contention hurts the wide prefill
//! chunks most, and their cost per token is not a decode step's.

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
        }
    }

    pub(crate) fn threads(&self) -> i32 {
        self.candidates[self.current]
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
        if self.candidates.len() < 2 || tokens == 0 {
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
        self.probe = Some(Probe { index: other, back_to: self.current, steps: 0, ms: 0.0, tokens: 0 });
        self.current = other;
        Some(self.threads())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `steps` decode steps of one token at `ms` each; the thread counts switched to.
    fn run(t: &mut ThreadTuner, steps: u32, ms: impl Fn(i32) -> f64) -> Vec<i32> {
        (0..steps).filter_map(|_| t.observe(ms(t.threads()), 1)).collect()
    }

    /// A decode probe's period: steps between two probes plus the probe's own.
    fn period() -> u32 {
        let (every, steps) = Kind::Decode.probing();
        every + steps
    }

    #[test]
    fn calibration_starts_with_the_faster_count() {
        let mut t = ThreadTuner::new(Kind::Decode, 2, true);
        assert_eq!(t.candidates(), [2, 1]);
        t.seed(0, 40.0); // 2 threads while other processes hold the cores
        t.seed(1, 15.0);
        assert_eq!(t.choose_best(), 1);
        let mut quiet = ThreadTuner::new(Kind::Decode, 2, true);
        quiet.seed(0, 8.0);
        quiet.seed(1, 13.0);
        assert_eq!(quiet.choose_best(), 2);
    }

    #[test]
    fn a_probe_switches_when_the_other_count_became_cheaper_and_returns_when_not() {
        let mut t = ThreadTuner::new(Kind::Decode, 2, true);
        t.seed(0, 8.0);
        t.seed(1, 13.0);
        assert_eq!(t.choose_best(), 2);
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
    fn losing_probes_come_less_often_and_a_winning_one_resets_the_period() {
        let (every, steps) = Kind::Decode.probing();
        let mut t = ThreadTuner::new(Kind::Decode, 2, true);
        t.seed(0, 8.0);
        t.seed(1, 13.0);
        assert_eq!(t.choose_best(), 2);
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
    fn one_thread_or_a_gpu_engine_is_never_tuned() {
        for mut t in [ThreadTuner::new(Kind::Decode, 1, true), ThreadTuner::new(Kind::Decode, 4, false)] {
            assert!(run(&mut t, 10 * period(), |_| 5.0).is_empty());
        }
    }
}
