//! Question intake of `vlmquery`: the video and query sink pads, the `ask` signal and periodic
//! captions; binding each question to a version of its stream's history (by running time) and
//! answering it on its own thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gst::prelude::*;
use gst::subclass::prelude::*;
use parking_lot::Mutex;
use vlm_runtime::{CommitTurn, Question, Stream};

use super::{CAT, CommitAnswers, FRAME_HISTORY, Job, Outcome, Pending, SeenFrame, Shared, VlmQuery};
use crate::events::{QuestionEvent, StandingEvent, StreamEvent};
use crate::meta::VlmFrameMeta;
use crate::text::question_text;

/// Name of the details structure of a warning about one question.
pub const QUESTION_DETAILS: &str = "vlm-question";

/// Why a question cannot be accepted now.
enum Refusal {
    Flushing,
    /// The text pad stopped with this flow return (its queue will not drain).
    Downstream(gst::FlowError),
    Ended,
    Full(usize),
    Duplicate(String),
}

/// How long the question pad may stay quiet after the video's EOS before the answers end
/// without its EOS (see `VlmQuery::maybe_finish`).
const QUERY_EOS_GRACE: Duration = Duration::from_secs(1);
/// Longest a question pad that keeps sending holds the answers' end after the video's EOS.
const QUERY_EOS_LIMIT: Duration = Duration::from_secs(10);

/// Generated question ids (`q1`, `q2`, ...) count across every `vlmquery` of the process: unique
/// in a pipeline of several cameras and over the element's whole life.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Accepted question ids remembered to refuse a repeated one.
const RECENT_IDS: usize = 4096;

/// Why a question that waited for its stream's first frame fails at the video's EOS.
const NO_FRAME: &str = "the video ended before any frame was registered";

/// How often a question waiting for its stream's first frame looks at the stream again (a
/// frame arriving here wakes it at once; this catches a registration seen nowhere else).
const FIRST_FRAME_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// Longest such a question waits for its first frame to pass this element once it is registered.
const FIRST_FRAME_PASS: std::time::Duration = std::time::Duration::from_secs(1);

impl Pending {
    /// The question's stream: the one it was bound to when accepted, or (accepted before any
    /// stream reached the element) the one whose first frame it waited for.
    pub(super) fn stream(&self) -> Option<&Arc<Stream>> {
        self.job.stream.as_ref().or_else(|| self.late_stream.get())
    }

    /// The pts of the frame the question is bound to (for one that waited for its stream's
    /// first frame, that frame's), and how old its picture was at the question's time.
    pub(super) fn picture(&self) -> (Option<gst::ClockTime>, Option<f64>) {
        self.late_picture.get().copied().unwrap_or((self.job.pts, self.picture_age_ms))
    }
}

impl VlmQuery {
    /// A question as asked; without an id of its own it gets `q<N>` from the process's counter,
    /// passing over any id this element has accepted lately (an application may have chosen
    /// `q7` itself).
    fn question(&self, shared: &Shared, text: &str, id: Option<String>, max_tokens: Option<u32>) -> Question {
        let id = id.unwrap_or_else(|| {
            loop {
                let id = format!("q{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
                if !shared.recent_ids.contains(&id) {
                    break id;
                }
            }
        });
        let settings = self.settings.lock();
        Question {
            id,
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
        let ordered = self.settings.lock().commit_answers == CommitAnswers::Ordered;
        loop {
            // (Read again after each wait: `max-questions` may change while playing.)
            let max = self.settings.lock().max_questions as usize;
            if shared.flushing {
                return Err(Refusal::Flushing);
            }
            if shared.eos {
                return Err(Refusal::Ended);
            }
            if shared.taken_slots() < max {
                break;
            }
            if !block {
                return Err(Refusal::Full(max));
            }
            // The query pad's flush, or a text pad that stopped (the queue will not drain).
            if shared.query_flushing || shared.srcresult.is_some() {
                shared.query_waiting = false;
                return Err(match shared.srcresult {
                    Some(flow) if !shared.query_flushing && flow != gst::FlowError::Flushing => {
                        Refusal::Downstream(flow)
                    }
                    _ => Refusal::Flushing,
                });
            }
            // (The video's EOS does not wait for a question that waits for room.)
            shared.query_waiting = true;
            self.changed.notify_all();
            self.changed.wait(shared);
        }
        shared.query_waiting = false;
        if shared.recent_ids.contains(&job.question.id) {
            return Err(Refusal::Duplicate(job.question.id));
        }
        if shared.recent_ids.len() == RECENT_IDS {
            shared.recent_ids.pop_front();
        }
        shared.recent_ids.push_back(job.question.id.clone());
        let stream = job.stream.clone().or_else(|| shared.video.stream());
        gst::debug!(
            CAT,
            imp = self,
            "question {} bound to {} frames: {:?}",
            job.question.id,
            job.frames,
            job.question.text
        );
        let id = job.question.id.clone();
        let picture_age_ms = shared.video.picture_age(job.frames, job.at);
        let since_arrival = gst::ClockTime::from_nseconds(job.question.arrival.elapsed().as_nanos() as u64);
        let arrival_rt = self.obj().current_running_time().map(|now| now.saturating_sub(since_arrival));
        let pending = Arc::new(Pending {
            lag: stream.as_ref().map(|s| s.lag()).unwrap_or_default(),
            picture_age_ms,
            arrival_rt,
            job: Job { stream, ..job },
            cancel: Arc::new(AtomicBool::new(false)),
            outcome: Mutex::new(None),
            message: Mutex::new(None),
            decided: AtomicBool::new(false),
            posted: AtomicBool::new(false),
            text: Mutex::new(String::new()),
            text_taken: AtomicUsize::new(0),
            commit: CommitTurn::new(),
            thread: Mutex::new(None),
            late_stream: std::sync::OnceLock::new(),
            late_picture: std::sync::OnceLock::new(),
        });
        // With ordered commits a question sees the answers before it on its stream: it waits for
        // the newest of them (another stream's answer, after a stream switch, is not its history).
        let same_stream = |q: &Pending| match (q.stream(), pending.stream()) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        let previous = ordered.then(|| shared.pending.iter().rev().find(|q| same_stream(q)).cloned()).flatten();
        let placement = self.settings.lock().placement.clone();
        let this = self.ref_counted();
        let p = Arc::clone(&pending);
        self.counters.accepted();
        let thread = std::thread::Builder::new().name(format!("vlmquery-{id}")).spawn(move || {
            // (Notified here, where no lock of the element is held.)
            this.obj().notify("questions-accepted");
            // A panic fails this question (its one vlm-answer says so); the queue goes on.
            let generate = std::panic::AssertUnwindSafe(|| this.generate(&p, previous.as_deref(), &placement, ordered));
            let outcome = std::panic::catch_unwind(generate).unwrap_or_else(|panic| {
                Outcome::Failed(format!("panic while answering: {}", vlm_runtime::error::panic_message(panic.as_ref())))
            });
            *p.outcome.lock() = Some(outcome);
            p.commit.end();
            // Its vlm-answer goes out now, from this thread, unless an earlier question is still
            // being answered; the source pad's task is woken after, so that it does not post it
            // instead (an application may stop the pipeline from a sync bus handler on the
            // answer or on a failed question's warning, which a pad's own task cannot do).
            this.post_finished();
            let _guard = this.shared.lock();
            this.changed.notify_all();
        });
        match thread {
            Ok(t) => *pending.thread.lock() = Some(t),
            Err(e) => {
                *pending.outcome.lock() = Some(Outcome::Failed(format!("cannot start a thread: {e}")));
                pending.commit.end();
            }
        }
        shared.pending.push_back(pending);
        self.changed.notify_all();
        Ok(id)
    }

    /// Accept the timed questions ahead of the video whose time it has passed, in arrival order,
    /// while `max-questions` slots are free (called as the video goes on, and while its EOS
    /// waits). Returns those refused, to be said with no lock held.
    fn bind_ahead(&self, shared: &mut parking_lot::MutexGuard<'_, Shared>) -> Vec<(Question, Refusal)> {
        let max = self.settings.lock().max_questions as usize;
        let mut refused = vec![];
        let mut i = 0;
        while let Some(at) = shared.ahead.get(i).map(|a| a.at) {
            if !shared.video_past(at) {
                i += 1; // (one timed earlier, behind it, may be due)
                continue;
            }
            if shared.taken_slots() >= max && !shared.flushing {
                break;
            }
            let Some(ahead) = shared.ahead.remove(i) else { break };
            let (frames, pts) = if shared.video.untimed { shared.video.newest() } else { shared.video.at(at) };
            let stream = shared.video.stream();
            let question = ahead.question.clone();
            let job = Job { question: ahead.question, stream, frames, pts, at: Some(at) };
            if let Err(why) = self.accept(shared, job, false) {
                refused.push((question, why));
            }
        }
        refused
    }

    /// Refuse every timed question still ahead of the video (a flush, a stop).
    pub(super) fn refuse_ahead(&self) {
        let ahead = std::mem::take(&mut self.shared.lock().ahead);
        for a in ahead {
            self.refused(&a.question, Refusal::Flushing);
        }
    }

    /// Say the refusals `bind_ahead` returned (no lock held).
    fn refused_all(&self, refused: Vec<(Question, Refusal)>) {
        for (question, why) in refused {
            self.refused(&question, why);
        }
    }

    /// Answer one question (on its own thread): wait for its version (or replay it elsewhere, as
    /// the placer decides), then generate. A question bound to no frame first waits for its
    /// stream's first one (`first_frame`): nothing is answered from no frames.
    fn generate(&self, p: &Pending, previous: Option<&Pending>, placement: &str, commit: bool) -> Outcome {
        let q = &p.job.question;
        let mut frame = p.job.frames;
        let mut first = None;
        if frame == 0 {
            match self.first_frame(p) {
                Ok((stream, number)) => {
                    frame = number;
                    if p.job.stream.is_none() {
                        let _ = p.late_stream.set(Arc::clone(&stream));
                    }
                    first = Some(stream);
                }
                Err(true) => return Outcome::Cancelled("cancelled".into()),
                Err(false) => return Outcome::Failed(NO_FRAME.into()),
            }
        }
        if let Some(previous) = previous {
            // It sees the conversation so far: the newest version at or after the previous
            // answer's commit, which is appended after the newest frame registered then (so it
            // may hold frames newer than the question's own).
            frame = previous.commit.wait(frame, &p.cancel);
        }
        let Some(stream) = first.or_else(|| p.job.stream.clone()) else {
            return Outcome::Failed("no video stream has reached vlmquery yet".into());
        };
        let stream_tokens = self.settings.lock().stream_tokens;
        let result = vlm_runtime::answer_frame(&stream, frame, q, placement, &p.cancel, |piece| {
            if stream_tokens {
                p.text.lock().push_str(piece);
                let _shared = self.shared.lock();
                self.changed.notify_all();
            }
        });
        match result {
            Ok(report) if !report.cancelled => {
                // (Cancelled meanwhile by a flush: not committed, and its vlm-answer says so.)
                if commit
                    && let Err(e) = p.commit.commit(&stream, &q.text, &report.token_ids, &p.cancel)
                    && !matches!(e, vlm_runtime::Error::Cancelled)
                {
                    self.warn_question(
                        gst::StreamError::Failed,
                        Some(&q.id),
                        &format!("answer {} not committed: {e}", q.id),
                    );
                }
                Outcome::Answered(report)
            }
            Ok(_) | Err(vlm_runtime::Error::Cancelled) => Outcome::Cancelled("cancelled".into()),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }

    /// A question bound to no frame (none of its stream registered yet when it came: a video
    /// with no frame so far, a timed question before the first frame, `ask` before any video):
    /// wait for its stream's first registered frame (the stream it was accepted with, or the one
    /// that reaches the element first) and bind to the newest registered frame then. It holds
    /// its `max-questions` slot meanwhile; a flush or stop cancels it, and at the video's EOS
    /// with still no frame it fails (`NO_FRAME`).
    ///
    /// `Err(true)` when cancelled, `Err(false)` at the video's EOS.
    fn first_frame(&self, p: &Pending) -> Result<(Arc<Stream>, u64), bool> {
        let mut shared = self.shared.lock();
        gst::debug!(CAT, imp = self, "question {} waits for its stream's first frame", p.job.question.id);
        // When a registered frame was first seen without having passed here yet.
        let mut registered_at = None;
        loop {
            if p.cancel.load(Ordering::Acquire) || shared.flushing {
                return Err(true);
            }
            if let Some(stream) = p.job.stream.clone().or_else(|| shared.video.stream()) {
                let registered = stream.registered();
                // It binds once the frame has passed here too, for its pts and picture age (a
                // frame dropped on the way, by a leaky queue, is waited for a moment only).
                let video = &shared.video;
                let passed = video.current_frames().any(|f| f.number == registered) || video.eos.is_some();
                if registered > 0
                    && (passed || registered_at.get_or_insert_with(Instant::now).elapsed() >= FIRST_FRAME_PASS)
                {
                    gst::debug!(CAT, imp = self, "question {} bound to {registered} frames", p.job.question.id);
                    let _ = p.late_picture.set((video.pts_up_to(registered), video.picture_age(registered, p.job.at)));
                    return Ok((stream, registered));
                }
            }
            if shared.video.eos.is_some() {
                return Err(false);
            }
            self.changed.wait_for(&mut shared, FIRST_FRAME_POLL);
        }
    }

    /// Warn about a question that was not accepted.
    fn refused(&self, question: &Question, why: Refusal) {
        let why = match why {
            Refusal::Flushing => "the element is flushing".to_string(),
            Refusal::Downstream(flow) => format!("the text pad stopped ({flow:?} from downstream)"),
            Refusal::Ended => "the streams have ended (after EOS)".to_string(),
            Refusal::Full(n) => format!("{n} questions are already pending (max-questions)"),
            Refusal::Duplicate(id) => format!("id {id:?} was already taken by an earlier question"),
        };
        self.counters.refused();
        self.obj().notify("questions-refused");
        let message = format!("question {} {:?} refused: {why}", question.id, question.text);
        self.warn_question(gst::StreamError::Failed, Some(&question.id), &message);
    }

    /// A warning about one question (refused, malformed, not answered): the message says why,
    /// and its details (a `vlm-question` structure with `id` and `reason`) tell an application
    /// which question it was.
    pub(super) fn warn_question(&self, domain: impl gst::MessageErrorDomain, id: Option<&str>, message: &str) {
        let details = gst::Structure::builder(QUESTION_DETAILS).field("id", id).field("reason", message).build();
        gst::warning!(CAT, imp = self, "{message}");
        let warning = gst::message::Warning::builder(domain, message).details(details).src(&*self.obj()).build();
        let _ = self.obj().post_message(warning);
    }

    /// After the video's EOS, the answers end (what is pending is answered, then the text pad
    /// gets its EOS) once the question pad has sent EOS too, is unlinked, or has been quiet for
    /// `QUERY_EOS_GRACE`, and at most `QUERY_EOS_LIMIT` after the video's EOS: a question file
    /// read by `subparse` delivers its remaining questions back to back and then its EOS, while
    /// a question source that stays open (an appsrc, a live feed) never holds the pipeline's EOS (the question pad is sparse, as textoverlay's
    /// text pad is). A question arriving after that is refused with a warning. Returns how long
    /// to wait before asking again, if the answer is not yet.
    pub(super) fn maybe_finish(&self, shared: &mut Shared) -> Option<std::time::Duration> {
        if shared.video.eos.is_none() || shared.eos {
            return None;
        }
        let quiet = shared.query_quiet_since.map_or(QUERY_EOS_GRACE, |t| t.elapsed());
        // (A source that keeps asking, a question every half second, holds it no longer.)
        let left = QUERY_EOS_LIMIT.saturating_sub(shared.video.eos.map_or(Duration::ZERO, |t| t.elapsed()));
        if shared.ahead.is_empty()
            && (shared.query_eos
                || !self.querypad.is_linked()
                || (shared.query_busy == 0 && (quiet >= QUERY_EOS_GRACE || left.is_zero())))
        {
            shared.eos = true;
            self.changed.notify_all();
            return None;
        }
        Some(QUERY_EOS_GRACE.saturating_sub(quiet).min(left).max(Duration::from_millis(10)))
    }

    /// Every output has ended: one whose downstream returned EOS, the others EOS too or not
    /// linked (`video_src`, while linked, gives its own flow return upstream).
    fn outputs_ended(&self, shared: &Shared) -> bool {
        let text = shared.text_ended || !self.srcpad.is_linked();
        let cues = shared.cue_ended || !self.subtitle_srcpad.is_linked();
        (shared.text_ended || shared.cue_ended) && text && cues && !self.video_srcpad.is_linked()
    }

    /// The flow return the sink pads give upstream.
    fn flow(&self) -> Result<gst::FlowSuccess, gst::FlowError> {
        let shared = self.shared.lock();
        if shared.flushing {
            return Err(gst::FlowError::Flushing);
        }
        match shared.srcresult {
            Some(e) => Err(e),
            None if self.outputs_ended(&shared) => Err(gst::FlowError::Eos),
            None => Ok(gst::FlowSuccess::Ok),
        }
    }

    pub(super) fn sink_chain(&self, buffer: gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        let mut shared = self.shared.lock();
        // `vlmcontext` announces its stream (`vlm-stream`) before its first buffer: video without
        // one never brings a frame a question can bind to.
        if shared.video.stream_id.is_none() && !shared.video.no_context_said {
            shared.video.no_context_said = true;
            drop(shared);
            gst::element_imp_warning!(
                self,
                gst::CoreError::Negotiation,
                ("the video carries no vlmcontext stream: questions wait for a frame of one (put vlmencode ! vlmcontext before vlmquery; a vlmcontext at its max-streams passes a camera's frames without one until a stream closes)")
            );
            shared = self.shared.lock();
        }
        let rt = buffer.pts().and_then(|pts| shared.video.segment.as_ref().and_then(|s| s.to_running_time(pts)));
        let meta = buffer.meta::<VlmFrameMeta>();
        if let (Some(rt), Some((stream, _))) = (rt, meta.as_ref().and_then(|m| m.position())) {
            shared.video.captured(stream, rt);
        }
        // (A held frame carries the position of the frame that stands for it: not a new frame.)
        if let Some((stream, number)) = meta.as_ref().filter(|m| !m.held()).and_then(|m| m.position()) {
            shared.video.switch_to(stream);
            if shared.video.frames.len() == FRAME_HISTORY {
                shared.video.frames.pop_front();
            }
            shared.video.frames.push_back(SeenFrame { stream, rt, pts: buffer.pts(), number });
            self.maybe_caption(&mut shared, rt, buffer.pts(), number);
            self.alert_frame(shared.video.stream().as_ref(), number, buffer.pts(), rt);
        } else if let Some((stream, number)) = meta.as_ref().and_then(|m| m.position())
            && shared.video.stream_id == Some(stream)
            && self.settings.lock().caption_interval > 0
        {
            // A frame the gate held stands for the picture before it: captions go on at their
            // interval, about that picture (a still camera is captioned as a moving one is; with
            // `caption-interval=0`, a caption for each frame that joins the history, none);
            // alerts keep their states (the same picture answers the same).
            self.maybe_caption(&mut shared, rt, buffer.pts(), number);
        }
        if let Some(rt) = rt {
            shared.video.running_time = Some(rt);
            shared.video.known_to(rt, buffer.duration());
        }
        // Untimed video: frames without timestamps since its segment began. One frame without a
        // time (or outside the segment) among timed ones does not make it so: a timed question
        // goes on waiting for the video to pass its time.
        if rt.is_some() {
            shared.video.untimed = false;
        } else if buffer.pts().is_none() && shared.video.running_time.is_none() {
            shared.video.untimed = true;
        }
        let refused = self.bind_ahead(&mut shared);
        if let Some(pts) = buffer.pts() {
            shared.video.pts = Some(pts);
            // A frame without a duration lasts one frame of the caps' rate, or a nanosecond, as
            // textoverlay counts it: it waits for text up to there.
            let duration = buffer.duration().or(shared.video.frame_duration).unwrap_or(gst::ClockTime::NSECOND);
            shared.video.end = Some(pts.saturating_add(duration));
            shared.video.between_segments = false;
        }
        // The oldest answer not yet on a video buffer rides on this one.
        let answer = shared.video_answers.pop_front();
        let alert_stream = shared.video.stream_id;
        // The text pad's task sends a GAP up to this frame before it goes on, so an overlay
        // that waits for text at this frame's time is never stuck.
        self.changed.notify_all();
        drop(shared);
        self.refused_all(refused);
        let video = if self.video_srcpad.is_linked() {
            let mut buffer = buffer;
            if let Some(answer) = answer {
                crate::meta::add_video_answer_meta(buffer.make_mut(), &answer);
            }
            self.add_alert_meta(&mut buffer, alert_stream);
            self.video_srcpad.push(buffer)
        } else {
            Ok(gst::FlowSuccess::Ok)
        };
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
            (_, None) => true,
            (Some(rt), Some((Some(last), _))) => rt >= last.saturating_add(interval) || rt < last,
            // Untimed video: the interval on the wall clock (a caption on every frame before).
            (_, Some((_, at))) => at.elapsed() >= std::time::Duration::from_nanos(interval.nseconds()),
        };
        if prompt.trim().is_empty() || !due {
            return;
        }
        shared.video.last_caption = Some((rt, Instant::now()));
        let question = self.question(shared, &prompt, None, None);
        let stream = shared.video.stream();
        if self.accept(shared, Job { question, stream, frames: number, pts, at: rt }, false).is_err() {
            gst::debug!(CAT, imp = self, "caption at frame {number} skipped: the question queue is full");
        }
    }

    /// Caps and allocation queries of the video go on through `video_src`.
    pub(super) fn sink_query(&self, pad: &gst::Pad, query: &mut gst::QueryRef) -> bool {
        gst::log!(CAT, obj = pad, "handling {query:?}");
        match query.view() {
            gst::QueryView::Caps(_) | gst::QueryView::AcceptCaps(_) | gst::QueryView::Allocation(_)
                if self.video_srcpad.is_linked() =>
            {
                self.video_srcpad.peer_query(query)
            }
            _ => gst::Pad::query_default(pad, Some(&*self.obj()), query),
        }
    }

    pub(super) fn sink_event(&self, event: gst::Event) -> bool {
        use gst::EventView;
        gst::log!(CAT, obj = self.sinkpad, "handling {event:?}");
        if let Some(parsed) = QuestionEvent::parse(&event) {
            match parsed {
                Ok(q) => {
                    let mut shared = self.shared.lock();
                    let question = self.question(&shared, &q.text, q.id, q.max_tokens);
                    let (frames, pts) = shared.video.newest();
                    let stream = shared.video.stream();
                    let refusal = question.clone();
                    // Refused, not waited for, when the queue is full: the video's thread must not
                    // wait for answers that may wait for the video (an overlay holds them until
                    // the video passes their time).
                    let at = shared.video.running_time;
                    let accepted = self.accept(&mut shared, Job { question, stream, frames, pts, at }, false);
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
            self.shared.lock().video.switch_to(id);
            return self.video_srcpad.push_event(event);
        }
        // `vlmencode` encodes a frame again that did not change: the frame encoded last stands
        // for it from its time on, as for a frame the gate held, and the questions about that
        // time bind now instead of waiting for the encode.
        if let Some(standing) = StandingEvent::parse(&event) {
            let mut shared = self.shared.lock();
            let video = &mut shared.video;
            let rt = standing.pts.and_then(|pts| video.segment.as_ref()?.to_running_time(pts));
            if let (Some(rt), Some(stream)) = (rt, standing.stream.or(video.stream_id)) {
                video.captured(stream, rt);
                video.known_to(rt, standing.duration);
                let refused = self.bind_ahead(&mut shared);
                self.changed.notify_all();
                drop(shared);
                self.refused_all(refused);
            }
            return self.video_srcpad.push_event(event);
        }
        match event.view() {
            EventView::Caps(c) => {
                let rate = c.caps().structure(0).and_then(|s| s.get::<gst::Fraction>("framerate").ok());
                self.shared.lock().video.frame_duration = rate
                    .filter(|r| r.numer() > 0 && r.denom() > 0)
                    .and_then(|r| gst::ClockTime::SECOND.mul_div_floor(r.denom() as u64, r.numer() as u64));
                self.video_srcpad.push_event(event)
            }
            // A new segment without a flush (concat, a non-flushing seek): the text pad follows
            // it, and its position starts again in the new segment's time.
            EventView::Segment(s) => {
                let mut shared = self.shared.lock();
                shared.video.segment = s.segment().downcast_ref::<gst::ClockTime>().cloned();
                // What comes out before its first frame (an answer, a cue) is stamped where it
                // starts, not at the old segment's last frame.
                let start = shared.video.segment.as_ref().and_then(|s| s.start());
                (shared.video.pts, shared.video.end) = (start, start);
                // (Its running time may start lower: a timed question waits for its frames.)
                shared.video.known_until = None;
                (shared.text_pad.segment_sent, shared.cue_pad.segment_sent) = (false, false);
                (shared.text_position, shared.cue_position, shared.gap_ahead) = (None, None, None);
                shared.video.between_segments = true;
                // An answer on screen has its display's end in the old segment's time: it ends
                // with it (it stayed on the new one's frames up to that time).
                if shared.shown.as_ref().is_some_and(|s| s.drawn()) {
                    shared.shown = None;
                }
                drop(shared);
                self.video_srcpad.push_event(event);
                true
            }
            EventView::Eos(_) => {
                // The alerts of the last frames are evaluated (and their lines queued) first.
                self.alerts_drain();
                let mut shared = self.shared.lock();
                shared.video.eos = Some(Instant::now());
                shared.query_quiet_since = Some(Instant::now());
                self.maybe_finish(&mut shared);
                self.changed.notify_all();
                // The video's EOS waits until every accepted question has its vlm-answer on the
                // bus, or the pipeline would end (and cancel them unseen) first: a pipeline that
                // ends with the video (textoverlay) ends after its last answer. It does not wait
                // for the text pad, which an overlay may hold until the video passes an answer's
                // time; with no text pad linked the answers go to the bus only, and it waits for
                // all of them to be through.
                let linked = self.srcpad.is_linked();
                loop {
                    if shared.flushing || shared.srcresult.is_some() {
                        break;
                    }
                    // (The questions still ahead bind to the last frame as slots free.)
                    let refused = self.bind_ahead(&mut shared);
                    if !refused.is_empty() {
                        drop(shared);
                        self.refused_all(refused);
                        shared = self.shared.lock();
                    }
                    let recheck = self.maybe_finish(&mut shared);
                    let done = if linked {
                        (shared.eos || shared.query_waiting) && shared.all_posted()
                    } else {
                        shared.all_answered
                    };
                    if done {
                        break;
                    }
                    match recheck {
                        Some(after) => {
                            self.changed.wait_for(&mut shared, after);
                        }
                        None => self.changed.wait(&mut shared),
                    }
                }
                drop(shared);
                self.video_srcpad.push_event(event);
                true
            }
            // A GAP (a live source's lost packets, a source with nothing to send for a while): no
            // frame comes before its end. Timed questions up to there bind to the frames before,
            // and the text pads move on to it, as at a frame.
            EventView::Gap(g) => {
                let (ts, duration) = g.get();
                let end = ts.saturating_add(duration.unwrap_or(gst::ClockTime::ZERO));
                let mut shared = self.shared.lock();
                if let Some(rt) = shared.video.segment.as_ref().and_then(|s| s.to_running_time(end)) {
                    shared.video.known_until = shared.video.known_until.max(Some(rt));
                    shared.video.end = shared.video.end.max(Some(end));
                    shared.video.between_segments = false;
                    let refused = self.bind_ahead(&mut shared);
                    self.changed.notify_all();
                    drop(shared);
                    self.refused_all(refused);
                }
                self.video_srcpad.push_event(event)
            }
            // As in gst-plugins-rs: flushing first, downstream told (a push blocked there returns),
            // then the task paused; on stop, state reset and downstream told under the task's
            // stream lock before the task starts again.
            EventView::FlushStart(_) => {
                self.flush_start("flush");
                self.video_srcpad.push_event(event.clone());
                self.subtitle_srcpad.push_event(event.clone());
                let pushed = self.srcpad.push_event(event);
                let _ = self.srcpad.pause_task();
                pushed
            }
            EventView::FlushStop(_) => {
                let task_lock = self.srcpad.stream_lock();
                let cue_task_lock = self.subtitle_srcpad.stream_lock();
                self.flush_stop();
                self.video_srcpad.push_event(event.clone());
                self.subtitle_srcpad.push_event(event.clone());
                let pushed = self.srcpad.push_event(event);
                drop((cue_task_lock, task_lock));
                // (Not on pads a stop has deactivated: their tasks start with their activation.)
                if self.srcpad.is_active() {
                    self.start_task();
                }
                if self.subtitle_srcpad.is_active() {
                    self.start_cue_task();
                }
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

    pub(super) fn query_chain(&self, buffer: gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
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
            // (A subtitle with no text, or markup alone: nothing to ask.)
            gst::debug!(CAT, imp = self, "empty question buffer at {:?} ignored", buffer.pts());
            return self.query_flow();
        }
        let question = self.question(&shared, &text, None, None);
        let t = buffer.pts().and_then(|pts| shared.query_segment.as_ref().and_then(|s| s.to_running_time(pts)));
        // A question ahead of the video waits inside (`Shared::ahead`) and binds when the video
        // passes its time, so that every frame up to it is known; the pad does not wait for
        // that: a pipeline hands a forced EOS to one source at a time, and the camera's would
        // wait behind a question source held here.
        if let Some(at) = t.filter(|&t| !shared.video_past(t)) {
            while shared.ahead_full() && !shared.flushing && !shared.query_flushing {
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
            gst::debug!(CAT, imp = self, "question {} waits for the video to reach {at}", question.id);
            let _watch = shared.video.stream().map(|s| s.watch());
            shared.ahead.push_back(super::Ahead { question, at, _watch });
            drop(shared);
            return self.query_flow();
        }
        let (frames, pts) = match t {
            Some(t) if !shared.video.untimed => shared.video.at(t),
            _ => shared.video.newest(),
        };
        let stream = shared.video.stream();
        let refusal = question.clone();
        let at = t.or(shared.video.running_time);
        let accepted = self.accept(&mut shared, Job { question, stream, frames, pts, at }, true);
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
            None if self.outputs_ended(&shared) => Err(gst::FlowError::Eos),
            _ => Ok(gst::FlowSuccess::Ok),
        }
    }

    pub(super) fn query_event(&self, event: gst::Event) -> bool {
        use gst::EventView;
        gst::log!(CAT, obj = self.querypad, "handling {event:?}");
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
                drop(shared);
                self.refuse_ahead();
            }
            // A question event belongs with the video (it binds to the frames before it there).
            EventView::CustomDownstream(_) if QuestionEvent::parse(&event).is_some() => {
                gst::element_imp_warning!(
                    self,
                    gst::StreamError::Format,
                    ("a vlm-question event on the query pad is ignored: send it on the video (the sink pad), or send text here")
                );
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
    pub(super) fn ask(&self, text: &str) -> Option<String> {
        if text.trim().is_empty() {
            gst::element_imp_warning!(self, gst::LibraryError::Settings, ("ask: empty question ignored"));
            return None;
        }
        let mut shared = self.shared.lock();
        let question = self.question(&shared, text, None, None);
        let stream = shared.video.stream();
        let frames = stream.as_ref().map_or(0, |s| s.registered());
        let pts = shared.video.pts_up_to(frames);
        let refusal = question.clone();
        let at = shared.video.running_time;
        let accepted = self.accept(&mut shared, Job { question, stream, frames, pts, at }, false);
        drop(shared);
        accepted.map_err(|why| self.refused(&refusal, why)).ok()
    }
}
