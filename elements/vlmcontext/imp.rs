use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use parking_lot::Mutex;
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::snapshot::PrefixCache;
use vlm_runtime::{Engine, Stream, models};

// Each its own `impl VlmContext`: loading the engines, and the stream behind a pair of pads (its
// buffers, events and queries). The element, its properties, pads and state changes stay here.
mod load;
mod streams;

use load::Loading;

pub(crate) static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlmcontext", gst::DebugColorFlags::empty(), Some("gst-vlm versioned stream history"))
});

// Property names, each used by its ParamSpec and by `set_property` or `property`.
const PROP_MODEL: &str = "model";
const PROP_RETAIN: &str = "retain";
const PROP_SYSTEM_PROMPT: &str = "system-prompt";
const PROP_CONTEXT_SIZE: &str = "context-size";
const PROP_MAX_STREAMS: &str = "max-streams";
const PROP_MAX_PENDING: &str = "max-pending";
const PROP_OVERLOAD: &str = "overload";
const PROP_STEP_BUDGET_MS: &str = "step-budget-ms";
const PROP_INGEST_SHARE: &str = "ingest-share";
const PROP_MAX_ANSWERS: &str = "max-answers";
const PROP_FLASH_ATTENTION: &str = "flash-attention";
const PROP_GPU_DEVICE: &str = "gpu-device";
const PROP_GPU_LAYERS: &str = "gpu-layers";
const PROP_KV_LAYOUT: &str = "kv-layout";
const PROP_KV_TYPE: &str = "kv-type";
const PROP_KV_BYTES: &str = "kv-bytes";
const PROP_KV_BYTES_ALLOCATED: &str = "kv-bytes-allocated";
const PROP_FRAMES_SKIPPED: &str = "frames-skipped";
const PROP_MAX_LAG_MS: &str = "max-lag-ms";
const PROP_HISTORY_POLICY: &str = "history-policy";
const PROP_HISTORY_KEEP: &str = "history-keep";
const PROP_HISTORY_RESTARTS: &str = "history-restarts";
const PROP_HISTORY_SLIDES: &str = "history-slides";
const PROP_PREFIX_CACHE_SIZE: &str = "prefix-cache-size";
const PROP_PREFIX_CACHE_ENTRIES: &str = "prefix-cache-entries";
const PROP_PREFIX_CACHE_HITS: &str = "prefix-cache-hits";
const PROP_PREFIX_CACHE_MISSES: &str = "prefix-cache-misses";
const PROP_ENGINES: &str = "engines";
const PROP_THREADS: &str = "threads";
const PROP_MODEL_OWNERS: &str = "model-owners";
const PROP_FRAMES_DROPPED: &str = "frames-dropped";

const DEFAULT_CONTEXT_SIZE: u32 = 2048;
const DEFAULT_MAX_STREAMS: u32 = 2;
const DEFAULT_MAX_PENDING: u32 = 2;
const DEFAULT_HISTORY_KEEP: u32 = 8;
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
        name = "Slide: drop the oldest frames until a quarter of context-size is free and shift the rest in place (llama.cpp's K-shift); M-RoPE models and kv-layout=unified prefill the kept frames again",
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
        name = "Skip the frame: it passes without joining the history, counted in frames-skipped, with a vlm-overload message",
        nick = "skip"
    )]
    Skip,
}
/// How each engine lays out its KV cells (see `vlm_runtime::KvLayout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmKvLayout")]
pub enum KvLayoutKind {
    #[enum_value(
        name = "Per sequence: context-size cells for every stream and answer, a branch copies its prefix; bit-identical to a re-prefill",
        nick = "per-sequence"
    )]
    PerSequence,
    #[enum_value(
        name = "Unified pool sized by need: an answer shares its version's cells and costs its question and tokens; agrees closely with a re-prefill",
        nick = "unified"
    )]
    Unified,
}

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmKvType")]
pub enum KvTypeKind {
    #[enum_value(name = "16-bit floats", nick = "f16")]
    F16,
    #[enum_value(name = "8-bit blocks (needs flash-attention)", nick = "q8_0")]
    Q8_0,
    #[enum_value(name = "4-bit blocks (needs flash-attention)", nick = "q4_0")]
    Q4_0,
}

const DEFAULT_MAX_ANSWERS: u32 = 8;

/// Cells kept free after the history for a question and its answer.
const ANSWER_RESERVE: i32 = 256;

#[derive(Debug, Clone, PartialEq)]
struct Settings {
    model: String,
    retain: bool,
    system_prompt: String,
    context_size: u32,
    max_streams: u32,
    max_pending: u32,
    engines: String,
    history_policy: HistoryPolicyKind,
    history_keep: u32,
    overload: OverloadKind,
    step_budget_ms: f64,
    ingest_share: f64,
    max_answers: u32,
    flash_attention: bool,
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
            max_pending: DEFAULT_MAX_PENDING,
            engines: "cpu".into(),
            history_policy: HistoryPolicyKind::Restart,
            history_keep: DEFAULT_HISTORY_KEEP,
            overload: OverloadKind::Auto,
            step_budget_ms: vlm_runtime::engine::DEFAULT_STEP_BUDGET_MS,
            ingest_share: vlm_runtime::engine::DEFAULT_INGEST_SHARE,
            max_answers: DEFAULT_MAX_ANSWERS,
            flash_attention: false,
            gpu_device: 0,
            gpu_layers: -1,
            kv_layout: KvLayoutKind::PerSequence,
            kv_type: KvTypeKind::F16,
            prefix_cache_size: 0,
            prefix_cache_entries: DEFAULT_PREFIX_CACHE_ENTRIES,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get() as u32),
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
        static PROPS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            let d = Settings::default();
            vec![
                glib::ParamSpecString::builder(PROP_MODEL).nick("Model").blurb("Path to the language-model GGUF").mutable_ready().build(),
                glib::ParamSpecBoolean::builder(PROP_RETAIN)
                    .nick("Retain")
                    .blurb("Keep each stream's language KV; false re-prefills the whole history for every question (the baseline)")
                    .default_value(true)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder(PROP_SYSTEM_PROMPT)
                    .nick("System prompt")
                    .blurb("System message that starts every stream's history")
                    .default_value(Some(DEFAULT_SYSTEM_PROMPT))
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_CONTEXT_SIZE)
                    .nick("Context size")
                    .blurb("KV cells per stream (history + question + answer)")
                    .minimum(512)
                    .maximum(131072)
                    .default_value(DEFAULT_CONTEXT_SIZE)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_MAX_STREAMS)
                    .nick("Max streams")
                    .blurb("Streams (sink pads) the engine holds KV for")
                    .minimum(1)
                    .maximum(64)
                    .default_value(DEFAULT_MAX_STREAMS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_MAX_PENDING)
                    .nick("Max pending frames")
                    .blurb("Frames per stream registered but not yet prefilled (the lag bound); past it the overload policy applies")
                    .minimum(1)
                    .maximum(1024)
                    .default_value(DEFAULT_MAX_PENDING)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default(PROP_OVERLOAD, OverloadKind::Auto)
                    .nick("Overload policy")
                    .blurb("What happens to a new frame while max-pending frames of its stream still wait for ingestion: block upstream, or skip it (the stream's sampling rate falls to what the engine ingests, so questions never wait behind a queue of frames); auto skips for live sources and blocks otherwise")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecDouble::builder(PROP_STEP_BUDGET_MS)
                    .nick("Step budget")
                    .blurb("Most prefill (frame ingestion, question prefill; from measured rates) run between two decode steps of the answers being generated")
                    .minimum(1.0)
                    .maximum(10000.0)
                    .default_value(vlm_runtime::engine::DEFAULT_STEP_BUDGET_MS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecDouble::builder(PROP_INGEST_SHARE)
                    .nick("Ingest share")
                    .blurb("Share of an engine's time that frame ingestion takes while answers are being generated (more while a question waits for a frame: then a step budget every step); answers keep the rest of their decode rate")
                    .minimum(0.0)
                    .maximum(0.9)
                    .default_value(vlm_runtime::engine::DEFAULT_INGEST_SHARE)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_MAX_ANSWERS)
                    .nick("Max answers")
                    .blurb("Answers generated at once per engine (each has a KV sequence of context-size cells, or with kv-layout=unified 256 cells of the pool); more wait for one to end")
                    .minimum(1)
                    .maximum(64)
                    .default_value(DEFAULT_MAX_ANSWERS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder(PROP_FLASH_ATTENTION)
                    .nick("Flash attention")
                    .blurb("Flash attention on every engine (llama.cpp's --flash-attn): faster on GPUs; it stores V untransposed, so KV snapshots move only between engines that agree on it (a mismatch is refused)")
                    .default_value(false)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_GPU_DEVICE)
                    .nick("GPU device")
                    .blurb("Which GPU the gpu engines use (llama.cpp's --device): an index among llama.cpp's GPUs, discrete ones first, then integrated ones (0: the first); a GPU that is not there is an error naming the ones found")
                    .default_value(0)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecInt::builder(PROP_GPU_LAYERS)
                    .nick("GPU layers")
                    .blurb("Layers of the language model on the GPU for the gpu engines (llama.cpp's --n-gpu-layers / -ngl), the last ones; the others run on the CPU with the engine's threads. -1: all")
                    .minimum(-1)
                    .default_value(-1)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default(PROP_KV_LAYOUT, KvLayoutKind::PerSequence)
                    .nick("KV layout")
                    .blurb("per-sequence: context-size cells for every stream and every answer (max-streams + max-answers sequences), answers bit-identical to a re-prefill; unified: one pool of (max-streams + 1) x context-size + max-answers x 256 cells where an answer shares the cells of the version it reads (llama.cpp's kv_unified), greedy answers agreeing closely with a re-prefill")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default(PROP_KV_TYPE, KvTypeKind::F16)
                    .nick("KV type")
                    .blurb("Element type of K and V (llama.cpp's --cache-type-k/-v): q8_0 and q4_0 need flash-attention=true; snapshots move only between engines of one type")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_KV_BYTES)
                    .nick("KV bytes in use")
                    .blurb("Bytes of KV cells in use on every engine, a cell shared by several sequences counted once (refreshed every 50 ms while an engine works, and when it goes idle)")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_KV_BYTES_ALLOCATED)
                    .nick("KV bytes allocated")
                    .blurb("Bytes of KV cells the engines' contexts allocated")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_FRAMES_SKIPPED)
                    .nick("Frames skipped")
                    .blurb("Frames the overload policy kept out of the history because ingestion was max-pending frames behind")
                    .read_only()
                    .build(),
                glib::ParamSpecDouble::builder(PROP_MAX_LAG_MS)
                    .nick("Max lag")
                    .blurb("Largest ingestion lag seen when a frame arrived: age of the oldest frame registered but not yet published (ms)")
                    .read_only()
                    .build(),
                glib::ParamSpecEnum::builder_with_default(PROP_HISTORY_POLICY, HistoryPolicyKind::Restart)
                    .nick("History policy")
                    .blurb("What happens when a stream's history would overflow context-size")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_HISTORY_KEEP)
                    .nick("History keep")
                    .blurb("Newest frames kept when history-policy=restart starts the history again")
                    .maximum(4096)
                    .default_value(DEFAULT_HISTORY_KEEP)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_HISTORY_RESTARTS)
                    .nick("History restarts")
                    .blurb("Times a stream's history was restarted by history-policy (prefilled again)")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_HISTORY_SLIDES)
                    .nick("History slides")
                    .blurb("Times history-policy=slide shifted a stream's history in place")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_PREFIX_CACHE_SIZE)
                    .nick("Prefix cache size")
                    .blurb("Bytes of KV snapshots kept to let a stream (or a new session) with an identical history import it instead of prefilling; 0 = off")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_PREFIX_CACHE_ENTRIES)
                    .nick("Prefix cache entries")
                    .blurb("Most KV snapshots kept in the prefix cache")
                    .default_value(DEFAULT_PREFIX_CACHE_ENTRIES)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_PREFIX_CACHE_HITS)
                    .nick("Prefix cache hits")
                    .blurb("Frames whose history was imported from the prefix cache instead of prefilled")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_PREFIX_CACHE_MISSES)
                    .nick("Prefix cache misses")
                    .blurb("Prefix cache look-ups that found nothing (the first of a session included)")
                    .read_only()
                    .build(),
                glib::ParamSpecString::builder(PROP_ENGINES)
                    .nick("Engines")
                    .blurb("Language engines, NAME[:cpu|gpu[:THREADS[:CORES]]] or NAME:rpc:HOST:PORT[+HOST:PORT...] (llama.cpp rpc-servers: no authentication, reach them over SSH or a private network) separated by commas (e.g. cpu,gpu or big:cpu:4:4-7,little:cpu:4:0-3 or cpu,far:rpc:127.0.0.1:50052); a stream lives on the engine where its frames are ingested soonest (measured prefill rate x streams already there), and vlmquery's placer may answer on any of them. A GPU engine on a machine without one needs GGML_VK_VISIBLE_DEVICES=0 for Mesa's lavapipe")
                    .default_value(Some("cpu"))
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_THREADS)
                    .nick("Threads")
                    .blurb("CPU threads of the language engine")
                    .minimum(1)
                    .maximum(256)
                    .default_value(d.threads)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder(PROP_MODEL_OWNERS)
                    .nick("Model owners")
                    .blurb("Owners of this model's loaded weights in the process (one copy shared by all)")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder(PROP_FRAMES_DROPPED)
                    .nick("Frames dropped")
                    .blurb("Encoded frames that did not join a history because it was full")
                    .read_only()
                    .build(),
            ]
        });
        PROPS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut s = self.settings.lock();
        match pspec.name() {
            PROP_MODEL => s.model = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            PROP_RETAIN => s.retain = value.get().unwrap(),
            PROP_SYSTEM_PROMPT => s.system_prompt = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            PROP_CONTEXT_SIZE => s.context_size = value.get().unwrap(),
            PROP_MAX_STREAMS => s.max_streams = value.get().unwrap(),
            PROP_MAX_PENDING => s.max_pending = value.get().unwrap(),
            PROP_HISTORY_POLICY => s.history_policy = value.get().unwrap(),
            PROP_KV_LAYOUT => s.kv_layout = value.get().unwrap(),
            PROP_KV_TYPE => s.kv_type = value.get().unwrap(),
            PROP_HISTORY_KEEP => s.history_keep = value.get().unwrap(),
            PROP_OVERLOAD => s.overload = value.get().unwrap(),
            PROP_STEP_BUDGET_MS => s.step_budget_ms = value.get().unwrap(),
            PROP_INGEST_SHARE => s.ingest_share = value.get().unwrap(),
            PROP_MAX_ANSWERS => s.max_answers = value.get().unwrap(),
            PROP_FLASH_ATTENTION => s.flash_attention = value.get().unwrap(),
            PROP_GPU_DEVICE => s.gpu_device = value.get().unwrap(),
            PROP_GPU_LAYERS => s.gpu_layers = value.get().unwrap(),
            PROP_PREFIX_CACHE_SIZE => s.prefix_cache_size = value.get().unwrap(),
            PROP_PREFIX_CACHE_ENTRIES => s.prefix_cache_entries = value.get().unwrap(),
            PROP_ENGINES => s.engines = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            PROP_THREADS => s.threads = value.get().unwrap(),
            _ => unreachable!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        // Statistics first, without the settings lock: one lock at a time here (pads, then a
        // pad's counters), never settings with another (see `stream`).
        let sum =
            |count: fn(&Stats) -> u64| self.pads.lock().iter().map(|p| count(&p.stats.lock())).sum::<u64>().to_value();
        let cache = |stat: fn(vlm_runtime::cache::CacheStats) -> u64| {
            self.prefix_cache.lock().as_ref().map_or(0, |c| stat(c.stats())).to_value()
        };
        match pspec.name() {
            PROP_FRAMES_SKIPPED => return sum(|s| s.skipped),
            PROP_HISTORY_RESTARTS => return sum(|s| s.restarts),
            PROP_HISTORY_SLIDES => return sum(|s| s.slides),
            PROP_FRAMES_DROPPED => return sum(|s| s.dropped),
            PROP_MAX_LAG_MS => {
                return self.pads.lock().iter().map(|p| p.stats.lock().max_lag_ms).fold(0.0, f64::max).to_value();
            }
            PROP_KV_BYTES | PROP_KV_BYTES_ALLOCATED => {
                let st = self.state.lock();
                let kv = st.engines.iter().map(|e| e.kv_memory());
                let bytes: usize = if pspec.name() == PROP_KV_BYTES {
                    kv.map(|m| m.in_use_bytes).sum()
                } else {
                    kv.map(|m| m.allocated_bytes()).sum()
                };
                return (bytes as u64).to_value();
            }
            PROP_PREFIX_CACHE_HITS => return cache(|s| s.hits),
            PROP_PREFIX_CACHE_MISSES => return cache(|s| s.misses),
            _ => (),
        }
        let s = self.settings.lock().clone();
        match pspec.name() {
            PROP_MODEL => s.model.to_value(),
            PROP_RETAIN => s.retain.to_value(),
            PROP_SYSTEM_PROMPT => s.system_prompt.to_value(),
            PROP_CONTEXT_SIZE => s.context_size.to_value(),
            PROP_MAX_STREAMS => s.max_streams.to_value(),
            PROP_MAX_PENDING => s.max_pending.to_value(),
            PROP_HISTORY_POLICY => s.history_policy.to_value(),
            PROP_KV_LAYOUT => s.kv_layout.to_value(),
            PROP_KV_TYPE => s.kv_type.to_value(),
            PROP_HISTORY_KEEP => s.history_keep.to_value(),
            PROP_OVERLOAD => s.overload.to_value(),
            PROP_STEP_BUDGET_MS => s.step_budget_ms.to_value(),
            PROP_INGEST_SHARE => s.ingest_share.to_value(),
            PROP_MAX_ANSWERS => s.max_answers.to_value(),
            PROP_FLASH_ATTENTION => s.flash_attention.to_value(),
            PROP_GPU_DEVICE => s.gpu_device.to_value(),
            PROP_GPU_LAYERS => s.gpu_layers.to_value(),
            PROP_PREFIX_CACHE_SIZE => s.prefix_cache_size.to_value(),
            PROP_PREFIX_CACHE_ENTRIES => s.prefix_cache_entries.to_value(),
            PROP_ENGINES => s.engines.to_value(),
            PROP_THREADS => s.threads.to_value(),
            PROP_MODEL_OWNERS => (models::model_owners(&PathBuf::from(&s.model)) as u32).to_value(),
            _ => unreachable!(),
        }
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
        entry.cancel.store(true, Ordering::Release);
        if let Some(s) = entry.stream.lock().take() {
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
                    p.cancel.store(false, Ordering::Release);
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
