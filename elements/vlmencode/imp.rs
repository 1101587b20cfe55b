use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_video::prelude::*;
use parking_lot::{Condvar, Mutex};
use vlm_runtime::encoder::gate::{ChangeGate, Decision, Luma};
use vlm_runtime::encoder::{FrameEncoder, Picture, PixelFormat, PixelLayout, YuvMatrix};

use crate::events::NotTakenEvent;
use crate::meta::VlmFrameMeta;

mod encoder;
mod task;

pub(crate) static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlmencode", gst::DebugColorFlags::empty(), Some("gst-vlm vision encoder"))
});

const DEFAULT_INTERVAL: u64 = 1_000_000_000;

const DEFAULT_CACHE_ENTRIES: u32 = 64;
const DEFAULT_MAX_PENDING: u32 = 2;
/// Frames (encoded or not) and events waiting in order behind the encoder, at most.
const MAX_QUEUED: usize = 64;
const DEFAULT_CACHE_BYTES: u64 = 64 << 20;
/// The change gate's default: a due frame is encoded when at least 0.1% of its blocks (and
/// at least one) changed beyond the noise since the last encoded frame.
const DEFAULT_MIN_CHANGE: f64 = 0.001;
/// At most this much running time (ns) between encodes of an unchanged picture.
const DEFAULT_MAX_UNCHANGED: u64 = 30_000_000_000;

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

/// Which vision encoder runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmEncodeBackend")]
pub enum Backend {
    #[enum_value(name = "Auto: the NPU (rknn builds, rknn-model set), else the GPU, else the CPU", nick = "auto")]
    Auto,
    #[enum_value(name = "CPU (libmtmd)", nick = "cpu")]
    Cpu,
    #[enum_value(name = "GPU (libmtmd on llama.cpp's GPU device)", nick = "gpu")]
    Gpu,
    #[enum_value(name = "Rockchip NPU (RKNN; rknn builds only)", nick = "rknn")]
    Rknn,
}

/// Which tiles of a due frame are taken from the frame encoded before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, glib::Enum)]
#[enum_type(name = "GstVlmEncodeTileReuse")]
pub enum TileReuseKind {
    #[enum_value(name = "Off: every tile of a due frame is encoded", nick = "off")]
    Off,
    #[enum_value(name = "Exact: a tile whose pixels are identical", nick = "exact")]
    Exact,
    #[enum_value(
        name = "Threshold: a tile with no change beyond noise since its embeddings were made",
        nick = "threshold"
    )]
    Threshold,
}

#[derive(Debug, Clone)]
struct Settings {
    backend: Backend,
    rknn_model: String,
    mmproj: String,
    model: String,
    interval: u64,
    max_rate: f64,
    cache_entries: u32,
    cache_bytes: u64,
    max_pending: u32,
    leaky: bool,
    threads: u32,
    contexts: u32,
    min_change: f64,
    max_unchanged: u64,
    tile_reuse: TileReuseKind,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            backend: Backend::Auto,
            rknn_model: String::new(),
            mmproj: String::new(),
            model: String::new(),
            interval: DEFAULT_INTERVAL,
            max_rate: 0.0,
            cache_entries: DEFAULT_CACHE_ENTRIES,
            cache_bytes: DEFAULT_CACHE_BYTES,
            max_pending: DEFAULT_MAX_PENDING,
            leaky: false,
            // (At most the property's maximum: 256.)
            threads: std::thread::available_parallelism().map_or(2, |n| n.get().min(256) as u32),
            contexts: 0,
            min_change: DEFAULT_MIN_CHANGE,
            max_unchanged: DEFAULT_MAX_UNCHANGED,
            tile_reuse: TileReuseKind::Threshold,
        }
    }
}

#[derive(Default)]
struct Stats {
    seen: u64,
    encoded: u64,
    /// Due frames not encoded because of max-rate or, when leaky, a full encoder, and frames
    /// that could not be read (`unreadable` of them).
    skipped: u64,
    unreadable: u64,
    encode_ms_total: f64,
    /// Of `encode_ms_total`: preparing pictures on the CPU, and waiting for an encoder context.
    prepare_ms_total: f64,
    wait_ms_total: f64,
    /// The slowest encoding so far (ms), refreshes left out: the latency this element reports.
    slowest_ms: f64,
    /// Most due frames ever waiting for the encoder at once.
    peak_pending: usize,
    /// Due frames the change gate held (no change since the last encoded frame).
    unchanged: u64,
    /// Images (tiles) of encoded frames encoded, and taken from the frame before.
    tiles_encoded: u64,
    tiles_reused: u64,
}

impl Stats {
    /// A total's mean over the frames encoded (0 before the first).
    fn mean(&self, total: impl Fn(&Stats) -> f64) -> f64 {
        if self.encoded == 0 { 0.0 } else { total(self) / self.encoded as f64 }
    }
}

#[derive(Default)]
struct State {
    info: Option<gst_video::VideoInfo>,
    segment: Option<gst::FormattedSegment<gst::ClockTime>>,
    encoder: Option<Arc<FrameEncoder>>,
    /// After a stop: the encoder's cache statistics and contexts then (the encoder itself is let
    /// go: the projector and the model copy it holds are freed, and it no longer counts as one of
    /// the process's streams for automatic encoder contexts).
    stopped: Option<(vlm_runtime::cache::CacheStats, u32)>,
    /// The projector is loading on a thread of its own (`leaky`: frames pass meanwhile).
    loading: bool,
    /// The backend the encoder runs on (`cpu`, `gpu`, `rknn`).
    backend: &'static str,
    last_encoded: Option<gst::ClockTime>,
    last_encoded_at: Option<Instant>,
    /// The change gate (`min-change`), and when it last let a frame through: its running time
    /// (untimed: none) and the wall clock's.
    gate: ChangeGate,
    gate_passed: Option<(Option<gst::ClockTime>, Instant)>,
    /// `tile-reuse` met a projector that encodes a frame as one image (said once).
    untiled_said: bool,
}

/// A frame to encode: the caps to read it by, and its sampling by the change gate (for tile
/// reuse).
struct Due {
    info: gst_video::VideoInfo,
    luma: Option<Arc<Luma>>,
    /// `max-unchanged` forced it: no tile is reused on a threshold (drifts under it add up).
    refresh: bool,
    /// The gate found it unchanged (a refresh with `min-change` on): the frame encoded last
    /// stands for it until it is registered, said downstream before the encode (`vlm-standing`).
    stands: bool,
}

/// What waits, in stream order, for the encoding task.
enum Item {
    /// A frame, and how to encode it when it is to be encoded.
    Frame(gst::Buffer, Option<Due>),
    Event(gst::Event),
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    /// Frames queued or being encoded.
    pending: usize,
    /// The task has taken an item and not yet pushed it.
    busy: bool,
    flushing: bool,
    /// The last downstream flow result, returned to upstream by the next chain call.
    flow: Option<gst::FlowError>,
    /// Downstream returned EOS (a sink with `num-buffers`, an element that has all it wants):
    /// frames are refused with EOS until a new segment or stream comes, while events still
    /// pass, so the EOS that follows reaches the sinks (as `queue` does).
    downstream_eos: bool,
}

pub struct VlmEncode {
    sinkpad: gst::Pad,
    srcpad: gst::Pad,
    settings: Mutex<Settings>,
    state: Mutex<State>,
    stats: Mutex<Stats>,
    queue: Mutex<Queue>,
    changed: Condvar,
    /// The queue is flushing (a mirror of its flag read without its lock): the frame being
    /// encoded gives up waiting for the encoder, so a flush or a stop never waits behind other
    /// streams' encodes.
    flushing: std::sync::atomic::AtomicBool,
    /// Held while the projector loads, so that the encoding task and a background load never
    /// load it twice.
    load: Mutex<()>,
    /// Runs started (READY→PAUSED): a load begun in an earlier run is not this run's encoder.
    runs: std::sync::atomic::AtomicU64,
}

impl VlmEncode {
    fn cache_stats(&self) -> vlm_runtime::cache::CacheStats {
        let state = self.state.lock();
        state.encoder.as_ref().map(|e| e.cache_stats()).or(state.stopped.map(|s| s.0)).unwrap_or_default()
    }

    /// Whether the frame at running time `time` is due for encoding under `interval` and
    /// `max-rate` (counting the frames max-rate skips). Nothing is spent: the interval starts
    /// again only when a frame is handed to the encoder ([`VlmEncode::encoding`]), so a frame a
    /// leaky encoder lets pass leaves the next one due.
    fn due(&self, time: Option<gst::ClockTime>) -> bool {
        let (interval, max_rate) = {
            let s = self.settings.lock();
            (gst::ClockTime::from_nseconds(s.interval), s.max_rate)
        };
        let state = self.state.lock();
        // (Untimed frames keep the interval on the wall clock.)
        let due = match (time, state.last_encoded) {
            _ if interval.is_zero() => true,
            (None, _) => state.last_encoded_at.is_none_or(|at| at.elapsed() >= std::time::Duration::from(interval)),
            (Some(_), None) => true,
            (Some(t), Some(last)) => t < last || t >= last.saturating_add(interval),
        };
        if !due {
            return false;
        }
        if max_rate > 0.0 && state.last_encoded_at.is_some_and(|at| at.elapsed().as_secs_f64() < 1.0 / max_rate) {
            drop(state);
            self.stats.lock().skipped += 1;
            return false;
        }
        true
    }

    /// The frame at running time `time` goes to the encoder: the interval starts from it.
    fn encoding(&self, time: Option<gst::ClockTime>) {
        let mut state = self.state.lock();
        state.last_encoded = time;
        state.last_encoded_at = Some(Instant::now());
    }
}

/// What the change gate decided for a due frame.
enum Gate {
    /// Encode it (changed, the gate off, or `max-unchanged` reached: then true), with its
    /// sampling for later frames to compare with once it goes to the encoder.
    Encode(Option<Arc<Luma>>, bool),
    /// It did not change, but `max-unchanged` was reached: it is encoded again, the last
    /// encoded frame standing for it meanwhile.
    Refresh(Arc<Luma>),
    /// It did not change (the share of the picture that did): the last encoded frame stands.
    Hold(f64),
}

/// `buffer` mapped as a video frame of `info`. A buffer with a `VideoMeta` is refused where a
/// plane reaches past its end: GStreamer maps such a frame without checking how far its planes
/// reach (without a meta it checks the size), and a plane is read as stride x rows bytes from
/// its offset.
pub(crate) fn map_frame<'a>(
    buffer: &'a gst::BufferRef,
    info: &gst_video::VideoInfo,
) -> Result<gst_video::VideoFrameRef<&'a gst::BufferRef>, String> {
    if let Some(meta) = buffer.meta::<gst_video::VideoMeta>() {
        let format = gst_video::VideoFormatInfo::from_format(meta.format());
        for plane in 0..meta.n_planes() as usize {
            // (The rows of the plane's first component.)
            let rows = (0..format.n_components())
                .find(|&c| format.plane()[c as usize] == plane as u32)
                .map_or(0, |c| format.scale_height(c as u8, meta.height()) as usize);
            let end = usize::try_from(meta.stride()[plane])
                .ok()
                .and_then(|stride| stride.checked_mul(rows)?.checked_add(meta.offset()[plane]));
            if end.is_none_or(|end| end > buffer.size()) {
                return Err(format!(
                    "a buffer of {} bytes is smaller than its video meta says ({}x{} {:?}, plane {plane} at offset {} with stride {})",
                    buffer.size(),
                    meta.width(),
                    meta.height(),
                    meta.format(),
                    meta.offset()[plane],
                    meta.stride()[plane]
                ));
            }
        }
    }
    gst_video::VideoFrameRef::from_buffer_ref_readable(buffer, info)
        .map_err(|_| format!("cannot map a video frame of {info:?}"))
}

/// The raw picture of a mapped video frame.
pub(crate) fn picture<'a>(
    vframe: &'a gst_video::VideoFrameRef<&'a gst::BufferRef>,
    info: &gst_video::VideoInfo,
    format: PixelFormat,
) -> Picture<'a> {
    let plane = |i: u32| if i < vframe.n_planes() { vframe.plane_data(i).unwrap_or(&[]) } else { &[] };
    let stride = |i: usize| vframe.plane_stride().get(i).map_or(0, |s| *s as usize);
    Picture {
        planes: [plane(0), plane(1), plane(2)],
        strides: [stride(0), stride(1), stride(2)],
        width: info.width(),
        height: info.height(),
        format,
    }
}

impl VlmEncode {
    /// The change gate (`min-change`) for a due frame at running time `time`.
    fn gate(&self, buffer: &gst::Buffer, info: &gst_video::VideoInfo, time: Option<gst::ClockTime>) -> Gate {
        let (min_change, max_unchanged, tiles) = {
            let s = self.settings.lock();
            (s.min_change, gst::ClockTime::from_nseconds(s.max_unchanged), s.tile_reuse)
        };
        // (With the gate off, the sampling still serves tile reuse.)
        if min_change <= 0.0 && tiles != TileReuseKind::Threshold {
            return Gate::Encode(None, false);
        }
        let Some(format) = pixel_format(info) else { return Gate::Encode(None, false) };
        // (A frame that cannot be mapped fails in the encode, which says why.)
        let Ok(vframe) = map_frame(buffer.as_ref(), info) else {
            return Gate::Encode(None, false);
        };
        let state = self.state.lock();
        // (Untimed frames, or a timed one after an untimed, count `max-unchanged` on the wall
        // clock.)
        let stale = !max_unchanged.is_zero()
            && match (time, state.gate_passed) {
                (_, None) => false,
                (Some(t), Some((Some(passed), _))) => t < passed || t >= passed.saturating_add(max_unchanged),
                (_, Some((_, at))) => at.elapsed() >= std::time::Duration::from(max_unchanged),
            };
        match state.gate.decide(&picture(&vframe, info, format), min_change) {
            Some(Decision::Unchanged(_, luma)) if stale && min_change > 0.0 => Gate::Refresh(Arc::new(luma)),
            Some(Decision::Unchanged(change, _)) if min_change > 0.0 => Gate::Hold(change.share()),
            Some(Decision::Unchanged(_, luma)) => Gate::Encode(Some(Arc::new(luma)), stale),
            Some(Decision::Changed(_, luma)) => Gate::Encode(Some(Arc::new(luma)), false),
            None => Gate::Encode(None, false),
        }
    }

    /// Start the change gate afresh: the next due frame is encoded.
    fn reset_gate(&self) {
        let mut state = self.state.lock();
        state.gate.reset();
        state.gate_passed = None;
    }

    fn sink_chain(&self, buffer: gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        self.stats.lock().seen += 1;
        let (running_time, info) = {
            let state = self.state.lock();
            let rt = buffer.pts().and_then(|pts| state.segment.as_ref().and_then(|s| s.to_running_time(pts)));
            (rt, state.info.clone())
        };
        let info = info.ok_or(gst::FlowError::NotNegotiated)?;
        if !self.due(running_time) {
            gst::trace!(CAT, imp = self, "frame {:?} not due", buffer.pts());
            return self.enqueue(Item::Frame(buffer, None), false);
        }
        let (luma, refresh, stands) = match self.gate(&buffer, &info, running_time) {
            Gate::Encode(luma, refresh) => (luma, refresh, false),
            Gate::Refresh(luma) => (Some(luma), true, true),
            Gate::Hold(share) => {
                // The last encoded frame stands for this one: it passes, marked, and the interval
                // starts again from it.
                gst::trace!(CAT, imp = self, "frame {:?} unchanged ({:.4} of the picture)", buffer.pts(), share);
                self.stats.lock().unchanged += 1;
                self.encoding(running_time);
                let mut buffer = buffer;
                VlmFrameMeta::add_held(buffer.make_mut());
                return self.enqueue(Item::Frame(buffer, None), false);
            }
        };
        let (max_pending, leaky) = {
            let s = self.settings.lock();
            (s.max_pending as usize, s.leaky)
        };
        // The projector (100-700 MB for real models) never loads on this, the streaming thread,
        // nor on the encoding task (a flush waits for that): on a thread of its own, started
        // with the first due frame, which the task then waits for, or with `leaky` (a live
        // camera) while frames pass without embeddings. A bad file fails the stream from there.
        if leaky && !self.encoder_ready() {
            self.stats.lock().skipped += 1;
            gst::debug!(CAT, imp = self, "projector loading: frame {:?} passes without embeddings", buffer.pts());
            return self.enqueue(Item::Frame(buffer, None), false);
        }
        if leaky && self.queue.lock().pending >= max_pending {
            self.stats.lock().skipped += 1;
            gst::debug!(CAT, imp = self, "encoder busy: frame {:?} passes without embeddings (leaky)", buffer.pts());
            return self.enqueue(Item::Frame(buffer, None), false);
        }
        self.encoding(running_time);
        if let Some(luma) = &luma {
            let mut state = self.state.lock();
            state.gate.encoded(Arc::clone(luma));
            state.gate_passed = Some((running_time, Instant::now()));
        }
        self.enqueue(Item::Frame(buffer, Some(Due { info, luma, refresh, stands })), true)
    }

    fn sink_event(&self, event: gst::Event) -> bool {
        use gst::EventView;
        gst::log!(CAT, imp = self, "handling {event:?}");
        match event.view() {
            EventView::FlushStart(_) => {
                self.set_flushing(true);
                let forwarded = self.srcpad.push_event(event);
                let _ = self.srcpad.pause_task();
                return forwarded;
            }
            // (Not on a source pad a stop has deactivated, whose sink pad is still active:
            // the element stays flushing and its task starts with the next activation.)
            EventView::FlushStop(_) if !self.srcpad.is_active() => return self.srcpad.push_event(event),
            EventView::FlushStop(_) => {
                self.set_flushing(false);
                self.state.lock().last_encoded = None;
                self.reset_gate();
                if let Some(encoder) = self.state.lock().encoder.as_ref() {
                    encoder.forget_last();
                }
                let forwarded = self.srcpad.push_event(event);
                self.start_task();
                return forwarded;
            }
            EventView::Caps(c) => match gst_video::VideoInfo::from_caps(c.caps()) {
                Ok(info) if info.width() > 0 && info.height() > 0 && pixel_format(&info).is_some() => {
                    let mut state = self.state.lock();
                    // A new geometry or format: the change gate starts afresh.
                    if state.info.as_ref() != Some(&info) {
                        state.gate.reset();
                        state.gate_passed = None;
                    }
                    state.info = Some(info);
                }
                _ => {
                    gst::element_imp_error!(self, gst::StreamError::Format, ("unsupported video caps {}", c.caps()));
                    return false;
                }
            },
            EventView::Segment(seg) => {
                self.state.lock().segment = seg.segment().downcast_ref::<gst::ClockTime>().cloned();
                self.reset_gate();
            }
            _ => (),
        }
        if event.is_serialized() {
            self.enqueue(Item::Event(event), false).is_ok()
        } else {
            self.srcpad.push_event(event)
        }
    }

    /// The latency query: upstream's, plus `max-pending` of the slowest encoding seen (a frame
    /// leaves after the due frames ahead of it and its own, up to `max-pending` of them).
    fn src_event(&self, pad: &gst::Pad, event: gst::Event) -> bool {
        if NotTakenEvent::is(&event) {
            gst::debug!(
                CAT,
                imp = self,
                "the last encoded frame did not join the history: the next due frame is encoded"
            );
            self.reset_gate();
            return true;
        }
        gst::Pad::event_default(pad, Some(&*self.obj()), event)
    }

    fn src_query(&self, pad: &gst::Pad, query: &mut gst::QueryRef) -> bool {
        let gst::QueryViewMut::Latency(latency) = query.view_mut() else {
            return gst::Pad::query_default(pad, Some(&*self.obj()), query);
        };
        let mut upstream = gst::query::Latency::new();
        if !self.sinkpad.peer_query(&mut upstream) {
            return false;
        }
        let (live, min, max) = upstream.result();
        let pending = f64::from(self.settings.lock().max_pending);
        let own = gst::ClockTime::from_nseconds((self.stats.lock().slowest_ms * pending * 1e6) as u64);
        latency.set(live, min + own, max.map(|m| m + own));
        true
    }

    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let s = self.settings.lock().clone();
        let (file, what) =
            if s.backend == Backend::Rknn { (&s.rknn_model, "rknn-model") } else { (&s.mmproj, "mmproj") };
        vlm_runtime::llama::check_readable(&PathBuf::from(file), what)
            .map_err(|e| gst::error_msg!(gst::ResourceError::OpenRead, ("{}", e), ["vlmencode {what}={file}"]))?;
        self.runs.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        *self.state.lock() = State::default();
        *self.stats.lock() = Stats::default();
        *self.queue.lock() = Queue::default();
        Ok(())
    }

    /// PAUSED→READY, once the pads are inactive (the task stopped with its pad).
    fn stop(&self) {
        // The encoder is let go; its cache statistics and contexts stay readable until the next
        // start. A load still running is not this run's any more: dropped when it ends.
        self.runs.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let mut state = self.state.lock();
        let stopped = state.encoder.take().map(|e| (e.cache_stats(), e.encoder().contexts() as u32)).or(state.stopped);
        *state = State { stopped, backend: state.backend, ..State::default() };
    }
}

#[glib::object_subclass]
impl ObjectSubclass for VlmEncode {
    const NAME: &'static str = "GstVlmEncode";
    type Type = super::VlmEncode;
    type ParentType = gst::Element;

    fn with_class(klass: &Self::Class) -> Self {
        let sinkpad = gst::Pad::builder_from_template(&klass.pad_template("sink").unwrap())
            .chain_function(|_, parent, buffer| {
                VlmEncode::catch_panic_pad_function(parent, || Err(gst::FlowError::Error), |imp| imp.sink_chain(buffer))
            })
            .event_function(|_, parent, event| {
                VlmEncode::catch_panic_pad_function(parent, || false, |imp| imp.sink_event(event))
            })
            .query_function(|pad, parent, query| {
                VlmEncode::catch_panic_pad_function(parent, || false, |imp| imp.sink_query(pad, query))
            })
            .flags(gst::PadFlags::PROXY_CAPS | gst::PadFlags::PROXY_ALLOCATION)
            .build();
        let srcpad = gst::Pad::builder_from_template(&klass.pad_template("src").unwrap())
            .event_function(|pad, parent, event| {
                VlmEncode::catch_panic_pad_function(parent, || false, |imp| imp.src_event(pad, event))
            })
            .query_function(|pad, parent, query| {
                VlmEncode::catch_panic_pad_function(parent, || false, |imp| imp.src_query(pad, query))
            })
            .activatemode_function(|pad, parent, mode, active| {
                VlmEncode::catch_panic_pad_function(
                    parent,
                    || Err(gst::loggable_error!(CAT, "panic in the activation of {}", pad.name())),
                    |imp| imp.src_activatemode(pad, mode, active),
                )
            })
            .flags(gst::PadFlags::PROXY_CAPS | gst::PadFlags::PROXY_ALLOCATION)
            .build();
        VlmEncode {
            sinkpad,
            srcpad,
            settings: Mutex::default(),
            state: Mutex::default(),
            stats: Mutex::default(),
            queue: Mutex::default(),
            changed: Condvar::new(),
            flushing: std::sync::atomic::AtomicBool::new(false),
            load: Mutex::new(()),
            runs: 0.into(),
        }
    }
}

impl ObjectImpl for VlmEncode {
    fn constructed(&self) {
        self.parent_constructed();
        self.obj().add_pad(&self.sinkpad).unwrap();
        self.obj().add_pad(&self.srcpad).unwrap();
    }

    fn properties() -> &'static [glib::ParamSpec] {
        static PROPS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            vec![
                glib::ParamSpecEnum::builder_with_default("backend", Backend::Auto)
                    .nick("Backend")
                    .blurb("Vision encoder: auto (NPU, then GPU, then CPU), cpu, gpu or rknn")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("rknn-model")
                    .nick("RKNN model")
                    .blurb("Path to the .rknn vision encoder for the NPU (rknn builds); it must output the language model's embedding width")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("active-backend")
                    .nick("Active backend")
                    .blurb("The backend the encoder runs on once loaded: cpu, gpu or rknn")
                    .read_only()
                    .build(),
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
                    .blurb("Running time between encoded frames in ns (0 = every frame; the wall clock for untimed frames); other frames pass without embeddings")
                    .maximum(gst::ClockTime::MAX.nseconds())
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
                glib::ParamSpecUInt::builder("max-pending")
                    .nick("Max pending")
                    .blurb("Frames waiting for or in the encoder (which runs off the streaming thread) before upstream blocks, or, when leaky, before due frames pass without embeddings")
                    .minimum(1)
                    .maximum(64)
                    .default_value(DEFAULT_MAX_PENDING)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("leaky")
                    .nick("Leaky")
                    .blurb("When the encoder is full, let due frames pass without embeddings (counted in frames-skipped) instead of blocking upstream")
                    .default_value(false)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecDouble::builder("min-change")
                    .nick("Minimum change")
                    .blurb("Share of the picture (0-1) that must have changed beyond noise since the last encoded frame for a due frame to be encoded; 0 = encode every due frame")
                    .minimum(0.0)
                    .maximum(1.0)
                    .default_value(DEFAULT_MIN_CHANGE)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt64::builder("max-unchanged")
                    .nick("Maximum unchanged")
                    .blurb("Stream time in ns after which an unchanged picture is encoded again (0 = never)")
                    .maximum(gst::ClockTime::MAX.nseconds())
                    .default_value(DEFAULT_MAX_UNCHANGED)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("tile-reuse", TileReuseKind::Threshold)
                    .nick("Tile reuse")
                    .blurb("Tiles of a due frame taken from the frame encoded before (tiled projectors such as SmolVLM's): off, exact (identical pixels) or threshold (no change beyond noise)")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt64::builder("tiles-encoded")
                    .nick("Tiles encoded")
                    .blurb("Images (tiles) of encoded frames that were encoded")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("tiles-reused")
                    .nick("Tiles reused")
                    .blurb("Images (tiles) of encoded frames taken from the frame encoded before (tile-reuse)")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("frames-unchanged")
                    .nick("Frames unchanged")
                    .blurb("Due frames not encoded because they had not changed (min-change)")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt::builder("threads")
                    .nick("Threads")
                    .blurb("CPU threads of the vision encoder, shared by its encoder contexts")
                    .minimum(1)
                    .maximum(256)
                    .default_value(Settings::default().threads)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("encoder-contexts")
                    .nick("Encoder contexts")
                    .blurb(
                        "libmtmd encoder contexts shared by the process's vlmencodes of one projector: tiles and \
                         frames encoded side by side (0: on a GPU 2, growing to 4 while busy; 1 on the CPU)",
                    )
                    .maximum(vlm_runtime::llama::MAX_ENCODER_CONTEXTS as u32)
                    .default_value(0)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("frames-seen").nick("Frames seen").blurb("Video frames received").read_only().build(),
                glib::ParamSpecUInt64::builder("frames-encoded").nick("Frames encoded").blurb("Frames run through the vision encoder (frames given embeddings from the cache: cache-hits)").read_only().build(),
                glib::ParamSpecUInt64::builder("frames-skipped")
                    .nick("Frames skipped")
                    .blurb("Due frames that passed without embeddings because of max-rate, a frame that could not be read (a warning says why) or, when leaky, a full encoder or a projector still loading")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt::builder("peak-pending")
                    .nick("Peak pending")
                    .blurb("Most frames that waited for the encoder at once")
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
                glib::ParamSpecDouble::builder("mean-prepare-ms")
                    .nick("Mean preparation time")
                    .blurb(
                        "Of mean-encode-ms: preparing the picture on the CPU (the projector's resize, tiling and \
                         normalisation), in milliseconds",
                    )
                    .read_only()
                    .build(),
                glib::ParamSpecUInt::builder("active-encoder-contexts")
                    .nick("Active encoder contexts")
                    .blurb("Encoder contexts the process's projector has loaded (encoder-contexts resolved; 0 before it loads, the last count after a stop)")
                    .read_only()
                    .build(),
                glib::ParamSpecDouble::builder("mean-context-wait-ms")
                    .nick("Mean wait for an encoder context")
                    .blurb(
                        "Of mean-encode-ms: waiting for a free encoder context (other frames of the process \
                         encoding), in milliseconds",
                    )
                    .read_only()
                    .build(),
            ]
        });
        PROPS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        if crate::refused_while_running(self.obj().upcast_ref(), pspec) {
            return;
        }
        let mut s = self.settings.lock();
        let gate_before = (s.min_change, s.tile_reuse);
        match pspec.name() {
            "backend" => s.backend = value.get().unwrap(),
            "rknn-model" => s.rknn_model = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            "mmproj" => s.mmproj = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            "model" => s.model = value.get::<Option<String>>().unwrap().unwrap_or_default(),
            "interval" => s.interval = value.get().unwrap(),
            "max-rate" => s.max_rate = value.get().unwrap(),
            "max-pending" => s.max_pending = value.get().unwrap(),
            "leaky" => s.leaky = value.get().unwrap(),
            "cache-entries" => s.cache_entries = value.get().unwrap(),
            "cache-bytes" => s.cache_bytes = value.get().unwrap(),
            "threads" => s.threads = value.get().unwrap(),
            "encoder-contexts" => s.contexts = value.get().unwrap(),
            "min-change" => s.min_change = value.get().unwrap(),
            "max-unchanged" => s.max_unchanged = value.get().unwrap(),
            "tile-reuse" => s.tile_reuse = value.get().unwrap(),
            _ => unreachable!(),
        }
        // The gate's reference is kept only while it samples: a gate turned on again starts
        // afresh (it held frames against a picture from before it was off).
        if (s.min_change, s.tile_reuse) != gate_before {
            drop(s);
            self.reset_gate();
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        match pspec.name() {
            "backend" => self.settings.lock().backend.to_value(),
            "rknn-model" => self.settings.lock().rknn_model.to_value(),
            "active-backend" => self.state.lock().backend.to_value(),
            "mmproj" => self.settings.lock().mmproj.to_value(),
            "model" => self.settings.lock().model.to_value(),
            "interval" => self.settings.lock().interval.to_value(),
            "max-rate" => self.settings.lock().max_rate.to_value(),
            "max-pending" => self.settings.lock().max_pending.to_value(),
            "leaky" => self.settings.lock().leaky.to_value(),
            "peak-pending" => (self.stats.lock().peak_pending as u32).to_value(),
            "cache-entries" => self.settings.lock().cache_entries.to_value(),
            "cache-bytes" => self.settings.lock().cache_bytes.to_value(),
            "frames-skipped" => self.stats.lock().skipped.to_value(),
            "cache-hits" => self.cache_stats().hits.to_value(),
            "cache-misses" => self.cache_stats().misses.to_value(),
            "threads" => self.settings.lock().threads.to_value(),
            "encoder-contexts" => self.settings.lock().contexts.to_value(),
            "min-change" => self.settings.lock().min_change.to_value(),
            "max-unchanged" => self.settings.lock().max_unchanged.to_value(),
            "frames-unchanged" => self.stats.lock().unchanged.to_value(),
            "tile-reuse" => self.settings.lock().tile_reuse.to_value(),
            "tiles-encoded" => self.stats.lock().tiles_encoded.to_value(),
            "tiles-reused" => self.stats.lock().tiles_reused.to_value(),
            "frames-seen" => self.stats.lock().seen.to_value(),
            "frames-encoded" => self.stats.lock().encoded.to_value(),
            "mean-encode-ms" => self.stats.lock().mean(|st| st.encode_ms_total).to_value(),
            "mean-prepare-ms" => self.stats.lock().mean(|st| st.prepare_ms_total).to_value(),
            "mean-context-wait-ms" => self.stats.lock().mean(|st| st.wait_ms_total).to_value(),
            "active-encoder-contexts" => {
                let (encoder, stopped) = {
                    let state = self.state.lock();
                    (state.encoder.clone(), state.stopped.map(|s| s.1))
                };
                encoder.map(|e| e.encoder().contexts() as u32).or(stopped).unwrap_or(0).to_value()
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

    fn change_state(&self, transition: gst::StateChange) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        match transition {
            gst::StateChange::ReadyToPaused => {
                if let Err(e) = self.start() {
                    self.post_error_message(e);
                    return Err(gst::StateChangeError);
                }
            }
            // Upstream's chain function may wait for room: released before the pads deactivate
            // (the source pad's deactivation stops the task).
            gst::StateChange::PausedToReady => self.set_flushing(true),
            _ => (),
        }
        let ret = self.parent_change_state(transition)?;
        if transition == gst::StateChange::PausedToReady {
            self.stop();
        }
        Ok(ret)
    }
}
