use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use parking_lot::{Condvar, Mutex};
use vlm_runtime::{AnswerReport, Lag, Question, Sampling, Stream};

use crate::events::{QuestionEvent, StreamEvent};
use crate::meta::VlmFrameMeta;
use crate::text::{question_text, without_nul};

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
    #[enum_value(name = "Text: each answer's text, ending with a newline", nick = "text")]
    Text,
    #[enum_value(name = "JSON: one object a line with the vlm-answer message's fields", nick = "json")]
    Json,
}
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
}

/// How an accepted question ended.
enum Outcome {
    Answered(AnswerReport),
    Cancelled(String),
    Failed(String),
}

/// One accepted question: answered on its own thread, pushed in question order by the source
/// pad's task.
struct Pending {
    job: Job,
    cancel: Arc<AtomicBool>,
    /// Filled by the answering thread (and taken by the source pad's task).
    outcome: Mutex<Option<Outcome>>,
    /// With `stream-tokens`: text generated and not yet pushed (taken by the source pad's task).
    partial: Mutex<String>,
    /// Whether some of its text went out before the answer ended.
    streamed: AtomicBool,
    /// Set once the answering thread has its outcome (and, with ordered commits, committed).
    finished: AtomicBool,
    /// With ordered commits: the frame after which its answer was committed to the history.
    committed_after: Mutex<Option<u64>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The lag of the question's stream when it was accepted.
    lag: Lag,
}

/// What the video sink pad has seen.
#[derive(Default)]
struct Video {
    stream: Option<Arc<Stream>>,
    /// (running time, pts, frame number) of recent registered frames.
    frames: VecDeque<(Option<gst::ClockTime>, Option<gst::ClockTime>, u64)>,
    /// Running time of the newest video buffer, registered or not.
    running_time: Option<gst::ClockTime>,
    /// The newest video buffer had no timestamp: a timed question cannot be matched to the
    /// video's time and binds to the newest frame instead of waiting for the video to pass it.
    untimed: bool,
    /// Timestamp (in the video segment) of the newest video buffer, and where it ends.
    pts: Option<gst::ClockTime>,
    end: Option<gst::ClockTime>,
    segment: Option<gst::FormattedSegment<gst::ClockTime>>,
    eos: bool,
    /// Running time of the frame the last periodic caption was asked at.
    last_caption: Option<gst::ClockTime>,
}

impl Video {
    fn newest(&self) -> (u64, Option<gst::ClockTime>) {
        self.frames.back().map_or((0, None), |&(_, pts, n)| (n, pts))
    }

    /// The newest frame at or before running time `t`.
    fn at(&self, t: gst::ClockTime) -> (u64, Option<gst::ClockTime>) {
        self.frames
            .iter()
            .rev()
            .find(|(rt, _, _)| rt.is_some_and(|rt| rt <= t))
            .map_or((0, None), |&(_, pts, n)| (n, pts))
    }
}

#[derive(Default)]
struct Shared {
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
    src_started: bool,
    /// The text pad has sent the video's current segment.
    segment_sent: bool,
    /// The last flow return of the source pad: errors travel upstream from the sink pads.
    srcresult: Option<gst::FlowError>,
    /// How far the text pad has told downstream about (answers and GAP events), in the video
    /// segment's time.
    text_position: Option<gst::ClockTime>,
    /// Ids of the most recent accepted questions: an id is answered once.
    recent_ids: VecDeque<String>,
}

pub struct VlmQuery {
    sinkpad: gst::Pad,
    querypad: gst::Pad,
    srcpad: gst::Pad,
    /// The video, passed through unchanged (for textoverlay and display, no tee needed).
    video_srcpad: gst::Pad,
    settings: Mutex<Settings>,
    shared: Mutex<Shared>,
    changed: Condvar,
    answered: Mutex<u64>,
}

/// Fields of `vlm-answer` that hold a clock time. A `GstClockTime` field is a plain `guint64`
/// in a structure (no type of its own to tell it by), so they are known by name: untimed
/// (`GST_CLOCK_TIME_NONE`) is `null` in JSON, not 18446744073709551615.
const CLOCK_TIME_FIELDS: [&str; 1] = ["pts"];

/// One line of JSON with a message's fields (strings, numbers, the pts in nanoseconds or null).
fn json_line(s: &gst::StructureRef) -> String {
    let mut object = serde_json::Map::new();
    for (name, value) in s.iter() {
        let v = if let Ok(v) = value.get::<String>() {
            serde_json::Value::from(v)
        } else if let Ok(v) = value.get::<f64>() {
            serde_json::Value::from(v)
        } else if CLOCK_TIME_FIELDS.contains(&name.as_str())
            && let Ok(v) = value.get::<Option<gst::ClockTime>>()
        {
            v.map_or(serde_json::Value::Null, |t| t.nseconds().into())
        } else if let Ok(v) = value.get::<u64>() {
            serde_json::Value::from(v)
        } else if let Ok(v) = value.get::<u32>() {
            serde_json::Value::from(v)
        } else {
            serde_json::Value::from(value.serialize().map(|s| s.to_string()).unwrap_or_default())
        };
        object.insert(name.to_string(), v);
    }
    serde_json::Value::Object(object).to_string() + "\n"
}

/// Name of the details structure of a warning about one question.
pub const QUESTION_DETAILS: &str = "vlm-question";

/// Why a question cannot be accepted now.
enum Refusal {
    Flushing,
    Ended,
    Full(usize),
    Duplicate(String),
}

/// How long the question pad may stay quiet after the video's EOS before the answers end
/// without its EOS (see `VlmQuery::maybe_finish`).
const QUERY_EOS_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Generated question ids (`q1`, `q2`, ...) count across every `vlmquery` of the process: unique
/// in a pipeline of several cameras and over the element's whole life.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Accepted question ids remembered to refuse a repeated one.
const RECENT_IDS: usize = 4096;

impl VlmQuery {
    fn question(&self, text: &str, id: Option<String>, max_tokens: Option<u32>) -> Question {
        let settings = self.settings.lock();
        Question {
            id: id.unwrap_or_else(|| format!("q{}", NEXT_ID.fetch_add(1, Ordering::Relaxed))),
            text: text.trim().to_owned(),
            max_tokens: max_tokens.unwrap_or(settings.max_tokens),
            ignore_eos: settings.exact_tokens,
            sampling: settings.sampling.clone(),
            arrival: Instant::now(),
        }
    }

    /// Accept a bound question and start answering it at once, on its own thread. With `block`,
    /// waits while `max-questions` are pending (backpressure on a streaming thread); without,
    /// refuses.
    fn accept(
        &self,
        shared: &mut parking_lot::MutexGuard<'_, Shared>,
        job: Job,
        block: bool,
    ) -> Result<String, Refusal> {
        let (max, ordered) = {
            let s = self.settings.lock();
            (s.max_questions as usize, s.commit_answers == CommitAnswers::Ordered)
        };
        loop {
            if shared.flushing {
                return Err(Refusal::Flushing);
            }
            if shared.eos {
                return Err(Refusal::Ended);
            }
            if shared.pending.len() < max {
                break;
            }
            if !block {
                return Err(Refusal::Full(max));
            }
            // The query pad's flush, or a text pad that stopped (the queue will not drain).
            if shared.query_flushing || shared.srcresult.is_some() {
                return Err(Refusal::Flushing);
            }
            self.changed.wait(shared);
        }
        if shared.recent_ids.contains(&job.question.id) {
            return Err(Refusal::Duplicate(job.question.id));
        }
        if shared.recent_ids.len() == RECENT_IDS {
            shared.recent_ids.pop_front();
        }
        shared.recent_ids.push_back(job.question.id.clone());
        let stream = job.stream.clone().or_else(|| shared.video.stream.clone());
        gst::debug!(
            CAT,
            imp = self,
            "question {} bound to {} frames: {:?}",
            job.question.id,
            job.frames,
            job.question.text
        );
        let id = job.question.id.clone();
        let pending = Arc::new(Pending {
            lag: stream.as_ref().map(|s| s.lag()).unwrap_or_default(),
            job: Job { stream, ..job },
            cancel: Arc::new(AtomicBool::new(false)),
            outcome: Mutex::new(None),
            partial: Mutex::new(String::new()),
            streamed: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            committed_after: Mutex::new(None),
            thread: Mutex::new(None),
        });
        // With ordered commits a question sees the answers before it: it waits for them.
        let previous = ordered.then(|| shared.pending.back().cloned()).flatten();
        let placement = self.settings.lock().placement.clone();
        let this = self.ref_counted();
        let p = Arc::clone(&pending);
        let thread = std::thread::Builder::new().name(format!("vlmquery-{id}")).spawn(move || {
            // A panic fails this question (its one vlm-answer says so); the queue goes on.
            let generate = std::panic::AssertUnwindSafe(|| this.generate(&p, previous.as_deref(), &placement, ordered));
            let outcome = std::panic::catch_unwind(generate).unwrap_or_else(|panic| {
                Outcome::Failed(format!("panic while answering: {}", vlm_runtime::error::panic_message(panic.as_ref())))
            });
            *p.outcome.lock() = Some(outcome);
            p.finished.store(true, Ordering::Release);
            let _guard = this.shared.lock();
            this.changed.notify_all();
        });
        match thread {
            Ok(t) => *pending.thread.lock() = Some(t),
            Err(e) => {
                *pending.outcome.lock() = Some(Outcome::Failed(format!("cannot start a thread: {e}")));
                pending.finished.store(true, Ordering::Release);
            }
        }
        shared.pending.push_back(pending);
        self.changed.notify_all();
        Ok(id)
    }

    /// Answer one question (on its own thread): wait for its version (or replay it elsewhere, as
    /// the placer decides), then generate.
    fn generate(&self, p: &Pending, previous: Option<&Pending>, placement: &str, commit: bool) -> Outcome {
        let q = &p.job.question;
        let mut frame = p.job.frames;
        if let Some(previous) = previous {
            let mut shared = self.shared.lock();
            while !previous.finished.load(Ordering::Acquire) && !p.cancel.load(Ordering::Acquire) {
                self.changed.wait(&mut shared);
            }
            // It sees the conversation so far: the newest version at or after the previous
            // answer's commit, which is appended after the newest frame registered then (so it
            // may hold frames newer than the question's own).
            if let Some(after) = *previous.committed_after.lock() {
                frame = frame.max(after);
            }
        }
        let Some(stream) = p.job.stream.clone() else {
            return Outcome::Failed("no video stream has reached vlmquery yet".into());
        };
        let stream_tokens = self.settings.lock().stream_tokens;
        let result = vlm_runtime::answer_frame(&stream, frame, q, placement, &p.cancel, |piece| {
            if stream_tokens {
                p.partial.lock().push_str(piece);
                let _shared = self.shared.lock();
                self.changed.notify_all();
            }
        });
        match result {
            Ok(report) if !report.cancelled => {
                if commit {
                    match stream.commit(&q.text, &report.token_ids, &p.cancel) {
                        Ok(r) => *p.committed_after.lock() = Some(r.number),
                        Err(e) => self.warn_question(
                            gst::StreamError::Failed,
                            Some(&q.id),
                            &format!("answer {} not committed: {e}", q.id),
                        ),
                    }
                }
                Outcome::Answered(report)
            }
            Ok(_) | Err(vlm_runtime::Error::Cancelled) => Outcome::Cancelled("cancelled".into()),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }

    /// Warn about a question that was not accepted.
    fn refused(&self, question: &Question, why: Refusal) {
        let why = match why {
            Refusal::Flushing => "the element is flushing".to_string(),
            Refusal::Ended => "the streams have ended (after EOS)".to_string(),
            Refusal::Full(n) => format!("{n} questions are already pending (max-questions)"),
            Refusal::Duplicate(id) => format!("id {id:?} was already taken by an earlier question"),
        };
        let message = format!("question {} {:?} refused: {why}", question.id, question.text);
        self.warn_question(gst::StreamError::Failed, Some(&question.id), &message);
    }

    /// A warning about one question (refused, malformed, not answered): the message says why,
    /// and its details (a `vlm-question` structure with `id` and `reason`) tell an application
    /// which question it was.
    fn warn_question(&self, domain: impl gst::MessageErrorDomain, id: Option<&str>, message: &str) {
        let details = gst::Structure::builder(QUESTION_DETAILS).field("id", id).field("reason", message).build();
        gst::warning!(CAT, imp = self, "{message}");
        let warning = gst::message::Warning::builder(domain, message).details(details).src(&*self.obj()).build();
        let _ = self.obj().post_message(warning);
    }

    /// After the video's EOS, the answers end (what is pending is answered, then the text pad
    /// gets its EOS) once the question pad has sent EOS too, is unlinked, or has been quiet for
    /// `QUERY_EOS_GRACE`: a question file read by `subparse` delivers its remaining questions
    /// back to back and then its EOS, while a question source that stays open (an appsrc, a
    /// live feed) never holds the pipeline's EOS (the question pad is sparse, as textoverlay's
    /// text pad is). A question arriving after that is refused with a warning. Returns how long
    /// to wait before asking again, if the answer is not yet.
    fn maybe_finish(&self, shared: &mut Shared) -> Option<std::time::Duration> {
        if !shared.video.eos || shared.eos {
            return None;
        }
        let quiet = shared.query_quiet_since.map_or(QUERY_EOS_GRACE, |t| t.elapsed());
        if shared.query_eos || !self.querypad.is_linked() || (shared.query_busy == 0 && quiet >= QUERY_EOS_GRACE) {
            shared.eos = true;
            self.changed.notify_all();
            return None;
        }
        Some(QUERY_EOS_GRACE.saturating_sub(quiet).max(std::time::Duration::from_millis(10)))
    }

    /// The flow return the sink pads give upstream.
    fn flow(&self) -> Result<gst::FlowSuccess, gst::FlowError> {
        let shared = self.shared.lock();
        if shared.flushing {
            return Err(gst::FlowError::Flushing);
        }
        match shared.srcresult {
            Some(e) => Err(e),
            None => Ok(gst::FlowSuccess::Ok),
        }
    }

    fn sink_chain(&self, buffer: gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        let mut shared = self.shared.lock();
        let rt = buffer.pts().and_then(|pts| shared.video.segment.as_ref().and_then(|s| s.to_running_time(pts)));
        if let Some((stream, number)) = buffer.meta::<VlmFrameMeta>().and_then(|m| m.position()) {
            if shared.video.stream.as_ref().is_none_or(|s| s.id() != stream) {
                shared.video.stream = vlm_runtime::stream::lookup(stream);
            }
            if shared.video.frames.len() == FRAME_HISTORY {
                shared.video.frames.pop_front();
            }
            shared.video.frames.push_back((rt, buffer.pts(), number));
            self.maybe_caption(&mut shared, rt, buffer.pts(), number);
        }
        if rt.is_some() {
            shared.video.running_time = rt;
        }
        shared.video.untimed = rt.is_none();
        if let Some(pts) = buffer.pts() {
            shared.video.pts = Some(pts);
            shared.video.end = Some(pts.saturating_add(buffer.duration().unwrap_or(gst::ClockTime::ZERO)));
        }
        // The text pad's task sends a GAP up to this frame before it goes on, so an overlay
        // that waits for text at this frame's time is never stuck.
        self.changed.notify_all();
        drop(shared);
        let video =
            if self.video_srcpad.is_linked() { self.video_srcpad.push(buffer) } else { Ok(gst::FlowSuccess::Ok) };
        self.flow().and(video)
    }

    /// Ask `caption-prompt` about frame `number` when `caption-interval` has passed since the
    /// last caption (periodic captions, no question needed). A caption that finds the queue
    /// full is skipped, not waited for.
    fn maybe_caption(
        &self,
        shared: &mut parking_lot::MutexGuard<'_, Shared>,
        rt: Option<gst::ClockTime>,
        pts: Option<gst::ClockTime>,
        number: u64,
    ) {
        let (prompt, interval) = {
            let s = self.settings.lock();
            (s.caption_prompt.clone(), gst::ClockTime::from_nseconds(s.caption_interval))
        };
        let due = match (rt, shared.video.last_caption) {
            (Some(rt), Some(last)) => rt >= last.saturating_add(interval) || rt < last,
            _ => true,
        };
        if prompt.trim().is_empty() || !due {
            return;
        }
        shared.video.last_caption = rt;
        let question = self.question(&prompt, None, None);
        let stream = shared.video.stream.clone();
        if self.accept(shared, Job { question, stream, frames: number, pts }, false).is_err() {
            gst::debug!(CAT, imp = self, "caption at frame {number} skipped: the question queue is full");
        }
    }

    /// Caps and allocation queries of the video go on through `video_src`.
    fn sink_query(&self, pad: &gst::Pad, query: &mut gst::QueryRef) -> bool {
        match query.view() {
            gst::QueryView::Caps(_) | gst::QueryView::AcceptCaps(_) | gst::QueryView::Allocation(_)
                if self.video_srcpad.is_linked() =>
            {
                self.video_srcpad.peer_query(query)
            }
            _ => gst::Pad::query_default(pad, Some(&*self.obj()), query),
        }
    }

    fn sink_event(&self, event: gst::Event) -> bool {
        use gst::EventView;
        if let Some(parsed) = QuestionEvent::parse(&event) {
            match parsed {
                Ok(q) => {
                    let mut shared = self.shared.lock();
                    let question = self.question(&q.text, q.id, q.max_tokens);
                    let (frames, pts) = shared.video.newest();
                    let stream = shared.video.stream.clone();
                    let refusal = question.clone();
                    // Refused, not waited for, when the queue is full: the video's thread must not
                    // wait for answers that may wait for the video (an overlay holds them until
                    // the video passes their time).
                    let accepted = self.accept(&mut shared, Job { question, stream, frames, pts }, false);
                    drop(shared);
                    return match accepted {
                        Ok(_) => true,
                        Err(Refusal::Flushing) => false,
                        Err(why) => {
                            self.refused(&refusal, why);
                            true
                        }
                    };
                }
                Err(reason) => {
                    let id = event.structure().and_then(|s| s.get::<String>("id").ok());
                    let message = match &id {
                        Some(id) => format!("malformed question {id}: {reason}"),
                        None => format!("malformed question: {reason}"),
                    };
                    self.warn_question(gst::StreamError::Format, id.as_deref(), &message);
                    return true;
                }
            }
        }
        if let Some(id) = StreamEvent::parse(&event) {
            self.shared.lock().video.stream = vlm_runtime::stream::lookup(id);
            return true;
        }
        match event.view() {
            // A new segment without a flush (concat, a non-flushing seek): the text pad follows
            // it, and its position starts again in the new segment's time.
            EventView::Segment(s) => {
                let mut shared = self.shared.lock();
                shared.video.segment = s.segment().downcast_ref::<gst::ClockTime>().cloned();
                shared.segment_sent = false;
                shared.text_position = None;
                drop(shared);
                self.video_srcpad.push_event(event);
                true
            }
            EventView::Eos(_) => {
                let mut shared = self.shared.lock();
                shared.video.eos = true;
                shared.query_quiet_since = Some(Instant::now());
                self.maybe_finish(&mut shared);
                self.changed.notify_all();
                // With no text pad linked the answers only go to the bus: the video's EOS waits
                // for them, or the pipeline would end (and cancel them) first. (A linked text
                // pad carries its own EOS after the last answer; the video must go on to EOS
                // then, as an overlay holds answers until the video passes their time.)
                if !self.srcpad.is_linked() {
                    while !shared.flushing && !shared.all_answered && shared.srcresult.is_none() {
                        self.changed.wait(&mut shared);
                    }
                }
                drop(shared);
                self.video_srcpad.push_event(event);
                true
            }
            // As in gst-plugins-rs: flushing first, downstream told (a push blocked there returns),
            // then the task paused; on stop, state reset and downstream told under the task's
            // stream lock before the task starts again.
            EventView::FlushStart(_) => {
                self.flush_start("flush");
                self.video_srcpad.push_event(event.clone());
                let pushed = self.srcpad.push_event(event);
                let _ = self.srcpad.pause_task();
                pushed
            }
            EventView::FlushStop(_) => {
                let task_lock = self.srcpad.stream_lock();
                self.flush_stop();
                self.video_srcpad.push_event(event.clone());
                let pushed = self.srcpad.push_event(event);
                drop(task_lock);
                self.start_task();
                pushed
            }
            // The video's own events go on with it; the text pad makes its own.
            _ if event.is_serialized() || event.is_sticky() => {
                self.video_srcpad.push_event(event);
                true
            }
            _ => gst::Pad::event_default(&self.sinkpad, Some(&*self.obj()), event),
        }
    }

    fn query_chain(&self, buffer: gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        self.shared.lock().query_busy += 1;
        let flow = self.take_question(buffer);
        let mut shared = self.shared.lock();
        // (A stop resets the count while a question is in here.)
        shared.query_busy = shared.query_busy.saturating_sub(1);
        shared.query_quiet_since = Some(Instant::now());
        self.maybe_finish(&mut shared);
        flow
    }

    /// One question buffer: wait for the video to reach its time, then accept it.
    fn take_question(&self, buffer: gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        let map = buffer.map_readable().map_err(|_| gst::FlowError::Error)?;
        let mut shared = self.shared.lock();
        let Ok(text) = question_text(&map, shared.query_markup) else {
            drop(shared);
            gst::element_imp_warning!(self, gst::StreamError::Format, ("question buffer is not UTF-8; ignored"));
            return self.query_flow();
        };
        drop(map);
        if text.is_empty() {
            drop(shared);
            return self.query_flow();
        }
        let question = self.question(&text, None, None);
        let t = buffer.pts().and_then(|pts| shared.query_segment.as_ref().and_then(|s| s.to_running_time(pts)));
        let (frames, pts) = match t {
            Some(t) => {
                // Wait for the video to pass the question's time, so every frame up to it is known.
                while !shared.flushing
                    && !shared.query_flushing
                    && !shared.video.eos
                    && !shared.video.untimed
                    && shared.video.running_time.is_none_or(|rt| rt <= t)
                {
                    self.changed.wait(&mut shared);
                }
                if shared.query_flushing {
                    return Err(gst::FlowError::Flushing);
                }
                if shared.flushing {
                    drop(shared);
                    self.refused(&question, Refusal::Flushing);
                    return self.query_flow();
                }
                if shared.video.untimed { shared.video.newest() } else { shared.video.at(t) }
            }
            None => shared.video.newest(),
        };
        let stream = shared.video.stream.clone();
        let refusal = question.clone();
        let accepted = self.accept(&mut shared, Job { question, stream, frames, pts }, true);
        drop(shared);
        if let Err(why) = accepted {
            self.refused(&refusal, why);
        }
        self.query_flow()
    }

    /// The flow return of the query pad: FLUSHING only while the query pad itself flushes. A
    /// flush of the video refuses the questions that arrive meanwhile (with a warning) but does
    /// not pause the question source's task, which would never start again.
    fn query_flow(&self) -> Result<gst::FlowSuccess, gst::FlowError> {
        let shared = self.shared.lock();
        match shared.srcresult {
            _ if shared.query_flushing => Err(gst::FlowError::Flushing),
            Some(e) if e != gst::FlowError::Flushing => Err(e),
            _ => Ok(gst::FlowSuccess::Ok),
        }
    }

    fn query_event(&self, event: gst::Event) -> bool {
        use gst::EventView;
        match event.view() {
            EventView::Caps(c) => {
                self.shared.lock().query_markup =
                    c.caps().structure(0).and_then(|s| s.get::<&str>("format").ok()) == Some("pango-markup");
            }
            EventView::Segment(s) => {
                self.shared.lock().query_segment = s.segment().downcast_ref::<gst::ClockTime>().cloned()
            }
            EventView::Eos(_) => {
                let mut shared = self.shared.lock();
                shared.query_eos = true;
                self.maybe_finish(&mut shared);
            }
            // A flush of the questions alone: unblock a question waiting on the query pad; the
            // answers and the video go on.
            EventView::FlushStart(_) => {
                let mut shared = self.shared.lock();
                shared.query_flushing = true;
                self.changed.notify_all();
            }
            EventView::FlushStop(_) => {
                let mut shared = self.shared.lock();
                shared.query_flushing = false;
                shared.query_eos = false;
                shared.query_segment = None;
            }
            _ => (),
        }
        true
    }

    /// The `ask` action signal: bind to the newest registered frame. Refused (no id, a warning)
    /// after EOS, while flushing, or when `max-questions` are pending.
    fn ask(&self, text: &str) -> Option<String> {
        if text.trim().is_empty() {
            gst::element_imp_warning!(self, gst::LibraryError::Settings, ("ask: empty question ignored"));
            return None;
        }
        let mut shared = self.shared.lock();
        let question = self.question(text, None, None);
        let stream = shared.video.stream.clone();
        let frames = stream.as_ref().map_or(0, |s| s.registered());
        let pts = shared.video.frames.iter().rev().find(|f| f.2 <= frames).and_then(|f| f.1);
        let refusal = question.clone();
        let accepted = self.accept(&mut shared, Job { question, stream, frames, pts }, false);
        drop(shared);
        accepted.map_err(|why| self.refused(&refusal, why)).ok()
    }

    /// Cancel every pending question (each still gets its `vlm-answer`, `cancelled`) and stop
    /// the source task's output until `flush_stop`.
    fn flush_start(&self, reason: &str) {
        let pending = {
            let mut shared = self.shared.lock();
            shared.flushing = true;
            for p in &shared.pending {
                p.cancel.store(true, Ordering::Release);
                if let Some(stream) = &p.job.stream {
                    stream.wake();
                }
            }
            self.changed.notify_all();
            std::mem::take(&mut shared.pending)
        };
        for p in pending {
            self.post_answer(&p, Outcome::Cancelled(reason.into()));
        }
    }

    /// Reset what the flush made void; the query pad's own state (its caps, segment and EOS,
    /// sent once) stays.
    fn flush_stop(&self) {
        let mut shared = self.shared.lock();
        let old = std::mem::take(&mut *shared);
        *shared = Shared {
            video: Video { stream: old.video.stream, ..Video::default() },
            query_segment: old.query_segment,
            query_markup: old.query_markup,
            query_eos: old.query_eos,
            query_busy: old.query_busy,
            query_flushing: old.query_flushing,
            recent_ids: old.recent_ids,
            ..Shared::default()
        };
    }

    fn start_task(&self) {
        let this = self.ref_counted();
        let _ = self.srcpad.start_task(move || this.task_iteration());
    }

    /// One iteration of the source pad's task: push the oldest question's answer once it has
    /// one (answers go out in question order), or EOS after the last one.
    fn task_iteration(&self) {
        enum Next {
            /// Text of the oldest answer generated so far (`stream-tokens`).
            Partial(Arc<Pending>, Option<gst::ClockTime>),
            Answer(Arc<Pending>, Option<gst::ClockTime>),
            Gap(gst::ClockTime, gst::ClockTime),
            Eos,
        }
        let next = {
            let mut shared = self.shared.lock();
            loop {
                if shared.flushing {
                    drop(shared);
                    let _ = self.srcpad.pause_task();
                    return;
                }
                // An answer (or a piece of it) is shown from where the video is when it came:
                // the end of the newest frame (the next frame is the first that can show it).
                let shown_at = |shared: &mut Shared, p: &Pending| {
                    let at = shared.video.end.or(p.job.pts);
                    if let Some(at) = at {
                        let end =
                            at.saturating_add(gst::ClockTime::from_nseconds(self.settings.lock().answer_duration));
                        shared.text_position = shared.text_position.max(Some(end));
                    }
                    at
                };
                // (Before the answers are looked at: it may end them now.)
                let recheck = self.maybe_finish(&mut shared);
                match shared.pending.front() {
                    Some(p) if p.outcome.lock().is_some() => {
                        let p = shared.pending.pop_front().expect("front");
                        let at = shown_at(&mut shared, &p);
                        break Next::Answer(p, at);
                    }
                    Some(p) if !p.partial.lock().is_empty() => {
                        let p = Arc::clone(p);
                        let at = shown_at(&mut shared, &p);
                        break Next::Partial(p, at);
                    }
                    None if shared.eos => {
                        shared.all_answered = true;
                        break Next::Eos;
                    }
                    _ => (),
                }
                // Nothing to say up to the newest frame: tell downstream, so it never waits.
                if let Some(end) = shared.video.end
                    && shared.text_position.is_none_or(|t| t < end)
                {
                    let start = shared.text_position.unwrap_or(shared.video.pts.unwrap_or(end));
                    shared.text_position = Some(end);
                    break Next::Gap(start, end - start);
                }
                match recheck {
                    Some(after) => {
                        self.changed.wait_for(&mut shared, after);
                    }
                    None => self.changed.wait(&mut shared),
                }
            }
        };
        self.changed.notify_all();
        self.ensure_src_started();
        let pending = match next {
            Next::Gap(start, duration) => {
                self.srcpad.push_event(gst::event::Gap::builder(start).duration(duration).build());
                return;
            }
            Next::Partial(p, at) => {
                self.push_partial(&p, at);
                return;
            }
            Next::Answer(p, at) => Some((p, at)),
            Next::Eos => None,
        };
        let Some((p, at)) = pending else {
            gst::debug!(CAT, imp = self, "all questions answered, EOS");
            self.srcpad.push_event(gst::event::Eos::new());
            let _ = self.srcpad.pause_task();
            return;
        };
        if let Some(t) = p.thread.lock().take() {
            let _ = t.join();
        }
        // The last pieces, generated after the task last looked.
        let streamed = self.push_partial(&p, at);
        let outcome = p.outcome.lock().take().expect("checked above");
        let answered = matches!(outcome, Outcome::Answered(_));
        let message = self.post_answer(&p, outcome);
        let status = message.get::<String>("status").unwrap_or_default();
        let (format, duration) = {
            let s = self.settings.lock();
            (s.output_format, gst::ClockTime::from_nseconds(s.answer_duration))
        };
        let line = match format {
            // Streamed text ends with the newline alone, so the text pad's bytes are the same.
            OutputFormat::Text if streamed => "\n".to_owned(),
            OutputFormat::Text if answered => message.get::<String>("text").unwrap_or_default() + "\n",
            // Nothing to show: say so for the time the answer would have taken, so an overlay
            // waiting for text goes on.
            OutputFormat::Text => {
                if let Some(at) = at {
                    self.srcpad.push_event(gst::event::Gap::builder(at).duration(duration).build());
                }
                return;
            }
            OutputFormat::Json => json_line(&message),
        };
        *self.answered.lock() += 1;
        self.push_text(&p, at, line, &status);
    }

    /// With `stream-tokens`: push the text of `p` generated since the last push (text mode: the
    /// text itself; json: an object with `status` `partial`). Returns whether `p` streamed any.
    fn push_partial(&self, p: &Pending, at: Option<gst::ClockTime>) -> bool {
        let piece = std::mem::take(&mut *p.partial.lock());
        if !piece.is_empty() {
            let line = match self.settings.lock().output_format {
                OutputFormat::Text => piece,
                OutputFormat::Json => json_line(
                    &gst::Structure::builder("vlm-answer")
                        .field("id", &p.job.question.id)
                        .field("stream", p.job.stream.as_ref().map_or("", |s| s.name()))
                        .field("status", "partial")
                        .field("text", without_nul(&piece).as_ref())
                        .build(),
                ),
            };
            p.streamed.store(true, Ordering::Release);
            self.push_text(p, at, line, "partial");
        }
        p.streamed.load(Ordering::Acquire)
    }

    /// Push one text buffer of `p`'s answer, shown from `at` for `answer-duration`, with the
    /// answer meta naming its question.
    fn push_text(&self, p: &Pending, at: Option<gst::ClockTime>, text: String, status: &str) {
        let duration = self.settings.lock().answer_duration;
        let mut buffer = gst::Buffer::from_mut_slice(text.into_bytes());
        {
            let buffer = buffer.get_mut().unwrap();
            buffer.set_pts(at);
            buffer.set_duration(gst::ClockTime::from_nseconds(duration));
            let stream = p.job.stream.as_ref().map_or("", |s| s.name());
            crate::meta::add_answer_meta(buffer, &p.job.question.id, stream, status);
        }
        match self.srcpad.push(buffer) {
            // Answers read from the bus, the video shown: an unlinked text pad is fine.
            Err(gst::FlowError::NotLinked) if self.video_srcpad.is_linked() => {
                gst::log!(CAT, imp = self, "text pad not linked; answer {} on the bus only", p.job.question.id)
            }
            Err(e) => self.flow_error(e),
            Ok(_) => (),
        }
    }

    /// The source pad's push failed: remember it for upstream, post an error for a real failure
    /// (as gst-plugins-rs elements do), and pause.
    fn flow_error(&self, e: gst::FlowError) {
        gst::debug!(CAT, imp = self, "answer push: {e:?}");
        // Flushing ends with the flush (the task starts again); anything else travels upstream.
        if e != gst::FlowError::Flushing {
            self.shared.lock().srcresult = Some(e);
            self.changed.notify_all();
        }
        crate::post_flow_error(self.obj().upcast_ref(), e);
        let _ = self.srcpad.pause_task();
    }

    /// Stream start and caps once, then the video's segment whenever it changed.
    fn ensure_src_started(&self) {
        let (start, segment) = {
            let mut shared = self.shared.lock();
            if shared.src_started && shared.segment_sent {
                return;
            }
            let start = !shared.src_started;
            (shared.src_started, shared.segment_sent) = (true, true);
            (start, shared.video.segment.clone().unwrap_or_default())
        };
        if start {
            let stream_id = format!("{}/answers", self.obj().name());
            self.srcpad.push_event(gst::event::StreamStart::new(&stream_id));
            self.srcpad
                .push_event(gst::event::Caps::new(&gst::Caps::builder("text/x-raw").field("format", "utf8").build()));
        }
        self.srcpad.push_event(gst::event::Segment::new(&segment));
    }

    /// Post the question's one `vlm-answer` message (and return it).
    fn post_answer(&self, p: &Pending, outcome: Outcome) -> gst::Structure {
        let q = &p.job.question;
        let stream = p.job.stream.as_ref().map_or("", |s| s.name());
        let mut msg = gst::Structure::builder("vlm-answer")
            .field("id", &q.id)
            .field("question", &q.text)
            .field("stream", stream)
            .field("lag-frames", p.lag.frames)
            .field("lag-ms", p.lag.ms)
            .field("pts", p.job.pts);
        msg = match &outcome {
            Outcome::Answered(r) => {
                gst::info!(
                    CAT,
                    imp = self,
                    "answer {} ({} frames, {} on {}): ttft {:.0} ms, {} tokens, {:.0} ms: {:?}",
                    q.id,
                    r.frames,
                    r.path.name(),
                    r.engine,
                    r.ttft_ms,
                    r.tokens,
                    r.total_ms,
                    r.text
                );
                let answered = msg
                    .field("status", "answered")
                    .field("text", without_nul(&r.text).as_ref())
                    .field("frames", r.frames)
                    .field("frame", r.frame)
                    .field("history-cells", r.history_cells)
                    .field("engine", &r.engine)
                    .field("path", r.path.name())
                    .field("ttft-ms", r.ttft_ms)
                    .field("wait-ms", r.wait_ms)
                    .field("queue-ms", r.queue_ms)
                    .field("prepare-ms", r.prepare_ms)
                    .field("tokens", r.tokens)
                    .field("total-ms", r.total_ms)
                    .field("estimate-ms", r.estimate_ms.unwrap_or(-1.0));
                // Answered, but with nothing to show: said, so an application can tell it from
                // an answer it missed.
                if r.tokens == 0 {
                    answered.field("reason", "empty: the model ended its answer before any token")
                } else {
                    answered
                }
            }
            Outcome::Cancelled(reason) | Outcome::Failed(reason) => {
                let status = if matches!(outcome, Outcome::Failed(_)) { "failed" } else { "cancelled" };
                gst::debug!(CAT, imp = self, "question {} {status}: {reason}", q.id);
                if status == "failed" {
                    let message = format!("question {} not answered: {reason}", q.id);
                    self.warn_question(gst::StreamError::Failed, Some(&q.id), &message);
                }
                let total = q.arrival.elapsed().as_secs_f64() * 1e3;
                // No version was bound: its history length is unknown (0), the frame it waited
                // for is `frame`.
                msg.field("status", status)
                    .field("reason", reason)
                    .field("text", "")
                    .field("frames", 0u64)
                    .field("frame", p.job.frames)
                    .field("engine", "")
                    .field("path", "")
                    .field("ttft-ms", total)
                    .field("wait-ms", total)
                    .field("tokens", 0u32)
                    .field("total-ms", total)
            }
        };
        let msg = msg.build();
        let _ = self.obj().post_message(gst::message::Element::builder(msg.clone()).src(&*self.obj()).build());
        msg
    }

    fn stop(&self) {
        self.flush_start("the element stopped");
        let _ = self.srcpad.stop_task();
        // Still flushing until READY->PAUSED starts again: a chain function woken by the flush
        // (the query pad's, waiting for the video) must see it and return, or deactivating its
        // pad would wait for it forever.
        *self.shared.lock() = Shared { flushing: true, ..Shared::default() };
    }
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
        let srcpad = gst::Pad::builder_from_template(&klass.pad_template("src").unwrap()).build();
        let video_srcpad = gst::Pad::builder_from_template(&klass.pad_template("video_src").unwrap())
            .event_function(|_, parent, event| {
                VlmQuery::catch_panic_pad_function(parent, || false, |imp| imp.sinkpad.push_event(event))
            })
            .query_function(|_, parent, query| {
                VlmQuery::catch_panic_pad_function(parent, || false, |imp| imp.sinkpad.peer_query(query))
            })
            .build();
        VlmQuery {
            sinkpad,
            querypad,
            srcpad,
            video_srcpad,
            settings: Mutex::new(Settings::default()),
            // Refusing until READY->PAUSED: a question accepted before would be dropped there.
            shared: Mutex::new(Shared { flushing: true, ..Shared::default() }),
            changed: Condvar::new(),
            answered: Mutex::new(0),
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
                    .blurb("Push each answer's text as it is generated (live captions): text mode sends the pieces and then the newline, json mode one object per piece with status \"partial\" and then the whole answer; the oldest answer streams, later ones follow in question order")
                    .default_value(false)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("output-format", OutputFormat::Text)
                    .nick("Output format")
                    .blurb("What the src pad carries: text (each answer's text and a newline) or json (one object a line with the vlm-answer fields, every outcome included)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("answer-duration")
                    .nick("Answer duration")
                    .blurb("Display duration (ns) set on each answer buffer, e.g. for textoverlay")
                    .maximum(gst::ClockTime::MAX.nseconds())
                    .default_value(DEFAULT_ANSWER_DURATION)
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
                    .blurb("Questions pending (being answered or waiting to be pushed) before the query pad blocks and question events and ask are refused")
                    .minimum(1)
                    .maximum(1024)
                    .default_value(DEFAULT_MAX_QUESTIONS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("commit-answers", CommitAnswers::None)
                    .nick("Commit answers")
                    .blurb("Whether each question and its answer become part of the stream's history (in question order), so later questions see the conversation: a question waits for the previous answer's commit and binds the newest version at or after it (which may hold frames newer than the question's own)")
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
                    .blurb("Seed of the sampler (temp > 0)")
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
                    .blurb("Answers pushed so far")
                    .read_only()
                    .build(),
            ]
        });
        PROPS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
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
            "caption-prompt" => s.caption_prompt = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            "caption-interval" => s.caption_interval = value.get().unwrap(),
            "max-questions" => s.max_questions = value.get().unwrap(),
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
        let s = self.settings.lock();
        match pspec.name() {
            "placement" => s.placement.to_value(),
            "max-tokens" => s.max_tokens.to_value(),
            "exact-tokens" => s.exact_tokens.to_value(),
            "stream-tokens" => s.stream_tokens.to_value(),
            "output-format" => s.output_format.to_value(),
            "answer-duration" => s.answer_duration.to_value(),
            "caption-prompt" => s.caption_prompt.to_value(),
            "caption-interval" => s.caption_interval.to_value(),
            "max-questions" => s.max_questions.to_value(),
            "commit-answers" => s.commit_answers.to_value(),
            "temp" => s.sampling.temperature.to_value(),
            "seed" => s.sampling.seed.to_value(),
            "top-k" => s.sampling.top_k.to_value(),
            "top-p" => s.sampling.top_p.to_value(),
            "min-p" => s.sampling.min_p.to_value(),
            "answers" => self.answered.lock().to_value(),
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
            ]
        });
        TEMPLATES.as_ref()
    }

    fn change_state(&self, transition: gst::StateChange) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        if transition == gst::StateChange::PausedToReady {
            self.stop();
        }
        let ret = self.parent_change_state(transition)?;
        if transition == gst::StateChange::ReadyToPaused {
            *self.shared.lock() = Shared::default();
            self.start_task();
        }
        Ok(ret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_pts_of_an_untimed_question_is_null_and_counts_stay_numbers() {
        gst::init().unwrap();
        let line = |pts: Option<gst::ClockTime>| {
            let s = gst::Structure::builder("vlm-answer")
                .field("id", "q1")
                .field("lag-frames", u64::MAX - 1)
                .field("tokens", 3u32)
                .field("pts", pts)
                .build();
            serde_json::from_str::<serde_json::Value>(&json_line(&s)).unwrap()
        };
        let untimed = line(None);
        assert_eq!(untimed["pts"], serde_json::Value::Null, "{untimed}");
        assert_eq!(untimed["lag-frames"], u64::MAX - 1);
        assert_eq!(untimed["tokens"], 3);
        assert_eq!(line(Some(gst::ClockTime::from_mseconds(1500)))["pts"], 1_500_000_000u64);
    }
}
