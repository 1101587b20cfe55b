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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::engine::Engine;
pub use crate::entry::{Entry, Frame};
use crate::error::{Error, Result};
use crate::llama::{Demand, Segment, Token};
use crate::prefix::PrefixKey;
use crate::prompt::Prompt;
use crate::snapshot::PrefixCache;

// Ingestion on the resident engine (prefill, prefix-cache import, publication) and moving a
// stream off a failed engine, in an `impl Stream` of their own.
mod ingest;

use ingest::{Rebuild, move_resident};

/// What happens when the next frame would overflow the stream's sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryPolicy {
    /// Refuse further frames ([`Error::HistoryFull`]); the caller counts them.
    Stop,
    /// Start a new epoch from the prompt and the newest `keep` frames (fewer if they do not
    /// fit), replayed from their retained embeddings.
    Restart { keep: usize },
    /// Drop the oldest frames until a quarter of the cells is free, keep the prompt, and shift
    /// the remaining cells' positions in place (llama.cpp's K-shift) instead of prefilling them
    /// again. A new epoch as a restart is: readers of older versions replay theirs. An M-RoPE
    /// model cannot shift ([`Engine::shift_refusal`]) but takes a gap: the oldest frames' cells
    /// are dropped and the rest stay where they are, until the positions would pass the model's
    /// trained context ([`Engine::position_gap_limit`]); then, as where neither is possible, the
    /// kept frames are prefilled from position 0, as a restart. In a unified pool a shift waits
    /// for the branches sharing the stream's cells to end, up to [`StreamConfig::slide_wait`],
    /// then prefills the kept frames instead ([`Stream::slides_prefilled`]).
    Slide,
}

/// A planned version, how ingestion makes it, and (frames kept, dropped) when it starts an epoch.
struct Plan {
    record: Record,
    rebuild: Rebuild,
    restart: Option<(usize, usize)>,
}

/// What happens to a new frame when `max_pending` frames already wait for their prefill
/// (ingestion cannot keep up with the frame rate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    /// Block the caller until one is published (backpressure: right for files and non-live
    /// sources).
    Block,
    /// Skip the new frame: it does not join the history, and is counted (right for live
    /// sources: the stream's sampling rate falls to what the engine can ingest, so a question
    /// never waits behind a long queue of frames).
    Skip,
}

/// How far ingestion is behind registration.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Lag {
    /// Frames registered but not yet published.
    pub frames: u64,
    /// Age of the oldest of them (ms; 0 when none).
    pub ms: f64,
}

/// Cells a stream keeps free after its history for a question and its answer
/// ([`StreamConfig::answer_reserve`]) where the application does not size its answers (as
/// `vlmcontext`, whose questions come at any length). An engine with a unified KV pool gives
/// each answer as many cells beyond the version it reads ([`EngineConfig::answer_cells`], which
/// defaults to the same), so an answer that fits its stream's reserve fits the pool.
///
/// [`EngineConfig::answer_cells`]: crate::EngineConfig::answer_cells
pub const DEFAULT_ANSWER_RESERVE: i32 = 256;

/// Settings of one stream.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub name: String,
    /// Keep the history's KV (true) or re-prefill it for every question (the baseline).
    pub retain: bool,
    /// Registered but unpublished entries allowed (the lag bound); past it `overload` applies.
    pub max_pending: usize,
    pub overload: Overload,
    /// Cells kept free at the end of the sequence for a question and its answer
    /// ([`DEFAULT_ANSWER_RESERVE`] where the application does not size its answers).
    pub answer_reserve: i32,
    pub history_policy: HistoryPolicy,
    /// Exact-match cache of complete prefixes, shared by the streams that should reuse each
    /// other's KV; `None` to keep none.
    pub prefix_cache: Option<Arc<PrefixCache>>,
    /// Every engine that may answer this stream's questions (the resident one included); the
    /// placer chooses among them. Empty: the resident engine only.
    pub peers: Vec<Arc<Engine>>,
    /// In a unified pool, how long a slide waits for the answers reading the stream's cells
    /// to end before it prefills the kept frames instead of shifting them.
    pub slide_wait: Duration,
}

/// [`StreamConfig::slide_wait`] by default: about two answers of 64 tokens on a small CPU
/// (a slide's prefill of three quarters of the context costs far more).
pub const DEFAULT_SLIDE_WAIT: Duration = Duration::from_secs(2);

impl StreamConfig {
    /// A retained stream with a small pending budget (blocking past it), room for a 128-token
    /// answer, the `Stop` policy, no prefix cache and no other engine.
    pub fn new(name: &str) -> StreamConfig {
        StreamConfig {
            name: name.into(),
            retain: true,
            max_pending: 4,
            overload: Overload::Block,
            answer_reserve: 128,
            history_policy: HistoryPolicy::Stop,
            prefix_cache: None,
            peers: Vec::new(),
            slide_wait: DEFAULT_SLIDE_WAIT,
        }
    }
}

/// Versions kept bindable at most; a question bound to an older one is refused.
const VERSIONS_KEPT: usize = 64;
/// Versions kept bindable at least, whether or not their newest frame is still in the history.
/// Beyond these, a version stays bindable only while its newest frame is still in the newest
/// version's history: each kept version pins its frames' embeddings (for replay), so versions of
/// frames that have slid out of the history would pin frames no reader is likely to ask for
/// (measured: 32 streams of SmolVLM-500M frames, 64 versions each, pinned about 7 GiB).
const VERSIONS_KEPT_MIN: usize = 8;

/// A planned or published version.
#[derive(Clone)]
struct Record {
    /// Number of the newest frame in the history.
    number: u64,
    /// Counts every registered record (frames and commits), in order.
    serial: u64,
    epoch: u32,
    end: i32,
    /// KV cells the history fills (text tokens + embedding rows).
    cells: i32,
    key: PrefixKey,
    history: Arc<[Entry]>,
    /// The epoch's cells were shifted in place (a slide): not what a prefill of `history` gives,
    /// so its versions stay out of the prefix cache.
    shifted: bool,
}

struct Timeline {
    registered: u64,
    published: u64,
    published_serial: u64,
    /// (frame number, serial) of the recently registered frames.
    frame_serials: VecDeque<(u64, u64)>,
    /// (frame number, registration time) of the frames not yet published.
    unpublished: VecDeque<(u64, Instant)>,
    skipped: u64,
    /// Published versions, oldest first (at most VERSIONS_KEPT).
    versions: VecDeque<Record>,
    /// The newest registered version (planned, maybe not yet published).
    tail: Record,
    /// Versions registered after the newest published one, oldest first (at most
    /// `max_pending`): what a move to another engine ingests there again.
    planned: VecDeque<Record>,
    restarts: u64,
    slides: u64,
    failed: Option<Error>,
    closed: bool,
    /// `StreamConfig::overload`, until [`Stream::set_overload`] changes it.
    overload: Overload,
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
    /// KV cells the history fills (text tokens + embedding rows; more than `end` for M-RoPE
    /// images): what a sequence's capacity and the cost of moving the history count.
    pub cells: i32,
    pub key: PrefixKey,
    /// The entries of the history after its prompt, oldest first (kept for replay).
    pub history: Arc<[Entry]>,
}

impl Version {
    /// History length in frames.
    pub fn frames(&self) -> u64 {
        frames_in(&self.history)
    }
}

fn frames_in(history: &[Entry]) -> u64 {
    history.iter().filter(|e| matches!(e, Entry::Frame(_))).count() as u64
}

/// What registering a frame did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    pub number: u64,
    /// Set when the frame started a new epoch: (frames kept, frames dropped from the history).
    pub restart: Option<(usize, usize)>,
    /// The new epoch kept its frames' cells, shifted in place (`HistoryPolicy::Slide`).
    pub slid: bool,
    /// Set when the overload policy skipped the frame: it did not join the history, `number`
    /// is the newest frame that did.
    pub skipped: bool,
}

/// Where a stream lives.
#[derive(Clone)]
struct Home {
    engine: Arc<Engine>,
    seq: i32,
}

/// A reader counted in a stream's demand ([`Stream::watch`]) until dropped.
pub struct Watch(Arc<AtomicUsize>);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

pub struct Stream {
    id: u64,
    config: StreamConfig,
    /// The engine whose sequence `seq` holds the stream's history (its frames are ingested
    /// there): changes only when that engine fails for good (`move_resident`).
    home: Mutex<Home>,
    prompt: Arc<Prompt>,
    /// Epoch whose KV the stream's sequence holds now (changed only on the engine thread).
    resident_epoch: AtomicU32,
    /// Slides that prefilled the kept history instead of shifting it (a reader's branch held
    /// the cells in a unified pool).
    slides_prefilled: AtomicU64,
    /// Set when the stream closes: queued ingestion is dropped.
    closing: Arc<AtomicBool>,
    /// Questions waiting for frames not yet published (the engine gives their ingestion more
    /// time, the encoder their frames' encodes).
    demand: Demand,
    timeline: Mutex<Timeline>,
    changed: Condvar,
    /// Told of every restart or slide of the history, whoever appended the entry that caused it
    /// (a frame, or a committed answer from another element's thread): [`Stream::on_rebuild`].
    on_rebuild: OnceLock<RebuildListener>,
}

/// What [`Stream::on_rebuild`] calls: with the stream, the registration that rebuilt its
/// history, and whether a frame (true) or a committed answer (false) caused it.
pub type RebuildListener = Box<dyn Fn(&Stream, &Registration, bool) + Send + Sync>;

/// The stream registry: every stream by id. It moves the streams resident on an engine that fails
/// for good when the engine reports the failure ([`crate::engine::on_failure`], registered with
/// the first stream).
static STREAMS: LazyLock<Mutex<HashMap<u64, Weak<Stream>>>> = LazyLock::new(|| {
    crate::engine::on_failure(move_resident);
    Mutex::default()
});
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Find a live stream by its id (as carried by the `vlm-stream` event).
pub fn lookup(id: u64) -> Option<Arc<Stream>> {
    STREAMS.lock().get(&id).and_then(Weak::upgrade)
}

impl Stream {
    /// Create a stream on `engine` and prefill its prompt prefix (version 0).
    pub fn open(engine: &Arc<Engine>, prompt: Arc<Prompt>, config: StreamConfig) -> Result<Arc<Stream>> {
        // (No frame could ever join a history whose prompt leaves no room.)
        let room = engine.n_ctx_per_seq() as i32 - config.answer_reserve;
        if prompt.prefix.len() as i32 >= room {
            return Err(Error::Config(format!(
                "the system prompt takes {} KV cells: a stream's sequence of {} cells leaves {} after the {} kept for \
                 answers (a shorter system-prompt or a larger context-size)",
                prompt.prefix.len(),
                engine.n_ctx_per_seq(),
                room.max(0),
                config.answer_reserve
            )));
        }
        let seq = engine.take_stream_seq()?;
        // Serials start at 1: a published serial of 0 means nothing is published yet.
        let root = Record {
            number: 0,
            serial: 1,
            epoch: 0,
            end: prompt.prefix.len() as i32,
            cells: prompt.prefix.len() as i32,
            key: PrefixKey::root(engine.model().identity(), &prompt.prefix),
            history: Arc::from(Vec::new()),
            shifted: false,
        };
        let overload = config.overload;
        let stream = Arc::new(Stream {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            config,
            home: Mutex::new(Home { engine: Arc::clone(engine), seq }),
            prompt,
            resident_epoch: AtomicU32::new(0),
            slides_prefilled: AtomicU64::new(0),
            closing: Arc::new(AtomicBool::new(false)),
            demand: Arc::new(AtomicUsize::new(0)),
            timeline: Mutex::new(Timeline {
                registered: 0,
                published: 0,
                published_serial: 0,
                frame_serials: VecDeque::new(),
                unpublished: VecDeque::new(),
                skipped: 0,
                versions: VecDeque::new(),
                tail: root.clone(),
                planned: VecDeque::new(),
                restarts: 0,
                slides: 0,
                failed: None,
                closed: false,
                overload,
            }),
            changed: Condvar::new(),
            on_rebuild: OnceLock::new(),
        });
        {
            let mut streams = STREAMS.lock();
            streams.retain(|_, w| w.strong_count() > 0);
            streams.insert(stream.id, Arc::downgrade(&stream));
        }
        stream.ingest(&mut stream.timeline.lock(), root, Rebuild::Whole)?;
        Ok(stream)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Call `listener` after each entry whose registration restarted or slid the history
    /// (`Registration::restart` set), with the lock of the history released, on the thread that
    /// appended it: a frame's ([`Stream::register`]) or a committed answer's ([`Stream::commit`]).
    /// One listener per stream; a second is refused (returned).
    pub fn on_rebuild(&self, listener: RebuildListener) -> std::result::Result<(), RebuildListener> {
        self.on_rebuild.set(listener)
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The engine the stream lives on (its frames are ingested there).
    pub fn engine(&self) -> Arc<Engine> {
        Arc::clone(&self.home.lock().engine)
    }

    /// Engines that may answer this stream's questions, the resident one first.
    pub fn peers(&self) -> Vec<Arc<Engine>> {
        let engine = self.engine();
        let mut peers = vec![Arc::clone(&engine)];
        peers.extend(self.config.peers.iter().filter(|e| !Arc::ptr_eq(e, &engine)).cloned());
        peers
    }

    pub(crate) fn prefix_cache(&self) -> Option<&Arc<PrefixCache>> {
        self.config.prefix_cache.as_ref().filter(|c| c.enabled())
    }

    pub fn retain(&self) -> bool {
        self.config.retain
    }

    /// The resident engine and the sequence that holds the history there, read together.
    pub(crate) fn home(&self) -> (Arc<Engine>, i32) {
        let home = self.home.lock();
        (Arc::clone(&home.engine), home.seq)
    }

    /// The stream's prompt (system text, chat template).
    pub fn prompt(&self) -> &Prompt {
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

    /// What later frames get when `max_pending` frames already wait (a caller that learns
    /// only after the stream opened whether its source is live).
    pub fn set_overload(&self, overload: Overload) {
        self.timeline.lock().overload = overload;
    }

    /// How far ingestion is behind registration now.
    pub fn lag(&self) -> Lag {
        let t = self.timeline.lock();
        Lag {
            frames: t.registered - t.published,
            ms: t.unpublished.front().map_or(0.0, |(_, at)| at.elapsed().as_secs_f64() * 1e3),
        }
    }

    /// Frames the overload policy skipped.
    pub fn skipped(&self) -> u64 {
        self.timeline.lock().skipped
    }

    /// Times the history policy restarted the history (prefilled it again).
    pub fn restarts(&self) -> u64 {
        self.timeline.lock().restarts
    }

    /// Times `HistoryPolicy::Slide` dropped the oldest frames (shifting the rest in place, or
    /// prefilling them: [`Stream::slides_prefilled`]).
    pub fn slides(&self) -> u64 {
        self.timeline.lock().slides
    }

    /// Slides that prefilled the kept frames because a reader's branch shared the stream's cells
    /// (a unified pool) when the slide began.
    pub fn slides_prefilled(&self) -> u64 {
        self.slides_prefilled.load(Ordering::Relaxed)
    }

    /// Plan the version that appends `entry` to `tail` (a new frame when `new_frame`),
    /// applying the history policy.
    fn plan(&self, tail: &Record, entry: Entry, new_frame: bool) -> Result<Plan> {
        // Capacity in KV cells (positions may be fewer: M-RoPE).
        let capacity = self.engine().n_ctx_per_seq() as i32 - self.config.answer_reserve;
        let (n_pos, n_cells) = (entry.n_pos(), entry.cells());
        let number = tail.number + new_frame as u64;
        let serial = tail.serial + 1;
        let with = |kept: &[Entry]| -> Arc<[Entry]> { kept.iter().cloned().chain([entry.clone()]).collect() };
        if tail.cells + n_cells <= capacity {
            let (key, end, history) = (entry.extend(tail.key), tail.end + n_pos, with(&tail.history));
            let cells = tail.cells + n_cells;
            let record = Record { number, serial, epoch: tail.epoch, end, cells, key, history, shifted: tail.shifted };
            return Ok(Plan { record, rebuild: Rebuild::Append, restart: None });
        }
        let prefix_len = self.prompt.prefix.len() as i32;
        if prefix_len + n_cells > capacity {
            // (No policy makes room for it; the next entry may fit.)
            let room = (capacity - prefix_len).max(0) as u32;
            return Err(Error::EntryTooLarge { cells: n_cells as u32, room });
        }
        let frames = |h: &[Entry]| frames_in(h) as usize;
        let full = || Error::HistoryFull {
            frames: frames_in(&tail.history),
            used: tail.cells as u32,
            cells: self.engine().n_ctx_per_seq(),
        };
        // Keep the entries from the newest `keep` frames on (a slide: all), fewer where they
        // would not leave a quarter of the cells free: the next frames then join the history
        // instead of starting it again each.
        let keep = match self.config.history_policy {
            HistoryPolicy::Stop => return Err(full()),
            HistoryPolicy::Restart { keep } => keep,
            HistoryPolicy::Slide => usize::MAX,
        };
        let room = capacity - capacity / 4;
        let mut from = tail.history.len();
        let mut seen = 0;
        while from > 0 && seen < keep {
            from -= 1;
            seen += matches!(tail.history[from], Entry::Frame(_)) as usize;
        }
        let mut kept: &[Entry] = &tail.history[from..];
        while !kept.is_empty() && prefix_len + kept.iter().map(Entry::cells).sum::<i32>() + n_cells > room {
            kept = &kept[1..];
        }
        // A committed answer never drops the last frame: the questions after it would be
        // answered from no picture (a still scene, whose frames the gate holds, and a long
        // conversation). It is not committed; the next frame makes room.
        if !new_frame && frames(kept) == 0 && frames(&tail.history) > 0 {
            return Err(full());
        }
        let root = PrefixKey::root(self.engine().model().identity(), &self.prompt.prefix);
        let key = kept.iter().chain([&entry]).fold(root, |key, e| e.extend(key));
        let cells = prefix_len + kept.iter().map(Entry::cells).sum::<i32>() + n_cells;
        let dropped = frames(&tail.history) - frames(kept);
        // The history's entries follow one another; the dropped ones start it.
        let first = tail.end - tail.history.iter().map(Entry::n_pos).sum::<i32>();
        let gone: i32 = tail.history[..tail.history.len() - kept.len()].iter().map(Entry::n_pos).sum();
        let (from, to) = (first, first + gone);
        let engine = self.engine();
        let rebuild = match self.config.history_policy {
            HistoryPolicy::Slide if engine.shift_refusal().is_none() => Rebuild::Shift { from, to },
            HistoryPolicy::Slide if engine.position_gap_limit().is_some_and(|limit| tail.end + n_pos <= limit) => {
                Rebuild::Drop { from, to }
            }
            _ => Rebuild::Whole,
        };
        let end = match rebuild {
            Rebuild::Drop { .. } => tail.end + n_pos,
            _ => self.replay_end(kept) + n_pos,
        };
        let shifted = matches!(rebuild, Rebuild::Shift { .. } | Rebuild::Drop { .. });
        let record = Record { number, serial, epoch: tail.epoch + 1, end, cells, key, history: with(kept), shifted };
        Ok(Plan { record, rebuild, restart: Some((frames(kept), dropped)) })
    }

    /// Register a frame now and prefill it asynchronously. Blocks while `max_pending` entries
    /// are already waiting for their prefill (backpressure), until `cancel` is set (then
    /// [`Stream::wake`]) or the stream closes.
    pub fn register(self: &Arc<Self>, frame: Arc<Frame>, cancel: &AtomicBool) -> Result<Registration> {
        self.check_frame(&frame)?;
        self.append(Entry::Frame(frame), true, cancel)
    }

    /// A frame encoded for another language model (another width, or another vocabulary for its
    /// text markers) is refused before anything of it reaches the engine.
    fn check_frame(&self, frame: &Frame) -> Result<()> {
        let engine = self.engine();
        let model = engine.model();
        for segment in &frame.segments {
            let Segment::Image(image) = segment else { continue };
            let source = image.model().filter(|m| m.identity() != model.identity());
            if image.width != model.n_embd() || source.is_some() {
                let encoded_for = source.map_or_else(String::new, |m| format!(" for {}", m.path().display()));
                return Err(Error::BadInput(format!(
                    "stream {}: a frame encoded{encoded_for} ({} wide) cannot feed the language model {} ({} wide): give vlmencode the same model as vlmcontext",
                    self.name(),
                    image.width,
                    model.path().display(),
                    model.n_embd()
                )));
            }
        }
        Ok(())
    }

    /// Commit a question and its answer into the history, after everything registered so far
    /// (the `commit-answers=ordered` policy: callers commit in question order). The text is the
    /// question's own suffix, the answer's tokens, and the template's turn change back to the
    /// user, so later frames and questions continue one valid conversation; no KV tail is
    /// concatenated: the text is prefilled on the stream's sequence.
    pub fn commit(self: &Arc<Self>, question: &str, answer: &[Token], cancel: &AtomicBool) -> Result<Registration> {
        let mut tokens = self.prompt.question_tokens(self.engine().model(), question)?;
        tokens.extend_from_slice(answer);
        tokens.extend_from_slice(&self.prompt.reopen);
        self.append(Entry::Text(tokens.into()), false, cancel)
    }

    fn append(self: &Arc<Self>, entry: Entry, new_frame: bool, cancel: &AtomicBool) -> Result<Registration> {
        let mut t = self.timeline.lock();
        // (An answer whose question a flush cancelled after it was generated is not committed.)
        if cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        // Entries registered but not yet published (the prompt's own prefill not counted).
        // (At least one: none would wait for ever.)
        let full =
            |t: &Timeline| (t.tail.serial - t.published_serial.max(1)) as usize >= self.config.max_pending.max(1);
        if new_frame && t.overload == Overload::Skip && full(&t) && t.failed.is_none() && !t.closed {
            t.skipped += 1;
            return Ok(Registration { number: t.registered, restart: None, slid: false, skipped: true });
        }
        // (The same count as the skip above: a skipping stream never waits for its prompt.)
        while full(&t) && t.failed.is_none() && !t.closed {
            if cancel.load(Ordering::Acquire) {
                return Err(Error::Cancelled);
            }
            self.changed.wait(&mut t);
        }
        if let Some(e) = &t.failed {
            return Err(e.clone());
        }
        if t.closed {
            return Err(Error::Cancelled);
        }
        let Plan { record, rebuild, restart } = self.plan(&t.tail, entry, new_frame)?;
        t.registered = record.number;
        if new_frame {
            t.unpublished.push_back((record.number, Instant::now()));
            if t.frame_serials.len() == VERSIONS_KEPT {
                t.frame_serials.pop_front();
            }
            t.frame_serials.push_back((record.number, record.serial));
        }
        t.tail = record.clone();
        if self.config.retain {
            t.planned.push_back(record.clone());
        }
        match rebuild {
            Rebuild::Whole => t.restarts += 1,
            Rebuild::Shift { .. } | Rebuild::Drop { .. } => t.slides += 1,
            Rebuild::Append => (),
        }
        // Hand the work to the engine before the next append can plan: entries reach it in the
        // order their positions were planned (a frame from the streaming thread and an answer
        // committed from an answer thread plan one after the other; handed over after the lock
        // is released they could reach the engine the other way round, and llama.cpp would
        // refuse the positions). Handing over only queues a job.
        self.ingest(&mut t, record.clone(), rebuild)?;
        drop(t);
        let registration = Registration {
            number: record.number,
            restart,
            slid: matches!(rebuild, Rebuild::Shift { .. } | Rebuild::Drop { .. }),
            skipped: false,
        };
        if let (Some(listener), Some(_)) = (self.on_rebuild.get(), restart) {
            listener(self, &registration, new_frame);
        }
        Ok(registration)
    }

    /// Publish a version (or record the failure that prevents it) and wake waiters.
    fn publish(&self, record: Result<Record>) {
        Self::record_publication(&mut self.timeline.lock(), record);
        self.changed.notify_all();
    }

    fn record_publication(t: &mut Timeline, record: Result<Record>) {
        match record {
            // (Published already: a newer version of the stream is.)
            Ok(r) if r.serial <= t.published_serial && t.published_serial > 0 => {}
            Ok(r) => {
                while t.planned.front().is_some_and(|p| p.serial <= r.serial) {
                    t.planned.pop_front();
                }
                t.published = r.number;
                t.published_serial = r.serial;
                while t.unpublished.front().is_some_and(|(n, _)| *n <= r.number) {
                    t.unpublished.pop_front();
                }
                // (A history's frames are the newest registered ones: the oldest is `number`
                // less the frames it holds, plus one.)
                let oldest_in_history = (r.number + 1).saturating_sub(frames_in(&r.history));
                t.versions.push_back(r);
                while t.versions.len() > VERSIONS_KEPT
                    || (t.versions.len() > VERSIONS_KEPT_MIN
                        && t.versions.front().is_some_and(|v| v.number < oldest_in_history))
                {
                    t.versions.pop_front();
                }
            }
            Err(e) => t.failed = Some(e),
        }
    }

    /// The stream's demand, for whatever encodes its frames: while a reader waits on the stream,
    /// its frames' encodes go before other streams' ([`crate::encoder::FrameEncoder::encode_reusing`]).
    pub fn demand(&self) -> Demand {
        Arc::clone(&self.demand)
    }

    /// Count a reader in the stream's demand while the returned guard lives: its frames are
    /// ingested as a waiting question's are (before the frames of streams nobody waits on, a
    /// budget every step, never on a thread probe). [`Stream::wait_version`] holds one while it
    /// waits; a reader of every new version (standing alerts) holds one for as long as it reads,
    /// since it asks for each version only once the frame has been registered, and the frame's
    /// prefill may start before.
    pub fn watch(&self) -> Watch {
        self.demand.fetch_add(1, Ordering::AcqRel);
        Watch(Arc::clone(&self.demand))
    }

    /// Wait until the version of frame `number` is published and pin it. Never returns another
    /// version: a question that needs a registered frame waits for that frame, until `cancel` is
    /// set (then [`Stream::wake`]), the stream fails or it closes.
    pub fn wait_version(self: &Arc<Self>, number: u64, cancel: &AtomicBool) -> Result<Version> {
        let _waiting = self.watch();
        let mut t = self.timeline.lock();
        loop {
            // The newest record of that frame: with its committed answers, once every one
            // registered before the next frame is published (before the oldest frame still
            // counted, for a frame older than all of them; every one so far for the newest).
            // A published version stays readable after the stream failed.
            let last_serial = t.frame_serials.iter().find(|(n, _)| *n > number).map_or(t.tail.serial, |(_, s)| s - 1);
            if number <= t.published && t.published_serial >= last_serial {
                let r = t.versions.iter().rev().find(|r| r.number == number).ok_or_else(|| {
                    Error::BadInput(format!("version {number} of stream {} is no longer retained", self.name()))
                })?;
                return Ok(self.pin(r));
            }
            if let Some(e) = &t.failed {
                return Err(e.clone());
            }
            if number > t.registered && t.closed {
                return Err(Error::BadInput(format!("stream {} has no frame {number}", self.name())));
            }
            if cancel.load(Ordering::Acquire) {
                return Err(Error::Cancelled);
            }
            self.changed.wait(&mut t);
        }
    }

    /// The version of frame `number` before it is published: registered, the newest so far, its
    /// frames still waiting for ingestion on the resident engine. Its history (the retained
    /// embeddings) can be replayed on another engine at once; it is the same record that will
    /// be published, so nothing a reader sees changes. `None` when the frame is published, or is
    /// not the newest registered.
    pub fn pending_version(self: &Arc<Self>, number: u64) -> Option<Version> {
        let t = self.timeline.lock();
        let r = &t.tail;
        (t.failed.is_none() && !t.closed && number > t.published && r.number == number && t.registered == number)
            .then(|| self.pin(r))
    }

    /// A reader's view of `record`.
    fn pin(self: &Arc<Self>, r: &Record) -> Version {
        Version {
            stream: Arc::clone(self),
            number: r.number,
            epoch: r.epoch,
            end: r.end,
            cells: r.cells,
            key: r.key,
            history: Arc::clone(&r.history),
        }
    }

    /// Wake every thread waiting on this stream (for a frame's publication or for room under
    /// `max_pending`), so that it sees the cancel flag its caller has just set.
    pub fn wake(&self) {
        let _timeline = self.timeline.lock();
        self.changed.notify_all();
    }

    /// Whether the stream has closed ([`Stream::close`]): no frame joins it any more.
    pub fn is_closed(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Stop accepting frames, wake every waiter, and give the stream's sequence back to its
    /// engine at once: a reader may hold the stream for long (an element downstream, its
    /// alerts), and a camera reconnecting then needs the sequence. After the frames already
    /// queued there, the stream's versions stop being resident (an answer still asked over one
    /// replays it), then the sequence is cleared and free.
    pub fn close(self: &Arc<Self>) {
        self.closing.store(true, Ordering::Release);
        self.timeline.lock().closed = true;
        self.changed.notify_all();
        let mut home = self.home.lock();
        if home.seq < 0 {
            return;
        }
        let seq = std::mem::replace(&mut home.seq, -1);
        let stream = Arc::downgrade(self);
        let _ = home.engine.submit(move |_| {
            if let Some(s) = stream.upgrade() {
                s.resident_epoch.store(u32::MAX, Ordering::Release);
            }
        });
        home.engine.give_stream_seq(seq);
    }

    /// Whether the stream gave its sequence back ([`Stream::close`]).
    pub(crate) fn gave_back(&self) -> bool {
        self.home.lock().seq < 0
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let home = self.home.lock();
        if home.seq >= 0 {
            home.engine.give_stream_seq(home.seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineConfig;

    #[test]
    fn an_engines_default_answer_cells_hold_the_default_answer_reserve() {
        assert_eq!(EngineConfig::default().answer_cells, DEFAULT_ANSWER_RESERVE as u32);
    }
}
