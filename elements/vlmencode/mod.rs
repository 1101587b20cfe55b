//! SECTION:element-vlmencode
//! @see_also: vlmcontext, vlmquery
//!
//! `vlmencode` runs a vision-language model's vision encoder (and projector) on sampled video
//! frames and attaches the projected embeddings to each encoded buffer as a `VlmFrameMeta` (a
//! shared handle: no copy). Video passes through unchanged and in order. Encoding runs on the
//! element's own task, off the streaming thread, with at most `max-pending` frames waiting:
//! then upstream blocks, or with `leaky=true` due frames pass without embeddings (counted in
//! `frames-skipped`). Frames between two due frames (`interval`, `max-rate`) pass without
//! embeddings. A repeated picture (hash of the visible pixels) is a cache hit: no encode.
//!
//! A due frame that has not changed since the last encoded one (`min-change`, on by default)
//! is not encoded either: it passes marked as held (`VlmFrameMeta::held`), without embeddings,
//! so `vlmcontext` ingests nothing and a question about its time binds at once to the last
//! changed frame (`vlm-answer`'s `picture-age-ms` says how old that picture is). The picture is
//! cut into blocks (16 px or more, at most 64 across) and a block has changed when its
//! brightness moved one way beyond what noise does (sensor noise and noise patches move
//! samples both ways; an object that moves, appears or leaves moves them one way). An object
//! smaller than about 10 × 10 px, a change under 24 levels (of 255) of brightness, or a change of
//! colour alone is not seen; `max-unchanged` re-encodes an unchanged picture every so often
//! (30 s of running time by default) so that slow drifts are caught. A caps change, a flush or a
//! new segment starts the gate afresh.
//!
//! A frame that did change is encoded tile by tile where the projector cuts it into tiles
//! (SmolVLM's idefics3: a grid of 512 px tiles and an overview, each encoded on its own):
//! `tile-reuse` takes a tile's embeddings from the frame encoded before when that tile did not
//! change (`exact`: its pixels, and the few around it the resize blends in, are identical, so
//! the embeddings are exactly what an encode would give; `threshold`, the default: the change
//! gate sees no change beyond noise in it since the pixels its embeddings came from, so they
//! differ from an encode by the noise only). The overview shows the whole picture and is
//! encoded whenever anything changed. Projectors that encode a frame as one image (LLaVA-style,
//! Qwen2-VL, Gemma 3) have no tiles to reuse (said once in the debug log). Tiles come only from
//! the same projector, size and tile grid; caps, a flush or a new segment start afresh.
//! Serialized queries (ALLOCATION, DRAIN) keep their place in the stream: one goes downstream
//! once the frames before it have left (a flush or a stop releases it unanswered).
//!
//! The encoder is libmtmd (`mmproj`, a projector GGUF) on the CPU or llama.cpp's GPU device, or,
//! in builds with the `rknn` cargo feature, a `.rknn` model on a Rockchip NPU (`rknn-model`).
//! `backend=auto` takes the NPU when `rknn-model` is set and it initialises, else the GPU when
//! llama.cpp has one, else the CPU; a fallback from the NPU posts an INFO message
//! ("vlmencode: NPU unavailable, using ...", the reason in its debug text); `active-backend`
//! says which runs. The projector needs the language model it feeds: set `model`, or leave it
//! empty and `vlmencode` asks the downstream `vlmcontext` (custom query `vlm-model`).
//!
//! Input: raw video in RGB, BGR, RGBA, RGBx, BGRA, BGRx, ARGB, xRGB, ABGR, xBGR, NV12 or I420
//! (any stride); output caps are the input caps.
//!
//! ## Example pipelines
//!
//! One frame a second encoded, periodic captions on the bus (`-m`):
//!
//! ```sh
//! gst-launch-1.0 -m videotestsrc num-buffers=90 ! videoconvert \
//!     ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=1000000000 \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     ! vlmquery caption-prompt="What do you see?" max-tokens=16 ! fakesink
//! ```
//!
//! Encoding alone (every frame of an NV12 stream, `model` set since no `vlmcontext` follows):
//!
//! ```sh
//! gst-launch-1.0 videotestsrc num-buffers=30 ! video/x-raw,format=NV12,width=640,height=480 \
//!     ! vlmencode mmproj=models/test-mmproj-mlp.gguf model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!       interval=0 ! fakesink
//! ```
//!
//! A live source (a camera: `v4l2src` in place of `videotestsrc is-live=true`) sampled at most
//! twice a second, never blocking the camera while an encode takes under 64 frame intervals
//! (docs/troubleshooting.md, "Overload and lag", for slower encoders):
//!
//! ```sh
//! gst-launch-1.0 -m videotestsrc is-live=true num-buffers=90 ! videoconvert \
//!     ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 max-rate=2 leaky=true \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     ! vlmquery caption-prompt="What do you see?" caption-interval=1000000000 max-tokens=8 ! fakesink
//! ```
//!
//! ## Properties
//!
//! Every property below: Since: 0.1.
//!
//! - `mmproj` (string): libmtmd projector GGUF (vision tower + projector).
//! - `model` (string, empty): language-model GGUF the embeddings feed; empty = ask `vlmcontext`.
//! - `backend` (`auto`/`cpu`/`gpu`/`rknn`, `auto`); `rknn-model` (string): the `.rknn` encoder.
//! - `interval` (ns, 1000000000): running time between encoded frames (untimed frames: the wall clock); 0 = every frame.
//! - `max-rate` (encodes per second of wall-clock time, 0 = no limit).
//! - `max-pending` (1-64, 2): frames waiting for or in the encoder before upstream blocks.
//! - `leaky` (false): when the encoder is full, due frames pass without embeddings instead.
//! - `cache-entries` (64, 0 = no cache), `cache-bytes` (64 MiB): the embedding cache.
//! - `threads` (1-256; the machine's cores, at most 256): CPU threads of the encoder.
//! - `min-change` (0-1, 0.001; 0 = off): the share of the picture's blocks (and at least one)
//!   that must have changed since the last encoded frame for a due frame to be encoded.
//! - `max-unchanged` (ns, 30000000000; 0 = never): running time (untimed frames: the wall clock) after which an unchanged
//!   picture is encoded again.
//! - `tile-reuse` (`off`/`exact`/`threshold`, `threshold`): see above.
//! - Read-only: `active-backend`, `frames-seen`, `frames-encoded`, `frames-skipped`,
//!   `frames-unchanged` (due frames the gate held), `tiles-encoded` and `tiles-reused` (images of
//!   encoded frames), `peak-pending`, `cache-hits`, `cache-misses`, `mean-encode-ms` (of which
//!   `mean-prepare-ms`, the picture prepared on the CPU, and `mean-context-wait-ms`, waiting for an
//!   encoder context).
//!
//! ## Messages
//!
//! - ERROR at READY→PAUSED when `mmproj` (with `backend=rknn`: `rknn-model`) cannot be read,
//!   and at the first due frame when the encoder cannot load (not a projector, no GPU for
//!   `backend=gpu`, no RKNN in this build, a projector that does not fit the model); the
//!   message names the file or the cause, the debug text the element's settings.
//! - INFO when `backend=auto` falls back from the NPU.
//! - LATENCY when the slowest encoding so far grows by a quarter or more: the latency query is
//!   answered with upstream's latency plus `max-pending` times the slowest encoding seen (a
//!   frame leaves after the due frames ahead of it and its own), so a live pipeline's sinks do
//!   not drop them.
//!
//! Debug category: `vlmencode`.
//!
//! Since: 0.1

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct VlmEncode(ObjectSubclass<imp::VlmEncode>) @extends gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    // The enum of a property is part of the plugin's documented API.
    imp::Backend::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    imp::TileReuseKind::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    gst::Element::register(Some(plugin), "vlmencode", gst::Rank::NONE, VlmEncode::static_type())
}
