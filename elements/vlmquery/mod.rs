//! `vlmquery`: answers questions about a stream from the version of its history each question
//! is bound to, and pushes every answer as a `text/x-raw, format=utf8` buffer.
//!
//! Questions arrive as
//! - a serialized custom downstream event `vlm-question` (`text`, optional `id`, `max-tokens`),
//!   bound to the frames before it in the stream;
//! - the action signal `ask` (returns the question id), bound to the newest registered frame;
//! - text buffers on the `query` pad (`utf8` or `pango-markup`, as `subparse` emits), bound to
//!   the frames whose running time is at or before the question's, waiting for the video to get
//!   there.
//!
//! A question whose frame is registered but not yet prefilled waits for it. Every answer also
//! posts an element message `vlm-answer` with its timings.
//!
//! ```text
//! gst-launch-1.0 -m videotestsrc num-buffers=150 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q ! fakesink \
//!     filesrc location=pipelines/questions.srt ! subparse ! q.query
//! ```

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct VlmQuery(ObjectSubclass<imp::VlmQuery>) @extends gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    gst::Element::register(Some(plugin), "vlmquery", gst::Rank::NONE, VlmQuery::static_type())
}
