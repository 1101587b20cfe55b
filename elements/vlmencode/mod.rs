//! `vlmencode`: runs the vision encoder on sampled video frames and attaches the projected
//! embeddings to them (`VlmFrameMeta`). Video passes through unchanged and in order, so a `tee`
//! can still display it. Encoding runs on the element's own task, off the streaming thread, with
//! at most `max-pending` frames waiting for it: then upstream blocks, or with `leaky=true` due
//! frames pass without embeddings (counted).
//!
//! ```text
//! gst-launch-1.0 videotestsrc ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=1000000000 \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery ! fakesink
//! ```
//!
//! The projector needs the language model it feeds (libmtmd checks the embedding width and uses
//! its vocabulary): set `model`, or leave it empty and `vlmencode` asks the downstream
//! `vlmcontext` for its `model`.

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct VlmEncode(ObjectSubclass<imp::VlmEncode>) @extends gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    gst::Element::register(Some(plugin), "vlmencode", gst::Rank::NONE, VlmEncode::static_type())
}
