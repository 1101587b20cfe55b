//! The streams of `vlmcontext`: the runtime stream behind a pair of pads, opened on first use; the
//! sink pad's buffers (each frame registered in its history), events and queries; the pad's
//! statistics (frames skipped or dropped, history restarts and slides, largest lag), each
//! property notified when it changes.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use gst::prelude::*;
use gst::subclass::prelude::*;
use vlm_runtime::{DEFAULT_ANSWER_RESERVE, Error, HistoryPolicy, Overload, Stream, StreamConfig};

use super::{CAT, HistoryPolicyKind, OverloadKind, StreamPads, VlmContext};
use crate::events::{DemandQuery, ModelQuery, NotTakenEvent, StandingEvent, StreamEvent};
use crate::meta::VlmFrameMeta;

impl VlmContext {
    /// The runtime stream of `pads`, opened on first use.
    ///
    /// Locks are taken one at a time, none held across the upstream latency query, and only
    /// `opening` (taken nowhere else) across the stream's opening (`stop` takes the pads and then
    /// a pad's stream; `property` takes no other lock with the settings).
    /// `None` when the pad is flushing, stopping or released (nothing to report: no stream
    /// opens for it).
    fn stream(&self, pads: &StreamPads) -> Result<Option<Arc<Stream>>, gst::ErrorMessage> {
        if let Some(s) = pads.stream.lock().as_ref() {
            return Ok(Some(Arc::clone(s)));
        }
        {
            let mut st = self.state.lock();
            // The first frame of a stream may come while the engines load (READY→PAUSED
            // completing asynchronously): it waits for them, or for a flush or a stop.
            while st.loading && !pads.cancel.load(Ordering::Acquire) {
                self.loaded.wait_for(&mut st, std::time::Duration::from_millis(100));
            }
        }
        let settings = self.settings.lock().clone();
        let name = pads.sink.downcast_ref::<crate::vlmcontext::VlmContextSinkPad>().map(|p| p.stream_name());
        // A source asked before its caps may not know yet whether it is live (videotestsrc
        // answers no latency query then): asked again at the first frame (`settle_stream`).
        let (overload, settled) = match settings.overload {
            OverloadKind::Block => (Overload::Block, true),
            OverloadKind::Skip => (Overload::Skip, true),
            OverloadKind::Auto => match self.upstream_is_live(&pads.sink) {
                Some(live) => (if live { Overload::Skip } else { Overload::Block }, true),
                None => (Overload::Block, false),
            },
        };
        // One stream opens at a time: choosing its engine and taking a stream sequence there are
        // one step (two streams whose first frames came together, as when the engines finish
        // loading, would both choose the engine with one free sequence).
        // (`stop` and `release_pad` set `cancel` and then take this lock to close the stream:
        // one opened after they looked would be left open.)
        let opening = self.opening.lock();
        if let Some(s) = pads.stream.lock().as_ref() {
            return Ok(Some(Arc::clone(s))); // opened meanwhile by another of the pad's threads
        }
        if pads.cancel.load(Ordering::Acquire) {
            return Ok(None);
        }
        let (engine, engines, prompt) = {
            let st = self.state.lock();
            let Some(p) = &st.prompt else {
                if pads.stopped.load(Ordering::SeqCst) {
                    return Ok(None); // stopped (a flush-stop meanwhile cleared `cancel`)
                }
                return Err(gst::error_msg!(
                    gst::CoreError::StateChange,
                    ("vlmcontext has no engines: it is not started, or its model did not load (see the error before)")
                ));
            };
            // Where its frames are ingested soonest.
            let resident = vlm_runtime::placer::resident_engine(&st.engines)
                .ok_or_else(|| gst::error_msg!(gst::CoreError::StateChange, ["no engine"]))?;
            (Arc::clone(resident), st.engines.clone(), Arc::clone(p))
        };
        // Every engine holds its `max-streams`: this camera is refused, not the pipeline ended
        // (its frames pass without joining a history; a sequence another stream gives back
        // opens it at a later frame).
        // (A failed engine keeps its free sequences but takes no stream: only when every engine
        // has failed does the open below fail.)
        let mut healthy = engines.iter().filter(|e| e.failure().is_none()).peekable();
        if healthy.peek().is_some() && healthy.all(|e| e.stream_slots().1 == 0) {
            // (Posted once the lock is let go: a sync bus handler may release the pad or stop.)
            drop(opening);
            if !pads.refused.swap(true, Ordering::AcqRel) {
                let (used, free) = engine.stream_slots();
                gst::element_imp_warning!(
                    self,
                    gst::ResourceError::Busy,
                    (
                        "{}: no stream sequence is free on the engines (max-streams={} each): its frames pass without joining a history until another stream closes",
                        pads.sink.name(),
                        used + free
                    )
                );
            }
            return Ok(None);
        }
        let config = StreamConfig {
            name: name.unwrap_or_else(|| pads.sink.name().to_string()),
            retain: settings.retain,
            max_pending: settings.max_pending as usize,
            overload,
            answer_reserve: DEFAULT_ANSWER_RESERVE,
            history_policy: match settings.history_policy {
                HistoryPolicyKind::Restart => HistoryPolicy::Restart { keep: settings.history_keep as usize },
                HistoryPolicyKind::Stop => HistoryPolicy::Stop,
                HistoryPolicyKind::Slide => HistoryPolicy::Slide,
            },
            prefix_cache: self.prefix_cache.lock().clone(),
            peers: engines,
            slide_wait: vlm_runtime::DEFAULT_SLIDE_WAIT,
        };
        let stream = Stream::open(&engine, prompt, config).map_err(|e| {
            gst::error_msg!(gst::ResourceError::Failed, ("{}: {}", pads.sink.name(), e), ["vlmcontext"])
        })?;
        gst::info!(CAT, obj = pads.sink, "opened stream {} on engine {}", stream.id(), engine.name());
        // Restarts and slides, whichever thread's entry caused them (a frame here, an answer
        // `vlmquery` commits from its own thread).
        let (element, sink) = (self.obj().downgrade(), pads.sink.downgrade());
        let _ = stream.on_rebuild(Box::new(move |stream, registration, by_frame| {
            let Some(element) = element.upgrade() else { return };
            if let Some(pads) = sink.upgrade().and_then(|sink| element.imp().pads_of(&sink)) {
                element.imp().history_restarted(&pads, stream, registration, by_frame);
            }
        }));
        pads.overload_settled.store(settled, Ordering::Release);
        pads.announced.store(false, Ordering::Release);
        *pads.stream.lock() = Some(Arc::clone(&stream));
        pads.refused.store(false, Ordering::Release);
        Ok(Some(stream))
    }

    /// Whether the stream comes from a live source (its frames cannot wait); `None` where
    /// upstream does not answer.
    fn upstream_is_live(&self, sink: &gst::Pad) -> Option<bool> {
        let mut q = gst::query::Latency::new();
        sink.peer_query(&mut q).then(|| q.result().0)
    }

    /// At a frame, before it registers: `overload=auto` that could not tell at the stream's
    /// opening whether its source is live asks again (a source that still does not answer is
    /// taken as not live), and the stream's `vlm-stream` event goes downstream where its
    /// opening did not send it (a stream opened at a frame: refused at its start, or after a
    /// flush).
    fn settle_stream(&self, pads: &StreamPads, stream: &Stream) {
        if !pads.overload_settled.swap(true, Ordering::AcqRel) && self.upstream_is_live(&pads.sink) == Some(true) {
            gst::debug!(CAT, obj = pads.sink, "overload=auto: the source is live, frames are skipped past max-pending");
            stream.set_overload(Overload::Skip);
        }
        if !pads.announced.swap(true, Ordering::AcqRel) {
            pads.src.push_event(StreamEvent::event(stream.id(), stream.name()));
        }
    }

    pub(super) fn sink_chain(
        &self,
        pads: &StreamPads,
        mut buffer: gst::Buffer,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        // Flushing, stopping (PAUSED->READY runs before the pads deactivate) or released.
        if pads.cancel.load(Ordering::Acquire) {
            return Err(gst::FlowError::Flushing);
        }
        let frame = buffer.meta::<VlmFrameMeta>().and_then(|m| m.frame().cloned());
        if let Some(frame) = frame {
            let opened = self.stream(pads).map_err(|e| {
                self.post_error_message(e);
                gst::FlowError::Error
            })?;
            let Some(stream) = opened else {
                if pads.cancel.load(Ordering::Acquire) || pads.stopped.load(Ordering::SeqCst) {
                    return Err(gst::FlowError::Flushing);
                }
                // Refused: no sequence is free.
                pads.sink.push_event(NotTakenEvent::event());
                return pads.src.push(buffer);
            };
            self.settle_stream(pads, &stream);
            let lag = stream.lag();
            self.update_stats(pads, |stats| stats.max_lag_ms = stats.max_lag_ms.max(lag.ms));
            match stream.register(frame, &pads.cancel) {
                Ok(registration) if registration.skipped => {
                    self.frame_skipped(pads, &stream, lag);
                    pads.sink.push_event(NotTakenEvent::event());
                }
                Ok(registration) => {
                    let number = registration.number;
                    gst::trace!(CAT, obj = pads.sink, "registered frame {number} ({:?})", buffer.pts());
                    let buf = buffer.make_mut();
                    if let Some(mut m) = buf.meta_mut::<VlmFrameMeta>() {
                        m.set_position(stream.id(), number);
                    }
                }
                Err(Error::Cancelled) => return Err(gst::FlowError::Flushing),
                Err(e @ (Error::HistoryFull { .. } | Error::EntryTooLarge { .. })) => {
                    pads.sink.push_event(NotTakenEvent::event());
                    let first = self.update_stats(pads, |stats| {
                        stats.dropped += 1;
                        stats.dropped == 1
                    });
                    if first {
                        let which =
                            if matches!(e, Error::HistoryFull { .. }) { "later frames" } else { "frames this large" };
                        gst::element_imp_warning!(
                            self,
                            gst::ResourceError::NoSpaceLeft,
                            (
                                "{}: {}; {which} pass without joining the history (raise context-size)",
                                pads.sink.name(),
                                e
                            )
                        );
                    }
                }
                Err(e) => {
                    gst::element_imp_error!(
                        self,
                        gst::StreamError::Failed,
                        ("{}: frame not taken into the history: {}", pads.sink.name(), e)
                    );
                    return Err(gst::FlowError::Error);
                }
            }
        } else if buffer.meta::<VlmFrameMeta>().is_some_and(|m| m.held()) {
            // A frame the gate held: the last registered one stands for it, and says so.
            // Nothing stands for it (a new or reopened stream, or its frames not taken): the
            // next due frame is to be encoded.
            let standing = pads.stream.lock().as_ref().map(|s| (s.id(), s.registered())).filter(|s| s.1 > 0);
            match (standing, buffer.make_mut().meta_mut::<VlmFrameMeta>()) {
                (Some((stream, number)), Some(mut m)) => m.set_position(stream, number),
                _ => _ = pads.sink.push_event(NotTakenEvent::event()),
            }
        }
        pads.src.push(buffer)
    }

    /// The overload policy skipped a frame: count it; tell the application when a run of skips
    /// starts and then every 10 skipped frames.
    fn frame_skipped(&self, pads: &StreamPads, stream: &Stream, lag: vlm_runtime::Lag) {
        let skipped = self.update_stats(pads, |stats| {
            stats.skipped += 1;
            stats.skipped
        });
        gst::debug!(CAT, obj = pads.sink, "ingestion {} frames / {:.0} ms behind: frame skipped", lag.frames, lag.ms);
        if skipped == 1 || skipped.is_multiple_of(10) {
            let s = gst::Structure::builder("vlm-overload")
                .field("stream", stream.name())
                .field("policy", "skip")
                .field("lag-frames", lag.frames)
                .field("lag-ms", lag.ms)
                .field("skipped", skipped)
                .build();
            let _ = self.obj().post_message(gst::message::Element::builder(s).src(&*self.obj()).build());
        }
    }

    /// The history policy restarted (or slid) a stream's history, for a frame or for an answer
    /// committed to it (`by_frame` false): count it and tell the application.
    fn history_restarted(
        &self,
        pads: &StreamPads,
        stream: &Stream,
        registration: &vlm_runtime::Registration,
        by_frame: bool,
    ) {
        let (frame, slid) = (registration.number, registration.slid);
        let (kept, dropped) = registration.restart.unwrap_or_default();
        let (policy, how) = if slid {
            self.update_stats(pads, |stats| stats.slides += 1);
            ("slide", "slid in place")
        } else {
            self.update_stats(pads, |stats| stats.restarts += 1);
            ("restart", "restarted")
        };
        gst::info!(
            CAT,
            obj = pads.sink,
            "history full at {} {frame}: {how}, keeping the newest {kept} frames ({dropped} dropped)",
            if by_frame { "frame" } else { "an answer committed after frame" }
        );
        let engine = stream.engine();
        if !slid
            && self.settings.lock().history_policy == HistoryPolicyKind::Slide
            && let Some(why) = engine.shift_refusal()
        {
            match engine.position_gap_limit() {
                Some(limit) => gst::info!(
                    CAT,
                    obj = pads.sink,
                    "history-policy=slide restarts: the positions reached the model's trained context ({limit})"
                ),
                None => gst::info!(CAT, obj = pads.sink, "history-policy=slide restarts instead: {why}"),
            }
        }
        let s = gst::Structure::builder("vlm-history")
            .field("stream", stream.name())
            .field("policy", policy)
            .field("frame", frame)
            .field("kept", kept as u32)
            .field("dropped", dropped as u32)
            .field("cause", if by_frame { "frame" } else { "answer" })
            .field("restarts", stream.restarts())
            .field("slides", stream.slides())
            .build();
        let _ = self.obj().post_message(gst::message::Element::builder(s).src(&*self.obj()).build());
    }

    pub(super) fn sink_event(&self, pads: &StreamPads, event: gst::Event) -> bool {
        gst::log!(CAT, obj = pads.sink, "handling {event:?}");
        match event.view() {
            gst::EventView::FlushStart(_) => {
                pads.cancel.store(true, Ordering::Release);
                if let Some(stream) = pads.stream.lock().as_ref() {
                    stream.wake();
                }
            }
            gst::EventView::FlushStop(_) => {
                // (A stop or release that set `stopped` before or meanwhile keeps `cancel` set.)
                pads.cancel.store(false, Ordering::SeqCst);
                if pads.stopped.load(Ordering::SeqCst) {
                    pads.cancel.store(true, Ordering::SeqCst);
                }
            }
            gst::EventView::StreamStart(_) => {
                let forwarded = pads.src.push_event(event);
                return match self.stream(pads) {
                    Ok(Some(stream)) => {
                        let announced = pads.src.push_event(StreamEvent::event(stream.id(), stream.name()));
                        pads.announced.store(true, Ordering::Release);
                        forwarded && announced
                    }
                    // (Refused for want of a sequence, or flushing.)
                    Ok(None) => forwarded,
                    Err(e) => {
                        self.post_error_message(e);
                        false
                    }
                };
            }
            // (The stream it stands in, for a vlmquery that several streams reach.)
            gst::EventView::CustomDownstream(_) => {
                if let Some(standing) = StandingEvent::parse(&event) {
                    let stream = pads.stream.lock().as_ref().map(|s| s.id());
                    return pads.src.push_event(StandingEvent { stream, ..standing }.event());
                }
            }
            _ => (),
        }
        pads.src.push_event(event)
    }

    pub(super) fn sink_query(&self, pads: &StreamPads, query: &mut gst::QueryRef) -> bool {
        gst::log!(CAT, obj = pads.sink, "handling {query:?}");
        if ModelQuery::is(query) {
            // Asked by vlmencode's encoding task before it loads its projector: answered once
            // the engines have loaded (READY→PAUSED completing asynchronously), so that the
            // projector binds to their copy of the weights instead of loading another.
            let mut st = self.state.lock();
            while st.loading && !pads.cancel.load(Ordering::Acquire) {
                self.loaded.wait_for(&mut st, std::time::Duration::from_millis(100));
            }
            drop(st);
            ModelQuery::answer(query, &self.settings.lock().model);
            return true;
        }
        if DemandQuery::is(query) {
            // (Only a stream already open: a query opens none.)
            let Some(stream) = pads.stream.lock().clone() else { return false };
            DemandQuery::answer(query, stream.demand());
            return true;
        }
        pads.src.peer_query(query)
    }
}
