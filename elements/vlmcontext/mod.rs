//! `vlmcontext`: keeps, per stream, an append-only, versioned language history.
//!
//! Each request sink pad `sink_%u` (one per camera/stream) has a matching `src_%u`. Every frame
//! that carries embeddings from `vlmencode` is registered the moment it arrives and prefilled
//! into the stream's KV on the language engine; its version is published only once that prefill
//! has completed. The buffer goes on downstream at once, marked with its stream and frame number,
//! so `vlmquery` can bind a question to exactly the history before it.
//!
//! ```text
//! gst-launch-1.0 videotestsrc num-buffers=100 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery ! fakesink
//! ```
//!
//! `retain=false` keeps no KV: every question re-prefills its whole history (the baseline).

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct VlmContext(ObjectSubclass<imp::VlmContext>) @extends gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    gst::Element::register(Some(plugin), "vlmcontext", gst::Rank::NONE, VlmContext::static_type())
}
