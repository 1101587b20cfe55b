//! Where streams live: the engine a stream is resident on (its history's sequence is there and its
//! frames are ingested there), chosen from measured prefill rates when the stream opens and again
//! when its engine fails for good. The placer re-exports the choice ([`crate::placer`]); it lives
//! here, below both the streams and the placer, so that the stream registry can choose a new home
//! without depending on the placer, which reads the streams.

use std::sync::Arc;

use crate::engine::Engine;

/// The engine a new stream should live on (have its frames ingested on): the one where its
/// ingestion would cost least with the streams already resident there, by measured prefill rate
/// x (resident streams + 1), among engines with a free stream sequence (with none free, the
/// first engine, whose refusal then names the limit; `None` only for no engines). Dealing streams out in
/// turn would leave half of them on an engine several times slower than another (the RK3588's
/// CPU beside its GPU, a GPU host's cores beside the GPU); engines of equal speed still share the
/// streams evenly.
pub fn resident_engine(engines: &[Arc<Engine>]) -> Option<&Arc<Engine>> {
    let loads: Vec<(f64, usize, usize)> = engines
        .iter()
        .map(|e| {
            let (open, free) = e.stream_slots();
            // A failed engine has no room.
            (e.rates().prefill_ms_per_token, open, if e.failure().is_some() { 0 } else { free })
        })
        .collect();
    least_loaded(&loads).map(|i| &engines[i]).or(engines.first())
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
    use super::least_loaded;

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
}
