//! Where streams live: the engine a stream is resident on (its history's sequence is there and its
//! frames are ingested there), chosen from measured prefill rates when the stream opens and again
//! when its engine fails for good. The placer re-exports the choice ([`crate::placer`]); it lives
//! here, below both the streams and the placer, so that the stream registry can choose a new home
//! without depending on the placer, which reads the streams.

use std::sync::Arc;

use crate::engine::Engine;
use crate::llama::{Device, Gpu};

/// The engine a new stream should live on (have its frames ingested on): the one where its
/// ingestion would cost least with the streams already resident there, by measured prefill rate
/// x (resident streams + 1), among engines with a free stream sequence (with none free, the
/// first engine that has not failed, whose refusal then names the limit; `None` only for no
/// engines). Dealing streams out in
/// turn would leave half of them on an engine several times slower than another (the RK3588's
/// CPU beside its GPU, a GPU host's cores beside the GPU); engines of equal speed still share the
/// streams evenly, and engines of one GPU are of equal speed ([`gpu_rates`]).
pub fn resident_engine(engines: &[Arc<Engine>]) -> Option<&Arc<Engine>> {
    let gpus: Vec<Option<&Gpu>> = engines
        .iter()
        .map(|e| match &e.config().device {
            Device::Gpu(gpu) => Some(gpu),
            _ => None,
        })
        .collect();
    let rates = gpu_rates(&gpus, &engines.iter().map(|e| e.rates().prefill_ms_per_token).collect::<Vec<_>>());
    let loads: Vec<(f64, usize, usize)> = engines
        .iter()
        .zip(rates)
        .map(|(e, rate)| {
            let (open, free) = e.stream_slots();
            // A failed engine has no room.
            (rate, open, if e.failure().is_some() { 0 } else { free })
        })
        .collect();
    least_loaded(&loads)
        .map(|i| &engines[i])
        .or_else(|| engines.iter().find(|e| e.failure().is_none()))
        .or(engines.first())
}

/// The prefill rates streams are dealt out by: engines of one GPU (the same GPU and layers)
/// share its compute, so each is given their mean; their own measurements differ only by when
/// each was taken (engines calibrating together slow each other's first prefills). Dealt out
/// by their own rates, 32 streams left one of two engines of an H100 ingesting 1.8x the other's
/// rows over 7.5 minutes, idle 0.5% of the time against the other's 29% while frames were
/// skipped. CPU engines keep their own (their cores may differ: the RK3588's big and little ones).
fn gpu_rates(gpus: &[Option<&Gpu>], rates: &[f64]) -> Vec<f64> {
    gpus.iter()
        .zip(rates)
        .map(|(gpu, &rate)| {
            let Some(gpu) = gpu else { return rate };
            let same: Vec<f64> =
                gpus.iter().zip(rates).filter(|(g, _)| g.as_ref() == Some(gpu)).map(|(_, &r)| r).collect();
            same.iter().sum::<f64>() / same.len() as f64
        })
        .collect()
}

/// Index of the cheapest `(prefill ms per token, streams open, free slots)` with a free slot;
/// the first of equals.
fn least_loaded(loads: &[(f64, usize, usize)]) -> Option<usize> {
    let cost = |&(rate, open, _): &(f64, usize, usize)| rate * (open + 1) as f64;
    loads
        .iter()
        .enumerate()
        .filter(|(_, l)| l.2 > 0)
        .min_by(|(_, a), (_, b)| cost(a).total_cmp(&cost(b)))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::{Gpu, gpu_rates, least_loaded};

    #[test]
    fn streams_live_where_their_ingestion_costs_least() {
        // Equal engines share the streams in turn.
        assert_eq!(least_loaded(&[(5.0, 0, 2), (5.0, 0, 2)]), Some(0));
        assert_eq!(least_loaded(&[(5.0, 1, 1), (5.0, 0, 2)]), Some(1));
        // An engine 10x faster takes the first 9 streams; the 10th would cost as much there as
        // alone on the slow one (equals: the first).
        assert_eq!(least_loaded(&[(5.0, 0, 4), (0.5, 1, 3)]), Some(1));
        assert_eq!(least_loaded(&[(5.0, 0, 4), (0.5, 8, 3)]), Some(1));
        assert_eq!(least_loaded(&[(5.0, 0, 4), (0.5, 9, 3)]), Some(0));
        // A full engine takes none; no free engine, no choice.
        assert_eq!(least_loaded(&[(5.0, 0, 2), (0.5, 2, 0)]), Some(0));
        assert_eq!(least_loaded(&[(5.0, 2, 0)]), None);
    }

    /// Two engines of one GPU are dealt streams by one rate (the mean of theirs); another GPU
    /// and the CPU keep their own.
    #[test]
    fn engines_of_one_gpu_share_one_rate() {
        let (a, b) = (Gpu::default(), Gpu { index: 1, layers: None });
        let gpus = [Some(&a), Some(&a), Some(&b), None];
        assert_eq!(gpu_rates(&gpus, &[0.06, 0.04, 0.03, 5.0]), [0.05, 0.05, 0.03, 5.0]);
        // With those, two engines of one GPU share the streams in turn, whatever their seeds.
        let rates = gpu_rates(&gpus[..2], &[0.06, 0.04]);
        let (mut open, mut picks) = ([0, 0], vec![]);
        for _ in 0..4 {
            let i = least_loaded(&[(rates[0], open[0], 9), (rates[1], open[1], 9)]).unwrap();
            open[i] += 1;
            picks.push(i);
        }
        assert_eq!(picks, [0, 1, 0, 1]);
    }
}
