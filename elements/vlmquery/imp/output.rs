//! Output of `vlmquery`: each question's `vlm-answer` message (posted in question order as soon
//! as its answer has ended, whatever the text pad is doing), the text pad's task, which pushes
//! the answers in question order (text or JSON, the answer so far while it streams, GAP events
//! while there is nothing to say), and the answers queued for the video buffers' meta.
//!
//! Where the answers are drawn on `video_src` (text output with `video_src` linked), the text pad
//! follows the video: what is shown goes out one buffer per frame, each ending where the newest
//! frame ends, so an overlay (which holds one text buffer until the video passes its end) never
//! holds an answer or a piece while a newer one waits. Elsewhere each answer is one buffer.
//!
//! `subtitle_src`, for a recorder, carries one cue per answer whatever the text pad does: the
//! answer's text from where the video was when it came, for `answer-duration`, and GAP events
//! between.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use gst::prelude::*;
use gst::subclass::prelude::*;

use super::{CAT, Display, Outcome, OutputFormat, PadStarted, Pending, Shared, VlmQuery};
use crate::text::{one_line, without_nul};
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

/// What the text pad shows while it follows the video.
pub(in crate::vlmquery) struct Shown {
    pending: Arc<Pending>,
    /// The answer so far, or the whole answer.
    text: String,
    /// `partial` or `answered`.
    status: &'static str,
    /// Where the display ends: the whole answer's completion + `answer-duration`; `None` while
    /// the answer streams (it lasts until its next piece).
    until: Option<gst::ClockTime>,
    /// A buffer of it went out: it has been drawn on a frame, so a newer answer may replace it.
    pushed: bool,
}

impl Shown {
    /// A buffer of it went out (it has been drawn on a frame).
    pub(in crate::vlmquery) fn drawn(&self) -> bool {
        self.pushed
    }
}

/// A buffer's text: the answer (so far) as one line (line breaks inside it folded into spaces,
/// `one_line`) and a newline, or in JSON its question's `id`, `stream`,
/// `status` and the text (the whole answer's buffer is its `vlm-answer` instead).
fn line(format: OutputFormat, p: &Pending, text: &str, status: &str) -> String {
    match format {
        OutputFormat::Text => text_line(text),
        OutputFormat::Json => json_line(
            &gst::Structure::builder("vlm-answer")
                .field("id", &p.job.question.id)
                .field("stream", p.stream().map_or("", |s| s.name()))
                .field("status", status)
                .field("text", without_nul(text).as_ref())
                .build(),
        ),
    }
}

/// A buffer of `p`'s answer (`text`), shown from `at` for `duration`, with the answer meta
/// naming its question.
fn answer_buffer(
    p: &Pending,
    at: Option<gst::ClockTime>,
    duration: Option<gst::ClockTime>,
    text: String,
    status: &str,
) -> gst::Buffer {
    let mut buffer = gst::Buffer::from_mut_slice(text.into_bytes());
    {
        let buffer = buffer.get_mut().unwrap();
        buffer.set_pts(at);
        buffer.set_duration(duration);
        let stream = p.stream().map_or("", |s| s.name());
        crate::meta::add_answer_meta(buffer, &p.job.question.id, stream, status);
    }
    buffer
}

/// A line of `output-format=text`: the answer (so far) with its line breaks folded, and a newline.
fn text_line(text: &str) -> String {
    format!("{}\n", one_line(text))
}

/// An answer's cue on `subtitle_src`.
pub(in crate::vlmquery) struct Cue {
    pending: Arc<Pending>,
    text: String,
    pts: Option<gst::ClockTime>,
    duration: gst::ClockTime,
}

/// What the source pad's task does next.
enum Next {
    /// One text buffer of a question's answer.
    Text {
        p: Arc<Pending>,
        text: String,
        pts: Option<gst::ClockTime>,
        duration: Option<gst::ClockTime>,
        status: String,
    },
    Gap(gst::ClockTime, gst::ClockTime),
    /// A `vlm-alert`'s JSON line, at its frame's pts.
    Alert(String, Option<gst::ClockTime>),
    Eos,
}

/// What `subtitle_src`'s task does next.
enum NextCue {
    Cue(Cue),
    Gap(gst::ClockTime, gst::ClockTime),
    Eos,
}

/// The settings the task reads.
struct Output {
    format: OutputFormat,
    display: Display,
    duration: gst::ClockTime,
    stream_tokens: bool,
}

impl VlmQuery {
    pub(super) fn start_task(&self) {
        let this = self.ref_counted();
        let _ = self.srcpad.start_task(move || this.task_iteration());
    }

    /// Post the `vlm-answer` of every question that has ended, in question order: up to the
    /// oldest one still being answered. Called by each answering thread when it ends and by the
    /// source pad's task, so the messages never wait for the text pad (which an overlay may hold
    /// until the video passes an answer's time). Each answered or failed question's answer is
    /// also queued for the next video buffer, before its message goes out.
    pub(super) fn post_finished(&self) {
        let mut changed: Vec<&str> = vec![];
        {
            let _order = self.post_order.lock();
            let queue: Vec<Arc<Pending>> = self.shared.lock().pending.iter().cloned().collect();
            for p in queue {
                if p.decided.load(Ordering::Acquire) {
                    continue;
                }
                let Some(outcome) = p.outcome.lock().take() else { break };
                let cancelled = matches!(outcome, Outcome::Cancelled(_));
                changed.extend(self.counters.ended(&outcome));
                let message = self.answer_message(&p, outcome);
                if !cancelled {
                    let mut shared = self.shared.lock();
                    if !shared.flushing {
                        super::push_bounded(&mut shared.video_answers, video_answer(&message));
                        self.queue_cue(&mut shared, &p, &message);
                    }
                }
                p.decided.store(true, Ordering::Release);
                self.outbox.lock().messages.push_back((p, message));
            }
        }
        self.drain_outbox();
        changed.sort_unstable();
        changed.dedup();
        for name in changed {
            self.obj().notify(name);
        }
    }

    /// One iteration of the source pad's task: push the oldest question's answer once its
    /// `vlm-answer` is out (answers go out in question order), the answer so far while it
    /// streams, what is shown while the text pad follows the video, a GAP while there is nothing
    /// to say, or EOS after the last answer.
    fn task_iteration(&self) {
        // The answering threads post their answers (an application may stop the pipeline from
        // a sync bus handler on one, which this pad's own task cannot do); the task posts only
        // where the oldest question waiting for its answer has no thread left to do it.
        let front_thread_runs = {
            let shared = self.shared.lock();
            let front = shared.pending.iter().find(|p| !p.decided.load(Ordering::Acquire));
            front.is_some_and(|p| p.thread.lock().as_ref().is_some_and(|t| !t.is_finished()))
        };
        if !front_thread_runs {
            self.post_finished();
        }
        let (next, stats) = {
            let mut shared = self.shared.lock();
            let before = shared.stats;
            let next = loop {
                if shared.flushing {
                    let now = shared.stats;
                    drop(shared);
                    self.notify_stats(before, now);
                    let _ = self.srcpad.pause_task();
                    return;
                }
                let output = {
                    let s = self.settings.lock();
                    Output {
                        format: s.output_format,
                        display: s.display,
                        duration: gst::ClockTime::from_nseconds(s.answer_duration),
                        stream_tokens: s.stream_tokens,
                    }
                };
                // (Before the answers are looked at: it may end them now.)
                let recheck = self.maybe_finish(&mut shared);
                if let Some(next) = self.next_output(&mut shared, &output) {
                    break next;
                }
                match recheck {
                    Some(after) => {
                        self.changed.wait_for(&mut shared, after);
                    }
                    None => self.changed.wait(&mut shared),
                }
            };
            (next, (before, shared.stats))
        };
        self.notify_stats(stats.0, stats.1);
        self.changed.notify_all();
        // (Its answering thread has ended, or is ending; or it is posting later answers, and a
        // sync bus handler there may be flushing, which waits for this task: not joined here.)
        if let Next::Text { p, .. } = &next
            && p.posted.load(Ordering::Acquire)
            && let Some(t) = p.thread.lock().take()
        {
            self.keep_ending(t);
        }
        self.ensure_started(&self.srcpad, "answers", |s| &mut s.text_pad);
        // Downstream has ended: the answers are taken (and posted) as before, none is pushed,
        // and the EOS event still goes out.
        let ended = self.shared.lock().text_ended;
        match next {
            Next::Gap(..) | Next::Text { .. } | Next::Alert(..) if ended => (),
            Next::Gap(start, duration) => {
                self.srcpad.push_event(gst::event::Gap::builder(start).duration(duration).build());
            }
            Next::Text { p, text, pts, duration, status } => self.push_text(&p, pts, duration, text, &status),
            Next::Alert(text, pts) => self.push_alert_line(text, pts),
            Next::Eos => {
                gst::debug!(CAT, imp = self, "all questions answered, EOS");
                self.srcpad.push_event(gst::event::Eos::new());
                let _ = self.srcpad.pause_task();
            }
        }
    }

    /// What the text pad says next, if anything now (under the shared lock).
    fn next_output(&self, shared: &mut Shared, output: &Output) -> Option<Next> {
        let format = output.format;
        // Drawn on the video: the text pad follows it, frame by frame.
        let following = format == OutputFormat::Text
            && self.video_srcpad.is_linked()
            && shared.video.end.is_some()
            && shared.video.eos.is_none();
        let replace = following && output.display == Display::Replace;
        if !following && let Some(shown) = shared.shown.take() {
            // The video has ended: a whole answer that was never drawn still goes out, once.
            if shown.status == "answered" && !shown.pushed {
                let at = shared.text_position.max(shared.video.end).or(shown.pending.picture().0);
                let duration = shown.until.zip(at).map(|(until, at)| until.saturating_sub(at));
                let text = line(format, &shown.pending, &shown.text, "answered");
                return Some(Self::text(shared, shown.pending, text, at, duration, "answered"));
            }
            // The video ended while it was drawn, before the text pad caught up with its last
            // frames: it covers them too, up to its end.
            if shown.pushed
                && let (Some(from), Some(end)) = (shared.text_position, shared.video.end)
            {
                let to = shown.until.map_or(end, |until| until.min(end));
                if to > from {
                    let text = line(format, &shown.pending, &shown.text, shown.status);
                    return Some(Self::text(shared, shown.pending, text, Some(from), Some(to - from), shown.status));
                }
            }
        }
        let front = shared.pending.front().cloned();
        // The oldest question's answer, once its vlm-answer is out. Under `replace` it replaces
        // what is shown, once that has been drawn on a frame.
        if let Some(p) = front.as_ref().filter(|p| p.posted.load(Ordering::Acquire))
            && !(replace && shared.shown.as_ref().is_some_and(|s| !s.pushed && !Arc::ptr_eq(&s.pending, p)))
        {
            let p = shared.pending.pop_front().expect("front");
            if shared.shown.as_ref().is_some_and(|s| Arc::ptr_eq(&s.pending, &p)) {
                shared.shown = None;
            }
            let message = p.message.lock().take().expect("posted");
            let status = message.get::<String>("status").unwrap_or_default();
            // An answer is shown from where the video is when it comes: the end of the newest
            // frame (the next frame is the first that can show it).
            let at = shared.video.end.or(p.picture().0);
            let duration = output.duration;
            match format {
                OutputFormat::Json => {
                    // A line is an event, not a display: the pad's position stays at its start,
                    // so that the lines after it (alerts, answers) are stamped at their own
                    // times, in order, not `answer-duration` ahead. (A failed or cancelled
                    // question's line is counted as such, not in `answers`.)
                    shared.stats.answers += u64::from(status == "answered");
                    let at = at.max(shared.text_position);
                    shared.text_position = at;
                    let text = json_line(&message);
                    return Some(Next::Text { p, text, pts: at, duration: Some(duration), status });
                }
                OutputFormat::Text if status == "answered" => {
                    shared.stats.answers += 1;
                    let text = message.get::<String>("text").unwrap_or_default();
                    if !replace {
                        // Following the video, from where the text pad is: where its pieces
                        // ended (no frame between), or where the answer before it ends (its
                        // whole `answer-duration`: an overlay takes the next buffer only then).
                        let at = if following { shared.text_position.or(at) } else { at };
                        let text = line(format, &p, &text, "answered");
                        return Some(Self::text(shared, p, text, at, Some(duration), "answered"));
                    }
                    // Its display lasts `answer-duration` from its first buffer, which starts
                    // where the text pad is (it may be behind the newest frame).
                    let end = shared.video.end.expect("following");
                    let from = shared.text_position.unwrap_or(shared.video.pts.unwrap_or(end));
                    // (`answer-duration=0`: on one frame, not dropped unseen.)
                    let until = Some(from.saturating_add(duration.max(gst::ClockTime::NSECOND)));
                    shared.shown = Some(Shown { pending: p, text, status: "answered", until, pushed: false });
                }
                // Nothing to show (failed, cancelled): drawn under `replace`, what is shown stays.
                // Otherwise say so for the time the answer would have taken, so an overlay
                // waiting for text goes on.
                OutputFormat::Text => {
                    if !replace && let Some(at) = at {
                        shared.text_position = shared.text_position.max(Some(at.saturating_add(duration)));
                        return Some(Next::Gap(at, duration));
                    }
                }
            }
        }
        // Streaming: the oldest question's answer so far, when it has grown.
        if output.stream_tokens
            && let Some(p) = front.filter(|p| !p.posted.load(Ordering::Acquire))
        {
            let text = p.text.lock().clone();
            let mine = shared.shown.as_ref().is_some_and(|s| Arc::ptr_eq(&s.pending, &p));
            if text.len() > p.text_taken.load(Ordering::Acquire) {
                if !following {
                    p.text_taken.store(text.len(), Ordering::Release);
                    let at = shared.video.end.or(p.picture().0);
                    let text = line(format, &p, &text, "partial");
                    return Some(Self::text(shared, p, text, at, None, "partial"));
                }
                // It replaces what is shown once that has been drawn on a frame.
                if mine || shared.shown.as_ref().is_none_or(|s| s.pushed) {
                    p.text_taken.store(text.len(), Ordering::Release);
                    let pushed = mine && shared.shown.as_ref().is_some_and(|s| s.pushed);
                    shared.shown = Some(Shown { pending: p, text, status: "partial", until: None, pushed });
                }
            }
        }
        // Following the video: what is shown covers it up to its newest frame.
        if following
            && let Some(end) = shared.video.end
            && let Some(shown) = shared.shown.as_mut()
        {
            let from = shared.text_position.unwrap_or(shared.video.pts.unwrap_or(end));
            let to = shown.until.map_or(end, |until| until.min(end));
            if to > from {
                shown.pushed = true;
                let (p, status) = (Arc::clone(&shown.pending), shown.status);
                let text = line(format, &p, &shown.text, status);
                if shown.until.is_some_and(|until| until <= to) {
                    shared.shown = None;
                }
                shared.text_position = Some(to);
                return Some(Next::Text { p, text, pts: Some(from), duration: Some(to - from), status: status.into() });
            }
            if shown.until.is_some_and(|until| until <= from) {
                shared.shown = None;
            }
        }
        if let Some((text, pts)) = shared.alert_lines.pop_front() {
            // (A frame's pts is never ahead of the video, but one of a segment before it is.)
            let pts = match (pts, shared.video.end) {
                (Some(pts), Some(end)) => Some(pts.min(end)),
                (pts, _) => pts,
            };
            let at = shared.text_position.max(pts);
            shared.text_position = at;
            return Some(Next::Alert(text, at));
        }
        if shared.pending.is_empty() && shared.eos {
            shared.all_answered = true;
            return Some(Next::Eos);
        }
        // A text buffer reaches past the newest frame (`display=queue`): a GAP at its end, once,
        // so that a muxer waiting for this pad's next item before it writes the video up to it
        // (matroskamux, with no queue between) goes on instead of waiting for ever.
        if shared.shown.is_none()
            && let (Some(end), Some(position)) = (shared.video.gap_end(), shared.text_position)
            && position > end
            && shared.gap_ahead != Some(position)
        {
            shared.gap_ahead = Some(position);
            return Some(Next::Gap(position, gst::ClockTime::ZERO));
        }
        // Nothing to say up to the newest frame: tell downstream, so it never waits.
        if shared.shown.is_none()
            && let Some(end) = shared.video.gap_end()
            && shared.text_position.is_none_or(|t| t < end)
        {
            let start = shared.text_position.unwrap_or(shared.video.pts.unwrap_or(end));
            shared.text_position = Some(end);
            return Some(Next::Gap(start, end - start));
        }
        None
    }

    /// An answered question's cue for `subtitle_src` (while it is linked), from the end of the
    /// newest frame now (the first that can show it), for `answer-duration`.
    fn queue_cue(&self, shared: &mut Shared, p: &Arc<Pending>, message: &gst::Structure) {
        if message.get::<String>("status").as_deref() != Ok("answered") || !self.subtitle_srcpad.is_linked() {
            return;
        }
        let text = message.get::<String>("text").unwrap_or_default();
        let duration = gst::ClockTime::from_nseconds(self.settings.lock().answer_duration);
        let pts = shared.video.end.max(shared.cue_position).or(p.picture().0);
        super::push_bounded(&mut shared.cues, Cue { pending: Arc::clone(p), text, pts, duration });
        self.changed.notify_all();
    }

    pub(super) fn start_cue_task(&self) {
        let this = self.ref_counted();
        let _ = self.subtitle_srcpad.start_task(move || this.cue_task_iteration());
    }

    /// One iteration of `subtitle_src`'s task (its own, so that a text pad held by an overlay
    /// never holds the recorder, which would hold the video): the next cue, a GAP up to the
    /// newest frame, or EOS once every cue is out after the streams' end.
    fn cue_task_iteration(&self) {
        let next = {
            let mut shared = self.shared.lock();
            loop {
                if shared.flushing {
                    drop(shared);
                    let _ = self.subtitle_srcpad.pause_task();
                    return;
                }
                if let Some(next) = Self::next_cue(&mut shared) {
                    break next;
                }
                self.changed.wait(&mut shared);
            }
        };
        self.ensure_started(&self.subtitle_srcpad, "subtitles", |s| &mut s.cue_pad);
        let ended = self.shared.lock().cue_ended;
        match next {
            NextCue::Cue(_) | NextCue::Gap(..) if ended => (),
            NextCue::Cue(cue) => self.push_cue(cue),
            NextCue::Gap(start, duration) => {
                self.subtitle_srcpad.push_event(gst::event::Gap::builder(start).duration(duration).build());
            }
            NextCue::Eos => {
                self.subtitle_srcpad.push_event(gst::event::Eos::new());
                let _ = self.subtitle_srcpad.pause_task();
            }
        }
    }

    /// What `subtitle_src` says next, if anything now: a cue, a GAP up to the newest frame, or
    /// EOS. Cues start where the video is when their answers end, so cues and GAPs go forward
    /// together; a GAP does not reach past the newest frame (a cue may still come there). EOS
    /// once the streams have ended and every accepted question's answer is posted (its cue
    /// queued before): not after the text pad, which textoverlay holds for ever once the video
    /// has ended and a second answer comes after it.
    fn next_cue(shared: &mut Shared) -> Option<NextCue> {
        if let Some(cue) = shared.cues.pop_front() {
            shared.cue_position = shared.cue_position.max(cue.pts);
            return Some(NextCue::Cue(cue));
        }
        if shared.eos && shared.all_posted() {
            return (!shared.cue_eos).then(|| {
                shared.cue_eos = true;
                NextCue::Eos
            });
        }
        let end = shared.video.gap_end()?;
        let start = shared.cue_position.unwrap_or(shared.video.pts.unwrap_or(end));
        (start < end).then(|| {
            shared.cue_position = Some(end);
            NextCue::Gap(start, end - start)
        })
    }

    /// Push an answer's cue on `subtitle_src`, with the answer meta naming its question.
    fn push_cue(&self, cue: Cue) {
        let text = one_line(&cue.text).into_owned();
        let buffer = answer_buffer(&cue.pending, cue.pts, Some(cue.duration), text, "answered");
        match self.subtitle_srcpad.push(buffer) {
            Ok(_) | Err(gst::FlowError::NotLinked | gst::FlowError::Flushing) => (),
            Err(e) => self.flow_error(&self.subtitle_srcpad, e),
        }
    }

    /// A text buffer of `p` shown from `at` for `duration`, advancing the text pad's position.
    fn text(
        shared: &mut Shared,
        p: Arc<Pending>,
        text: String,
        at: Option<gst::ClockTime>,
        duration: Option<gst::ClockTime>,
        status: &str,
    ) -> Next {
        if let Some(at) = at {
            shared.text_position = shared.text_position.max(Some(at.saturating_add(duration.unwrap_or_default())));
        }
        Next::Text { p, text, pts: at, duration, status: status.into() }
    }

    /// Push one text buffer of `p`'s answer on the text pad.
    fn push_text(
        &self,
        p: &Pending,
        at: Option<gst::ClockTime>,
        duration: Option<gst::ClockTime>,
        text: String,
        status: &str,
    ) {
        self.text_pushed(self.srcpad.push(answer_buffer(p, at, duration, text, status)));
    }

    /// What a push on the text pad returned.
    pub(super) fn text_pushed(&self, result: Result<gst::FlowSuccess, gst::FlowError>) {
        match result {
            // Answers read from the bus, the video shown or recorded: an unlinked text pad is fine.
            Err(gst::FlowError::NotLinked) if self.video_srcpad.is_linked() || self.subtitle_srcpad.is_linked() => {
                gst::log!(CAT, imp = self, "text pad not linked: answers and alerts on the bus only")
            }
            Err(e) => self.flow_error(&self.srcpad, e),
            Ok(_) => (),
        }
    }

    /// A push on `pad` (the text pad or `subtitle_src`) failed: remember it for upstream, post an
    /// error for a real failure (as gst-plugins-rs elements do), and pause the pad's task.
    /// EOS only ends that output: its task goes on, pushes nothing more, and still sends its
    /// EOS event after the last answer (`subtitle_src`'s follows the text pad's), or the
    /// pipeline would never post EOS; upstream gets EOS once every output has ended.
    fn flow_error(&self, pad: &gst::Pad, e: gst::FlowError) {
        gst::debug!(CAT, obj = pad, "push: {e:?}");
        let mut shared = self.shared.lock();
        if e == gst::FlowError::Eos {
            if pad == &self.srcpad {
                shared.text_ended = true;
            } else {
                shared.cue_ended = true;
            }
            self.changed.notify_all();
            return;
        }
        // Our own flushing ends with the flush (the task starts again); anything else (a peer
        // flushing or inactive included) travels upstream, as GstQueue's srcresult does.
        if e != gst::FlowError::Flushing || !shared.flushing {
            shared.srcresult = Some(e);
            self.changed.notify_all();
        }
        drop(shared);
        crate::post_flow_error(self.obj().upcast_ref(), e);
        let _ = pad.pause_task();
    }

    /// Stream start and caps once on `pad`, then the video's segment whenever it changed
    /// (`state`: the pad's flags in the shared state).
    fn ensure_started(&self, pad: &gst::Pad, name: &str, state: impl Fn(&mut Shared) -> &mut PadStarted) {
        let (start, segment) = {
            let mut shared = self.shared.lock();
            let mut segment = shared.video.segment.clone().unwrap_or_default();
            // Open-ended: an answer completing after the video's last frame starts at the
            // segment's stop, where a sink would drop it (a seek with a stop, a file's duration).
            if segment.rate() > 0.0 {
                segment.set_stop(gst::ClockTime::NONE);
            }
            let flags = state(&mut shared);
            if flags.started && flags.segment_sent {
                return;
            }
            let start = !flags.started;
            (flags.started, flags.segment_sent) = (true, true);
            (start, segment)
        };
        if start {
            // A sparse stream of the video's group, its id the video's with the pad's name after
            // it (as `gst_pad_create_stream_id` makes it for an element of one sink pad).
            let video = self.sinkpad.sticky_event::<gst::event::StreamStart>(0);
            let id = match &video {
                Some(v) => format!("{}/{name}", v.stream_id()),
                None => format!("{}/{name}", self.obj().name()),
            };
            let mut event = gst::event::StreamStart::builder(&id).flags(gst::StreamFlags::SPARSE);
            if let Some(group) = video.and_then(|v| v.group_id()) {
                event = event.group_id(group);
            }
            pad.push_event(event.build());
            pad.push_event(gst::event::Caps::new(&gst::Caps::builder("text/x-raw").field("format", "utf8").build()));
        }
        pad.push_event(gst::event::Segment::new(&segment));
    }

    /// Post the outbox's `vlm-answer`s in order, unless another thread is posting them (it
    /// posts these too before it stops). No lock of the element is held while a message is
    /// posted: a sync bus handler may seek with a flush from this thread, and the flush's
    /// cancelled answers then queue behind the others.
    pub(super) fn drain_outbox(&self) {
        let mut outbox = self.outbox.lock();
        if outbox.poster.is_some() {
            return;
        }
        outbox.poster = Some(std::thread::current().id());
        self.post_queued(&mut outbox);
        outbox.poster = None;
        self.outbox_idle.notify_all();
    }

    /// The element stops: every `vlm-answer` made goes on the bus now, before the pipeline's bus
    /// flushes at NULL. Where another thread is posting, wait for it (bounded: its sync bus
    /// handler may be stopping the pipeline too); where this one is (a sync bus handler stopping
    /// the pipeline on a `vlm-answer`), post the rest from here.
    pub(super) fn post_outbox_before_stop(&self) {
        let me = std::thread::current().id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut outbox = self.outbox.lock();
        while outbox.poster.is_some_and(|t| t != me) {
            if self.outbox_idle.wait_until(&mut outbox, deadline).timed_out() {
                gst::warning!(
                    CAT,
                    imp = self,
                    "the thread posting answers is still busy: the rest may come after the stop"
                );
                return;
            }
        }
        // (Inside this thread's own posting, that loop then finds the outbox empty.)
        let nested = outbox.poster.is_some();
        outbox.poster = Some(me);
        self.post_queued(&mut outbox);
        if !nested {
            outbox.poster = None;
            self.outbox_idle.notify_all();
        }
    }

    /// Post the outbox's answers in order, its lock released while each is posted.
    fn post_queued(&self, outbox: &mut parking_lot::MutexGuard<'_, super::Outbox>) {
        while let Some((p, message)) = outbox.messages.pop_front() {
            parking_lot::MutexGuard::unlocked(outbox, || self.post_answer(&p, message));
        }
    }

    /// Post one question's `vlm-answer` (a failed one's warning after it), and mark it posted
    /// for the text pad's task. Called with no lock held: a sync bus handler may stop or seek
    /// the pipeline on either message (and after NULL the bus drops what comes: the answer goes
    /// first).
    fn post_answer(&self, p: &Pending, message: gst::Structure) {
        self.post_message(&message);
        // A failed question's warning goes on the bus before the answer counts as posted: the
        // EOS that may follow it then comes after both.
        if let (Ok("failed"), Ok(reason)) = (message.get::<&str>("status"), message.get::<&str>("reason")) {
            let warning = format!("question {} not answered: {reason}", p.job.question.id);
            self.warn_question(gst::StreamError::Failed, Some(&p.job.question.id), &warning);
        }
        *p.message.lock() = Some(message);
        let _shared = self.shared.lock();
        p.posted.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    fn post_message(&self, message: &gst::Structure) {
        let _ = self.obj().post_message(gst::message::Element::builder(message.clone()).src(&*self.obj()).build());
    }

    /// Milliseconds from the capture of the question's frame (`Video::question_capture`: with
    /// `vlmencode min-change`, a held frame's, not the older picture's, which `picture-age-ms`
    /// tells) to the answer's first token, both in running time on the pipeline clock (a live
    /// source stamps a frame's capture as its running time); -1 without a clock, or where the
    /// frame's running time is ahead of the clock (a source that is not live, read faster than
    /// real time).
    fn ttft_from_capture_ms(&self, p: &Pending, ttft_ms: f64) -> f64 {
        let ms = |t: gst::ClockTime| t.nseconds() as f64 / 1e6;
        let frame = self.shared.lock().video.question_capture(p.job.at, p.job.frames);
        match (frame, p.arrival_rt) {
            (Some(frame), Some(arrival)) if ms(arrival) + ttft_ms >= ms(frame) => ms(arrival) + ttft_ms - ms(frame),
            _ => -1.0,
        }
    }

    /// The question's `vlm-answer` (a failed one's warning goes out with it: `post_answer`).
    pub(super) fn answer_message(&self, p: &Pending, outcome: Outcome) -> gst::Structure {
        let q = &p.job.question;
        let stream = p.stream().map_or("", |s| s.name());
        let (pts, picture_age_ms) = p.picture();
        let mut msg = gst::Structure::builder("vlm-answer")
            .field("id", &q.id)
            .field("question", &q.text)
            .field("stream", stream)
            .field("lag-frames", p.lag.frames)
            .field("lag-ms", p.lag.ms)
            .field("pts", pts)
            .field("picture-age-ms", picture_age_ms.unwrap_or(-1.0));
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
                    .field("ttft-from-capture-ms", self.ttft_from_capture_ms(p, r.ttft_ms))
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
        msg.build()
    }
}

/// What rides on a video buffer of an answer (`VlmAnswerMeta`): its `vlm-answer`'s `id`,
/// `stream`, `status`, `text` and `reason`.
fn video_answer(message: &gst::StructureRef) -> gst::Structure {
    let mut answer = gst::Structure::new_empty(crate::meta::ANSWER_META);
    for name in ["id", "stream", "status", "text", "reason"] {
        if let Ok(value) = message.value(name) {
            answer.set_value(name, value.clone());
        }
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_answer_is_one_line() {
        let text = text_line("The ball is red.\n\nIt rolls\r\nto the left.\n");
        assert_eq!(text, "The ball is red. It rolls to the left.\n");
        assert_eq!(text.lines().count(), 1);
        // A streamed piece (the answer so far) ending at a line break.
        assert_eq!(text_line("The ball\n"), "The ball\n");
        assert_eq!(text_line(""), "\n");
    }

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
