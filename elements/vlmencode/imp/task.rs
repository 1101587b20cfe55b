//! The frame queue of `vlmencode` and its source pad's task: frames and serialized events wait
//! in stream order (upstream blocks while the queue is full), the task encodes the due frames
//! and pushes everything on; serialized queries wait for what was queued before them; flushing
//! empties the queue, keeping sticky events.

use gst::prelude::*;
use gst::subclass::prelude::*;

use super::{CAT, Item, MAX_QUEUED, VlmEncode};
use crate::events::StandingEvent;

impl VlmEncode {
    /// Queue an item for the encoding task, blocking while the queue is full (backpressure).
    pub(super) fn enqueue(&self, item: Item, encode: bool) -> Result<gst::FlowSuccess, gst::FlowError> {
        let max_pending = self.settings.lock().max_pending as usize;
        let mut q = self.queue.lock();
        // Wait for room, unless the task has stopped (flush or a flow error): then nobody drains.
        while !q.flushing && q.flow.is_none() && (q.items.len() >= MAX_QUEUED || (encode && q.pending >= max_pending)) {
            self.changed.wait(&mut q);
        }
        if q.flushing {
            return Err(gst::FlowError::Flushing);
        }
        if let Some(e) = q.flow {
            return Err(e);
        }
        match &item {
            Item::Frame(..) if q.downstream_eos => return Err(gst::FlowError::Eos),
            // A new segment or stream may be wanted downstream again: its frames are taken.
            Item::Event(e) if matches!(e.type_(), gst::EventType::Segment | gst::EventType::StreamStart) => {
                q.downstream_eos = false;
            }
            _ => (),
        }
        if encode {
            q.pending += 1;
            let mut stats = self.stats.lock();
            stats.peak_pending = stats.peak_pending.max(q.pending);
        }
        q.items.push_back(item);
        self.changed.notify_all();
        Ok(gst::FlowSuccess::Ok)
    }

    /// A serialized query (ALLOCATION, DRAIN, ...) answers for the stream as far as it has come:
    /// it goes downstream once every item queued before it has left the source pad (as
    /// `livesync` keeps queries in order with its buffers). A flush, a stop or a failed push
    /// releases it unanswered.
    pub(super) fn sink_query(&self, pad: &gst::Pad, query: &mut gst::QueryRef) -> bool {
        gst::log!(CAT, obj = pad, "handling {query:?}");
        if query.is_serialized() {
            let mut q = self.queue.lock();
            while !q.flushing && q.flow.is_none() && (q.busy || !q.items.is_empty()) {
                self.changed.wait(&mut q);
            }
            if q.flushing || q.flow.is_some() {
                gst::debug!(CAT, obj = pad, "{:?} query not answered: flushing or stopped", query.type_());
                return false;
            }
        }
        gst::Pad::query_default(pad, Some(&*self.obj()), query)
    }

    /// The source pad's task runs while the pad is active (in push mode): started on
    /// activation, stopped on deactivation, as gst-plugins-rs elements do.
    pub(super) fn src_activatemode(
        &self,
        pad: &gst::Pad,
        mode: gst::PadMode,
        active: bool,
    ) -> Result<(), gst::LoggableError> {
        if mode != gst::PadMode::Push {
            return Err(gst::loggable_error!(CAT, "pull mode is not supported"));
        }
        gst::debug!(CAT, obj = pad, "{} the encoding task", if active { "starting" } else { "stopping" });
        if active {
            self.set_flushing(false);
            self.start_task();
        } else {
            self.set_flushing(true);
            pad.stop_task().map_err(|e| gst::loggable_error!(CAT, "cannot stop the encoding task: {e}"))?;
        }
        Ok(())
    }

    pub(super) fn set_flushing(&self, flushing: bool) {
        let mut q = self.queue.lock();
        q.flushing = flushing;
        self.flushing.store(flushing, std::sync::atomic::Ordering::Release);
        let dropped: Vec<Item> = q.items.drain(..).collect();
        q.pending = 0;
        q.busy = false;
        q.flow = None;
        q.downstream_eos = false;
        self.changed.notify_all();
        drop(q);
        // Sticky events still queued (caps, tags, stream-start) stay on the pad, as `queue`
        // keeps them: upstream does not send them again after the flush.
        for item in dropped {
            if let Item::Event(e) = item
                && e.is_sticky()
                && !matches!(e.type_(), gst::EventType::Segment | gst::EventType::Eos)
            {
                let _ = self.srcpad.store_sticky_event(&e);
            }
        }
    }

    pub(super) fn start_task(&self) {
        let this = self.ref_counted();
        let _ = self.srcpad.start_task(move || this.task_iteration());
    }

    /// One iteration of the source pad's task: take the next item, encode it if due, push it.
    fn task_iteration(&self) {
        let item = {
            let mut q = self.queue.lock();
            loop {
                if q.flushing || q.flow.is_some() {
                    drop(q);
                    let _ = self.srcpad.pause_task();
                    return;
                }
                if let Some(item) = q.items.pop_front() {
                    q.busy = true;
                    self.changed.notify_all();
                    break item;
                }
                self.changed.wait(&mut q);
            }
        };
        // Errors of our own (encoding) are posted where they happen; a failed push is posted
        // here, once.
        let mut posted = false;
        // (After EOS the task waits for the next item: a new stream may follow.)
        let result = match item {
            Item::Event(event) => {
                // New caps or a new segment: no tile of the frames before is reused (in stream
                // order: the frames queued before it may still use theirs).
                if matches!(event.type_(), gst::EventType::Caps | gst::EventType::Segment)
                    && let Some(encoder) = self.state.lock().encoder.as_ref()
                {
                    encoder.forget_last();
                }
                // (One queued before downstream returned EOS opens it again as it goes out.)
                if matches!(event.type_(), gst::EventType::Segment | gst::EventType::StreamStart) {
                    self.queue.lock().downstream_eos = false;
                }
                self.srcpad.push_event(event);
                Ok(gst::FlowSuccess::Ok)
            }
            Item::Frame(buffer, None) => self.srcpad.push(buffer),
            Item::Frame(mut buffer, Some(due)) => {
                if due.stands {
                    // (Without a duration, vlmquery counts one frame of the caps' rate.)
                    let standing = StandingEvent { pts: buffer.pts(), duration: buffer.duration(), stream: None };
                    self.srcpad.push_event(standing.event());
                }
                let encoded = self.encode(&mut buffer, &due);
                let mut q = self.queue.lock();
                q.pending = q.pending.saturating_sub(1);
                self.changed.notify_all();
                drop(q);
                posted = encoded.is_err();
                encoded.and_then(|()| self.srcpad.push(buffer))
            }
        };
        {
            // The item has left: a serialized query behind it may go.
            let mut q = self.queue.lock();
            q.busy = false;
            self.changed.notify_all();
        }
        if result == Err(gst::FlowError::Eos) {
            self.downstream_ended();
            return;
        }
        if let Err(e) = result {
            gst::debug!(CAT, imp = self, "task paused: {e:?}");
            if !matches!(e, gst::FlowError::Flushing | gst::FlowError::Eos) {
                if !posted {
                    crate::post_flow_error(self.obj().upcast_ref(), e);
                }
                self.srcpad.push_event(gst::event::Eos::new());
            }
            self.queue.lock().flow = Some(e);
            self.changed.notify_all();
            let _ = self.srcpad.pause_task();
        }
    }

    /// A push returned EOS: the frames queued are dropped up to the first EOS, segment or
    /// stream-start event (those go on: a sink posts EOS only when the EOS event reaches it),
    /// and frames are refused with EOS until a new segment or stream comes; the task keeps
    /// running to push the events. So `fakesink num-buffers=1` downstream ends the pipeline
    /// instead of holding its EOS here.
    fn downstream_ended(&self) {
        gst::debug!(CAT, imp = self, "downstream is EOS: frames refused, events passed");
        let mut q = self.queue.lock();
        q.downstream_eos = true;
        while let Some(item) = q.items.front() {
            match item {
                Item::Event(e)
                    if matches!(
                        e.type_(),
                        gst::EventType::Eos | gst::EventType::Segment | gst::EventType::StreamStart
                    ) =>
                {
                    break;
                }
                Item::Frame(_, Some(_)) => q.pending = q.pending.saturating_sub(1),
                _ => (),
            }
            q.items.pop_front();
        }
        self.changed.notify_all();
    }
}
