//! The `vlm` GStreamer plugin (`libgstvlm.so`): `vlmencode`, `vlmcontext`, `vlmquery`, `vlmpublish`.
#![allow(clippy::non_send_fields_in_send_ty, unused_doc_comments)]

use gst::glib;

fn plugin_init(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    gst_vlm_elements::register(plugin)
}

gst::plugin_define!(
    vlm,
    env!("CARGO_PKG_DESCRIPTION"),
    plugin_init,
    concat!(env!("CARGO_PKG_VERSION"), "-", env!("COMMIT_ID")),
    "MPL-2.0",
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_NAME"),
    // No public repository yet: the origin says so rather than naming an invented URL.
    "Unknown package origin",
    env!("BUILD_REL_DATE")
);
