//! docs/elements.md cannot drift from the plugin: every property and signal of `vlmencode`,
//! `vlmcontext`, `vlmquery` and `vlmpublish` (its base class's properties included), as the
//! registered elements report them (what gst-inspect-1.0 prints), is named in backticks in that
//! element's section of docs/elements.md (from its "## `vlmencode`" heading to the next "## "
//! heading).

mod common;

use common::*;
use gst::glib;
use gst::glib::translate::IntoGlib;
use gst::prelude::*;

/// The plugin's elements.
const ELEMENTS: [&str; 4] = ["vlmencode", "vlmcontext", "vlmquery", "vlmpublish"];

/// Property names of `factory` (GObject's `name` and `parent` left out) and the signals its own
/// type defines (`GstElement`'s are GStreamer's, documented there).
fn names(factory: &str) -> Vec<String> {
    let element = gst::ElementFactory::make(factory).build().unwrap_or_else(|e| panic!("make {factory}: {e}"));
    let mut names: Vec<String> = element
        .list_properties()
        .iter()
        .map(|p| p.name().to_string())
        .filter(|n| n != "name" && n != "parent")
        .collect();
    names.extend(signals(element.type_()));
    names
}

/// The signals `type_` itself defines (GObject lists them per type; glib-rs has no safe call).
fn signals(type_: glib::Type) -> Vec<String> {
    let mut n = 0u32;
    // SAFETY: g_signal_list_ids returns a newly allocated array of `n` signal ids of a registered
    // type, which is freed with g_free after the ids are read; each id is a valid, non-zero id.
    unsafe {
        let ids = glib::gobject_ffi::g_signal_list_ids(type_.into_glib(), &mut n);
        let names = (0..n as usize)
            .filter_map(|i| std::num::NonZeroU32::new(*ids.add(i)))
            .map(|id| glib::subclass::SignalId::new(id).query().signal_name().to_string())
            .collect();
        glib::ffi::g_free(ids.cast());
        names
    }
}

#[test]
fn every_property_and_signal_is_in_docs_elements_md() {
    init();
    let path = root().join("docs/elements.md");
    let docs = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut missing = Vec::new();
    for factory in ELEMENTS {
        let heading = format!("\n## `{factory}`\n");
        let start = docs.find(&heading).unwrap_or_else(|| panic!("docs/elements.md has no {heading:?} section"));
        let section = &docs[start + heading.len()..];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        let names = names(factory);
        assert!(!names.is_empty(), "{factory} reports no properties");
        for name in names {
            if !section.contains(&format!("`{name}`")) {
                missing.push(format!("{factory}::{name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/elements.md does not name (in backticks, in the element's section) these properties/signals: {}",
        missing.join(", ")
    );
}

/// Every property of the four elements, with its element's factory name.
fn every_property() -> Vec<(&'static str, gst::glib::ParamSpec)> {
    init();
    ELEMENTS
        .iter()
        .flat_map(|&factory| {
            let element = gst::ElementFactory::make(factory).build().unwrap();
            element.list_properties().into_iter().map(move |p| (factory, p))
        })
        .collect()
}

/// `gst-inspect-1.0` reads well: every property's blurb is at most 200 characters (the details
/// live in docs/elements.md).
#[test]
fn every_property_blurb_is_short() {
    let long: Vec<_> = every_property()
        .into_iter()
        .map(|(factory, p)| (factory, p.name().to_owned(), p.blurb().unwrap_or_default().chars().count()))
        .filter(|&(_, _, n)| n > 200)
        .collect();
    assert!(long.is_empty(), "blurbs over 200 characters: {long:?}");
}

/// Every enum value's name is a short description (at most 100 characters): PyGObject prints
/// an enum value through a fixed 256-byte buffer and aborted the process on `slide`'s 277
/// characters (`print(ctx.props.history_policy)`); the details live in docs/elements.md.
#[test]
fn every_enum_value_name_is_short() {
    let mut long = vec![];
    for (factory, p) in every_property() {
        let Some(e) = p.downcast_ref::<gst::glib::ParamSpecEnum>() else { continue };
        for v in e.enum_class().values().iter().filter(|v| v.name().chars().count() > 100) {
            long.push(format!("{factory}::{}={} ({} characters)", p.name(), v.nick(), v.name().chars().count()));
        }
    }
    assert!(long.is_empty(), "enum value names over 100 characters: {long:?}");
}
