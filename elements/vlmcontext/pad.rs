//! `vlmcontext`'s request sink pad: one stream each, with the name its answers report.

use std::sync::LazyLock;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use parking_lot::Mutex;

glib::wrapper! {
    /// A `sink_%u` pad of `vlmcontext`. Its `stream-name` property names the stream in
    /// `vlm-answer` messages, JSON lines and the logs; from `gst-launch-1.0` it is set through
    /// the element: `vlmcontext name=ctx sink_0::stream-name=door`.
    pub struct VlmContextSinkPad(ObjectSubclass<imp::VlmContextSinkPad>) @extends gst::Pad, gst::Object;
}

impl VlmContextSinkPad {
    /// The stream's name: `stream-name` when set, else the pad's own name (`sink_0`, ...).
    pub fn stream_name(&self) -> String {
        self.imp().stream_name.lock().clone().filter(|n| !n.is_empty()).unwrap_or_else(|| self.name().to_string())
    }
}

mod imp {
    use super::*;

    #[derive(Default)]
    pub struct VlmContextSinkPad {
        pub(super) stream_name: Mutex<Option<String>>,
    }

    #[glib::object_subclass]
    impl ObjectSubclass for VlmContextSinkPad {
        const NAME: &'static str = "GstVlmContextSinkPad";
        type Type = super::VlmContextSinkPad;
        type ParentType = gst::Pad;
    }

    impl ObjectImpl for VlmContextSinkPad {
        fn properties() -> &'static [glib::ParamSpec] {
            static PROPS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
                vec![
                    glib::ParamSpecString::builder("stream-name")
                        .nick("Stream name")
                        .blurb("The stream's name in vlm-answer messages, JSON and logs (empty: the pad's name); read when its stream opens, at its stream-start or first frame)")
                        .mutable_ready()
                        .build(),
                ]
            });
            PROPS.as_ref()
        }

        fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
            match pspec.name() {
                "stream-name" => *self.stream_name.lock() = value.get().unwrap(),
                _ => unreachable!(),
            }
        }

        fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
            match pspec.name() {
                "stream-name" => self.stream_name.lock().to_value(),
                _ => unreachable!(),
            }
        }
    }

    impl GstObjectImpl for VlmContextSinkPad {}
    impl PadImpl for VlmContextSinkPad {}
}
