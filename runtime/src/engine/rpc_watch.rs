//! The RPC watchdog: after each RPC failure (`llama::rpc`), every engine on RPC servers whose
//! thread stops turning is checked; one whose loop has not turned for
//! [`FAILURE_GRACE`](crate::llama::rpc::FAILURE_GRACE) while one of its servers refuses
//! connections, or for [`STUCK_LIMIT`] whatever its servers say, is stuck on the failure and is
//! declared failed. A busy engine turns at least every step (a step is budgeted to well under a
//! second) and an idle one every 200 ms, so a healthy engine is never taken for a stuck one.

use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Engine;
use crate::llama::rpc;

/// How long an engine's loop may stand still after an RPC failure while its servers still accept
/// connections (a server that answered something malformed) before it is declared failed.
const STUCK_LIMIT: Duration = Duration::from_secs(30);

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
fn fail_sharing(engine: &Arc<Engine>) {
    let endpoints = engine.config.device.endpoints();
    let reason = rpc::failure_reason(endpoints);
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

fn watch_failures() {
    let mut seen = rpc::failures();
    loop {
        let Some((count, _)) = rpc::wait_failure(seen, Duration::from_secs(3600)) else { continue };
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
                    fail_sharing(engine);
                    return false;
                }
                true
            });
        }
    }
}
