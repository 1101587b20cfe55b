//! SECTION:element-vlmcontext
//! @see_also: vlmencode, vlmquery
//!
//! `vlmcontext` keeps, per stream, an append-only, versioned language-model history (its KV).
//! Each request sink pad `sink_%u` (one per camera or stream) has a matching `src_%u`. A frame
//! that carries embeddings from `vlmencode` is registered the moment it arrives and prefilled
//! into the stream's KV on the language engine; its version is published only once that prefill
//! has completed. The buffer goes on downstream at once, marked with its stream and frame
//! number, so that `vlmquery` binds a question to exactly the history before it. Frames without
//! embeddings pass untouched and do not join the history. After each `stream-start`, `src_%u`
//! sends a sticky custom downstream event `vlm-stream` (`id`, `name`) naming its stream for
//! `vlmquery`; `vlmcontext` answers `vlmencode`'s `vlm-model` query with its `model` and its
//! `vlm-demand` query with the demand of the pad's stream.
//!
//! The model starts loading on a worker thread at NULL→READY, with `Progress` messages (code
//! `load-model`); READY→PAUSED returns ASYNC while that load runs (or loads again if the
//! settings changed meanwhile) and completes with ASYNC_DONE once the engines are loaded, so an
//! application's state change never blocks its main loop (outside a bin it waits instead). A
//! stream's first frame waits for the engines. Engines are declared by `engines`:
//! `NAME[:cpu|gpu[:THREADS[:CORES]]]` separated by commas, e.g. `cpu,gpu` or
//! `big:cpu:4:4-7,little:cpu:4:0-3` (CORES: cores and ranges joined by `+`), or
//! `NAME:rpc:HOST:PORT[+HOST:PORT...]`, an engine whose layers run on llama.cpp `rpc-server`s
//! (no authentication: reach them over SSH or a private network; an engine whose server goes
//! away fails its running answer with the reason and its streams move to the other engines). A
//! stream lives on the engine where its ingestion costs least, and `vlmquery`'s placer may answer
//! on any of them. A GPU engine is llama.cpp's GPU device `gpu-device` (Vulkan; CUDA with the
//! `cuda` feature) with `gpu-layers` of the model on it (for Mesa's lavapipe on a machine without
//! a GPU, set `GGML_VK_VISIBLE_DEVICES=0`).
//!
//! When ingestion is `max-pending` frames behind, `overload` applies: `block` holds upstream
//! (backpressure, for files), `skip` lets the frame pass without joining the history (the
//! stream's sampling rate falls to what the engine ingests), `auto` skips when upstream is live
//! and blocks otherwise. When a history would overflow `context-size`, `history-policy=slide` (the
//! default) drops its oldest frames and keeps the rest where they are, `restart` starts it again
//! from its newest `history-keep` frames (replayed from their embeddings) and `stop` lets later
//! frames pass without joining it.
//!
//! ## Example pipelines
//!
//! Timed questions over the re-prefill baseline (`retain=false`: no KV kept, every question
//! replays its whole history):
//!
//! ```sh
//! gst-launch-1.0 -m videotestsrc num-buffers=150 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf retain=false \
//!     ! vlmquery name=q max-tokens=16 ! fakesink \
//!     filesrc location=pipelines/questions.srt ! subparse ! q.query
//! ```
//!
//! Two streams, one model, two engines pinned to cores 0 and 1 (`pipelines/two-streams.pipeline`
//! is the same with timed questions):
//!
//! ```sh
//! gst-launch-1.0 -m vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf engines=a:cpu:1:0,b:cpu:1:1 \
//!     videotestsrc pattern=ball num-buffers=90 ! videoconvert \
//!     ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! ctx.sink_0 \
//!     ctx.src_0 ! vlmquery caption-prompt="What do you see?" max-tokens=8 ! fakesink \
//!     videotestsrc pattern=smpte num-buffers=90 ! videoconvert \
//!     ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! ctx.sink_1 \
//!     ctx.src_1 ! vlmquery caption-prompt="What do you see?" max-tokens=8 ! fakesink
//! ```
//!
//! A live source encoded at every frame, faster than the engine ingests: frames are skipped,
//! with `vlm-overload` messages:
//!
//! ```sh
//! gst-launch-1.0 -m videotestsrc is-live=true num-buffers=90 ! videoconvert \
//!     ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf overload=skip max-pending=2 ! vlmquery ! fakesink
//! ```
//!
//! ## Properties
//!
//! Every property below: Since: 0.1.
//!
//! - `model` (string): language-model GGUF. `retain` (true): keep each stream's KV.
//! - `engines` (`cpu`), `threads` (1-256; the machine's cores, at most 256; an engine's THREADS overrides it).
//! - `system-prompt`: the system message that starts every history.
//! - `context-size` (512-131072, 2048): KV cells per stream (history, question and answer).
//! - `max-streams` (1-64; unset: the sink pads requested before the model loads, at least 2):
//!   streams the engines hold KV for. `max-answers` (1-64, 8): answers
//!   generated at once per engine.
//! - `kv-layout` (`auto`/`per-sequence`/`unified`, `auto`: `unified` where every engine is on the
//!   CPU, `per-sequence` where one is on a GPU or remote): `per-sequence` gives every stream and
//!   every answer a KV sequence of `context-size` cells (an answer copies its version's prefix;
//!   answers bit-identical to a re-prefill); `unified` one pool of (`max-streams` + 1) x
//!   `context-size` + `max-answers` x 256 cells where an answer shares its version's cells and
//!   costs only its question and tokens (greedy answers agree closely with a re-prefill, not bit
//!   for bit). `kv-type` (`f16`/`q8_0`/`q4_0`, `f16`): the KV element type; quantized types turn
//!   `flash-attention` on (llama.cpp quantizes V only with it), and snapshots move only between
//!   engines of one type.
//! - `flash-attention` (unset: on with the unified pool or a GPU engine, else off): llama.cpp's
//!   `--flash-attn` on every engine (also a much smaller
//!   compute buffer, most of all with `kv-layout=unified`; use it with an `rpc` engine, whose
//!   snapshots it makes ~100x faster).
//! - `gpu-device` (0): llama.cpp's `--device` for the `gpu` engines, an index among its GPUs
//!   (discrete first). `gpu-layers` (-1 = all): llama.cpp's `--n-gpu-layers`, the last N layers
//!   on the GPU, the rest on the CPU.
//! - `max-pending` (1-1024, 2): frames per stream registered but not yet prefilled (the lag
//!   bound). `overload` (`auto`/`block`/`skip`, `auto`).
//! - `step-budget-ms` (150): most prefill between two decode steps. `ingest-share` (0-0.9,
//!   0.25): share of an engine's time ingestion takes while answers are generated.
//! - `encode-first` (false): on CPU engines, while vision encoding on the CPU needs the cores,
//!   answers that have their first token pause until the next encode ends, each at most once
//!   (mean TTFT from capture 3% lower on W1 on two cores; the paused answers end ~4 s later).
//! - `history-policy` (`restart`/`stop`/`slide`, `slide`), `history-keep` (8): `slide` drops the
//!   oldest frames until a quarter of `context-size` is free and shifts the rest in place
//!   (llama.cpp's K-shift) instead of prefilling them again; M-RoPE models (Qwen2-VL) cannot shift, but
//!   their positions may jump forward: there a slide drops the oldest frames' cells and leaves a
//!   gap of positions, until the positions would pass the model's trained context, where the
//!   kept frames are prefilled from position 0 (as a restart, said in the debug log); in the
//!   unified pool, where an answer shares the stream's cells, a shift waits up to 2 s for the
//!   answers reading them to end, then prefills the kept frames instead.
//! - `prefix-cache-size` (bytes, 0 = off), `prefix-cache-entries` (16): KV snapshots that let a
//!   stream or a new session with an identical history import it instead of prefilling.
//! - Pad property `stream-name` on each `sink_%u` (`vlmcontext name=ctx sink_0::stream-name=door`
//!   from `gst-launch-1.0`): the stream's name in `vlm-answer` and JSON (default: the pad's name).
//! - Read-only: `frames-skipped`, `max-lag-ms`, `frames-dropped`, `history-restarts`,
//!   `history-slides`, `prefix-cache-hits`, `prefix-cache-misses`, `model-owners`, `kv-bytes`
//!   (KV cells in use on every engine, a shared cell counted once) and `kv-bytes-allocated`.
//!   The first five are the session's statistics, summed over the streams (`max-lag-ms`: the
//!   largest): each is notified (`notify::frames-skipped`, ...) when it changes, and they start
//!   again at zero at PAUSED→READY (read them before stopping the pipeline).
//!
//! ## Messages
//!
//! - `Progress` (`load-model`): start, complete, or error while the model loads (from
//!   NULL→READY on).
//! - Element message `vlm-overload` (`stream`, `policy`, `lag-frames`, `lag-ms`, `skipped`), at
//!   a stream's first skipped frame and every tenth.
//! - Element message `vlm-history` (`stream`, `policy` = `restart` or `slide`, `frame`, `kept`,
//!   `dropped`, `restarts`, `slides`) when the history policy restarts or slides a history.
//! - WARNING when a history is full under `history-policy=stop` (raise `context-size`).
//! - ERROR when the model or `engines` cannot be used (the message names the file, the
//!   property or the device), or when a prefill fails.
//!
//! Debug category: `vlmcontext`.
//!
//! Since: 0.1

use gst::glib;
use gst::prelude::*;

mod imp;
mod pad;

pub use pad::VlmContextSinkPad;

glib::wrapper! {
    pub struct VlmContext(ObjectSubclass<imp::VlmContext>) @extends gst::Element, gst::Object, @implements gst::ChildProxy;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    VlmContextSinkPad::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    // The enums of its properties are part of the plugin's documented API.
    imp::HistoryPolicyKind::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    imp::OverloadKind::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    imp::KvLayoutKind::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    imp::KvTypeKind::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    gst::Element::register(Some(plugin), "vlmcontext", gst::Rank::NONE, VlmContext::static_type())
}
