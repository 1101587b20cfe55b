//! gst-vlm's GStreamer glue: the elements (vlmencode, vlmcontext, vlmquery and the MQTT sink
//! vlmpublish), the meta they share and their typed events.
//! The heavy work is in `vlm_runtime`; the elements stay thin.

use std::sync::LazyLock;

pub mod events;
pub mod meta;
pub mod text;
pub mod vlmcontext;
pub mod vlmencode;
pub mod vlmpublish;
pub mod vlmquery;

static LLAMA_CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlm-llama", gst::DebugColorFlags::empty(), Some("llama.cpp and libmtmd log"))
});

/// Route llama.cpp's own log into the `vlm-llama` debug category, its info and debug lines two
/// levels lower (LOG, TRACE) so that its model loader does not drown the elements' own INFO.
fn route_llama_log() {
    use vlm_runtime::llama::LogLevel;
    LazyLock::force(&LLAMA_CAT);
    vlm_runtime::llama::set_log_sink(|level, line| {
        let level = match level {
            LogLevel::Error => gst::DebugLevel::Error,
            LogLevel::Warn => gst::DebugLevel::Warning,
            LogLevel::Info => gst::DebugLevel::Log,
            LogLevel::Debug => gst::DebugLevel::Trace,
        };
        gst::log_with_level!(*LLAMA_CAT, level, "{}", line);
    });
}

/// Post the error of a push that failed downstream (not for flushing or EOS), with its flow
/// return in the details, as gst-plugins-rs elements do.
pub(crate) fn post_flow_error(element: &gst::Element, e: gst::FlowError) {
    if !matches!(e, gst::FlowError::Flushing | gst::FlowError::Eos) {
        gst::element_error!(
            element,
            gst::StreamError::Failed,
            ("Internal data stream error."),
            ["streaming stopped, reason {:?}", e],
            details: gst::Structure::builder("details").field("flow-return", gst::FlowReturn::from(e)).build()
        );
    }
}

/// Refuse (with a warning naming it, the value kept) a property that only applies when the
/// element starts (`mutable_ready`) while it is above READY or on its way there: GStreamer only
/// flags such properties, and the new value would otherwise be ignored until the next start
/// without a word. Returns whether it was refused.
pub(crate) fn refused_while_running(element: &gst::Element, pspec: &glib::ParamSpec) -> bool {
    use gst::prelude::*;
    let running = element.current_state() > gst::State::Ready || element.pending_state() > gst::State::Ready;
    if !running || !pspec.flags().contains(gst::PARAM_FLAG_MUTABLE_READY) {
        return false;
    }
    let message = format!("{} cannot change while the element runs: it applies when it starts", pspec.name());
    glib::g_warning!("vlm", "{}: {message}", element.name());
    gst::element_warning!(element, gst::LibraryError::Settings, ("{}", message));
    true
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    route_llama_log();
    // (Before any element exists: glibc fixes its arena limit once threads want more than eight.)
    vlm_runtime::llama::arenas::limit_once();
    meta::register_answer_meta();
    meta::register_alert_meta();
    vlmencode::register(plugin)?;
    vlmcontext::register(plugin)?;
    vlmquery::register(plugin)?;
    vlmpublish::register(plugin)?;
    Ok(())
}
