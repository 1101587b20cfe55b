//! The properties of `vlmcontext`: their names, their specifications (settings read at start or
//! live, and read-only statistics summed over the streams), and their writing and reading.

use std::path::PathBuf;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::ObjectSubclassExt;
use vlm_runtime::models;
use vlm_runtime::prompt::DEFAULT_SYSTEM_PROMPT;

use super::{
    DEFAULT_CONTEXT_SIZE, DEFAULT_HISTORY_KEEP, DEFAULT_HISTORY_POLICY, DEFAULT_MAX_ANSWERS, DEFAULT_MAX_PENDING,
    DEFAULT_MAX_STREAMS, DEFAULT_PREFIX_CACHE_ENTRIES, KvLayoutKind, KvTypeKind, OverloadKind, Settings, Stats,
    VlmContext,
};

// Property names, each used by its ParamSpec and by `set_property` or `property`.
pub(super) const PROP_MODEL: &str = "model";
pub(super) const PROP_RETAIN: &str = "retain";
pub(super) const PROP_SYSTEM_PROMPT: &str = "system-prompt";
pub(super) const PROP_CONTEXT_SIZE: &str = "context-size";
pub(super) const PROP_MAX_STREAMS: &str = "max-streams";
pub(super) const PROP_MAX_PENDING: &str = "max-pending";
pub(super) const PROP_OVERLOAD: &str = "overload";
pub(super) const PROP_STEP_BUDGET_MS: &str = "step-budget-ms";
pub(super) const PROP_INGEST_SHARE: &str = "ingest-share";
pub(super) const PROP_ENCODE_FIRST: &str = "encode-first";
pub(super) const PROP_MAX_ANSWERS: &str = "max-answers";
pub(super) const PROP_FLASH_ATTENTION: &str = "flash-attention";
pub(super) const PROP_GPU_DEVICE: &str = "gpu-device";
pub(super) const PROP_GPU_LAYERS: &str = "gpu-layers";
pub(super) const PROP_KV_LAYOUT: &str = "kv-layout";
pub(super) const PROP_ACTIVE_KV_LAYOUT: &str = "active-kv-layout";
pub(super) const PROP_ACTIVE_FLASH_ATTENTION: &str = "active-flash-attention";
pub(super) const PROP_KV_TYPE: &str = "kv-type";
pub(super) const PROP_KV_BYTES: &str = "kv-bytes";
pub(super) const PROP_KV_BYTES_ALLOCATED: &str = "kv-bytes-allocated";
pub(super) const PROP_FRAMES_SKIPPED: &str = "frames-skipped";
pub(super) const PROP_MAX_LAG_MS: &str = "max-lag-ms";
pub(super) const PROP_HISTORY_POLICY: &str = "history-policy";
pub(super) const PROP_HISTORY_KEEP: &str = "history-keep";
pub(super) const PROP_HISTORY_RESTARTS: &str = "history-restarts";
pub(super) const PROP_HISTORY_SLIDES: &str = "history-slides";
pub(super) const PROP_PREFIX_CACHE_SIZE: &str = "prefix-cache-size";
pub(super) const PROP_PREFIX_CACHE_ENTRIES: &str = "prefix-cache-entries";
pub(super) const PROP_PREFIX_CACHE_HITS: &str = "prefix-cache-hits";
pub(super) const PROP_PREFIX_CACHE_MISSES: &str = "prefix-cache-misses";
pub(super) const PROP_ENGINES: &str = "engines";
pub(super) const PROP_THREADS: &str = "threads";
pub(super) const PROP_MODEL_OWNERS: &str = "model-owners";
pub(super) const PROP_FRAMES_DROPPED: &str = "frames-dropped";
pub(super) const PROP_ENGINE_STATS: &str = "engine-stats";

/// The specifications of the element's properties, each with its nick, blurb, range and default.
pub(super) fn specs() -> Vec<glib::ParamSpec> {
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
            .blurb("Streams (sink pads) the engine holds KV for; unset, the sink pads requested before the model loads, at least 2")
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
            .blurb("A new frame while max-pending frames of its stream wait for ingestion: block upstream or skip it; auto skips for live sources and blocks otherwise")
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
            .blurb("Share of an engine's time that frame ingestion takes while answers are generated (more while a question waits for a frame); answers keep the rest")
            .minimum(0.0)
            .maximum(0.9)
            .default_value(vlm_runtime::engine::DEFAULT_INGEST_SHARE)
            .mutable_ready()
            .build(),
        glib::ParamSpecBoolean::builder(PROP_ENCODE_FIRST)
            .nick("Encode first")
            .blurb("CPU engines: while a CPU vision encode needs the cores, answers past their first token pause until it ends, each once (the next frame sooner, those answers later)")
            .default_value(vlm_runtime::engine::DEFAULT_ENCODE_FIRST)
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
            .blurb("Which GPU the gpu engines use (llama.cpp's --device): an index among its GPUs, discrete ones first, then integrated ones")
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
        glib::ParamSpecEnum::builder_with_default(PROP_KV_LAYOUT, KvLayoutKind::Auto)
            .nick("KV layout")
            .blurb("auto (unified on CPU engines and for up to 2 streams on a GPU, else per-sequence), per-sequence (answers bit-identical to a re-prefill) or unified (one shared pool, far less memory)")
            .mutable_ready()
            .build(),
        glib::ParamSpecEnum::builder_with_default(PROP_KV_TYPE, KvTypeKind::F16)
            .nick("KV type")
            .blurb("Element type of K and V (llama.cpp's --cache-type-k/-v): q8_0 and q4_0 turn flash attention on; snapshots move only between engines of one type")
            .mutable_ready()
            .build(),
        glib::ParamSpecUInt64::builder(PROP_KV_BYTES)
            .nick("KV bytes in use")
            .blurb("Bytes of KV cells in use on every engine, a cell shared by several sequences counted once (refreshed every 50 ms or more while an engine works, and when it goes idle)")
            .read_only()
            .build(),
        glib::ParamSpecString::builder(PROP_ACTIVE_KV_LAYOUT)
            .nick("Active KV layout")
            .blurb("The KV layout the engines use (kv-layout resolved at load), empty before it")
            .read_only()
            .build(),
        glib::ParamSpecBoolean::builder(PROP_ACTIVE_FLASH_ATTENTION)
            .nick("Active flash attention")
            .blurb("Whether the engines use flash attention (flash-attention resolved at load)")
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
        glib::ParamSpecEnum::builder_with_default(PROP_HISTORY_POLICY, DEFAULT_HISTORY_POLICY)
            .nick("History policy")
            .blurb("What happens when a stream's history would overflow context-size")
            .mutable_ready()
            .build(),
        glib::ParamSpecUInt::builder(PROP_HISTORY_KEEP)
            .nick("History keep")
            .blurb("Newest frames kept when history-policy=restart starts the history again (fewer where they would leave under a quarter of context-size free)")
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
            .blurb("Times history-policy=slide dropped a stream's oldest frames (shifting the rest in place where it can)")
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
            .blurb("Language engines, comma-separated: NAME[:cpu|gpu[:THREADS[:CORES]]] or NAME:rpc:HOST:PORT[+HOST:PORT...] (e.g. cpu,gpu or big:cpu:4:4-7,little:cpu:4:0-3); see docs/elements.md")
            .default_value(Some("cpu"))
            .mutable_ready()
            .build(),
        glib::ParamSpecUInt::builder(PROP_THREADS)
            .nick("Threads")
            .blurb("CPU threads of each language engine whose entry in engines names none (at most 4 for a gpu engine with every layer on the GPU)")
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
        gst::ParamSpecArray::builder(PROP_ENGINE_STATS)
            .nick("Engine statistics")
            .blurb("A vlm-engine-stats structure per engine: where its time went (ms) and its measured rates")
            .read_only()
            .build(),
    ]
}

impl VlmContext {
    /// `set_property`: a setting.
    pub(super) fn set_setting(&self, value: &glib::Value, pspec: &glib::ParamSpec) {
        if crate::refused_while_running(self.obj().upcast_ref(), pspec) {
            return;
        }
        let mut s = self.settings.lock();
        match pspec.name() {
            PROP_MODEL => s.model = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            PROP_RETAIN => s.retain = value.get().unwrap(),
            PROP_SYSTEM_PROMPT => s.system_prompt = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            PROP_CONTEXT_SIZE => s.context_size = value.get().unwrap(),
            PROP_MAX_STREAMS => (s.max_streams, s.max_streams_set) = (value.get().unwrap(), true),
            PROP_MAX_PENDING => s.max_pending = value.get().unwrap(),
            PROP_HISTORY_POLICY => s.history_policy = value.get().unwrap(),
            PROP_KV_LAYOUT => s.kv_layout = value.get().unwrap(),
            PROP_KV_TYPE => s.kv_type = value.get().unwrap(),
            PROP_HISTORY_KEEP => s.history_keep = value.get().unwrap(),
            PROP_OVERLOAD => s.overload = value.get().unwrap(),
            PROP_STEP_BUDGET_MS => s.step_budget_ms = value.get().unwrap(),
            PROP_INGEST_SHARE => s.ingest_share = value.get().unwrap(),
            PROP_ENCODE_FIRST => s.encode_first = value.get().unwrap(),
            PROP_MAX_ANSWERS => s.max_answers = value.get().unwrap(),
            PROP_FLASH_ATTENTION => (s.flash_attention, s.flash_attention_set) = (value.get().unwrap(), true),
            PROP_GPU_DEVICE => s.gpu_device = value.get().unwrap(),
            PROP_GPU_LAYERS => s.gpu_layers = value.get().unwrap(),
            PROP_PREFIX_CACHE_SIZE => s.prefix_cache_size = value.get().unwrap(),
            PROP_PREFIX_CACHE_ENTRIES => s.prefix_cache_entries = value.get().unwrap(),
            PROP_ENGINES => s.engines = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            PROP_THREADS => s.threads = value.get().unwrap(),
            _ => unreachable!(),
        }
    }

    /// `property`: a setting, or a statistic summed over the streams.
    pub(super) fn property_value(&self, pspec: &glib::ParamSpec) -> glib::Value {
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
            // Unset, once the model is loaded: the streams the load sized (the sink pads
            // requested by then, at least 2).
            PROP_MAX_STREAMS => {
                let loaded = self.state.lock().engines.first().map(|e| e.config().max_streams);
                let s = self.settings.lock();
                return loaded.filter(|_| !s.max_streams_set).unwrap_or(s.max_streams).to_value();
            }
            PROP_ACTIVE_KV_LAYOUT | PROP_ACTIVE_FLASH_ATTENTION => {
                let st = self.state.lock();
                let config = st.engines.first().map(|e| e.config());
                return if pspec.name() == PROP_ACTIVE_KV_LAYOUT {
                    config.map_or("", |c| c.kv_layout.name()).to_value()
                } else {
                    config.is_some_and(|c| c.flash_attention).to_value()
                };
            }
            PROP_ENGINE_STATS => {
                let st = self.state.lock();
                return gst::Array::new(st.engines.iter().map(|e| engine_stats(e).to_send_value())).to_value();
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
            PROP_MAX_PENDING => s.max_pending.to_value(),
            PROP_HISTORY_POLICY => s.history_policy.to_value(),
            PROP_KV_LAYOUT => s.kv_layout.to_value(),
            PROP_KV_TYPE => s.kv_type.to_value(),
            PROP_HISTORY_KEEP => s.history_keep.to_value(),
            PROP_OVERLOAD => s.overload.to_value(),
            PROP_STEP_BUDGET_MS => s.step_budget_ms.to_value(),
            PROP_INGEST_SHARE => s.ingest_share.to_value(),
            PROP_ENCODE_FIRST => s.encode_first.to_value(),
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

/// One engine's `vlm-engine-stats`: where its thread's time went since its calibration run (ms),
/// the rates it measured and what it chose by measurement (its thread count now, frames merged).
fn engine_stats(engine: &vlm_runtime::Engine) -> gst::Structure {
    let (split, rates) = (engine.time_split(), engine.rates());
    gst::Structure::builder("vlm-engine-stats")
        .field("name", engine.name())
        .field("wall-ms", split.wall_ms)
        .field("decode-ms", split.decode_ms)
        .field("start-ms", split.start_ms)
        .field("ingest-ms", split.ingest_ms)
        .field("jobs-ms", split.jobs_ms)
        .field("idle-ms", split.idle_ms)
        .field("other-ms", split.other_ms())
        .field("ingest-inputs", split.ingest_inputs)
        .field("ingest-inputs-per-s", split.ingest_inputs_per_s())
        .field("prefill-ms-per-input", rates.prefill_ms_per_token)
        .field("decode-ms-per-step", rates.decode_ms_per_step)
        .field("threads", engine.threads_now())
        .field("merge-frames", engine.merges_frames())
        .build()
}
