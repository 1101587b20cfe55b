//! The calibration run that seeds an engine's stage rates, thread count and KV cell size.

use std::time::Instant;

use super::{Stage, Worker};
use crate::llama::{Batch, Token};

/// Seed the stage rates with a short run on a scratch branch: 32 tokens of prefill (twice with
/// each thread count), 6 decode steps, one export and import. `cancelled` is asked before each computation: a stop,
/// an error elsewhere in the pipeline or the process's exit never waits for more than the one
/// running (seconds under heavy CPU contention, where the whole run took a minute).
pub(super) fn calibrate(w: &mut Worker, merge_frames: bool, cancelled: &dyn Fn() -> bool) {
    let Some(seq) = w.free_branches.last().copied() else { return };
    // First the thread count (`crate::threads`): the fastest of 4 decode steps with each
    // candidate, one thread first, so the rest (and the first prefill, which took seconds with
    // spinning threads under contention) runs with the faster. A candidate whose fastest of
    // two steps is three times slower than the best so far stops there: under contention a
    // step with spinning threads can take a second. One thread's steps run for at least
    // `METER_MS`, and the core meter's reading of them decides whether wider counts are timed
    // at all: with the cores taken by others, a lucky fast step would pick them.
    let candidates = w.tuner.candidates().to_vec();
    if candidates.len() > 1 {
        let mut best = f64::INFINITY;
        for (i, &threads) in candidates.iter().enumerate().rev() {
            // (A wider count runs as many threads as the cores deliver: not timed where that
            // is the one thread already timed.)
            let threads = threads.min(w.meter.cap());
            if threads == 1 && candidates[i] > 1 {
                continue;
            }
            w.ctx.seq_clear(seq);
            if cancelled() {
                return;
            }
            let at_least = if threads == 1 { METER_MS } else { 0.0 };
            let stop = |steps: usize, ms: f64| cancelled() || (steps >= 2 && ms > 3.0 * best);
            let fastest = fastest_step(w, threads, seq, 0..64, at_least, &stop);
            w.tuner.seed(i, fastest);
            best = best.min(fastest);
            if threads == 1
                && let Some(cap) = w.meter.read()
            {
                w.set_thread_cap(cap);
            }
        }
        w.tuner.choose_best();
    }
    // Prefill the same way (its own thread count: `crate::threads`), the faster of two prefills
    // of 32 tokens with each candidate (a GPU backend builds its pipelines on the first one);
    // the rate is seeded from the count chosen.
    let tokens: Vec<Token> = (0..32).map(|i| 100 + i).collect();
    let mut by_candidate = vec![f64::INFINITY; candidates.len()];
    for (i, &threads) in candidates.iter().enumerate().rev() {
        let threads = threads.min(w.meter.cap());
        if threads == 1 && candidates[i] > 1 {
            continue;
        }
        w.use_threads(threads);
        let best = by_candidate.iter().copied().fold(f64::INFINITY, f64::min);
        for _ in 0..2 {
            if cancelled() {
                return;
            }
            w.ctx.seq_clear(seq);
            let t = Instant::now();
            if w.ctx.decode_tokens(&tokens, 0, seq, true).is_err() {
                return;
            }
            by_candidate[i] = by_candidate[i].min(t.elapsed().as_secs_f64() * 1e3);
            if by_candidate[i] > 3.0 * best {
                break; // spinning threads under contention: one such prefill is enough
            }
        }
        w.prefill_tuner.seed(i, by_candidate[i] / tokens.len() as f64);
    }
    let chosen = w.prefill_tuner.choose_best();
    let index = candidates.iter().position(|&c| c == chosen).unwrap_or(0);
    w.seed(Stage::Prefill, tokens.len(), by_candidate[index]);
    w.use_threads(w.tuner.threads());
    // The fastest of 6 steps: the first builds its graph, and engines starting together slow
    // each other's first steps; a slow seed would make an idle engine look busy to the placer.
    let fastest = fastest_step(w, w.tuner.threads(), seq, 32..38, 0.0, &|_, _| cancelled());
    if fastest.is_finite() {
        w.seed(Stage::DecodeStep, 1, fastest);
    }
    let t = Instant::now();
    if let Some(snapshot) = (!cancelled()).then(|| w.ctx.seq_snapshot(seq).ok()).flatten() {
        w.seed(Stage::Export, 38, t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        if w.ctx.seq_restore(seq, &snapshot).is_ok() {
            w.seed(Stage::Import, 38, t.elapsed().as_secs_f64() * 1e3);
        }
    }
    // A cell's bytes: the difference between the cells held now and 16 fewer (the serialised
    // state also has a header per sequence stream and per layer).
    let (held, full) = (w.ctx.seq_pos_max(seq) + 1, w.ctx.kv_bytes_in_use());
    if held > 16 {
        w.ctx.seq_truncate(seq, held - 16);
        w.cell_bytes = full.saturating_sub(w.ctx.kv_bytes_in_use()) / 16;
    }
    w.ctx.seq_clear(seq);
    if merge_frames && !cancelled() {
        let model = std::sync::Arc::clone(w.ctx.model());
        w.merge_frames = model.rows_agree(|| rows_agree(w, seq));
    }
    // No cell is in use (no stream has opened yet): give back the pages the run wrote, so that
    // the KV costs what its cells use (`llama::kv_pages`).
    w.ctx.release_all_pages();
}

/// How long one thread's calibration steps run at least (ms): long enough for a reading of
/// the machine's idle cores (`/proc/stat` counts in 10 ms ticks).
const METER_MS: f64 = 150.0;

/// The fastest (ms) of one-token decode steps of `seq` on `threads` threads (infinite when none
/// ran): 4 steps, or more at the next of `positions` until they took `at_least_ms`; `stop` is
/// asked before each step with the steps run and their fastest so far.
fn fastest_step(
    w: &mut Worker,
    threads: i32,
    seq: i32,
    positions: std::ops::Range<i32>,
    at_least_ms: f64,
    stop: &dyn Fn(usize, f64) -> bool,
) -> f64 {
    let (mut fastest, mut spent) = (f64::INFINITY, 0.0);
    for (steps, pos) in positions.enumerate() {
        if stop(steps, fastest) || (steps >= 4 && spent >= at_least_ms) {
            break;
        }
        let (decoded, ms) = w.compute(threads, |ctx| ctx.decode_tokens(&[100], pos, seq, true));
        if decoded.is_err() {
            break;
        }
        (fastest, spent) = (fastest.min(ms), spent + ms);
    }
    fastest
}

/// Whether the model decodes tokens given as their input embedding rows as it decodes the
/// tokens here: the logits after 8 tokens both ways, equal to within 1e-3 of their scale (a
/// model whose graph scales or normalises the token path alone, as Gemma does, differs by far
/// more; an M-RoPE model refuses plain rows).
fn rows_agree(w: &mut Worker, seq: i32) -> bool {
    let n_vocab = w.ctx.model().n_vocab() as Token;
    let tokens: Vec<Token> = (0..8).map(|i| (100 + i) % n_vocab).collect();
    let width = w.ctx.model().n_embd();
    let mut rows = Vec::new();
    if w.ctx.model().token_rows(&tokens, &mut rows).is_err() {
        return false;
    }
    let mut batch = Batch::embeddings(tokens.len(), width);
    for (i, row) in rows.chunks_exact(width).enumerate() {
        batch.push_row(row, i as i32, seq, i + 1 == tokens.len());
    }
    w.ctx.seq_clear(seq);
    let by_tokens = w.ctx.decode_tokens(&tokens, 0, seq, true).and_then(|()| w.ctx.last_logits().map(<[f32]>::to_vec));
    w.ctx.seq_clear(seq);
    let agree = by_tokens.is_ok_and(|a| {
        let by_rows = w.ctx.decode(&batch).and_then(|()| w.ctx.last_logits());
        let scale = a.iter().fold(1f32, |m, x| m.max(x.abs()));
        by_rows.is_ok_and(|b| b.len() == a.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-3 * scale))
    });
    w.ctx.seq_clear(seq);
    agree
}
