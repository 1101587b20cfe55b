//! The RPC watchdog: after each RPC failure (`llama::rpc`), every engine on RPC servers whose
//! thread stops turning is checked; one whose loop has not turned for
//! [`FAILURE_GRACE`](crate::llama::rpc::FAILURE_GRACE) while one of its servers refuses
//! connections, or for [`STUCK_LIMIT`] whatever its servers say, is stuck on the failure and is
//! declared failed. A busy engine turns at least every step (a step is budgeted to well under a
//! second) and an idle one every 200 ms, so a healthy engine is never taken for a stuck one.
//!
//! A server that stops answering without closing its connection (SIGSTOP, a network partition)
//! raises no failure: TCP only gives up after about 15 minutes, or never while nothing is sent.
//! So the watchdog also looks at every RPC engine once a second: one whose loop has not turned
//! for the stall limit ([`stall_limit`]: `VLM_RPC_STALL_S` seconds, default 30; four times that
//! before its first turn, which follows the calibration run) is stuck on its server and is
//! declared failed, naming it. An answer running there then fails within the limit plus about a
//! second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Engine;
use crate::llama::rpc;

/// How long an engine's loop may stand still after an RPC failure while its servers still accept
/// connections (a server that answered something malformed) before it is declared failed.
const STUCK_LIMIT: Duration = Duration::from_secs(30);
/// The default stall limit (see [`stall_limit`]).
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// The longest stall limit (a larger one, a natural "never", is this).
const MAX_STALL_LIMIT: Duration = Duration::from_secs(365 * 24 * 3600);
/// A stall limit set by [`set_stall_limit`], in ms (0: none set).
static STALL_LIMIT_SET_MS: AtomicU64 = AtomicU64::new(0);

/// How long an RPC engine's loop may stand still, with no RPC failure, before it is taken to be
/// stuck on a server that stopped answering: [`set_stall_limit`]'s, else `VLM_RPC_STALL_S`
/// (seconds), else 30 s.
pub fn stall_limit() -> Duration {
    match STALL_LIMIT_SET_MS.load(Ordering::Relaxed) {
        0 => std::env::var("VLM_RPC_STALL_S").ok().and_then(|s| parse_stall_limit(&s)).unwrap_or(STALL_LIMIT),
        ms => Duration::from_millis(ms).min(MAX_STALL_LIMIT),
    }
}

/// `VLM_RPC_STALL_S`'s seconds: positive, at most [`MAX_STALL_LIMIT`].
fn parse_stall_limit(seconds: &str) -> Option<Duration> {
    let s = seconds.trim().parse::<f64>().ok().filter(|s| *s > 0.0)?;
    Some(Duration::try_from_secs_f64(s).map_or(MAX_STALL_LIMIT, |d| d.min(MAX_STALL_LIMIT)))
}

/// Set the stall limit of the process (tests; an application may set it too).
pub fn set_stall_limit(limit: Duration) {
    STALL_LIMIT_SET_MS.store(limit.as_millis().clamp(1, u64::MAX as u128) as u64, Ordering::Relaxed);
}

static WATCHED: LazyLock<Mutex<Vec<Weak<Engine>>>> = LazyLock::new(|| {
    std::thread::Builder::new()
        .name("vlm-rpc-watch".into())
        .spawn(watch_failures)
        .expect("cannot start the RPC watchdog thread");
    Mutex::new(Vec::new())
});

/// Watch `engine` (on RPC servers) for the rest of its life.
pub(super) fn watch(engine: &Arc<Engine>) {
    let mut watched = WATCHED.lock();
    watched.retain(|e| e.strong_count() > 0);
    watched.push(Arc::downgrade(engine));
}

/// Declare `engine` failed, and every other engine on one of its servers: they share ggml-rpc's
/// one connection to it, now dead, and would wait on it for ever without a failure of their own.
fn fail_sharing(engine: &Arc<Engine>, reason: String) {
    let endpoints = engine.config.device.endpoints();
    let sharing: Vec<Arc<Engine>> = WATCHED
        .lock()
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|e| e.failure().is_none() && e.config.device.endpoints().iter().any(|p| endpoints.contains(p)))
        .collect();
    for e in sharing {
        e.fail(format!("engine {}: {reason}", e.name()));
    }
}

/// Whether `engine`'s thread is running its loop, or its stop (draining its queue, freeing its
/// context on the server): not ended, not failed. (A stop waits for a thread stuck on a stalled
/// server until the stall is declared.)
fn running(engine: &Engine) -> bool {
    engine.failure().is_none() && !engine.shared.exited.load(Ordering::Acquire)
}

/// Declare failed the RPC engines whose loops have stood still for the stall limit; `last` keeps
/// each engine's turn count and since when it has had it.
fn check_stalls(last: &mut Vec<(Weak<Engine>, u64, Instant)>) {
    let engines: Vec<Arc<Engine>> = WATCHED.lock().iter().filter_map(Weak::upgrade).collect();
    last.retain(|(e, _, _)| e.strong_count() > 0);
    let limit = stall_limit();
    for engine in engines {
        let turns = engine.shared.turns.load(Ordering::Relaxed);
        let Some(i) = last.iter().position(|(e, _, _)| std::ptr::eq(e.as_ptr(), Arc::as_ptr(&engine))) else {
            last.push((Arc::downgrade(&engine), turns, Instant::now()));
            continue;
        };
        if last[i].1 != turns || !running(&engine) {
            last[i] = (Arc::downgrade(&engine), turns, Instant::now());
            continue;
        }
        // Before its first turn the engine runs its calibration: several computations.
        let limit = if turns == 0 { limit.saturating_mul(4) } else { limit };
        let still = last[i].2.elapsed();
        if still >= limit {
            let endpoints = engine.config.device.endpoints().join(" + ");
            fail_sharing(
                &engine,
                format!(
                    "the RPC server at {endpoints} has not answered for {:.0} s (stopped, or the network is partitioned \
                     without closing the connection; VLM_RPC_STALL_S sets the limit)",
                    still.as_secs_f64()
                ),
            );
        }
    }
}

fn watch_failures() {
    let mut seen = rpc::failures();
    let mut stalls = Vec::new();
    loop {
        let Some((count, _)) = rpc::wait_failure(seen, Duration::from_secs(1)) else {
            check_stalls(&mut stalls);
            continue;
        };
        seen = count;
        let started = Instant::now();
        let mut suspects: Vec<(Arc<Engine>, u64)> = WATCHED
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|e| e.failure().is_none())
            .map(|e| {
                let turns = e.shared.turns.load(std::sync::atomic::Ordering::Relaxed);
                (e, turns)
            })
            .collect();
        while !suspects.is_empty() {
            std::thread::sleep(rpc::FAILURE_GRACE / 4);
            suspects.retain(|(engine, turns)| {
                if engine.shared.turns.load(std::sync::atomic::Ordering::Relaxed) != *turns {
                    return false; // it goes on: not stuck on this failure
                }
                if started.elapsed() < rpc::FAILURE_GRACE {
                    return true;
                }
                let endpoints = engine.config.device.endpoints();
                let refused = endpoints.iter().any(|e| rpc::reachable(e).is_err());
                if refused || started.elapsed() >= STUCK_LIMIT {
                    fail_sharing(engine, rpc::failure_reason(endpoints));
                    return false;
                }
                true
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A huge limit (a natural "never") is the longest one: it panicked the watchdog's thread
    /// (a Duration out of range, or four times it before the first turn).
    #[test]
    fn a_huge_stall_limit_saturates() {
        assert_eq!(parse_stall_limit("5"), Some(Duration::from_secs(5)));
        assert_eq!(parse_stall_limit(" 0.5 "), Some(Duration::from_millis(500)));
        for never in ["1e19", "1e20", "inf"] {
            assert_eq!(parse_stall_limit(never), Some(MAX_STALL_LIMIT), "{never}");
        }
        for bad in ["0", "-3", "nan", "soon"] {
            assert_eq!(parse_stall_limit(bad), None, "{bad}");
        }
    }
}
