//! Output of `vlmquery`: the text pad's task, which pushes the answers in question order (text
//! or JSON, streamed pieces, GAP events while there is nothing to say) and posts each question's
//! `vlm-answer` message.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use gst::prelude::*;
use gst::subclass::prelude::*;

use super::{CAT, Outcome, OutputFormat, Pending, Shared, VlmQuery};
use crate::text::without_nul;

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

impl VlmQuery {
    pub(super) fn start_task(&self) {
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
    pub(super) fn post_answer(&self, p: &Pending, outcome: Outcome) -> gst::Structure {
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
