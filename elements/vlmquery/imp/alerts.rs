//! Standing questions of `vlmquery` (`alerts`): every new frame of every stream that reaches the
//! element is evaluated against each alert on a private branch of its version (the runtime's
//! [`vlm_runtime::alert`]: a forced yes/no choice, one decode, no sampling), on one thread of the
//! element's own; `vlm-alert` messages (and JSON lines on the text pad) say each stream's first
//! state of an alert and every change that holds for `alert-hold` evaluations.
//!
//! Thinning: each stream has one slot for its next frame to evaluate. A frame that arrives while
//! the slot is still full (the engine has not kept up) takes the slot, the older one is not
//! evaluated (newest frame first), counted in `alerts-thinned` and said by a `vlm-alert-overload`
//! message (at most one a second per stream). The history itself never waits for alerts. The
//! streams' frames taken together are evaluated at once (a thread each), so their evaluations
//! queue on their engines together.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use parking_lot::{Condvar, Mutex};
use vlm_runtime::alert::{self, AlertSpec, Hysteresis, YesNo};
use vlm_runtime::{Stream, Watch};

use super::{CAT, OutputFormat, VlmQuery};

/// How often the video's EOS, waiting for the alerts' last evaluations, looks for a stream that
/// closed meanwhile ([`VlmQuery::alerts_drain`]).
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// Name of the element message of an alert's state.
pub const ALERT_MESSAGE: &str = "vlm-alert";
/// Name of the element message saying frames went unevaluated.
pub const ALERT_OVERLOAD_MESSAGE: &str = "vlm-alert-overload";

const OVERLOAD_EVERY: Duration = Duration::from_secs(1);

/// A frame to evaluate.
#[derive(Clone, Copy)]
struct FrameAt {
    number: u64,
    pts: Option<gst::ClockTime>,
    running_time: Option<gst::ClockTime>,
    arrival: Instant,
}

/// The alerts of one stream.
struct StreamAlerts {
    stream: Arc<Stream>,
    /// While alerts are set: every new version is read, so the stream's frames are ingested as a
    /// waiting question's are (`Stream::watch`).
    watch: Option<Watch>,
    /// The next frame to evaluate (the newest one not yet taken).
    next: Option<FrameAt>,
    /// Frames since the last one scheduled (`alert-interval`).
    since: u32,
    /// The running time of the last frame scheduled (`alert-period`).
    last_at: Option<gst::ClockTime>,
    /// Each alert's hysteresis, by id.
    machines: HashMap<String, Hysteresis>,
    /// Each alert's reported state, by id: (state, probability, frame that decided it).
    reported: HashMap<String, (bool, f64, u64)>,
    thinned: u64,
    last_overload: Option<Instant>,
    /// A failure has been warned about (once per stream).
    warned: bool,
    /// Alerts whose own evaluation failed, warned about (once per alert and stream).
    failing: HashSet<String>,
}

#[derive(Default)]
struct State {
    /// The `alerts` property as set, and parsed.
    text: String,
    specs: Arc<Vec<AlertSpec>>,
    interval: u32,
    /// `alert-period` (ns of running time, 0 = none).
    period: u64,
    hold: u32,
    streams: HashMap<u64, StreamAlerts>,
    /// Streams in the order they first came (their evaluations are posted in this order).
    order: VecDeque<u64>,
    worker: Option<std::thread::JoinHandle<()>>,
    /// The run the worker belongs to: a stop starts the next, and a worker of an older run ends
    /// (one not joined: it was the thread stopping, from a sync bus handler on its `vlm-alert`).
    generation: u64,
    /// Set by a flush or a stop: the evaluation in flight ends, its results are dropped.
    cancel: Arc<AtomicBool>,
    /// The streams the evaluations in flight wait on (woken on cancel).
    waiting_on: Vec<Arc<Stream>>,
    flushing: bool,
    stopping: bool,
    /// The worker is evaluating a frame.
    busy: bool,
    evaluations: u64,
    thinned: u64,
    /// `vlm-alert-overload` messages for the alert thread to post.
    overloads: Vec<gst::Structure>,
    /// The yes/no tokens of each language model (by path), or why it has none.
    yes_no: HashMap<PathBuf, Result<YesNo, String>>,
}

/// The alert state of a `vlmquery`.
pub(super) struct Alerts {
    state: Mutex<State>,
    changed: Condvar,
}

impl Default for Alerts {
    fn default() -> Self {
        Alerts { state: Mutex::new(State { interval: 1, hold: 1, ..State::default() }), changed: Condvar::new() }
    }
}

/// The alert properties (added to the element's).
pub(super) fn properties() -> Vec<glib::ParamSpec> {
    vec![
        glib::ParamSpecString::builder("alerts")
            .nick("Alerts")
            .blurb("Standing yes/no questions evaluated on new frames of every stream, id:question;id:question (empty = none); first states and changes posted as vlm-alert messages")
            .mutable_playing()
            .build(),
        glib::ParamSpecUInt::builder("alert-interval")
            .nick("Alert interval")
            .blurb("Evaluate the alerts on every Nth frame of a stream (1 = every frame)")
            .minimum(1)
            .default_value(1)
            .mutable_playing()
            .build(),
        glib::ParamSpecUInt64::builder("alert-period")
            .nick("Alert period")
            .blurb("Evaluate the alerts on a stream's frames at least this far apart in running time (ns, 0 = every frame alert-interval allows)")
            .maximum(gst::ClockTime::MAX.nseconds())
            .mutable_playing()
            .build(),
        glib::ParamSpecUInt::builder("alert-hold")
            .nick("Alert hold")
            .blurb("Hysteresis: evaluations in a row of the other state before an alert's state changes (1 = at once)")
            .minimum(1)
            .maximum(10000)
            .default_value(1)
            .mutable_playing()
            .build(),
        glib::ParamSpecUInt64::builder("alert-evaluations")
            .nick("Alert evaluations")
            .blurb("Alert evaluations done so far (one per alert per evaluated frame)")
            .read_only()
            .build(),
        glib::ParamSpecUInt64::builder("alerts-thinned")
            .nick("Alerts thinned")
            .blurb("Frames whose alerts were not evaluated because a newer frame of the stream came first (the engine did not keep up)")
            .read_only()
            .build(),
    ]
}

impl VlmQuery {
    /// Set an alert property; false when `name` is not one.
    pub(super) fn set_alert_property(&self, name: &str, value: &glib::Value) -> bool {
        let mut st = self.alerts.state.lock();
        match name {
            "alerts" => {
                let text = value.get::<Option<String>>().unwrap().unwrap_or_default();
                match alert::parse_alerts(&text) {
                    Ok(specs) => {
                        let hold = st.hold;
                        // An alert whose question changed, or that is gone, starts again.
                        for s in st.streams.values_mut() {
                            s.machines.retain(|id, _| specs.iter().any(|a| &a.id == id));
                            s.reported.retain(|id, _| specs.iter().any(|a| &a.id == id));
                        }
                        for a in specs.iter() {
                            let same = st.specs.iter().any(|o| o.id == a.id && o.question == a.question);
                            if !same {
                                for s in st.streams.values_mut() {
                                    s.machines.insert(a.id.clone(), Hysteresis::new(hold));
                                    s.reported.remove(&a.id);
                                }
                            }
                        }
                        if specs.is_empty() {
                            st.streams.values_mut().for_each(|s| s.watch = None);
                        }
                        gst::info!(CAT, imp = self, "alerts: {}", alert::format_alerts(&specs));
                        st.text = text;
                        st.specs = Arc::new(specs);
                    }
                    Err(e) => {
                        let message = format!("invalid alerts {text:?}: {e}; keeping {:?}", st.text);
                        drop(st);
                        // As for `placement`: on stderr (gst-launch-1.0 has no bus yet), and on the bus.
                        glib::g_warning!("vlmquery", "{}: {message}", self.obj().name());
                        gst::element_imp_warning!(self, gst::LibraryError::Settings, ("{}", message));
                        return true;
                    }
                }
            }
            "alert-interval" => st.interval = value.get().unwrap(),
            "alert-period" => st.period = value.get().unwrap(),
            "alert-hold" => {
                st.hold = value.get().unwrap();
                let hold = st.hold;
                st.streams.values_mut().flat_map(|s| s.machines.values_mut()).for_each(|m| m.set_hold(hold));
            }
            _ => return false,
        }
        self.alerts.changed.notify_all();
        true
    }

    /// The value of an alert property, if `name` is one.
    pub(super) fn alert_property(&self, name: &str) -> Option<glib::Value> {
        let st = self.alerts.state.lock();
        Some(match name {
            "alerts" => st.text.to_value(),
            "alert-interval" => st.interval.to_value(),
            "alert-period" => st.period.to_value(),
            "alert-hold" => st.hold.to_value(),
            "alert-evaluations" => st.evaluations.to_value(),
            "alerts-thinned" => st.thinned.to_value(),
            _ => return None,
        })
    }

    /// A frame of `stream` reached the video pad (called under the shared lock): schedule it for
    /// evaluation when alerts are set and `alert-interval` says so, thinning the older frame.
    pub(super) fn alert_frame(
        &self,
        stream: Option<&Arc<Stream>>,
        number: u64,
        pts: Option<gst::ClockTime>,
        running_time: Option<gst::ClockTime>,
    ) {
        let Some(stream) = stream else { return };
        let mut st = self.alerts.state.lock();
        if st.specs.is_empty() || st.flushing || st.stopping {
            return;
        }
        let (interval, period, id) = (st.interval, gst::ClockTime::from_nseconds(st.period), stream.id());
        if !st.streams.contains_key(&id) {
            st.order.push_back(id);
        }
        let s = st.streams.entry(id).or_insert_with(|| StreamAlerts {
            stream: Arc::clone(stream),
            watch: None,
            next: None,
            since: 0,
            last_at: None,
            machines: HashMap::new(),
            reported: HashMap::new(),
            thinned: 0,
            last_overload: None,
            warned: false,
            failing: HashSet::new(),
        });
        s.watch.get_or_insert_with(|| stream.watch());
        s.since += 1;
        // (Running time that went back, a new segment, starts the period again.)
        let early = running_time.zip(s.last_at).is_some_and(|(now, last)| now >= last && now - last < period);
        if s.since < interval || early {
            return;
        }
        s.since = 0;
        s.last_at = running_time.or(s.last_at);
        let frame = FrameAt { number, pts, running_time, arrival: Instant::now() };
        let thinned = s.next.replace(frame);
        let overload = thinned.is_some().then(|| {
            s.thinned += 1;
            let due = s.last_overload.is_none_or(|t| t.elapsed() >= OVERLOAD_EVERY);
            if due {
                s.last_overload = Some(Instant::now());
            }
            (due, s.thinned, s.stream.name().to_owned(), thinned.map_or(0, |f| f.number))
        });
        if overload.is_some() {
            st.thinned += 1;
        }
        if st.worker.is_none() {
            let this = self.ref_counted();
            let generation = st.generation;
            let worker = move || {
                // (A panic ends the thread, not the alerts: the next frame starts another, and
                // the video's EOS does not wait for this one.)
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| this.alert_worker(generation))).is_err() {
                    gst::error!(CAT, imp = this, "panic in the alert thread");
                    let mut st = this.alerts.state.lock();
                    if st.generation == generation {
                        (st.busy, st.worker) = (false, None);
                        st.waiting_on.clear();
                    }
                    this.alerts.changed.notify_all();
                }
            };
            match std::thread::Builder::new().name("vlmquery-alerts".into()).spawn(worker) {
                Ok(t) => st.worker = Some(t),
                Err(e) => gst::error!(CAT, imp = self, "cannot start the alert thread: {e}"),
            }
        }
        if let Some((due, thinned, stream, frame)) = overload {
            gst::debug!(CAT, imp = self, "alerts of frame {frame} of {stream} not evaluated: a newer frame came first");
            // (Posted by the alert thread: the caller holds the element's lock.)
            if due {
                st.overloads.push(
                    gst::Structure::builder(ALERT_OVERLOAD_MESSAGE)
                        .field("stream", stream)
                        .field("frame", frame)
                        .field("thinned", thinned)
                        .field("policy", "newest-first")
                        .build(),
                );
            }
        }
        self.alerts.changed.notify_all();
    }

    /// The alert thread: take the next frame of every stream that has one, wait for their
    /// versions and evaluate every alert on them (the streams at once, so one stream's ingestion
    /// holds no other's evaluations and all of them queue on their engines together), post what
    /// changed.
    fn alert_worker(&self, generation: u64) {
        loop {
            let (taken, specs, cancel) = {
                let mut st = self.alerts.state.lock();
                let taken = loop {
                    if st.stopping || st.generation != generation {
                        return;
                    }
                    let mut taken: Vec<(Arc<Stream>, FrameAt)> = vec![];
                    // (A closed stream, a camera gone, is let go: its history with it.)
                    let State { order, streams, .. } = &mut *st;
                    streams.retain(|_, s| !s.stream.is_closed());
                    order.retain(|id| streams.contains_key(id));
                    if !st.flushing {
                        let State { order, streams, .. } = &mut *st;
                        for id in order.iter() {
                            if let Some(s) = streams.get_mut(id)
                                && let Some(f) = s.next.take()
                            {
                                taken.push((Arc::clone(&s.stream), f));
                            }
                        }
                    }
                    if !taken.is_empty() {
                        break taken;
                    }
                    self.alerts.changed.wait(&mut st);
                };
                st.busy = true;
                st.waiting_on = taken.iter().map(|(s, _)| Arc::clone(s)).collect();
                let overloads = std::mem::take(&mut st.overloads);
                let taken = (taken, Arc::clone(&st.specs), Arc::clone(&st.cancel));
                drop(st);
                for s in overloads {
                    let _ = self.obj().post_message(gst::message::Element::builder(s).src(&*self.obj()).build());
                }
                taken
            };
            // (Looked up here, not on the evaluations' threads: a warning that the model has no
            // yes/no tokens is posted by this thread, which a stop from a sync bus handler on it
            // does not wait for.)
            let mut yes_no: Vec<_> = taken
                .iter()
                .map(|(stream, _)| if specs.is_empty() { Err(String::new()) } else { self.yes_no(stream) })
                .collect();
            let results: Vec<_> = match &taken[..] {
                [(stream, frame)] => vec![
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.evaluate_frame(stream, *frame, &specs, yes_no.pop().expect("one"), &cancel)
                    }))
                    .unwrap_or_else(|_| Err(vlm_runtime::Error::Engine("panic in an evaluation".into()))),
                ],
                _ => std::thread::scope(|scope| {
                    let handles: Vec<_> = taken
                        .iter()
                        .zip(yes_no)
                        .map(|((stream, frame), yes_no)| {
                            scope.spawn(|| self.evaluate_frame(stream, *frame, &specs, yes_no, &cancel))
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| {
                            h.join()
                                .unwrap_or_else(|_| Err(vlm_runtime::Error::Engine("panic in an evaluation".into())))
                        })
                        .collect()
                }),
            };
            let mut st = self.alerts.state.lock();
            st.waiting_on.clear();
            let (mut posts, mut warnings) = (vec![], vec![]);
            for ((stream, frame), result) in taken.into_iter().zip(results) {
                match result {
                    _ if cancel.load(Ordering::Acquire) || st.flushing => (),
                    // (The stream closed while its frame was awaited: a camera gone, nothing to say.)
                    Err(vlm_runtime::Error::Cancelled) => (),
                    Ok(evaluations) => {
                        posts.extend(self.record(&mut st, &stream, frame, &specs, evaluations, &mut warnings))
                    }
                    Err(e) => {
                        let first =
                            st.streams.get_mut(&stream.id()).is_some_and(|s| !std::mem::replace(&mut s.warned, true));
                        if first {
                            warnings.push(format!("alerts of stream {} not evaluated: {e}", stream.name()));
                        } else {
                            gst::debug!(CAT, imp = self, "alerts of frame {} not evaluated: {e}", frame.number);
                        }
                    }
                }
            }
            drop(st);
            // (Posted with no lock held: a sync bus handler may stop the pipeline or set alerts.)
            for message in warnings {
                gst::warning!(CAT, imp = self, "{message}");
                gst::element_imp_warning!(self, gst::StreamError::Failed, ("{}", message));
            }
            self.post_alerts(posts, &cancel);
            // Busy until its lines are queued: the video's EOS waits for them (`alerts_drain`).
            let mut st = self.alerts.state.lock();
            if st.generation != generation {
                return;
            }
            st.busy = false;
            self.alerts.changed.notify_all();
        }
    }

    /// The yes/no tokens of `stream`'s language model, looked up once per model; a model with
    /// none disables the alerts, said once.
    fn yes_no(&self, stream: &Stream) -> Result<YesNo, String> {
        let engine = stream.engine();
        let model = engine.model().path().to_path_buf();
        if let Some(cached) = self.alerts.state.lock().yes_no.get(&model).cloned() {
            return cached;
        }
        let found = YesNo::find(engine.model()).map_err(|e| e.to_string());
        if let Err(e) = &found {
            gst::element_imp_warning!(self, gst::LibraryError::Settings, ("alerts disabled: {}", e));
        }
        self.alerts.state.lock().yes_no.insert(model, found.clone());
        found
    }

    /// Wait for the version of `frame` and evaluate every alert on it.
    fn evaluate_frame(
        &self,
        stream: &Arc<Stream>,
        frame: FrameAt,
        specs: &[AlertSpec],
        yes_no: Result<YesNo, String>,
        cancel: &Arc<AtomicBool>,
    ) -> Result<Vec<vlm_runtime::Result<alert::Evaluation>>, vlm_runtime::Error> {
        if specs.is_empty() {
            return Ok(vec![]);
        }
        let yes_no = yes_no.map_err(vlm_runtime::Error::Config)?;
        let version = stream.wait_version(frame.number, cancel)?;
        alert::evaluate(&version, specs, yes_no, cancel)
    }

    /// Count the evaluations of `frame` and return the `vlm-alert`s they make; an alert's own
    /// failure is added to `warnings` the first time on its stream.
    fn record(
        &self,
        st: &mut State,
        stream: &Arc<Stream>,
        frame: FrameAt,
        specs: &[AlertSpec],
        evaluations: Vec<vlm_runtime::Result<alert::Evaluation>>,
        warnings: &mut Vec<String>,
    ) -> Vec<gst::Structure> {
        let latency_ms = self.latency_ms(frame);
        let hold = st.hold;
        let current = Arc::clone(&st.specs);
        let mut posts = vec![];
        let mut done = 0;
        let Some(s) = st.streams.get_mut(&stream.id()) else { return posts };
        for (spec, result) in specs.iter().zip(evaluations) {
            // (An alert changed or removed while it was evaluated: the result is the old
            // question's, not the new one's first state.)
            if !current.iter().any(|a| a.id == spec.id && a.question == spec.question) {
                continue;
            }
            let e = match result {
                Ok(e) => e,
                Err(err) if s.failing.insert(spec.id.clone()) => {
                    warnings.push(format!("alert {} of stream {} not evaluated: {err}", spec.id, stream.name()));
                    continue;
                }
                Err(err) => {
                    gst::debug!(CAT, imp = self, "alert {} on frame {}: {err}", spec.id, frame.number);
                    continue;
                }
            };
            done += 1;
            let machine = s.machines.entry(spec.id.clone()).or_insert_with(|| Hysteresis::new(hold));
            let p = e.choice.probability();
            gst::log!(CAT, imp = self, "alert {} frame {}: P(yes) {p:.3}", spec.id, e.frame);
            if let Some(t) = machine.observe(e.choice.state()) {
                s.reported.insert(spec.id.clone(), (t.state, p, e.frame));
                posts.push(
                    gst::Structure::builder(ALERT_MESSAGE)
                        .field("id", &spec.id)
                        .field("question", &spec.question)
                        .field("stream", stream.name())
                        .field("state", t.state)
                        .field("probability", p)
                        .field("frame", e.frame)
                        .field("pts", frame.pts)
                        .field("latency-ms", latency_ms)
                        .field("evaluations", machine.evaluations())
                        .field("first", t.first)
                        .field("engine", &e.engine)
                        .build(),
                );
            }
        }
        st.evaluations += done;
        posts
    }

    /// Milliseconds from the frame's capture as best known: since it reached this element, or
    /// since its running time on the pipeline clock when that is longer (a live source stamps
    /// its capture time).
    fn latency_ms(&self, frame: FrameAt) -> f64 {
        let arrival = frame.arrival.elapsed().as_secs_f64() * 1e3;
        let obj = self.obj();
        let clock = obj
            .current_running_time()
            .zip(frame.running_time)
            .map(|(now, rt)| if now > rt { (now - rt).nseconds() as f64 / 1e6 } else { 0.0 });
        clock.map_or(arrival, |c| c.max(arrival))
    }

    /// Post the `vlm-alert`s, and queue their JSON lines for the text pad (`output-format=json`),
    /// unless a flush or a stop (`cancel`) came meanwhile: from a sync bus handler on one of
    /// them, the ones after it are of the time before.
    fn post_alerts(&self, posts: Vec<gst::Structure>, cancel: &AtomicBool) {
        if posts.is_empty() {
            return;
        }
        let json = self.settings.lock().output_format == OutputFormat::Json;
        for s in &posts {
            if cancel.load(Ordering::Acquire) {
                return;
            }
            gst::info!(CAT, imp = self, "{s}");
            let _ = self.obj().post_message(gst::message::Element::builder(s.clone()).src(&*self.obj()).build());
        }
        if json {
            let mut shared = self.shared.lock();
            if !shared.flushing && !cancel.load(Ordering::Acquire) {
                for s in &posts {
                    let pts = s.get::<Option<gst::ClockTime>>("pts").ok().flatten();
                    super::push_bounded(&mut shared.alert_lines, (json_line(s), pts));
                }
                self.changed.notify_all();
            }
        }
    }

    /// Wait until every frame scheduled for evaluation has been evaluated (the video's EOS),
    /// unless a flush or a stop comes first. A closed stream's frame is not waited for (its
    /// camera is gone: the alert thread lets it go, and nothing else would say so), and the
    /// streams are looked at again every [`DRAIN_POLL`] for one closing meanwhile.
    pub(super) fn alerts_drain(&self) {
        let mut st = self.alerts.state.lock();
        while st.worker.is_some()
            && !st.flushing
            && !st.stopping
            && (st.busy || st.streams.values().any(|s| s.next.is_some() && !s.stream.is_closed()))
        {
            self.alerts.changed.wait_for(&mut st, DRAIN_POLL);
        }
    }

    /// A flush starts (`true`): frames waiting are dropped and the evaluation in flight ends; or
    /// ends (`false`): evaluation goes on with the next frames.
    pub(super) fn alerts_flush(&self, flushing: bool) {
        let mut st = self.alerts.state.lock();
        st.flushing = flushing;
        if flushing {
            st.cancel.store(true, Ordering::Release);
            st.overloads.clear();
            // (The video after a seek is another scene: each alert starts afresh, its first state
            // posted again.)
            for s in st.streams.values_mut() {
                (s.next, s.last_at) = (None, None);
                s.machines.clear();
                s.reported.clear();
            }
            st.waiting_on.iter().for_each(|s| s.wake());
        } else {
            st.cancel = Arc::new(AtomicBool::new(false));
        }
        self.alerts.changed.notify_all();
    }

    /// PAUSED→READY: end the alert thread and forget the streams' states (a new run posts its
    /// first states again) and the counts.
    pub(super) fn alerts_stop(&self) {
        let worker = {
            let mut st = self.alerts.state.lock();
            st.stopping = true;
            st.cancel.store(true, Ordering::Release);
            st.waiting_on.iter().for_each(|s| s.wake());
            st.generation += 1;
            self.alerts.changed.notify_all();
            st.worker.take()
        };
        // (Not from the worker itself: a sync bus handler stopping the pipeline on a `vlm-alert`.
        // It ends when the handler returns, its run over. Nor for longer than a while: the
        // worker may be in such a handler that waits for this stop's state lock.)
        if let Some(w) = worker.filter(|w| w.thread().id() != std::thread::current().id())
            && !super::join_within(vec![w], super::ENDING_WAIT)
        {
            gst::warning!(CAT, imp = self, "the alert thread is still running (a bus handler on it?)");
        }
        let mut st = self.alerts.state.lock();
        st.stopping = false;
        st.busy = false;
        st.overloads.clear();
        // Until the text pad's next activation (`flush_stop`): a frame still in the video's chain
        // function starts no alert thread now.
        st.flushing = true;
        st.cancel = Arc::new(AtomicBool::new(false));
        st.streams.clear();
        st.order.clear();
        st.evaluations = 0;
        st.thinned = 0;
        self.alerts.changed.notify_all();
    }

    /// Attach the alert states reported for `stream` (`VlmAlertMeta`) to a video buffer leaving
    /// `video_src`, once the stream has one.
    pub(super) fn add_alert_meta(&self, buffer: &mut gst::Buffer, stream: Option<u64>) {
        let meta = {
            let st = self.alerts.state.lock();
            let Some(s) = stream.and_then(|id| st.streams.get(&id)) else { return };
            let states: Vec<_> =
                st.specs.iter().filter_map(|a| s.reported.get(&a.id).map(|r| (a.id.as_str(), *r))).collect();
            if states.is_empty() {
                return;
            }
            gst::Structure::builder(crate::meta::ALERT_META)
                .field("stream", s.stream.name())
                .field("ids", gst::Array::new(states.iter().map(|(id, _)| id.to_string())))
                .field("states", gst::Array::new(states.iter().map(|(_, r)| r.0)))
                .field("probabilities", gst::Array::new(states.iter().map(|(_, r)| r.1)))
                .field("frames", gst::Array::new(states.iter().map(|(_, r)| r.2)))
                .build()
        };
        if let Ok(mut m) = gst::meta::CustomMeta::add(buffer.make_mut(), crate::meta::ALERT_META) {
            let s = m.mut_structure();
            for (name, value) in meta.iter() {
                s.set_value(name, value.clone());
            }
        }
    }

    /// Push one alert's JSON line on the text pad.
    pub(super) fn push_alert_line(&self, text: String, at: Option<gst::ClockTime>) {
        let mut buffer = gst::Buffer::from_mut_slice(text.into_bytes());
        buffer.get_mut().unwrap().set_pts(at);
        self.text_pushed(self.srcpad.push(buffer));
    }
}

/// One JSON line of a `vlm-alert`: its fields and `"type": "alert"`; the pts in nanoseconds or
/// null.
fn json_line(s: &gst::StructureRef) -> String {
    let mut object = serde_json::Map::new();
    object.insert("type".into(), "alert".into());
    for (name, value) in s.iter() {
        let v = if let Ok(v) = value.get::<String>() {
            serde_json::Value::from(v)
        } else if let Ok(v) = value.get::<bool>() {
            serde_json::Value::from(v)
        } else if let Ok(v) = value.get::<f64>() {
            serde_json::Value::from(v)
        } else if name == "pts" {
            let pts = value.get::<Option<gst::ClockTime>>().ok().flatten();
            pts.map_or(serde_json::Value::Null, |t| t.nseconds().into())
        } else if let Ok(v) = value.get::<u64>() {
            serde_json::Value::from(v)
        } else {
            serde_json::Value::Null
        };
        object.insert(name.to_string(), v);
    }
    serde_json::Value::Object(object).to_string() + "\n"
}
