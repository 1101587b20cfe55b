use std::path::PathBuf;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::prelude::*;
use gst_video::prelude::*;
use parking_lot::Mutex;
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::{Device, models};

use crate::events::ModelQuery;
use crate::meta::VlmFrameMeta;

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlmencode", gst::DebugColorFlags::empty(), Some("gst-vlm vision encoder"))
});

const DEFAULT_INTERVAL: u64 = 1_000_000_000;

const FORMATS: [(gst_video::VideoFormat, PixelLayout); 10] = [
    (gst_video::VideoFormat::Rgb, PixelLayout::Rgb),
    (gst_video::VideoFormat::Bgr, PixelLayout::Bgr),
    (gst_video::VideoFormat::Rgba, PixelLayout::Rgbx),
    (gst_video::VideoFormat::Rgbx, PixelLayout::Rgbx),
    (gst_video::VideoFormat::Bgra, PixelLayout::Bgrx),
    (gst_video::VideoFormat::Bgrx, PixelLayout::Bgrx),
    (gst_video::VideoFormat::Argb, PixelLayout::Xrgb),
    (gst_video::VideoFormat::Xrgb, PixelLayout::Xrgb),
    (gst_video::VideoFormat::Abgr, PixelLayout::Xbgr),
    (gst_video::VideoFormat::Xbgr, PixelLayout::Xbgr),
];

#[derive(Debug, Clone)]
struct Settings {
    mmproj: String,
    model: String,
    interval: u64,
    threads: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            mmproj: String::new(),
            model: String::new(),
            interval: DEFAULT_INTERVAL,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get() as u32),
        }
    }
}

#[derive(Default)]
struct Stats {
    seen: u64,
    encoded: u64,
    encode_ms_total: f64,
}

#[derive(Default)]
struct State {
    info: Option<gst_video::VideoInfo>,
    encoder: Option<Arc<dyn VisionEncoder>>,
    last_encoded: Option<gst::ClockTime>,
}

#[derive(Default)]
pub struct VlmEncode {
    settings: Mutex<Settings>,
    state: Mutex<State>,
    stats: Mutex<Stats>,
}

impl VlmEncode {
    /// Load the projector, asking downstream for the language model when `model` is unset.
    fn encoder(&self) -> Result<Arc<dyn VisionEncoder>, gst::ErrorMessage> {
        if let Some(e) = self.state.lock().encoder.clone() {
            return Ok(e);
        }
        let settings = self.settings.lock().clone();
        let model_path = if settings.model.is_empty() {
            let mut q = ModelQuery::query();
            let srcpad = self.obj().static_pad("src").expect("src pad");
            srcpad.peer_query(&mut q);
            ModelQuery::model(&q).ok_or_else(|| {
                gst::error_msg!(
                    gst::LibraryError::Settings,
                    ["No language model: set vlmencode's 'model' property or link it to a vlmcontext with 'model' set"]
                )
            })?
        } else {
            settings.model.clone()
        };
        let fail = |e: vlm_runtime::Error| gst::error_msg!(gst::ResourceError::OpenRead, ["{}", e]);
        let model = models::model(&PathBuf::from(&model_path), &Device::Cpu).map_err(fail)?;
        let projector = models::projector(&PathBuf::from(&settings.mmproj), &model, false, settings.threads as i32)
            .map_err(fail)?;
        gst::info!(CAT, imp = self, "projector {} loaded for {}", settings.mmproj, model_path);
        let encoder: Arc<dyn VisionEncoder> = Arc::new(MtmdEncoder::new(projector));
        self.state.lock().encoder = Some(Arc::clone(&encoder));
        Ok(encoder)
    }

    /// Whether the frame at `time` is due for encoding under `interval`.
    fn due(&self, time: Option<gst::ClockTime>) -> bool {
        let interval = gst::ClockTime::from_nseconds(self.settings.lock().interval);
        let mut state = self.state.lock();
        let due = match (time, state.last_encoded) {
            (_, None) | (None, _) => true,
            (Some(t), Some(last)) => interval.is_zero() || t < last || t >= last + interval,
        };
        if due {
            state.last_encoded = time;
        }
        due
    }
}

#[glib::object_subclass]
impl ObjectSubclass for VlmEncode {
    const NAME: &'static str = "GstVlmEncode";
    type Type = super::VlmEncode;
    type ParentType = gst_base::BaseTransform;
}

impl ObjectImpl for VlmEncode {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            vec![
                glib::ParamSpecString::builder("mmproj")
                    .nick("Projector")
                    .blurb("Path to a libmtmd projector GGUF (vision tower + projector)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("model")
                    .nick("Language model")
                    .blurb("Language-model GGUF the embeddings feed; empty = ask the downstream vlmcontext")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("interval")
                    .nick("Interval")
                    .blurb("Stream time between encoded frames in ns (0 = every frame); other frames pass without embeddings")
                    .default_value(DEFAULT_INTERVAL)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("threads")
                    .nick("Threads")
                    .blurb("CPU threads of the vision encoder")
                    .minimum(1)
                    .maximum(256)
                    .default_value(Settings::default().threads)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("frames-seen").nick("Frames seen").blurb("Video frames received").read_only().build(),
                glib::ParamSpecUInt64::builder("frames-encoded").nick("Frames encoded").blurb("Frames given embeddings").read_only().build(),
                glib::ParamSpecDouble::builder("mean-encode-ms")
                    .nick("Mean encode time")
                    .blurb("Mean time to encode one frame, in milliseconds")
                    .read_only()
                    .build(),
            ]
        });
        PROPS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut s = self.settings.lock();
        match pspec.name() {
            "mmproj" => s.mmproj = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            "model" => s.model = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            "interval" => s.interval = value.get().unwrap(),
            "threads" => s.threads = value.get().unwrap(),
            _ => unreachable!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        match pspec.name() {
            "mmproj" => self.settings.lock().mmproj.to_value(),
            "model" => self.settings.lock().model.to_value(),
            "interval" => self.settings.lock().interval.to_value(),
            "threads" => self.settings.lock().threads.to_value(),
            "frames-seen" => self.stats.lock().seen.to_value(),
            "frames-encoded" => self.stats.lock().encoded.to_value(),
            "mean-encode-ms" => {
                let st = self.stats.lock();
                (if st.encoded == 0 { 0.0 } else { st.encode_ms_total / st.encoded as f64 }).to_value()
            }
            _ => unreachable!(),
        }
    }
}

impl GstObjectImpl for VlmEncode {}

impl ElementImpl for VlmEncode {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "VLM vision encoder",
                "Filter/Analyzer/Video",
                "Encodes sampled video frames into a vision-language model's projected embeddings",
                "gst-vlm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            let caps = gst_video::VideoCapsBuilder::new().format_list(FORMATS.iter().map(|(f, _)| *f)).build();
            vec![
                gst::PadTemplate::new("src", gst::PadDirection::Src, gst::PadPresence::Always, &caps).unwrap(),
                gst::PadTemplate::new("sink", gst::PadDirection::Sink, gst::PadPresence::Always, &caps).unwrap(),
            ]
        });
        TEMPLATES.as_ref()
    }
}

impl BaseTransformImpl for VlmEncode {
    const MODE: gst_base::subclass::BaseTransformMode = gst_base::subclass::BaseTransformMode::AlwaysInPlace;
    const PASSTHROUGH_ON_SAME_CAPS: bool = false;
    const TRANSFORM_IP_ON_PASSTHROUGH: bool = false;

    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let mmproj = self.settings.lock().mmproj.clone();
        vlm_runtime::llama::check_readable(&PathBuf::from(&mmproj), "mmproj")
            .map_err(|e| gst::error_msg!(gst::ResourceError::OpenRead, ["vlmencode: {}", e]))?;
        *self.state.lock() = State::default();
        *self.stats.lock() = Stats::default();
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        *self.state.lock() = State::default();
        Ok(())
    }

    fn set_caps(&self, incaps: &gst::Caps, _outcaps: &gst::Caps) -> Result<(), gst::LoggableError> {
        let info = gst_video::VideoInfo::from_caps(incaps)
            .map_err(|_| gst::loggable_error!(CAT, "invalid video caps {incaps}"))?;
        if info.width() == 0 || info.height() == 0 {
            return Err(gst::loggable_error!(CAT, "zero-size video {}x{}", info.width(), info.height()));
        }
        self.state.lock().info = Some(info);
        Ok(())
    }

    fn transform_ip(&self, buf: &mut gst::BufferRef) -> Result<gst::FlowSuccess, gst::FlowError> {
        self.stats.lock().seen += 1;
        let segment_time = buf.pts().and_then(|pts| {
            let seg = self.obj().segment();
            seg.downcast_ref::<gst::ClockTime>().and_then(|s| s.to_running_time(pts))
        });
        if !self.due(segment_time) {
            gst::trace!(CAT, imp = self, "frame {:?} not due", buf.pts());
            return Ok(gst::FlowSuccess::Ok);
        }
        let encoder = self.encoder().map_err(|e| {
            self.post_error_message(e);
            gst::FlowError::Error
        })?;
        let info = self.state.lock().info.clone().ok_or(gst::FlowError::NotNegotiated)?;
        let layout =
            FORMATS.iter().find(|(f, _)| *f == info.format()).map(|(_, l)| *l).ok_or(gst::FlowError::NotNegotiated)?;
        let started = Instant::now();
        let frame = {
            let vframe = gst_video::VideoFrameRef::from_buffer_ref_readable(&*buf, &info).map_err(|_| {
                gst::element_imp_error!(self, gst::StreamError::Format, ["cannot map video frame"]);
                gst::FlowError::Error
            })?;
            let picture = Picture {
                data: vframe.plane_data(0).map_err(|_| gst::FlowError::Error)?,
                width: info.width(),
                height: info.height(),
                stride: vframe.plane_stride()[0] as usize,
                layout,
            };
            encoder.encode(&picture).map_err(|e| {
                gst::element_imp_error!(self, gst::StreamError::Decode, ["vision encoding failed: {}", e]);
                gst::FlowError::Error
            })?
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        gst::debug!(CAT, imp = self, "encoded frame {:?} in {:.1} ms", buf.pts(), ms);
        VlmFrameMeta::add(buf, Arc::new(frame));
        {
            let mut st = self.stats.lock();
            st.encoded += 1;
            st.encode_ms_total += ms;
        }
        Ok(gst::FlowSuccess::Ok)
    }
}
