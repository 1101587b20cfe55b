use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Instant;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use parking_lot::{Condvar, Mutex};
use vlm_runtime::{AnswerReport, CommitTurn, Lag, Question, Sampling, Stream};

// The two halves of the element, each its own `impl VlmQuery`: question intake (the video and
// query pads, `ask`, captions, binding and answering) and the text pad's output task (answers,
// JSON, `vlm-answer`). The ObjectSubclass, properties and state changes stay here.
mod alerts;
mod counters;
mod intake;
mod output;

pub(crate) static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlmquery", gst::DebugColorFlags::empty(), Some("gst-vlm question answering"))
});

const DEFAULT_MAX_TOKENS: u32 = 64;

/// Whether answers become history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmCommitAnswers")]
pub enum CommitAnswers {
    #[enum_value(name = "None: answers never become history", nick = "none")]
    None,
    #[enum_value(
        name = "Ordered: each answer is appended to its stream's history, in question order",
        nick = "ordered"
    )]
    Ordered,
}
const DEFAULT_MAX_QUESTIONS: u32 = 16;
const DEFAULT_ANSWER_DURATION: u64 = 5_000_000_000;
const DEFAULT_CAPTION_INTERVAL: u64 = 10_000_000_000;

/// What the text pad carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmOutputFormat")]
pub enum OutputFormat {
    #[enum_value(name = "Text: each answer's text as one line (line breaks folded into spaces)", nick = "text")]
    Text,
    #[enum_value(name = "JSON: one object a line with the vlm-answer message's fields", nick = "json")]
    Json,
}
/// How answers closer together than `answer-duration` are shown on the video.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmDisplay")]
pub enum Display {
    #[enum_value(name = "Replace: a newer answer replaces the one on screen at once (live views)", nick = "replace")]
    Replace,
    #[enum_value(name = "Queue: each answer keeps its whole answer-duration, a newer one waits", nick = "queue")]
    Queue,
}
const DEFAULT_DISPLAY: Display = Display::Replace;

/// Frames remembered for binding timed questions to running times.
const FRAME_HISTORY: usize = 4096;

#[derive(Debug, Clone)]
struct Settings {
    placement: String,
    max_tokens: u32,
    exact_tokens: bool,
    stream_tokens: bool,
    output_format: OutputFormat,
    answer_duration: u64,
    display: Display,
    caption_prompt: String,
    caption_interval: u64,
    max_questions: u32,
    commit_answers: CommitAnswers,
    sampling: Sampling,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            placement: "auto".into(),
            max_tokens: DEFAULT_MAX_TOKENS,
            exact_tokens: false,
            stream_tokens: false,
            output_format: OutputFormat::Text,
            answer_duration: DEFAULT_ANSWER_DURATION,
            display: DEFAULT_DISPLAY,
            caption_prompt: String::new(),
            caption_interval: DEFAULT_CAPTION_INTERVAL,
            max_questions: DEFAULT_MAX_QUESTIONS,
            commit_answers: CommitAnswers::None,
            sampling: Sampling::default(),
        }
    }
}

/// A question bound to a version of a stream's history.
struct Job {
    question: Question,
    stream: Option<Arc<Stream>>,
    frames: u64,
    pts: Option<gst::ClockTime>,
    /// The running time the question is about (its own for a timed question, else the newest
    /// video buffer's): the picture's age is counted to it.
    at: Option<gst::ClockTime>,
}

/// How an accepted question ended.
enum Outcome {
    Answered(AnswerReport),
    Cancelled(String),
    Failed(String),
}

/// One accepted question: answered on its own thread; its `vlm-answer` is posted as soon as it
/// and every question before it have ended (`VlmQuery::post_finished`), its text pushed in
/// question order by the source pad's task.
struct Pending {
    job: Job,
    cancel: Arc<AtomicBool>,
    /// Filled by the answering thread (and taken when its `vlm-answer` is posted).
    outcome: Mutex<Option<Outcome>>,
    /// Its `vlm-answer` (taken by the source pad's task).
    message: Mutex<Option<gst::Structure>>,
    /// Its `vlm-answer` is made and queued in the outbox (exactly once: by `post_finished` or a
    /// flush).
    decided: AtomicBool,
    /// Its `vlm-answer` is on the bus.
    posted: AtomicBool,
    /// With `stream-tokens`: the answer so far.
    text: Mutex<String>,
    /// Bytes of `text` the source pad's task has taken.
    text_taken: AtomicUsize,
    /// Its turn in the ordered commits (with `commit-answers=ordered`, the frame after which its
    /// answer was committed to the history): ends once the answering thread has its outcome.
    commit: CommitTurn,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The stream of a question accepted before any stream reached the element, once its first
    /// frame is registered (see `Pending::stream`).
    late_stream: std::sync::OnceLock<Arc<Stream>>,
    /// The lag of the question's stream when it was accepted.
    lag: Lag,
    /// How old the picture the question is bound to was at the question's time (ms): the
    /// running time from its frame's capture, which with `vlmencode min-change` includes the
    /// unchanged frames it stood for.
    picture_age_ms: Option<f64>,
    /// For a question bound to its stream's first frame once one came (`first_frame`): that
    /// frame's pts and picture age (see `Pending::picture`).
    late_picture: std::sync::OnceLock<(Option<gst::ClockTime>, Option<f64>)>,
    /// The question's arrival (where `ttft-ms` starts) in running time on the pipeline clock.
    arrival_rt: Option<gst::ClockTime>,
}

/// What the video sink pad has seen.
#[derive(Default)]
struct Video {
    /// The stream the newest frame or `vlm-stream` event named, while `vlmcontext` (or a
    /// question, an alert) holds it: not kept here, so that a `vlmcontext` stopped or rebuilt
    /// upstream frees its engines while this element plays on.
    stream: Option<Weak<Stream>>,
    /// Its id.
    stream_id: Option<u64>,
    /// Recent registered frames, of every stream that came (several reach one vlmquery through
    /// a funnel, or another after vlmcontext restarted): a question binds to those of `stream`.
    frames: VecDeque<SeenFrame>,
    /// (stream, running time) of recent sampled frames, those `vlmencode min-change` held
    /// included: the frame a question is about may be one the gate held.
    captures: VecDeque<(u64, gst::ClockTime)>,
    /// Running time of the newest video buffer, registered or not.
    running_time: Option<gst::ClockTime>,
    /// Running time up to which the video is known: half-way through the newest frame, or the
    /// frame `vlm-standing` said the last encoded one stands for (its duration, or one frame of
    /// the caps' rate; half, as a live source's next frame may come early). A timed question
    /// binds once this is past its time: no frame before it is to come.
    known_until: Option<gst::ClockTime>,
    /// The newest video buffer had no timestamp: a timed question cannot be matched to the
    /// video's time and binds to the newest frame instead of waiting for the video to pass it.
    untimed: bool,
    /// Timestamp (in the video segment) of the newest video buffer, and where it ends.
    pts: Option<gst::ClockTime>,
    end: Option<gst::ClockTime>,
    /// One frame at the caps' frame rate (none for a variable rate).
    frame_duration: Option<gst::ClockTime>,
    /// A buffer came with no `vlmcontext` stream announced before it, and that was said.
    no_context_said: bool,
    /// A new segment came and no timed frame of it yet: `pts` and `end` are its start (no GAP
    /// is sent from them).
    between_segments: bool,
    segment: Option<gst::FormattedSegment<gst::ClockTime>>,
    /// When the video's EOS came.
    eos: Option<std::time::Instant>,
    /// Running time of the frame the last periodic caption was asked at (none for untimed
    /// video), and when.
    last_caption: Option<(Option<gst::ClockTime>, std::time::Instant)>,
}

/// A registered frame that passed: its stream, running time, pts and number.
#[derive(Clone, Copy)]
struct SeenFrame {
    stream: u64,
    rt: Option<gst::ClockTime>,
    pts: Option<gst::ClockTime>,
    number: u64,
}

impl Video {
    /// Where a GAP up to the newest frame ends: its end, once a frame of the current segment came.
    fn gap_end(&self) -> Option<gst::ClockTime> {
        self.end.filter(|_| !self.between_segments)
    }

    /// What stays over a flush: the stream and the caps' rate, and the frames seen before with
    /// their pts but not their running time (the flush starts it again): a question binds by
    /// running time to frames after the flush only, and one answered about a frame before it
    /// (none came since) still names that frame's pts.
    fn after_flush(self) -> Video {
        let frames = self.frames.into_iter().map(|f| SeenFrame { rt: None, ..f }).collect();
        Video {
            stream: self.stream,
            stream_id: self.stream_id,
            frame_duration: self.frame_duration,
            frames,
            ..Video::default()
        }
    }

    /// From now on questions bind to stream `id` (a frame of it came, or its `vlm-stream`).
    fn switch_to(&mut self, id: u64) {
        if self.stream_id != Some(id) || self.stream().is_none() {
            self.stream_id = Some(id);
            self.stream = vlm_runtime::stream::lookup(id).map(|s| Arc::downgrade(&s));
        }
    }

    /// The stream questions bind to now, while it is held.
    fn stream(&self) -> Option<Arc<Stream>> {
        self.stream.as_ref().and_then(Weak::upgrade)
    }

    /// Whether something seen was of the stream questions bind to now (any, before one).
    fn of_current(&self, stream: u64) -> bool {
        self.stream_id.is_none_or(|id| id == stream)
    }

    /// The recent frames of the stream questions bind to, oldest first.
    fn current_frames(&self) -> impl DoubleEndedIterator<Item = &SeenFrame> {
        self.frames.iter().filter(|f| self.of_current(f.stream))
    }

    fn newest(&self) -> (u64, Option<gst::ClockTime>) {
        self.current_frames().next_back().map_or((0, None), |f| (f.number, f.pts))
    }

    /// The pts of the newest frame numbered at most `number`.
    fn pts_up_to(&self, number: u64) -> Option<gst::ClockTime> {
        self.current_frames().rev().find(|f| f.number <= number).and_then(|f| f.pts)
    }

    /// The running time of registered frame `number`, while it is among the recent ones.
    fn time_of(&self, number: u64) -> Option<gst::ClockTime> {
        self.current_frames().rev().find(|f| f.number == number).and_then(|f| f.rt)
    }

    /// How old registered frame `number`'s picture was at running time `at` (ms; none while the
    /// frame is not among the recent ones).
    fn picture_age(&self, number: u64, at: Option<gst::ClockTime>) -> Option<f64> {
        self.time_of(number).zip(at).map(|(frame, at)| at.saturating_sub(frame).nseconds() as f64 / 1e6)
    }

    /// The capture (running time) of the frame a question is about: the newest sampled frame at
    /// or before its time `at`, held or not (its answer reflects that frame, the picture it was
    /// bound to standing for it); an untimed question's is the capture of its bound frame.
    fn question_capture(&self, at: Option<gst::ClockTime>, bound: u64) -> Option<gst::ClockTime> {
        match at {
            Some(at) => self.captures.iter().rev().find(|&&(s, rt)| self.of_current(s) && rt <= at).map(|c| c.1),
            None => self.time_of(bound),
        }
    }

    /// A sampled frame of `stream` (registered, held, or standing in for) captured at `rt`.
    fn captured(&mut self, stream: u64, rt: gst::ClockTime) {
        if self.captures.len() == FRAME_HISTORY {
            self.captures.pop_front();
        }
        self.captures.push_back((stream, rt));
    }

    /// The video is known up to half-way through a frame at `rt` lasting `duration` (unknown:
    /// one frame of the caps' rate, or a nanosecond).
    fn known_to(&mut self, rt: gst::ClockTime, duration: Option<gst::ClockTime>) {
        let half =
            duration.or(self.frame_duration).map_or(gst::ClockTime::NSECOND, |d| (d / 2).max(gst::ClockTime::NSECOND));
        self.known_until = self.known_until.max(Some(rt.saturating_add(half)));
    }

    /// The newest frame at or before running time `t`.
    fn at(&self, t: gst::ClockTime) -> (u64, Option<gst::ClockTime>) {
        self.current_frames().rev().find(|f| f.rt.is_some_and(|rt| rt <= t)).map_or((0, None), |f| (f.number, f.pts))
    }
}

/// The element's statistics (read-only properties, each notified when it changes), reset at
/// PAUSED→READY.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Stats {
    /// Answers pushed on the text pad (`answers`).
    answers: u64,
}

#[derive(Default)]
struct Shared {
    /// Kept across flushes; reset at PAUSED→READY.
    stats: Stats,
    video: Video,
    query_segment: Option<gst::FormattedSegment<gst::ClockTime>>,
    query_markup: bool,
    query_eos: bool,
    /// Question buffers being handled on the query pad now.
    query_busy: usize,
    /// When the query pad last finished handling a buffer, or the video reached EOS.
    query_quiet_since: Option<Instant>,
    /// The query pad alone is flushing: a question waiting there gives up; answers go on.
    query_flushing: bool,
    /// Accepted questions, in question order.
    pending: VecDeque<Arc<Pending>>,
    /// Every input has ended: later questions are refused, EOS follows the last answer.
    eos: bool,
    /// The text pad's task has posted every answer and reached EOS.
    all_answered: bool,
    flushing: bool,
    /// What the text pad and `subtitle_src` have sent of stream start, caps and segment.
    text_pad: PadStarted,
    cue_pad: PadStarted,
    /// The last flow return of the source pad: errors travel upstream from the sink pads.
    srcresult: Option<gst::FlowError>,
    /// Downstream of the text pad / `subtitle_src` has ended (a push there returned EOS, e.g.
    /// `fakesink num-buffers`): nothing more is pushed there, but its task goes on taking the
    /// answers and sends its EOS event, so its sink posts EOS. Upstream gets EOS once every
    /// output has ended (`VlmQuery::outputs_ended`).
    text_ended: bool,
    cue_ended: bool,
    /// How far the text pad has told downstream about (answers and GAP events), in the video
    /// segment's time.
    text_position: Option<gst::ClockTime>,
    /// A text buffer reached past the newest frame (`display=queue`) and a GAP at its end has
    /// said so: that end.
    gap_ahead: Option<gst::ClockTime>,
    /// What the text pad shows while it follows the video (see `output::Shown`).
    shown: Option<output::Shown>,
    /// Answers posted and not yet attached to a video buffer (`VlmAnswerMeta`), in question
    /// order: one per video buffer; at most [`WAITING_MAX`] (a stalled video drops the oldest).
    video_answers: VecDeque<gst::Structure>,
    /// The query pad waits for room (`max-questions` pending).
    query_waiting: bool,
    /// Timed questions ahead of the video, in arrival order (bounded: [`Shared::ahead_full`]):
    /// taken at once (the query pad does not hold its source's thread for the video, so a
    /// forced EOS reaches every source) and accepted, each in its turn, once the video has
    /// passed its time and a `max-questions` slot is free (`VlmQuery::bind_ahead`).
    ahead: VecDeque<Ahead>,
    /// Ids of the most recent accepted questions: an id is answered once.
    recent_ids: VecDeque<String>,
    /// JSON lines of `vlm-alert`s (`output-format=json`) for the text pad, with their frames' pts
    /// (at most [`WAITING_MAX`]: a stalled text pad drops the oldest).
    alert_lines: VecDeque<(String, Option<gst::ClockTime>)>,
    /// Answers for `subtitle_src` (one cue each, while it is linked), in question order (at most
    /// [`WAITING_MAX`]: a stalled recorder drops the oldest).
    cues: VecDeque<output::Cue>,
    /// How far `subtitle_src` has told downstream about (the start of its last cue, or the end
    /// of its last GAP).
    cue_position: Option<gst::ClockTime>,
    /// `subtitle_src` has sent its EOS.
    cue_eos: bool,
}

impl Shared {
    /// The `max-questions` slots taken: each accepted question's until its answer is pushed on
    /// the text pad, and after the video's EOS until its answer is posted. textoverlay holds a
    /// text pad for ever once its video has ended and a second answer comes, which would leave
    /// the questions after the video neither answered nor refused; the answers that wait for
    /// the text pad then are bounded by the questions taken before `maybe_finish` ends them.
    fn taken_slots(&self) -> usize {
        match self.video.eos {
            None => self.pending.len(),
            Some(_) => self.pending.iter().filter(|p| !p.posted.load(Ordering::Acquire)).count(),
        }
    }

    /// Every accepted question's `vlm-answer` is on the bus.
    fn all_posted(&self) -> bool {
        self.pending.iter().all(|p| p.posted.load(Ordering::Acquire))
    }

    /// The questions ahead of the video fill their queue: [`AHEAD_MAX`] of them, or
    /// [`AHEAD_BYTES`] of text (the query pad waits for room then, as textoverlay's text pad
    /// waits with one).
    fn ahead_full(&self) -> bool {
        self.ahead.len() >= AHEAD_MAX || self.ahead.iter().map(|a| a.question.text.len()).sum::<usize>() >= AHEAD_BYTES
    }

    /// Whether the video is known past running time `t`: every frame a question at `t` may
    /// bind to has come (or none will: EOS, or untimed video, where it binds to the newest).
    fn video_past(&self, t: gst::ClockTime) -> bool {
        self.video.eos.is_some() || self.video.untimed || self.video.known_until.is_some_and(|end| end > t)
    }
}

/// Most timed questions waiting for the video to reach their time, and most text of theirs: an
/// hour of subtitles, one a second, fits.
const AHEAD_MAX: usize = 4096;
const AHEAD_BYTES: usize = 4 << 20;

/// A timed question waiting for the video to reach its time (`Shared::ahead`).
struct Ahead {
    question: Question,
    at: gst::ClockTime,
    /// Its stream's frames go first meanwhile (encoded and ingested before other streams' where
    /// the process shares an encoder or an engine).
    _watch: Option<vlm_runtime::Watch>,
}

/// A source pad has sent its stream start and caps (once), and the video's current segment.
#[derive(Default)]
struct PadStarted {
    started: bool,
    segment_sent: bool,
}

/// Most answers waiting for a video buffer to ride on or for `subtitle_src`, and alert lines
/// waiting for the text pad: beyond, the oldest goes (each is on the bus too).
const WAITING_MAX: usize = 64;

/// Queue `item` on `queue`, dropping the oldest beyond [`WAITING_MAX`].
fn push_bounded<T>(queue: &mut VecDeque<T>, item: T) {
    if queue.len() >= WAITING_MAX {
        queue.pop_front();
    }
    queue.push_back(item);
}

/// `vlm-answer`s waiting to be posted. One thread posts at a time, with no lock of the element
/// held (a sync bus handler may seek with a flush from that thread); a thread that finds another
/// posting leaves its messages to it (`VlmQuery::drain_outbox`).
#[derive(Default)]
struct Outbox {
    messages: VecDeque<(Arc<Pending>, gst::Structure)>,
    /// The thread posting them.
    poster: Option<std::thread::ThreadId>,
}

pub struct VlmQuery {
    sinkpad: gst::Pad,
    querypad: gst::Pad,
    srcpad: gst::Pad,
    /// The video, passed through unchanged (for textoverlay and display, no tee needed).
    video_srcpad: gst::Pad,
    /// One cue per answer, whatever `display` says (for a recorder).
    subtitle_srcpad: gst::Pad,
    settings: Mutex<Settings>,
    shared: Mutex<Shared>,
    /// Held while ended questions' `vlm-answer`s are made and queued in the outbox, so they
    /// queue in question order (taken before `shared`).
    post_order: Mutex<()>,
    /// The `vlm-answer`s made and not yet posted, in question order.
    outbox: Mutex<Outbox>,
    /// Signalled when the outbox's poster is done.
    outbox_idle: Condvar,
    /// Answering threads that may still run: of questions a flush cancelled (each sees its
    /// cancel flag) and of answered ones still posting others' answers. Joined when the element
    /// stops, so none outlives it.
    ending_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    changed: Condvar,
    /// Standing questions (`alerts`).
    alerts: alerts::Alerts,
    /// Question statistics (read-only properties).
    counters: counters::Counters,
}

impl VlmQuery {
    /// Cancel every pending question (each still gets its `vlm-answer`, `cancelled`) and stop
    /// the source task's output until `flush_stop`.
    fn flush_start(&self, reason: &str) {
        self.alerts_flush(true);
        let _order = self.post_order.lock();
        let pending = {
            let mut shared = self.shared.lock();
            shared.flushing = true;
            for p in &shared.pending {
                p.cancel.store(true, Ordering::Release);
                if let Some(stream) = p.stream() {
                    stream.wake();
                }
                p.commit.wake();
            }
            self.changed.notify_all();
            std::mem::take(&mut shared.pending)
        };
        let mut changed = vec![];
        for p in &pending {
            if !p.decided.swap(true, Ordering::AcqRel) {
                let outcome = Outcome::Cancelled(reason.into());
                changed.extend(self.counters.ended(&outcome));
                self.outbox.lock().messages.push_back((Arc::clone(p), self.answer_message(p, outcome)));
            }
            if let Some(t) = p.thread.lock().take() {
                self.keep_ending(t);
            }
        }
        drop(_order);
        self.drain_outbox();
        for name in changed {
            self.obj().notify(name);
        }
        // (After `flushing` is set: no question joins them meanwhile.)
        self.refuse_ahead();
    }

    /// Keep an answering thread to join when the element stops (dropping those that ended).
    fn keep_ending(&self, thread: std::thread::JoinHandle<()>) {
        let mut threads = self.ending_threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
    }

    /// Reset what the flush made void; the query pad's own state (its caps, segment and EOS,
    /// sent once) stays.
    fn flush_stop(&self) {
        self.alerts_flush(false);
        let mut shared = self.shared.lock();
        let old = std::mem::take(&mut *shared);
        *shared = Shared {
            stats: old.stats,
            // (The caps stay: a sticky event is not sent again after a flush.)
            video: old.video.after_flush(),
            query_segment: old.query_segment,
            query_markup: old.query_markup,
            query_eos: old.query_eos,
            query_busy: old.query_busy,
            query_flushing: old.query_flushing,
            recent_ids: old.recent_ids,
            // (Stream start and caps are sticky: not sent again after a flush, the segment is.)
            text_pad: PadStarted { started: old.text_pad.started, segment_sent: false },
            cue_pad: PadStarted { started: old.cue_pad.started, segment_sent: false },
            ..Shared::default()
        };
    }

    /// PAUSED→READY, before the pads deactivate: every pending question is cancelled, and
    /// a chain function woken by the flush (the query pad's, waiting for the video) sees it and
    /// returns, or deactivating its pad would wait for it forever.
    fn stop(&self) {
        self.flush_start("the element stopped");
        self.post_outbox_before_stop();
        self.alerts_stop();
    }

    /// PAUSED→READY, once the pads are inactive (the text pad's task stopped): a fresh state
    /// with zero statistics, still flushing until the text pad is activated again.
    fn reset(&self) {
        // (A question accepted after `stop`, as a flush-stop raced it, still gets its answer;
        // an alert thread a frame started then ends, and the stream it held is let go.)
        self.flush_start("the element stopped");
        self.post_outbox_before_stop();
        self.alerts_stop();
        // (Not this one: a sync bus handler stopping the element from an answering thread.)
        let me = std::thread::current().id();
        let threads: Vec<_> =
            std::mem::take(&mut *self.ending_threads.lock()).into_iter().filter(|t| t.thread().id() != me).collect();
        // (Bounded: a thread stuck in an engine that hangs is left to end on its own.)
        if !join_within(threads, ENDING_WAIT) {
            gst::warning!(CAT, imp = self, "a cancelled answer's thread is still running");
        }
        let stats = {
            let mut shared = self.shared.lock();
            let stats = shared.stats;
            *shared = Shared { flushing: true, ..Shared::default() };
            stats
        };
        self.counters.reset();
        for name in counters::NAMES {
            self.obj().notify(name);
        }
        self.notify_stats(stats, Stats::default());
    }

    /// Notify the statistics that differ between `before` and `now` (called with no lock held).
    fn notify_stats(&self, before: Stats, now: Stats) {
        if before.answers != now.answers {
            self.obj().notify("answers");
        }
    }

    /// `subtitle_src`'s task runs while the pad is active; the text pad's activation (which
    /// resets the shared state) or a flush comes first, so it only starts or stops it.
    fn subtitle_activatemode(&self, pad: &gst::Pad, active: bool) -> Result<(), gst::LoggableError> {
        if active {
            self.start_cue_task();
        } else {
            self.shared.lock().flushing = true;
            self.changed.notify_all();
            pad.stop_task().map_err(|e| gst::loggable_error!(CAT, "cannot stop the subtitle task: {e}"))?;
        }
        Ok(())
    }

    /// The text pad's task runs while the pad is active (in push mode): started on activation
    /// with the flush state cleared, stopped on deactivation with every pending question
    /// cancelled, as gst-plugins-rs elements do.
    fn src_activatemode(&self, pad: &gst::Pad, active: bool) -> Result<(), gst::LoggableError> {
        gst::debug!(CAT, obj = pad, "{} the text task", if active { "starting" } else { "stopping" });
        if active {
            self.flush_stop();
            self.start_task();
        } else {
            self.flush_start("the text pad was deactivated");
            pad.stop_task().map_err(|e| gst::loggable_error!(CAT, "cannot stop the text task: {e}"))?;
        }
        Ok(())
    }
}

/// A pad's activation in push mode: its task started or stopped.
type Activate = fn(&VlmQuery, &gst::Pad, bool) -> Result<(), gst::LoggableError>;

/// A text source pad (`src`, `subtitle_src`): upstream events handled by default, push mode
/// only, a task of its own started and stopped by `activate`.
fn text_src_pad(klass: &<VlmQuery as ObjectSubclass>::Class, name: &str, activate: Activate) -> gst::Pad {
    gst::Pad::builder_from_template(&klass.pad_template(name).unwrap())
        .event_function(|pad, parent, event| {
            VlmQuery::catch_panic_pad_function(
                parent,
                || false,
                |imp| {
                    gst::log!(CAT, obj = pad, "handling {event:?}");
                    gst::Pad::event_default(pad, Some(&*imp.obj()), event)
                },
            )
        })
        .activatemode_function(move |pad, parent, mode, active| {
            VlmQuery::catch_panic_pad_function(
                parent,
                || Err(gst::loggable_error!(CAT, "panic in the activation of {}", pad.name())),
                |imp| match mode {
                    gst::PadMode::Push => activate(imp, pad, active),
                    _ => Err(gst::loggable_error!(CAT, "pull mode is not supported")),
                },
            )
        })
        .build()
}

/// How long a stop waits for the element's threads (answering, alerts) to end: one may be stuck
/// in an engine that hangs, or in an application's sync bus handler that waits for the stop.
const ENDING_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Join `threads` that end within `limit`; false when some still run (they are left to end on
/// their own: a run number makes them stop at their next turn).
fn join_within(threads: Vec<std::thread::JoinHandle<()>>, limit: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while threads.iter().any(|t| !t.is_finished()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let mut all = true;
    for t in threads {
        match t.is_finished() {
            true => drop(t.join()),
            false => all = false,
        }
    }
    all
}

#[glib::object_subclass]
impl ObjectSubclass for VlmQuery {
    const NAME: &'static str = "GstVlmQuery";
    type Type = super::VlmQuery;
    type ParentType = gst::Element;

    fn with_class(klass: &Self::Class) -> Self {
        let sinkpad = gst::Pad::builder_from_template(&klass.pad_template("sink").unwrap())
            .chain_function(|_, parent, buffer| {
                VlmQuery::catch_panic_pad_function(parent, || Err(gst::FlowError::Error), |imp| imp.sink_chain(buffer))
            })
            .event_function(|_, parent, event| {
                VlmQuery::catch_panic_pad_function(parent, || false, |imp| imp.sink_event(event))
            })
            .query_function(|pad, parent, query| {
                VlmQuery::catch_panic_pad_function(parent, || false, |imp| imp.sink_query(pad, query))
            })
            .build();
        let querypad = gst::Pad::builder_from_template(&klass.pad_template("query").unwrap())
            .chain_function(|_, parent, buffer| {
                VlmQuery::catch_panic_pad_function(parent, || Err(gst::FlowError::Error), |imp| imp.query_chain(buffer))
            })
            .event_function(|_, parent, event| {
                VlmQuery::catch_panic_pad_function(parent, || false, |imp| imp.query_event(event))
            })
            .build();
        let srcpad = text_src_pad(klass, "src", VlmQuery::src_activatemode);
        let subtitle_srcpad = text_src_pad(klass, "subtitle_src", VlmQuery::subtitle_activatemode);
        let video_srcpad = gst::Pad::builder_from_template(&klass.pad_template("video_src").unwrap())
            .event_function(|pad, parent, event| {
                VlmQuery::catch_panic_pad_function(
                    parent,
                    || false,
                    |imp| {
                        gst::log!(CAT, obj = pad, "handling {event:?}");
                        imp.sinkpad.push_event(event)
                    },
                )
            })
            .query_function(|pad, parent, query| {
                VlmQuery::catch_panic_pad_function(
                    parent,
                    || false,
                    |imp| {
                        gst::log!(CAT, obj = pad, "handling {query:?}");
                        imp.sinkpad.peer_query(query)
                    },
                )
            })
            .build();
        VlmQuery {
            sinkpad,
            querypad,
            srcpad,
            video_srcpad,
            subtitle_srcpad,
            settings: Mutex::new(Settings::default()),
            // Refusing until READY->PAUSED: a question accepted before would be dropped there.
            shared: Mutex::new(Shared { flushing: true, ..Shared::default() }),
            post_order: Mutex::new(()),
            outbox: Mutex::new(Outbox::default()),
            outbox_idle: Condvar::new(),
            ending_threads: Mutex::new(vec![]),
            changed: Condvar::new(),
            alerts: alerts::Alerts::default(),
            counters: counters::Counters::default(),
        }
    }
}

impl ObjectImpl for VlmQuery {
    fn constructed(&self) {
        self.parent_constructed();
        let obj = self.obj();
        obj.add_pad(&self.sinkpad).unwrap();
        obj.add_pad(&self.querypad).unwrap();
        obj.add_pad(&self.srcpad).unwrap();
        obj.add_pad(&self.video_srcpad).unwrap();
        obj.add_pad(&self.subtitle_srcpad).unwrap();
    }

    fn properties() -> &'static [glib::ParamSpec] {
        static PROPS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            let d = Sampling::default();
            vec![
                glib::ParamSpecString::builder("placement")
                    .nick("Placement")
                    .blurb("Engine that answers: auto (the placer decides) or an engine's name (cpu, gpu)")
                    .default_value(Some("auto"))
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("max-tokens")
                    .nick("Max tokens")
                    .blurb("Most tokens generated per answer (a question event's max-tokens overrides it)")
                    .minimum(1)
                    .maximum(4096)
                    .default_value(DEFAULT_MAX_TOKENS)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecBoolean::builder("exact-tokens")
                    .nick("Exact tokens")
                    .blurb("Generate exactly max-tokens tokens, going on past end-of-generation (equal work for measurements)")
                    .default_value(false)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecBoolean::builder("stream-tokens")
                    .nick("Stream tokens")
                    .blurb("Push each answer as it is generated (live captions): every buffer holds the answer so far (json: status \"partial\"), the last one the whole answer")
                    .default_value(false)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("output-format", OutputFormat::Text)
                    .nick("Output format")
                    .blurb("What the src pad carries: text (each answer's text as one line, line breaks folded into spaces) or json (one object a line with the vlm-answer fields, every outcome included)")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt64::builder("answer-duration")
                    .nick("Answer duration")
                    .blurb("Display duration (ns) of each answer, e.g. for textoverlay")
                    .maximum(gst::ClockTime::MAX.nseconds())
                    .default_value(DEFAULT_ANSWER_DURATION)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("display", DEFAULT_DISPLAY)
                    .nick("Display")
                    .blurb("Answers closer than answer-duration on video_src: replace (a newer one replaces the one shown at once; one buffer per frame) or queue (each keeps its answer-duration; one buffer each)")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("caption-prompt")
                    .nick("Caption prompt")
                    .blurb("Asked automatically about the newest frame every caption-interval (periodic captions, same outputs as questions); empty = off")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt64::builder("caption-interval")
                    .nick("Caption interval")
                    .blurb("Running time (ns) between periodic captions; 0 = at every frame that joins the history")
                    .maximum(gst::ClockTime::MAX.nseconds())
                    .default_value(DEFAULT_CAPTION_INTERVAL)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("max-questions")
                    .nick("Max questions")
                    .blurb("Questions pending (being answered, or waiting to be pushed while the video runs) before the query pad blocks and question events and ask are refused")
                    .minimum(1)
                    .maximum(1024)
                    .default_value(DEFAULT_MAX_QUESTIONS)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("commit-answers", CommitAnswers::None)
                    .nick("Commit answers")
                    .blurb("Whether each question and its answer join the stream's history in question order, so later questions see the conversation (each waits for the previous answer's commit)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecFloat::builder("temp")
                    .nick("Temperature")
                    .blurb("Sampling temperature; 0 = greedy (answers reproduce)")
                    .minimum(0.0)
                    .maximum(10.0)
                    .default_value(d.temperature)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("seed")
                    .nick("Seed")
                    .blurb("Seed of the sampler (temp > 0); 4294967295 is llama.cpp's random seed, refused")
                    .maximum(u32::MAX - 1)
                    .default_value(d.seed)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecInt::builder("top-k")
                    .nick("Top K")
                    .blurb("Keep the K most likely tokens (temp > 0; 0 = all)")
                    .minimum(0)
                    .default_value(d.top_k)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecFloat::builder("top-p")
                    .nick("Top P")
                    .blurb("Nucleus sampling probability mass (temp > 0)")
                    .minimum(0.0)
                    .maximum(1.0)
                    .default_value(d.top_p)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecFloat::builder("min-p")
                    .nick("Min P")
                    .blurb("Drop tokens below this fraction of the best one's probability (temp > 0)")
                    .minimum(0.0)
                    .maximum(1.0)
                    .default_value(d.min_p)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt64::builder("answers")
                    .nick("Answers")
                    .blurb("Questions answered and handed to the text pad so far (pushed, unless downstream has ended)")
                    .read_only()
                    .build(),
            ]
            .into_iter()
            .chain(alerts::properties())
            .chain(counters::properties())
            .collect()
        });
        PROPS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        if crate::refused_while_running(self.obj().upcast_ref(), pspec) {
            return;
        }
        if self.set_alert_property(pspec.name(), value) {
            return;
        }
        let mut s = self.settings.lock();
        match pspec.name() {
            "placement" => {
                let p = value.get::<Option<String>>().unwrap().unwrap_or_default();
                if p.is_empty() || !p.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                    let message =
                        format!("invalid placement {p:?}: use auto or an engine's name; keeping {}", s.placement);
                    drop(s);
                    // As GLib reports an invalid property value: on stderr, where gst-launch-1.0
                    // shows it (an element being configured from a launch line has no bus yet),
                    // and on the bus for an application that sets it later.
                    glib::g_warning!("vlmquery", "{}: {message}", self.obj().name());
                    gst::element_imp_warning!(self, gst::LibraryError::Settings, ("{}", message));
                    return;
                }
                s.placement = p;
            }
            "max-tokens" => s.max_tokens = value.get().unwrap(),
            "exact-tokens" => s.exact_tokens = value.get().unwrap(),
            "stream-tokens" => s.stream_tokens = value.get().unwrap(),
            "output-format" => s.output_format = value.get().unwrap(),
            "answer-duration" => s.answer_duration = value.get().unwrap(),
            "display" => s.display = value.get().unwrap(),
            "caption-prompt" => s.caption_prompt = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            "caption-interval" => s.caption_interval = value.get().unwrap(),
            "max-questions" => {
                s.max_questions = value.get().unwrap();
                drop(s);
                // A query pad waiting for room looks again.
                let _shared = self.shared.lock();
                self.changed.notify_all();
            }
            "commit-answers" => s.commit_answers = value.get().unwrap(),
            "temp" => s.sampling.temperature = value.get().unwrap(),
            "seed" => s.sampling.seed = value.get().unwrap(),
            "top-k" => s.sampling.top_k = value.get().unwrap(),
            "top-p" => s.sampling.top_p = value.get().unwrap(),
            "min-p" => s.sampling.min_p = value.get().unwrap(),
            _ => unreachable!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        // (Not under the settings lock: the text pad's task takes the shared lock first.)
        if pspec.name() == "answers" {
            return self.shared.lock().stats.answers.to_value();
        }
        if let Some(value) = self.alert_property(pspec.name()).or_else(|| self.counters.value(pspec.name())) {
            return value;
        }
        let s = self.settings.lock();
        match pspec.name() {
            "placement" => s.placement.to_value(),
            "max-tokens" => s.max_tokens.to_value(),
            "exact-tokens" => s.exact_tokens.to_value(),
            "stream-tokens" => s.stream_tokens.to_value(),
            "output-format" => s.output_format.to_value(),
            "answer-duration" => s.answer_duration.to_value(),
            "display" => s.display.to_value(),
            "caption-prompt" => s.caption_prompt.to_value(),
            "caption-interval" => s.caption_interval.to_value(),
            "max-questions" => s.max_questions.to_value(),
            "commit-answers" => s.commit_answers.to_value(),
            "temp" => s.sampling.temperature.to_value(),
            "seed" => s.sampling.seed.to_value(),
            "top-k" => s.sampling.top_k.to_value(),
            "top-p" => s.sampling.top_p.to_value(),
            "min-p" => s.sampling.min_p.to_value(),
            _ => unreachable!(),
        }
    }

    fn signals() -> &'static [glib::subclass::Signal] {
        static SIGNALS: LazyLock<Vec<glib::subclass::Signal>> = LazyLock::new(|| {
            vec![
                glib::subclass::Signal::builder("ask")
                    .param_types([String::static_type()])
                    .return_type::<Option<String>>()
                    .action()
                    .class_handler(|args| {
                        let element = args[0].get::<super::VlmQuery>().expect("signal arg");
                        let text = args[1].get::<String>().unwrap_or_default();
                        Some(element.imp().ask(&text).to_value())
                    })
                    .build(),
            ]
        });
        SIGNALS.as_ref()
    }
}

impl GstObjectImpl for VlmQuery {}

impl ElementImpl for VlmQuery {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "VLM question answering",
                "Filter/Analyzer/Video/Text",
                "Answers questions about a video stream from a pinned version of its history",
                "gst-vlm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            let video = gst::Caps::builder("video/x-raw").any_features().build();
            let questions =
                gst::Caps::builder("text/x-raw").field("format", gst::List::new(["utf8", "pango-markup"])).build();
            let text = gst::Caps::builder("text/x-raw").field("format", "utf8").build();
            vec![
                gst::PadTemplate::new("sink", gst::PadDirection::Sink, gst::PadPresence::Always, &video).unwrap(),
                gst::PadTemplate::new("query", gst::PadDirection::Sink, gst::PadPresence::Always, &questions).unwrap(),
                gst::PadTemplate::new("src", gst::PadDirection::Src, gst::PadPresence::Always, &text).unwrap(),
                gst::PadTemplate::new("video_src", gst::PadDirection::Src, gst::PadPresence::Always, &video).unwrap(),
                gst::PadTemplate::new("subtitle_src", gst::PadDirection::Src, gst::PadPresence::Always, &text).unwrap(),
            ]
        });
        TEMPLATES.as_ref()
    }

    fn change_state(&self, transition: gst::StateChange) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        if transition == gst::StateChange::PausedToReady {
            self.stop();
        }
        // The text pad's task starts and stops with the pad's activation (`src_activatemode`).
        let ret = self.parent_change_state(transition)?;
        if transition == gst::StateChange::PausedToReady {
            self.reset();
        }
        Ok(ret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frame a question is about is the newest sampled frame at or before its time, also
    /// where the change gate held it: `ttft-from-capture-ms` counts from there, not from the
    /// older picture that stood for it (`picture-age-ms` tells that one's age).
    #[test]
    fn a_questions_frame_is_the_newest_sampled_one_held_or_not() {
        let (s, ms) = (gst::ClockTime::from_seconds, gst::ClockTime::from_mseconds);
        // Frame 1 captured at 0 s; the frames at 1 s and 2 s held (standing for it).
        let video = Video {
            frames: [SeenFrame { stream: 1, rt: Some(s(0)), pts: Some(s(0)), number: 1 }].into(),
            captures: [(1, s(0)), (1, s(1)), (1, s(2))].into(),
            ..Video::default()
        };
        assert_eq!(video.question_capture(Some(ms(2500)), 1), Some(s(2)));
        assert_eq!(video.question_capture(Some(ms(1500)), 1), Some(s(1)));
        assert_eq!(video.question_capture(Some(s(0)), 1), Some(s(0)));
        // An untimed question: its bound frame's capture.
        assert_eq!(video.question_capture(None, 1), Some(s(0)));
        // Before any frame: none.
        assert_eq!(Video::default().question_capture(Some(s(1)), 1), None);
    }

    /// After a flush a timed question binds to no frame seen before it (their running times
    /// start again), and a question answered about one of them (no frame came since: the source
    /// was spent) names its pts; its picture's age is unknown.
    #[test]
    fn frames_seen_before_a_flush_keep_their_pts_not_their_time() {
        let s = gst::ClockTime::from_seconds;
        let video = Video {
            stream_id: Some(1),
            frames: [SeenFrame { stream: 1, rt: Some(s(2)), pts: Some(s(2)), number: 2 }].into(),
            known_until: Some(s(3)),
            ..Video::default()
        };
        assert_eq!(video.at(s(3)), (2, Some(s(2))));
        let flushed = video.after_flush();
        assert_eq!(flushed.at(s(3)), (0, None));
        assert_eq!(flushed.known_until, None);
        assert_eq!(flushed.pts_up_to(2), Some(s(2)));
        assert_eq!(flushed.picture_age(2, Some(s(3))), None);
    }

    /// Two streams reach one vlmquery (a funnel): a question binds to a frame of the stream it
    /// is asked about, numbered in that stream (frame 25 of a busy stream was bound to a stream
    /// of 3 frames, and its answer waited for that stream's 25th frame for good).
    #[test]
    fn a_question_binds_to_the_frames_of_its_own_stream() {
        let s = gst::ClockTime::from_seconds;
        let seen = |stream, t, number| SeenFrame { stream, rt: Some(s(t)), pts: Some(s(t)), number };
        let video = Video {
            stream_id: Some(2),
            frames: [seen(2, 2, 3), seen(1, 2, 24), seen(1, 3, 25)].into(),
            captures: [(2, s(2)), (1, s(2)), (1, s(3))].into(),
            ..Video::default()
        };
        assert_eq!(video.at(s(3)), (3, Some(s(2))));
        assert_eq!(video.newest(), (3, Some(s(2))));
        assert_eq!(video.time_of(25), None);
        assert_eq!(video.pts_up_to(30), Some(s(2)));
        assert_eq!(video.question_capture(Some(s(3)), 3), Some(s(2)));
    }
}
