use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use parking_lot::Mutex;
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::snapshot::PrefixCache;
use vlm_runtime::{Engine, Stream};

// Each its own `impl VlmContext`: loading the engines, the properties (names, specifications,
// writing and reading), and the stream behind a pair of pads (its buffers, events and queries).
// The element, its settings, pads and state changes stay here.
mod load;
mod properties;
mod streams;

use load::Loading;
use properties::{
    PROP_FRAMES_DROPPED, PROP_FRAMES_SKIPPED, PROP_HISTORY_RESTARTS, PROP_HISTORY_SLIDES, PROP_MAX_LAG_MS,
};

pub(crate) static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlmcontext", gst::DebugColorFlags::empty(), Some("gst-vlm versioned stream history"))
});

const DEFAULT_CONTEXT_SIZE: u32 = 2048;
const DEFAULT_MAX_STREAMS: u32 = 2;
const DEFAULT_MAX_PENDING: u32 = 2;
const DEFAULT_HISTORY_KEEP: u32 = 8;
/// Slide: measured against restart, two live streams for 9 minutes each (docs/benchmarks.md,
/// "Slide or restart"): no frame skipped (10 under restart), p95 TTFT 0.56x and the longest
/// 953 ms against 3061 ms, p50 1.19x (each answer reads a longer history).
const DEFAULT_HISTORY_POLICY: HistoryPolicyKind = HistoryPolicyKind::Slide;
const DEFAULT_PREFIX_CACHE_ENTRIES: u32 = 16;

/// What happens when a stream's history would overflow its KV cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmHistoryPolicy")]
pub enum HistoryPolicyKind {
    #[enum_value(
        name = "Restart from the newest history-keep frames, replayed from their embeddings",
        nick = "restart"
    )]
    Restart,
    #[enum_value(
        name = "Stop: later frames pass without joining the history (counted in frames-dropped)",
        nick = "stop"
    )]
    Stop,
    #[enum_value(
        name = "Slide: drop the oldest frames until a quarter of context-size is free, keep the rest in place",
        nick = "slide"
    )]
    Slide,
}
/// What happens to a frame when ingestion is `max-pending` frames behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmOverload")]
pub enum OverloadKind {
    #[enum_value(name = "Auto: skip for a live source, block otherwise", nick = "auto")]
    Auto,
    #[enum_value(name = "Block upstream until ingestion catches up (backpressure)", nick = "block")]
    Block,
    #[enum_value(
        name = "Skip: the frame passes without joining the history (frames-skipped, vlm-overload)",
        nick = "skip"
    )]
    Skip,
}
/// How each engine lays out its KV cells (see `vlm_runtime::KvLayout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmKvLayout")]
pub enum KvLayoutKind {
    #[enum_value(
        name = "Auto: unified on the CPU and for up to 2 GPU streams, else per sequence (active-kv-layout)",
        nick = "auto"
    )]
    Auto,
    #[enum_value(
        name = "Per sequence: context-size cells a stream and an answer; bit-identical to a re-prefill",
        nick = "per-sequence"
    )]
    PerSequence,
    #[enum_value(name = "Unified pool: an answer shares its version's cells; close to a re-prefill", nick = "unified")]
    Unified,
}

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmKvType")]
pub enum KvTypeKind {
    #[enum_value(name = "16-bit floats", nick = "f16")]
    F16,
    #[enum_value(name = "8-bit blocks (turns flash-attention on)", nick = "q8_0")]
    Q8_0,
    #[enum_value(name = "4-bit blocks (turns flash-attention on)", nick = "q4_0")]
    Q4_0,
}

const DEFAULT_MAX_ANSWERS: u32 = 8;

#[derive(Debug, Clone, PartialEq)]
struct Settings {
    model: String,
    retain: bool,
    system_prompt: String,
    context_size: u32,
    max_streams: u32,
    /// `max-streams` was set: it is not raised to the sink pads requested by the load.
    max_streams_set: bool,
    max_pending: u32,
    engines: String,
    history_policy: HistoryPolicyKind,
    history_keep: u32,
    overload: OverloadKind,
    step_budget_ms: f64,
    ingest_share: f64,
    encode_first: bool,
    max_answers: u32,
    flash_attention: bool,
    /// `flash-attention` was set: `auto` layouts do not choose it.
    flash_attention_set: bool,
    gpu_device: u32,
    /// -1: every layer.
    gpu_layers: i32,
    kv_layout: KvLayoutKind,
    kv_type: KvTypeKind,
    prefix_cache_size: u64,
    prefix_cache_entries: u32,
    threads: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            model: String::new(),
            retain: true,
            system_prompt: DEFAULT_SYSTEM_PROMPT.into(),
            context_size: DEFAULT_CONTEXT_SIZE,
            max_streams: DEFAULT_MAX_STREAMS,
            max_streams_set: false,
            max_pending: DEFAULT_MAX_PENDING,
            engines: "cpu".into(),
            history_policy: DEFAULT_HISTORY_POLICY,
            history_keep: DEFAULT_HISTORY_KEEP,
            overload: OverloadKind::Auto,
            step_budget_ms: vlm_runtime::engine::DEFAULT_STEP_BUDGET_MS,
            ingest_share: vlm_runtime::engine::DEFAULT_INGEST_SHARE,
            encode_first: vlm_runtime::engine::DEFAULT_ENCODE_FIRST,
            max_answers: DEFAULT_MAX_ANSWERS,
            flash_attention: false,
            flash_attention_set: false,
            gpu_device: 0,
            gpu_layers: -1,
            kv_layout: KvLayoutKind::Auto,
            kv_type: KvTypeKind::F16,
            prefix_cache_size: 0,
            prefix_cache_entries: DEFAULT_PREFIX_CACHE_ENTRIES,
            // (At most the property's maximum: 256.)
            threads: std::thread::available_parallelism().map_or(2, |n| n.get().min(256) as u32),
        }
    }
}

/// A stream's statistics, reset at PAUSED→READY. The element's read-only properties sum
/// them over the streams (`max-lag-ms`: the largest), each notified when a stream's changes.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Stats {
    /// Frames that did not join the history because it was full (`frames-dropped`).
    dropped: u64,
    /// History restarts (`history-restarts`) and slides (`history-slides`).
    restarts: u64,
    slides: u64,
    /// Frames skipped under the overload policy (`frames-skipped`).
    skipped: u64,
    /// Largest lag seen when a frame arrived, in ms (`max-lag-ms`).
    max_lag_ms: f64,
}

/// One stream: a sink pad, its source pad, and the runtime stream behind them.
struct StreamPads {
    sink: gst::Pad,
    src: gst::Pad,
    stream: Mutex<Option<Arc<Stream>>>,
    /// Set while flushing or stopping: unblocks a chain function waiting for backpressure.
    cancel: AtomicBool,
    /// Set from a stop (or the pad's release) until the next start: a flush-stop meanwhile
    /// leaves `cancel` set.
    stopped: AtomicBool,
    /// Its stream was refused for want of a free sequence, and said so (once until it opens).
    refused: AtomicBool,
    /// Its stream's `vlm-stream` event has gone downstream.
    announced: AtomicBool,
    /// The overload policy of its stream is settled (`overload=auto` asks whether the source
    /// is live again at the first frame where it could not answer before its caps).
    overload_settled: AtomicBool,
    stats: Mutex<Stats>,
}

#[derive(Default)]
struct State {
    /// The language engines; a stream lives on the one where its ingestion costs least
    /// (`placer::resident_engine`).
    engines: Vec<Arc<Engine>>,
    prompt: Option<Arc<Prompt>>,
    /// READY→PAUSED is completing asynchronously: the engines are loading, and a stream's
    /// first frame waits for them (`loaded` is notified when this ends).
    loading: bool,
    /// Set by PAUSED→READY to abandon that load and its asynchronous completion.
    abandon: Arc<AtomicBool>,
}

#[derive(Default)]
pub struct VlmContext {
    settings: Mutex<Settings>,
    state: Mutex<State>,
    loaded: parking_lot::Condvar,
    /// Held while a stream opens (see `stream`).
    opening: Mutex<()>,
    /// The load started at NULL→READY on a worker thread, with the settings it used.
    loading: Mutex<Option<Loading>>,
    /// Loads abandoned (a stop, changed settings) and maybe still running: the next load waits
    /// for them, so a state that goes up and down quickly never runs two loads at once.
    abandoned: Mutex<Vec<std::thread::JoinHandle<load::Loaded>>>,
    pads: Mutex<Vec<Arc<StreamPads>>>,
    /// Kept across sessions (state changes), so a new session with the same history reuses KV.
    prefix_cache: Mutex<Option<Arc<PrefixCache>>>,
}

impl VlmContext {
    fn pads_of(&self, pad: &gst::Pad) -> Option<Arc<StreamPads>> {
        self.pads.lock().iter().find(|p| &p.sink == pad || &p.src == pad).cloned()
    }

    /// Change a stream's statistics with `change`, then notify the properties that changed
    /// (outside every lock: a handler may read them).
    fn update_stats<T>(&self, pads: &StreamPads, change: impl FnOnce(&mut Stats) -> T) -> T {
        let (before, now, result) = {
            let mut stats = pads.stats.lock();
            let before = *stats;
            let result = change(&mut stats);
            (before, *stats, result)
        };
        self.notify_stats(before, now);
        result
    }

    fn notify_stats(&self, before: Stats, now: Stats) {
        let obj = self.obj();
        let changed = [
            (before.dropped != now.dropped, PROP_FRAMES_DROPPED),
            (before.restarts != now.restarts, PROP_HISTORY_RESTARTS),
            (before.slides != now.slides, PROP_HISTORY_SLIDES),
            (before.skipped != now.skipped, PROP_FRAMES_SKIPPED),
            (before.max_lag_ms != now.max_lag_ms, PROP_MAX_LAG_MS),
        ];
        for (_, name) in changed.iter().filter(|(changed, _)| *changed) {
            obj.notify(name);
        }
    }

    /// PAUSED→READY, once the pads are inactive: every stream's statistics start again at zero.
    fn reset_stats(&self) {
        let pads: Vec<Arc<StreamPads>> = self.pads.lock().clone();
        for p in pads {
            self.update_stats(&p, |stats| *stats = Stats::default());
        }
    }
}

#[glib::object_subclass]
impl ObjectSubclass for VlmContext {
    const NAME: &'static str = "GstVlmContext";
    type Type = super::VlmContext;
    type ParentType = gst::Element;
    type Interfaces = (gst::ChildProxy,);
}

/// The sink pads as children, so a launch line sets their properties (`sink_0::stream-name=...`).
impl ChildProxyImpl for VlmContext {
    fn child_by_index(&self, index: u32) -> Option<glib::Object> {
        self.pads.lock().get(index as usize).map(|p| p.sink.clone().upcast())
    }

    fn children_count(&self) -> u32 {
        self.pads.lock().len() as u32
    }
}

impl ObjectImpl for VlmContext {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(properties::specs);
        PROPS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        self.set_setting(value, pspec)
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        self.property_value(pspec)
    }
}

impl GstObjectImpl for VlmContext {}

impl ElementImpl for VlmContext {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "VLM stream context",
                "Filter/Analyzer/Video",
                "Keeps a versioned language-model history (KV) per video stream, published when each frame's prefill completes",
                "gst-vlm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            let caps = gst::Caps::builder("video/x-raw").any_features().build();
            vec![
                gst::PadTemplate::with_gtype(
                    "sink_%u",
                    gst::PadDirection::Sink,
                    gst::PadPresence::Request,
                    &caps,
                    super::VlmContextSinkPad::static_type(),
                )
                .unwrap(),
                gst::PadTemplate::new("src_%u", gst::PadDirection::Src, gst::PadPresence::Sometimes, &caps).unwrap(),
            ]
        });
        TEMPLATES.as_ref()
    }

    fn request_new_pad(
        &self,
        templ: &gst::PadTemplate,
        name: Option<&str>,
        _caps: Option<&gst::Caps>,
    ) -> Option<gst::Pad> {
        let mut pads = self.pads.lock();
        let index = match name.and_then(|n| n.strip_prefix("sink_")) {
            Some(i) => i.parse::<u32>().ok()?,
            None => (0..).find(|i| !pads.iter().any(|p| p.sink.name() == format!("sink_{i}")))?,
        };
        if pads.iter().any(|p| p.sink.name() == format!("sink_{index}")) {
            return None;
        }
        let sink = gst::PadBuilder::<super::VlmContextSinkPad>::from_template(templ)
            .name(format!("sink_{index}"))
            .chain_function(|pad, parent, buffer| {
                VlmContext::catch_panic_pad_function(
                    parent,
                    || Err(gst::FlowError::Error),
                    // A pad being released: upstream stops quietly.
                    |imp| match imp.pads_of(pad.upcast_ref()) {
                        Some(p) => imp.sink_chain(&p, buffer),
                        None => Err(gst::FlowError::Flushing),
                    },
                )
            })
            .event_function(|pad, parent, event| {
                VlmContext::catch_panic_pad_function(
                    parent,
                    || false,
                    |imp| imp.pads_of(pad.upcast_ref()).is_some_and(|p| imp.sink_event(&p, event)),
                )
            })
            .query_function(|pad, parent, query| {
                VlmContext::catch_panic_pad_function(
                    parent,
                    || false,
                    |imp| imp.pads_of(pad.upcast_ref()).is_some_and(|p| imp.sink_query(&p, query)),
                )
            })
            .flags(gst::PadFlags::PROXY_CAPS | gst::PadFlags::PROXY_ALLOCATION)
            .build()
            .upcast::<gst::Pad>();
        let src_templ = self.obj().pad_template("src_%u").unwrap();
        let src = gst::Pad::builder_from_template(&src_templ)
            .name(format!("src_{index}"))
            .query_function(|pad, parent, query| {
                VlmContext::catch_panic_pad_function(
                    parent,
                    || false,
                    |imp| {
                        gst::log!(CAT, obj = pad, "handling {query:?}");
                        imp.pads_of(pad.upcast_ref()).is_some_and(|p| p.sink.peer_query(query))
                    },
                )
            })
            .event_function(|pad, parent, event| {
                VlmContext::catch_panic_pad_function(
                    parent,
                    || false,
                    |imp| {
                        gst::log!(CAT, obj = pad, "handling {event:?}");
                        imp.pads_of(pad.upcast_ref()).is_some_and(|p| p.sink.push_event(event))
                    },
                )
            })
            .flags(gst::PadFlags::PROXY_CAPS | gst::PadFlags::PROXY_ALLOCATION)
            .build();
        let entry = Arc::new(StreamPads {
            sink: sink.clone(),
            src: src.clone(),
            stream: Mutex::new(None),
            cancel: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            announced: AtomicBool::new(false),
            overload_settled: AtomicBool::new(false),
            stats: Mutex::default(),
        });
        pads.push(entry);
        drop(pads);
        let added = (|| {
            if self.obj().current_state() > gst::State::Ready {
                sink.set_active(true).ok()?;
                src.set_active(true).ok()?;
            }
            self.obj().add_pad(&sink).ok()?;
            if self.obj().add_pad(&src).is_err() {
                let _ = self.obj().remove_pad(&sink);
                return None;
            }
            // For `sink_0::stream-name=...` on a launch line, set once the pad exists.
            self.obj().child_added(&sink, &sink.name());
            Some(())
        })();
        if added.is_none() {
            // Not a pad of this element after all: forget it, or its name stays taken.
            self.pads.lock().retain(|p| p.sink != sink);
            gst::warning!(CAT, imp = self, "could not add the pads of {}", sink.name());
        }
        added.map(|()| sink)
    }

    fn release_pad(&self, pad: &gst::Pad) {
        let Some(entry) = self.pads_of(pad) else {
            return;
        };
        entry.stopped.store(true, Ordering::SeqCst);
        entry.cancel.store(true, Ordering::SeqCst);
        let stream = {
            // (A stream opening now is opened and taken here, or sees `cancel` and does not open.)
            let _opening = self.opening.lock();
            entry.stream.lock().take()
        };
        if let Some(s) = stream {
            s.close();
        }
        self.pads.lock().retain(|p| !Arc::ptr_eq(p, &entry));
        let _ = entry.src.set_active(false);
        let _ = entry.sink.set_active(false);
        let _ = self.obj().remove_pad(&entry.src);
        let _ = self.obj().remove_pad(&entry.sink);
        self.obj().child_removed(&entry.sink, &entry.sink.name());
        // Its counts leave the element's sums.
        let stats = *entry.stats.lock();
        self.notify_stats(stats, Stats::default());
    }

    fn change_state(&self, transition: gst::StateChange) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        match transition {
            gst::StateChange::NullToReady => self.preload(),
            gst::StateChange::ReadyToPaused => {
                for p in self.pads.lock().iter() {
                    p.stopped.store(false, Ordering::SeqCst);
                    p.cancel.store(false, Ordering::SeqCst);
                }
                let parent = self.parent_change_state(transition)?;
                return match self.start() {
                    Ok(gst::StateChangeSuccess::Async) => Ok(gst::StateChangeSuccess::Async),
                    Ok(_) => Ok(parent),
                    Err(e) => {
                        self.post_error_message(e);
                        Err(gst::StateChangeError)
                    }
                };
            }
            gst::StateChange::PausedToReady => self.stop(),
            // A load still running is abandoned, not waited for (an error elsewhere in the
            // pipeline, or a stop, ends the process's wait at once).
            gst::StateChange::ReadyToNull => self.abandon_preload(),
            _ => (),
        }
        let ret = self.parent_change_state(transition)?;
        if transition == gst::StateChange::PausedToReady {
            self.reset_stats();
        }
        Ok(ret)
    }
}
