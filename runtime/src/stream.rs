//! A stream's append-only, versioned language history (the stream timeline).
//!
//! Version `n` is the history up to and including the stream's `n`-th frame (version 0 is the
//! prompt prefix alone). A frame is *registered* the moment it arrives, before any asynchronous
//! work; its version is *published* only when its prefill into the stream's sequence has
//! completed. Versions are immutable: the KV of version `n` is the stream sequence's positions
//! `0..end(n)`, and positions are only ever appended, so a reader that pinned version `n` sees
//! the same history whatever is ingested after it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::llama::{Segment, Token};
use crate::prompt::Prompt;

/// One encoded frame's inputs to the language model, retained for replay and the baseline.
#[derive(Debug)]
pub struct Frame {
    pub segments: Vec<Segment>,
    /// Identity of the picture (hash of its pixels and the encoder that saw it).
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
}

#[derive(Default)]
struct Timeline {
    registered: u64,
    published: u64,
    /// ends[n] = first free position after version n.
    ends: Vec<i32>,
    /// Positions the registered frames will occupy once published.
    pending_pos: i32,
    frames: Vec<Arc<Frame>>,
    failed: Option<Error>,
    closed: bool,
}

pub struct Stream {
    id: u64,
    config: StreamConfig,
    engine: Arc<Engine>,
    seq: i32,
    prompt: Arc<Prompt>,
    timeline: Mutex<Timeline>,
    changed: Condvar,
}

/// A pinned, immutable view of a stream's history.
#[derive(Clone)]
pub struct Version {
    pub stream: Arc<Stream>,
    /// Frames in this version's history.
    pub frames: u64,
    /// First free position after the history.
    pub end: i32,
}

static STREAMS: LazyLock<Mutex<HashMap<u64, Weak<Stream>>>> = LazyLock::new(Default::default);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Find a live stream by its id (as carried by the `vlm-stream` event).
pub fn lookup(id: u64) -> Option<Arc<Stream>> {
    STREAMS.lock().get(&id).and_then(Weak::upgrade)
}

impl Stream {
    /// Create a stream on `engine` and prefill its prompt prefix (version 0).
    pub fn open(
        engine: &Arc<Engine>,
        prompt: Arc<Prompt>,
        config: StreamConfig,
    ) -> Result<Arc<Stream>> {
        let seq = engine.take_stream_seq()?;
        let stream = Arc::new(Stream {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            config,
            engine: Arc::clone(engine),
            seq,
            prompt,
            timeline: Mutex::new(Timeline::default()),
            changed: Condvar::new(),
        });
        {
            let mut streams = STREAMS.lock();
            streams.retain(|_, w| w.strong_count() > 0);
            streams.insert(stream.id, Arc::downgrade(&stream));
        }
        let prefix_len = stream.prompt.prefix.len() as i32;
        if stream.config.retain {
            let s = Arc::clone(&stream);
            engine.submit(move |w| {
                let r = w.ctx.decode_tokens(&s.prompt.prefix, 0, s.seq, false);
                s.publish(r.map(|_| prefix_len));
            })?;
        } else {
            stream.publish(Ok(prefix_len));
        }
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

    pub fn retain(&self) -> bool {
        self.config.retain
    }

    pub(crate) fn seq(&self) -> i32 {
        self.seq
    }

    pub(crate) fn prompt(&self) -> &Prompt {
        &self.prompt
    }

    /// Frames registered so far (the newest frame's number).
    pub fn registered(&self) -> u64 {
        self.timeline.lock().registered
    }

    /// Frames whose version is published.
    pub fn published(&self) -> u64 {
        self.timeline.lock().published
    }

    /// Whether one more frame of `n_pos` positions fits, leaving room for an answer.
    fn fits(&self, t: &Timeline, n_pos: i32) -> bool {
        let end = t
            .ends
            .last()
            .copied()
            .unwrap_or(self.prompt.prefix.len() as i32)
            + t.pending_pos;
        end + n_pos + self.config.answer_reserve <= self.engine.n_ctx_per_seq() as i32
    }

    /// Register a frame now and prefill it asynchronously; returns its number. Blocks while
    /// `max_pending` frames are already waiting for their prefill (backpressure), until
    /// `cancel` is set or the stream closes.
    pub fn register(self: &Arc<Self>, frame: Arc<Frame>, cancel: &AtomicBool) -> Result<u64> {
        let n_pos = frame.n_pos();
        let mut t = self.timeline.lock();
        while (t.registered - t.published) as usize >= self.config.max_pending
            && t.failed.is_none()
            && !t.closed
        {
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
        if !self.fits(&t, n_pos) {
            return Err(Error::HistoryFull {
                frames: t.registered,
                cells: self.engine.n_ctx_per_seq(),
            });
        }
        t.registered += 1;
        t.pending_pos += n_pos;
        t.frames.push(Arc::clone(&frame));
        let number = t.registered;
        drop(t);
        if self.config.retain {
            let s = Arc::clone(self);
            self.engine.submit(move |w| {
                let start = *s
                    .timeline
                    .lock()
                    .ends
                    .last()
                    .expect("version 0 is published first");
                let r = crate::answer::prefill_frame(w, &frame, start, s.seq);
                s.publish(r);
            })?;
        } else {
            let start = *self
                .timeline
                .lock()
                .ends
                .last()
                .expect("version 0 is published first");
            self.publish(Ok(start + n_pos));
        }
        Ok(number)
    }

    /// Record the end of the next version (or the failure that prevents it) and wake waiters.
    fn publish(&self, end: Result<i32>) {
        let mut t = self.timeline.lock();
        match end {
            Ok(end) => {
                if let Some(last) = t.ends.last() {
                    t.pending_pos -= end - last;
                    t.published += 1;
                }
                t.ends.push(end);
            }
            Err(e) => t.failed = Some(e),
        }
        drop(t);
        self.changed.notify_all();
    }

    /// Wait until the version with `frames` frames is published and pin it. Never returns an
    /// older version: a question that needs a registered frame waits for that frame.
    pub fn wait_version(self: &Arc<Self>, frames: u64, cancel: &AtomicBool) -> Result<Version> {
        let mut t = self.timeline.lock();
        loop {
            if let Some(e) = &t.failed {
                return Err(e.clone());
            }
            if frames > t.registered && t.closed {
                return Err(Error::BadInput(format!(
                    "stream {} has no frame {frames}",
                    self.name()
                )));
            }
            if t.ends.len() as u64 > frames {
                return Ok(Version {
                    stream: Arc::clone(self),
                    frames,
                    end: t.ends[frames as usize],
                });
            }
            if cancel.load(Ordering::Acquire) {
                return Err(Error::Cancelled);
            }
            self.changed.wait_for(&mut t, Duration::from_millis(50));
        }
    }

    /// The retained inputs of frames `1..=n`.
    pub(crate) fn frames_upto(&self, n: u64) -> Vec<Arc<Frame>> {
        self.timeline.lock().frames[..n as usize].to_vec()
    }

    /// Stop accepting frames and wake every waiter.
    pub fn close(&self) {
        self.timeline.lock().closed = true;
        self.changed.notify_all();
    }

    /// Prompt tokens of this stream's history prefix.
    pub fn prefix_tokens(&self) -> &[Token] {
        &self.prompt.prefix
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.engine.give_stream_seq(self.seq);
    }
}
