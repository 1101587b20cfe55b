//! A stream's append-only, versioned language history (the stream timeline).
//!
//! Version `n` is the history that ends with the stream's `n`-th frame (version 0 is the prompt
//! prefix alone). A frame is *registered* the moment it arrives, before any asynchronous work:
//! registration plans its version (prefix key, positions, history) at once. The version is
//! *published* only when the engine has prefilled the frame into the stream's sequence.
//!
//! Versions are immutable. Within an *epoch* the stream's sequence only grows, so version `n` is
//! its positions `0..end(n)` and a reader branches from it (`seq_cp`) whatever is ingested later.
//! When the history would overflow the sequence, an explicit [`HistoryPolicy`] applies: `Stop`
//! refuses further frames; `Restart` starts a new epoch from the prompt and the last few frames,
//! replayed from their retained embeddings. A reader of an older epoch then replays its version's
//! own frames (every version keeps handles to them), so history never changes under it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::engine::{Engine, Stage, Worker};
use crate::error::{Error, Result};
use crate::llama::Segment;
use crate::prefix::PrefixKey;
use crate::prompt::Prompt;
use crate::snapshot::{PrefixCache, Snapshot};

/// One encoded frame's inputs to the language model, retained for replay and the baseline.
#[derive(Debug)]
pub struct Frame {
    pub segments: Vec<Segment>,
    /// Identity of the picture (hash of its pixels, the encoder and its preprocessing).
    pub content_hash: u64,
}

impl Frame {
    /// Positions the frame occupies in the language sequence.
    pub fn n_pos(&self) -> i32 {
        self.segments
            .iter()
            .map(|s| match s {
                Segment::Text(t) => t.len() as i32,
                Segment::Image(i) => i.n_pos,
            })
            .sum()
    }
}

/// What happens when the next frame would overflow the stream's sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryPolicy {
    /// Refuse further frames ([`Error::HistoryFull`]); the caller counts them.
    Stop,
    /// Start a new epoch from the prompt and the newest `keep` frames (fewer if they do not
    /// fit), replayed from their retained embeddings.
    Restart { keep: usize },
}

/// Settings of one stream.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub name: String,
    /// Keep the history's KV (true) or re-prefill it for every question (the baseline).
    pub retain: bool,
    /// Registered but unpublished frames allowed before `register` blocks (backpressure).
    pub max_pending: usize,
    /// Cells kept free at the end of the sequence for a question and its answer.
    pub answer_reserve: i32,
    pub history_policy: HistoryPolicy,
    /// Exact-match cache of complete prefixes, shared by the streams that should reuse each
    /// other's KV; `None` to keep none.
    pub prefix_cache: Option<Arc<PrefixCache>>,
    /// Every engine that may answer this stream's questions (the resident one included); the
    /// placer chooses among them. Empty: the resident engine only.
    pub peers: Vec<Arc<Engine>>,
}

/// Versions kept bindable; a question bound to an older one is refused.
const VERSIONS_KEPT: usize = 64;

/// A planned or published version.
#[derive(Clone)]
struct Record {
    number: u64,
    epoch: u32,
    end: i32,
    key: PrefixKey,
    history: Arc<[Arc<Frame>]>,
}

struct Timeline {
    registered: u64,
    published: u64,
    /// Published versions, oldest first (at most VERSIONS_KEPT).
    versions: VecDeque<Record>,
    /// The newest registered version (planned, maybe not yet published).
    tail: Record,
    restarts: u64,
    failed: Option<Error>,
    closed: bool,
}

/// A pinned, immutable view of a stream's history.
#[derive(Clone)]
pub struct Version {
    pub stream: Arc<Stream>,
    /// Number of the newest frame in this version (0: the prompt alone).
    pub number: u64,
    /// Epoch of the stream's sequence this version lives in.
    pub epoch: u32,
    /// First free position after the history.
    pub end: i32,
    pub key: PrefixKey,
    /// The frames of the history, oldest first (kept for replay).
    pub history: Arc<[Arc<Frame>]>,
}

impl Version {
    /// History length in frames.
    pub fn frames(&self) -> u64 {
        self.history.len() as u64
    }
}

/// What registering a frame did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    pub number: u64,
    /// Set when the frame started a new epoch: (frames kept, frames dropped from the history).
    pub restart: Option<(usize, usize)>,
}

pub struct Stream {
    id: u64,
    config: StreamConfig,
    engine: Arc<Engine>,
    seq: i32,
    prompt: Arc<Prompt>,
    /// Epoch whose KV the stream's sequence holds now (changed only on the engine thread).
    resident_epoch: AtomicU32,
    timeline: Mutex<Timeline>,
    changed: Condvar,
}

static STREAMS: LazyLock<Mutex<HashMap<u64, Weak<Stream>>>> = LazyLock::new(Default::default);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Find a live stream by its id (as carried by the `vlm-stream` event).
pub fn lookup(id: u64) -> Option<Arc<Stream>> {
    STREAMS.lock().get(&id).and_then(Weak::upgrade)
}

/// Prefill the prompt and `frames` into `seq` from position 0; returns the end position.
pub(crate) fn prefill_history(
    w: &mut Worker,
    prompt: &Prompt,
    frames: &[Arc<Frame>],
    seq: i32,
    cancel: &AtomicBool,
) -> Result<i32> {
    w.ctx.decode_tokens(&prompt.prefix, 0, seq, false)?;
    let mut pos = prompt.prefix.len() as i32;
    for frame in frames {
        if cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        pos = prefill_frame(w, frame, pos, seq)?;
    }
    Ok(pos)
}

/// Prefill one frame's segments into `seq` at `start`; returns the next free position.
pub(crate) fn prefill_frame(w: &mut Worker, frame: &Frame, start: i32, seq: i32) -> Result<i32> {
    let mut pos = start;
    for segment in &frame.segments {
        pos = match segment {
            Segment::Text(tokens) => {
                w.ctx.decode_tokens(tokens, pos, seq, false)?;
                pos + tokens.len() as i32
            }
            Segment::Image(image) => w.ctx.decode_image(image, pos, seq)?,
        };
    }
    Ok(pos)
}

impl Stream {
    /// Create a stream on `engine` and prefill its prompt prefix (version 0).
    pub fn open(engine: &Arc<Engine>, prompt: Arc<Prompt>, config: StreamConfig) -> Result<Arc<Stream>> {
        let seq = engine.take_stream_seq()?;
        let root = Record {
            number: 0,
            epoch: 0,
            end: prompt.prefix.len() as i32,
            key: PrefixKey::root(&engine.model().identity(), &prompt.prefix),
            history: Arc::from(Vec::new()),
        };
        let stream = Arc::new(Stream {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            config,
            engine: Arc::clone(engine),
            seq,
            prompt,
            resident_epoch: AtomicU32::new(0),
            timeline: Mutex::new(Timeline {
                registered: 0,
                published: 0,
                versions: VecDeque::new(),
                tail: root.clone(),
                restarts: 0,
                failed: None,
                closed: false,
            }),
            changed: Condvar::new(),
        });
        {
            let mut streams = STREAMS.lock();
            streams.retain(|_, w| w.strong_count() > 0);
            streams.insert(stream.id, Arc::downgrade(&stream));
        }
        stream.ingest(root, true)?;
        Ok(stream)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Engines that may answer this stream's questions, the resident one first.
    pub fn peers(&self) -> Vec<Arc<Engine>> {
        let mut peers = vec![Arc::clone(&self.engine)];
        peers.extend(self.config.peers.iter().filter(|e| !Arc::ptr_eq(e, &self.engine)).cloned());
        peers
    }

    pub(crate) fn prefix_cache(&self) -> Option<&Arc<PrefixCache>> {
        self.config.prefix_cache.as_ref().filter(|c| c.enabled())
    }

    pub fn retain(&self) -> bool {
        self.config.retain
    }

    pub(crate) fn seq(&self) -> i32 {
        self.seq
    }

    pub(crate) fn prompt(&self) -> &Prompt {
        &self.prompt
    }

    /// Epoch the stream's sequence holds now. Only meaningful on the engine thread, where
    /// restarts happen.
    pub(crate) fn resident_epoch(&self) -> u32 {
        self.resident_epoch.load(Ordering::Acquire)
    }

    /// Frames registered so far (the newest frame's number).
    pub fn registered(&self) -> u64 {
        self.timeline.lock().registered
    }

    /// Newest frame whose version is published.
    pub fn published(&self) -> u64 {
        self.timeline.lock().published
    }

    /// Times the history policy restarted the history.
    pub fn restarts(&self) -> u64 {
        self.timeline.lock().restarts
    }

    /// Plan the version that appends `frame` to `tail`, applying the history policy.
    fn plan(&self, tail: &Record, frame: &Arc<Frame>) -> Result<(Record, Option<(usize, usize)>)> {
        let capacity = self.engine.n_ctx_per_seq() as i32 - self.config.answer_reserve;
        let n_pos = frame.n_pos();
        let append = |history: &[Arc<Frame>], base: PrefixKey, start: i32| {
            let mut all = history.to_vec();
            all.push(Arc::clone(frame));
            (base.then_frame(frame.content_hash, n_pos), start + n_pos, Arc::<[Arc<Frame>]>::from(all))
        };
        if tail.end + n_pos <= capacity {
            let (key, end, history) = append(&tail.history, tail.key, tail.end);
            return Ok((Record { number: tail.number + 1, epoch: tail.epoch, end, key, history }, None));
        }
        let full = || Error::HistoryFull { frames: tail.history.len() as u64, cells: self.engine.n_ctx_per_seq() };
        let HistoryPolicy::Restart { keep } = self.config.history_policy else {
            return Err(full());
        };
        // Keep the newest `keep` frames, fewer if they do not fit with the new one.
        let prefix_len = self.prompt.prefix.len() as i32;
        let mut kept: &[Arc<Frame>] = &tail.history[tail.history.len().saturating_sub(keep)..];
        while !kept.is_empty() && prefix_len + kept.iter().map(|f| f.n_pos()).sum::<i32>() + n_pos > capacity {
            kept = &kept[1..];
        }
        if prefix_len + n_pos > capacity {
            return Err(full());
        }
        let mut key = PrefixKey::root(&self.engine.model().identity(), &self.prompt.prefix);
        let mut start = prefix_len;
        for f in kept {
            key = key.then_frame(f.content_hash, f.n_pos());
            start += f.n_pos();
        }
        let (key, end, history) = append(kept, key, start);
        let dropped = tail.history.len() - kept.len();
        Ok((Record { number: tail.number + 1, epoch: tail.epoch + 1, end, key, history }, Some((kept.len(), dropped))))
    }

    /// Register a frame now and prefill it asynchronously. Blocks while `max_pending` frames are
    /// already waiting for their prefill (backpressure), until `cancel` is set or the stream
    /// closes.
    pub fn register(self: &Arc<Self>, frame: Arc<Frame>, cancel: &AtomicBool) -> Result<Registration> {
        let mut t = self.timeline.lock();
        while (t.registered - t.published) as usize >= self.config.max_pending && t.failed.is_none() && !t.closed {
            if cancel.load(Ordering::Acquire) {
                return Err(Error::Cancelled);
            }
            self.changed.wait_for(&mut t, Duration::from_millis(50));
        }
        if let Some(e) = &t.failed {
            return Err(e.clone());
        }
        if t.closed {
            return Err(Error::Cancelled);
        }
        let (record, restart) = self.plan(&t.tail, &frame)?;
        t.registered = record.number;
        t.tail = record.clone();
        if restart.is_some() {
            t.restarts += 1;
        }
        drop(t);
        self.ingest(record.clone(), restart.is_some())?;
        Ok(Registration { number: record.number, restart })
    }

    /// Make `record` usable on the engine (prefill its last frame, or its whole history when it
    /// starts an epoch), then publish it. Without retention there is nothing to prefill.
    fn ingest(self: &Arc<Self>, record: Record, whole: bool) -> Result<()> {
        if !self.config.retain {
            self.publish(Ok(record));
            return Ok(());
        }
        let s = Arc::clone(self);
        let cache = self.config.prefix_cache.clone().filter(|c| c.enabled());
        let tag = self.engine.compat_tag();
        let tokens = if whole { record.end as usize } else { record.history.last().map_or(0, |f| f.n_pos() as usize) };
        let cost = tokens as f64 * self.engine.rates().prefill_ms_per_token;
        self.engine.submit_costed(cost, move |w| {
            let never = AtomicBool::new(false);
            s.resident_epoch.store(record.epoch, Ordering::Release);
            let cache_key = (record.key, tag.clone());
            let cached = cache.as_ref().and_then(|c| c.get(&cache_key));
            let result = match cached {
                Some(snapshot) => w.ctx.seq_restore(s.seq, &snapshot.bytes).map(|()| snapshot.end),
                None => {
                    let started = Instant::now();
                    let end = if whole {
                        w.ctx.seq_clear(s.seq);
                        prefill_history(w, &s.prompt, &record.history, s.seq, &never)
                    } else {
                        let frame = record.history.last().expect("a frame version has a frame");
                        prefill_frame(w, frame, record.end - frame.n_pos(), s.seq)
                    };
                    w.record(Stage::Prefill, tokens, started.elapsed().as_secs_f64() * 1e3);
                    if let (Ok(end), Some(cache)) = (&end, &cache) {
                        // A failed export only means nothing is cached.
                        if let Ok(bytes) = w.ctx.seq_snapshot(s.seq) {
                            cache.insert(cache_key, Arc::new(Snapshot { key: record.key, tag, bytes, end: *end }));
                        }
                    }
                    end
                }
            };
            s.publish(result.and_then(|end| {
                if end == record.end {
                    Ok(record)
                } else {
                    Err(Error::Engine(format!("prefill ended at position {end}, planned {}", record.end)))
                }
            }));
        })
    }

    /// Publish a version (or record the failure that prevents it) and wake waiters.
    fn publish(&self, record: Result<Record>) {
        let mut t = self.timeline.lock();
        match record {
            Ok(r) => {
                t.published = r.number;
                if t.versions.len() == VERSIONS_KEPT {
                    t.versions.pop_front();
                }
                t.versions.push_back(r);
            }
            Err(e) => t.failed = Some(e),
        }
        drop(t);
        self.changed.notify_all();
    }

    /// Wait until the version of frame `number` is published and pin it. Never returns another
    /// version: a question that needs a registered frame waits for that frame.
    pub fn wait_version(self: &Arc<Self>, number: u64, cancel: &AtomicBool) -> Result<Version> {
        let mut t = self.timeline.lock();
        loop {
            if let Some(e) = &t.failed {
                return Err(e.clone());
            }
            if number > t.registered && t.closed {
                return Err(Error::BadInput(format!("stream {} has no frame {number}", self.name())));
            }
            if number <= t.published {
                let r = t.versions.iter().find(|r| r.number == number).ok_or_else(|| {
                    Error::BadInput(format!("version {number} of stream {} is no longer retained", self.name()))
                })?;
                return Ok(Version {
                    stream: Arc::clone(self),
                    number,
                    epoch: r.epoch,
                    end: r.end,
                    key: r.key,
                    history: Arc::clone(&r.history),
                });
            }
            if cancel.load(Ordering::Acquire) {
                return Err(Error::Cancelled);
            }
            self.changed.wait_for(&mut t, Duration::from_millis(50));
        }
    }

    /// Stop accepting frames and wake every waiter.
    pub fn close(&self) {
        self.timeline.lock().closed = true;
        self.changed.notify_all();
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.engine.give_stream_seq(self.seq);
    }
}
