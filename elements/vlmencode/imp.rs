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
use vlm_runtime::encoder::{FrameEncoder, MtmdEncoder, Picture, PixelFormat, PixelLayout, YuvMatrix};
use vlm_runtime::{Device, models};

use crate::events::ModelQuery;
use crate::meta::VlmFrameMeta;

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlmencode", gst::DebugColorFlags::empty(), Some("gst-vlm vision encoder"))
});

const DEFAULT_INTERVAL: u64 = 1_000_000_000;

const DEFAULT_CACHE_ENTRIES: u32 = 64;
const DEFAULT_CACHE_BYTES: u64 = 64 << 20;

/// The raw formats vlmencode reads, and how.
const FORMATS: [(gst_video::VideoFormat, Option<PixelLayout>); 12] = [
    (gst_video::VideoFormat::Rgb, Some(PixelLayout::Rgb)),
    (gst_video::VideoFormat::Bgr, Some(PixelLayout::Bgr)),
    (gst_video::VideoFormat::Rgba, Some(PixelLayout::Rgbx)),
    (gst_video::VideoFormat::Rgbx, Some(PixelLayout::Rgbx)),
    (gst_video::VideoFormat::Bgra, Some(PixelLayout::Bgrx)),
    (gst_video::VideoFormat::Bgrx, Some(PixelLayout::Bgrx)),
    (gst_video::VideoFormat::Argb, Some(PixelLayout::Xrgb)),
    (gst_video::VideoFormat::Xrgb, Some(PixelLayout::Xrgb)),
    (gst_video::VideoFormat::Abgr, Some(PixelLayout::Xbgr)),
    (gst_video::VideoFormat::Xbgr, Some(PixelLayout::Xbgr)),
    (gst_video::VideoFormat::Nv12, None),
    (gst_video::VideoFormat::I420, None),
];

/// How the pixels of a negotiated format are read.
fn pixel_format(info: &gst_video::VideoInfo) -> Option<PixelFormat> {
    use gst_video::{VideoColorMatrix as M, VideoColorRange as R};
    let (_, layout) = FORMATS.iter().find(|(f, _)| *f == info.format())?;
    if let Some(layout) = layout {
        return Some(PixelFormat::Packed(*layout));
    }
    let c = info.colorimetry();
    let matrix = match (c.matrix(), c.range()) {
        (M::Bt709, R::Range0_255) => YuvMatrix::Bt709Full,
        (M::Bt709, _) => YuvMatrix::Bt709Limited,
        (_, R::Range0_255) => YuvMatrix::Bt601Full,
        _ => YuvMatrix::Bt601Limited,
    };
    Some(if info.format() == gst_video::VideoFormat::Nv12 {
        PixelFormat::Nv12(matrix)
    } else {
        PixelFormat::I420(matrix)
    })
}

#[derive(Debug, Clone)]
struct Settings {
    mmproj: String,
    model: String,
    interval: u64,
    max_rate: f64,
    cache_entries: u32,
    cache_bytes: u64,
    threads: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            mmproj: String::new(),
            model: String::new(),
            interval: DEFAULT_INTERVAL,
            max_rate: 0.0,
            cache_entries: DEFAULT_CACHE_ENTRIES,
            cache_bytes: DEFAULT_CACHE_BYTES,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get() as u32),
        }
    }
}

#[derive(Default)]
struct Stats {
    seen: u64,
    encoded: u64,
    /// Due frames not encoded because of max-rate.
    skipped: u64,
    encode_ms_total: f64,
}

#[derive(Default)]
struct State {
    info: Option<gst_video::VideoInfo>,
    encoder: Option<Arc<FrameEncoder>>,
    last_encoded: Option<gst::ClockTime>,
    last_encoded_at: Option<Instant>,
}

#[derive(Default)]
pub struct VlmEncode {
    settings: Mutex<Settings>,
    state: Mutex<State>,
    stats: Mutex<Stats>,
}

impl VlmEncode {
    fn cache_stats(&self) -> vlm_runtime::cache::CacheStats {
        self.state.lock().encoder.as_ref().map(|e| e.cache_stats()).unwrap_or_default()
    }

    /// Load the projector, asking downstream for the language model when `model` is unset.
    fn encoder(&self) -> Result<Arc<FrameEncoder>, gst::ErrorMessage> {
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
        let encoder = Arc::new(FrameEncoder::new(
            Arc::new(MtmdEncoder::new(projector)),
            settings.cache_entries as usize,
            settings.cache_bytes as usize,
        ));
        self.state.lock().encoder = Some(Arc::clone(&encoder));
        Ok(encoder)
    }

    /// Whether the frame at running time `time` is due for encoding under `interval` and
    /// `max-rate` (counting the frames max-rate skips).
    fn due(&self, time: Option<gst::ClockTime>) -> bool {
        let (interval, max_rate) = {
            let s = self.settings.lock();
            (gst::ClockTime::from_nseconds(s.interval), s.max_rate)
        };
        let mut state = self.state.lock();
        let due = match (time, state.last_encoded) {
            (_, None) | (None, _) => true,
            (Some(t), Some(last)) => interval.is_zero() || t < last || t >= last + interval,
        };
        if !due {
            return false;
        }
        let now = Instant::now();
        if max_rate > 0.0
            && state.last_encoded_at.is_some_and(|at| now.duration_since(at).as_secs_f64() < 1.0 / max_rate)
        {
            drop(state);
            self.stats.lock().skipped += 1;
            return false;
        }
        state.last_encoded = time;
        state.last_encoded_at = Some(now);
        true
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
                glib::ParamSpecDouble::builder("max-rate")
                    .nick("Max rate")
                    .blurb("Most frames encoded per second of wall-clock time (0 = no limit); due frames over it pass without embeddings, counted in frames-skipped")
                    .minimum(0.0)
                    .default_value(0.0)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("cache-entries")
                    .nick("Cache entries")
                    .blurb("Most frames kept in the embedding cache (0 = no cache)")
                    .default_value(DEFAULT_CACHE_ENTRIES)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("cache-bytes")
                    .nick("Cache bytes")
                    .blurb("Most bytes of embeddings kept in the embedding cache")
                    .default_value(DEFAULT_CACHE_BYTES)
                    .mutable_ready()
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
                glib::ParamSpecUInt64::builder("frames-skipped")
                    .nick("Frames skipped")
                    .blurb("Due frames not encoded because of max-rate")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("cache-hits")
                    .nick("Cache hits")
                    .blurb("Frames whose embeddings came from the cache (a hash, not an encode)")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("cache-misses")
                    .nick("Cache misses")
                    .blurb("Frames that had to be encoded (the first one included)")
                    .read_only()
                    .build(),
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
            "max-rate" => s.max_rate = value.get().unwrap(),
            "cache-entries" => s.cache_entries = value.get().unwrap(),
            "cache-bytes" => s.cache_bytes = value.get().unwrap(),
            "threads" => s.threads = value.get().unwrap(),
            _ => unreachable!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        match pspec.name() {
            "mmproj" => self.settings.lock().mmproj.to_value(),
            "model" => self.settings.lock().model.to_value(),
            "interval" => self.settings.lock().interval.to_value(),
            "max-rate" => self.settings.lock().max_rate.to_value(),
            "cache-entries" => self.settings.lock().cache_entries.to_value(),
            "cache-bytes" => self.settings.lock().cache_bytes.to_value(),
            "frames-skipped" => self.stats.lock().skipped.to_value(),
            "cache-hits" => self.cache_stats().hits.to_value(),
            "cache-misses" => self.cache_stats().misses.to_value(),
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
        // The encoder and its cache statistics stay readable until the next start.
        let mut state = self.state.lock();
        *state = State { encoder: state.encoder.take(), ..State::default() };
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
        let format = pixel_format(&info).ok_or(gst::FlowError::NotNegotiated)?;
        let started = Instant::now();
        let (frame, hit) = {
            let vframe = gst_video::VideoFrameRef::from_buffer_ref_readable(&*buf, &info).map_err(|_| {
                gst::element_imp_error!(self, gst::StreamError::Format, ["cannot map video frame"]);
                gst::FlowError::Error
            })?;
            let plane = |i: u32| if i < vframe.n_planes() { vframe.plane_data(i).unwrap_or(&[]) } else { &[] };
            let stride = |i: usize| vframe.plane_stride().get(i).map_or(0, |s| *s as usize);
            let picture = Picture {
                planes: [plane(0), plane(1), plane(2)],
                strides: [stride(0), stride(1), stride(2)],
                width: info.width(),
                height: info.height(),
                format,
            };
            encoder.encode(&picture).map_err(|e| {
                gst::element_imp_error!(self, gst::StreamError::Decode, ["vision encoding failed: {}", e]);
                gst::FlowError::Error
            })?
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        gst::debug!(
            CAT,
            imp = self,
            "frame {:?}: {} in {:.1} ms",
            buf.pts(),
            if hit { "cache hit" } else { "encoded" },
            ms
        );
        VlmFrameMeta::add(buf, frame);
        if !hit {
            let mut st = self.stats.lock();
            st.encoded += 1;
            st.encode_ms_total += ms;
        }
        Ok(gst::FlowSuccess::Ok)
    }
}
