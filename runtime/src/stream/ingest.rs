//! Ingestion of a stream's versions on its resident engine: a planned version handed to the
//! engine as a prefill (its last entry appended, or its whole history rebuilt from position 0 or
//! shifted in place when it starts an epoch), a prefix-cache hit imported instead, the version
//! published when the prefill ends; and a stream moved to another engine when its own fails.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use super::{Entry, Home, Record, STREAMS, Stream, Timeline};
use crate::engine::{Begun, Engine, Ingestion, Worker};
use crate::error::{Error, Result};
use crate::prefill::Prefill;
use crate::snapshot::Snapshot;

/// How ingestion rebuilds the stream's sequence for a planned version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rebuild {
    /// Append the version's last entry.
    Append,
    /// A new epoch, prefilled from position 0.
    Whole,
    /// A new epoch: positions `from..to` dropped and the later ones moved down, then the last
    /// entry appended.
    Shift { from: i32, to: i32 },
    /// A new epoch: positions `from..to` dropped, the later ones left where they are (a gap of
    /// positions, which M-RoPE models take), then the last entry appended.
    Drop { from: i32, to: i32 },
}

/// Move every stream resident on `engine`, which failed for good, to the cheapest other engine
/// of its peers with a free stream sequence: its registered versions are ingested there again
/// from their retained entries (a new epoch; what waits on them gets them from there). A stream
/// with nowhere to go fails with `error` (the other streams go on).
pub(super) fn move_resident(engine: &Arc<Engine>, error: &Error) {
    let streams: Vec<Arc<Stream>> = STREAMS.lock().values().filter_map(Weak::upgrade).collect();
    for stream in streams.iter().filter(|s| Arc::ptr_eq(&s.engine(), engine)) {
        // A closed stream gave its sequence back: nothing of it is resident to move, but what
        // still waits on a frame it registered (never to be ingested now) hears why.
        if stream.gave_back() {
            stream.publish(Err(error.clone()));
            continue;
        }
        if let Err(e) = stream.move_home(engine) {
            let why = format!("{error}; stream {} could not move to another engine: {e}", stream.name());
            crate::llama::log(crate::llama::LogLevel::Error, &why);
            stream.publish(Err(Error::Engine(why)));
        }
    }
}

impl Stream {
    /// The inputs that rebuild `history` after the prompt from position 0.
    pub(crate) fn replay_entries(&self, history: &[Entry]) -> Vec<Entry> {
        std::iter::once(Entry::Text(Arc::clone(&self.prompt.prefix))).chain(history.iter().cloned()).collect()
    }

    /// The position after `history` rebuilt after the prompt from position 0 (a version's own
    /// end is later where a slide left a gap).
    pub(crate) fn replay_end(&self, history: &[Entry]) -> i32 {
        self.prompt.prefix.len() as i32 + history.iter().map(Entry::n_pos).sum::<i32>()
    }

    /// Make `record` usable on the engine (prefill its last entry, or its whole history when it
    /// starts an epoch), chunk by chunk between decode steps, then publish it. Without
    /// retention there is nothing to prefill.
    pub(super) fn ingest(self: &Arc<Self>, t: &mut Timeline, record: Record, rebuild: Rebuild) -> Result<()> {
        if !self.config.retain {
            Self::record_publication(t, Ok(record));
            self.changed.notify_all();
            return Ok(());
        }
        let (engine, seq) = self.home();
        let cache = self.config.prefix_cache.clone().filter(|c| c.enabled() && !record.shifted);
        let tag = engine.compat_tag();
        let (start, entries) = if rebuild == Rebuild::Whole {
            (0, self.replay_entries(&record.history))
        } else {
            let entry = record.history.last().expect("an appended version has an entry").clone();
            (record.end - entry.n_pos(), vec![entry])
        };
        let prefill = Prefill::new(seq, start, entries, false, engine.frame_rows());
        let cost_ms = prefill.remaining() as f64 * engine.rates().prefill_ms_per_token;
        let cache_key = (record.key, tag.clone());
        let (s, key, lookup) = (Arc::clone(self), cache_key.clone(), cache.clone());
        let (epoch, history) = (record.epoch, Arc::clone(&record.history));
        // A prefix-cache hit imports the history instead of prefilling; a miss stores it after.
        let missed = Arc::new(AtomicBool::new(false));
        let missed_too = Arc::clone(&missed);
        // In a unified pool a reader's branch may hold the stream's cells, and a shift would move
        // its positions too: the shift waits up to `slide_wait` for the readers to end, then
        // the kept history is prefilled instead.
        let slide_wait = self.config.slide_wait;
        let mut waiting_since: Option<Instant> = None;
        // An engine declared failed (stalled) may still run its queue: what it ingests for a
        // stream that has moved since touches neither the stream's epoch nor its versions.
        let at_home = {
            let engine = Arc::as_ptr(&engine) as usize;
            move |s: &Stream| Arc::as_ptr(&s.home.lock().engine) as usize == engine
        };
        let begin = move |w: &mut Worker, prefill: &mut Prefill| -> Begun {
            if !at_home(&s) {
                return Begun::Ended(Err(Error::Cancelled));
            }
            let shared = matches!(rebuild, Rebuild::Shift { .. }) && w.ctx.shares_cells(seq);
            if shared && waiting_since.get_or_insert_with(Instant::now).elapsed() < slide_wait {
                return Begun::NotYet;
            }
            s.resident_epoch.store(epoch, Ordering::Release);
            match rebuild {
                Rebuild::Whole => w.ctx.seq_clear(seq),
                Rebuild::Shift { .. } if shared => {
                    w.ctx.seq_clear(seq);
                    *prefill = Prefill::new(seq, 0, s.replay_entries(&history), false, w.frame_rows());
                    s.slides_prefilled.fetch_add(1, Ordering::Relaxed);
                    let why = format!("answers read its cells in the unified pool for {slide_wait:?}");
                    crate::llama::log(
                        crate::llama::LogLevel::Info,
                        &format!("stream {} slides by prefilling its kept frames: {why}", s.name()),
                    );
                }
                Rebuild::Shift { from, to } => w.ctx.seq_shift_out(seq, from, to),
                Rebuild::Drop { from, to } => w.ctx.seq_drop(seq, from, to),
                Rebuild::Append => (),
            }
            // (No restore while a per-sequence copy from this sequence waits for the next
            // decode: the copy would carry the restored cells along; nor in a unified pool whose
            // answers still read the cells it replaces: the whole history would take new cells
            // at once, past the room the answers keep, where a prefill waits for it.)
            let held = w.ctx.copy_pending(seq) || (w.ctx.is_unified() && w.ctx.shares_cells(seq));
            let Some(cache) = lookup.as_ref().filter(|_| !held) else { return Begun::Prefill };
            let Some(snapshot) = cache.get(&key) else {
                missed_too.store(true, Ordering::Release);
                return Begun::Prefill;
            };
            // (A restore takes the whole history's cells at once: in a unified pool whose answers
            // may still take cells, only where it fits beside them; a prefill waits for room.)
            if w.entry_room.is_some_and(|room| room < snapshot.end.max(0) as usize) {
                return Begun::Prefill;
            }
            Begun::Ended(w.ctx.seq_restore(seq, &snapshot.bytes).map(|()| snapshot.end))
        };
        let s = Arc::clone(self);
        let done = move |w: Option<&mut Worker>, end: Result<i32>| {
            if !at_home(&s) {
                return;
            }
            // (The export is sized first: one the cache refuses is never copied.)
            if let (Ok(end), Some(cache), Some(w)) = (&end, &cache, w)
                && missed.load(Ordering::Acquire)
                && cache.admits(w.ctx.seq_snapshot_size(seq))
                && let Ok(bytes) = w.ctx.seq_snapshot(seq)
            {
                // A failed export only means nothing is cached.
                cache.insert(cache_key, Arc::new(Snapshot { key: record.key, tag, bytes, end: *end }));
            }
            s.publish(end.and_then(|end| {
                if end == record.end {
                    Ok(record)
                } else {
                    Err(Error::Engine(format!("prefill ended at position {end}, planned {}", record.end)))
                }
            }));
        };
        let queued = engine.ingest(Ingestion {
            prefill,
            begin: Some(Box::new(begin)),
            done: Some(Box::new(done)),
            cancel: Arc::clone(&self.closing),
            demand: Arc::clone(&self.demand),
            cost_ms,
            waiting: false,
        });
        // Refused by an engine that has just failed (its failure handler, which moves the
        // streams resident there, may not have come to this one yet): move now, with the planned
        // versions (this one among them); the handler then finds it moved.
        let queued = match queued {
            Err(_) if engine.failure().is_some() => self.move_home_locked(t, &engine),
            queued => queued,
        };
        // Refused (the engine stopped, or failed with nowhere to go): the version will never be
        // published, and readers waiting for it learn why.
        if let Err(e) = &queued {
            Self::record_publication(t, Err(e.clone()));
            self.changed.notify_all();
        }
        queued
    }

    /// Live on another engine from now on: `failed` (the resident engine) failed for good, so the
    /// versions registered but not published there are ingested again on the cheapest other
    /// peer with a free stream sequence, under new epochs (the first rebuilt whole from its
    /// retained entries, the next ones appended as before); with none pending, the newest
    /// version is rebuilt there (one more record of the same frame), so the stream is resident
    /// again. Published versions of the old epochs stay readable by replay.
    fn move_home(self: &Arc<Self>, failed: &Arc<Engine>) -> Result<()> {
        self.move_home_locked(&mut self.timeline.lock(), failed)
    }

    /// [`Stream::move_home`] under the timeline lock.
    fn move_home_locked(self: &Arc<Self>, t: &mut Timeline, failed: &Arc<Engine>) -> Result<()> {
        // (Moved already: by its own refused entry, before the failure handler came to it; or
        // closed meanwhile: a sequence taken now would not be given back.)
        if t.closed || !Arc::ptr_eq(&self.home.lock().engine, failed) {
            return Ok(());
        }
        let others: Vec<Arc<Engine>> =
            self.config.peers.iter().filter(|e| !Arc::ptr_eq(e, failed) && e.failure().is_none()).cloned().collect();
        let engine = crate::residence::resident_engine(&others)
            .ok_or_else(|| Error::Config("no other engine is configured for it".into()))?;
        // A stream that has already failed stays where it is: checked before a sequence is taken
        // on the new engine, which would otherwise be lost to it (nothing gives it back).
        if let Some(e) = &t.failed {
            return Err(e.clone());
        }
        let seq = engine.take_stream_seq()?;
        *self.home.lock() = Home { engine: Arc::clone(engine), seq };
        // No version is resident on the new engine until its first rebuild begins there (which
        // sets its epoch): readers of the versions published on the failed one replay them,
        // instead of branching from a sequence that does not hold them yet.
        self.resident_epoch.store(u32::MAX, Ordering::Release);
        let mut planned: Vec<Record> = t.planned.drain(..).collect();
        if planned.is_empty() {
            planned.push(Record { serial: t.tail.serial + 1, ..t.tail.clone() });
        }
        // New epochs after every epoch used so far, one for each old epoch among the planned.
        let mut epoch = t.tail.epoch;
        let mut previous: Option<u32> = None;
        for mut record in planned {
            let rebuild = if previous == Some(record.epoch) && !record.shifted {
                Rebuild::Append
            } else {
                epoch += 1;
                Rebuild::Whole
            };
            previous = Some(record.epoch);
            if rebuild == Rebuild::Whole {
                record.end = self.replay_end(&record.history);
            }
            record.epoch = epoch;
            record.shifted = false;
            t.tail = record.clone();
            t.planned.push_back(record.clone());
            self.ingest(t, record, rebuild)?;
        }
        crate::llama::log(
            crate::llama::LogLevel::Warn,
            &format!("stream {} moved from engine {} to {}", self.name(), failed.name(), engine.name()),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use crate::engine::Engine;
    use crate::error::Error;
    use crate::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
    use crate::{EngineConfig, Stream, StreamConfig};

    fn model_path() -> PathBuf {
        std::env::var_os("VLM_MODEL").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        })
    }

    /// A stream that failed is not moved when its engine fails, and the stream sequence of the
    /// engine it would have moved to stays free (it was taken, then lost with the error).
    #[test]
    fn a_failed_stream_takes_no_sequence_on_the_engine_it_cannot_move_to() {
        let config = |name: &str| EngineConfig {
            name: name.into(),
            context_per_sequence: 256,
            max_streams: 1,
            max_branches: 1,
            ..EngineConfig::default()
        };
        let a = Engine::start(&model_path(), config("a")).expect("engine a");
        let b = Engine::start(&model_path(), config("b")).expect("engine b");
        let prompt = Arc::new(Prompt::new(a.model(), DEFAULT_SYSTEM_PROMPT).expect("prompt"));
        let stream_config = StreamConfig { peers: vec![Arc::clone(&a), Arc::clone(&b)], ..StreamConfig::new("s") };
        let s = Stream::open(&a, prompt, stream_config).expect("stream");
        s.timeline.lock().failed = Some(Error::Engine("an earlier failure".into()));
        assert_eq!(b.stream_slots(), (0, 1));
        let moved = s.move_home(&a);
        assert!(moved.is_err_and(|e| e.to_string().contains("an earlier failure")));
        assert_eq!(b.stream_slots(), (0, 1), "engine b's stream sequence was taken by a stream that stayed on a");
        assert!(Arc::ptr_eq(&s.home().0, &a));
        drop(s);
        a.stop();
        b.stop();
    }

    /// An engine that takes no more jobs refuses a stream's next entry: the append fails with
    /// the reason and readers waiting for a version learn it, instead of the refused job's
    /// completion waiting for the lock its caller holds (a hang for good).
    #[test]
    fn an_entry_refused_by_a_stopped_engine_fails_the_stream_instead_of_hanging() {
        let config =
            EngineConfig { context_per_sequence: 256, max_streams: 1, max_branches: 1, ..EngineConfig::default() };
        let a = Engine::start(&model_path(), config).expect("engine");
        let prompt = Arc::new(Prompt::new(a.model(), DEFAULT_SYSTEM_PROMPT).expect("prompt"));
        let s = Stream::open(&a, prompt, StreamConfig::new("s")).expect("stream");
        let never = std::sync::atomic::AtomicBool::new(false);
        s.wait_version(0, &never).expect("the prompt's version is published");
        a.stop();
        let (tx, rx) = std::sync::mpsc::channel();
        let s2 = Arc::clone(&s);
        std::thread::spawn(move || {
            let never = std::sync::atomic::AtomicBool::new(false);
            let committed = s2.commit("Anything?", &[], &never).map(|_| ());
            let _ = tx.send((committed, s2.wait_version(0, &never).map(|_| ())));
        });
        let (committed, read) = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the append hung");
        assert!(committed.is_err_and(|e| e.to_string().contains("stopped")));
        assert!(read.is_err_and(|e| e.to_string().contains("stopped")), "a reader did not learn of the failure");
    }
}
