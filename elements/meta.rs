//! `VlmFrameMeta`: what gst-vlm attaches to a video buffer.
//!
//! `vlmencode` sets the frame's projected embeddings (a shared handle: no float is copied on the
//! way to `vlmcontext`); `vlmcontext` adds the stream and the frame's number in it, which is how
//! `vlmquery` knows which version of the history a question that follows this buffer needs.

use std::fmt;
use std::ptr;
use std::sync::{Arc, OnceLock};

use gst::prelude::*;
use vlm_runtime::Frame;

#[repr(C)]
pub struct VlmFrameMeta {
    parent: gst::ffi::GstMeta,
    frame: Option<Arc<Frame>>,
    stream: u64,
    number: u64,
    /// `vlmencode min-change`: the frame was due but had not changed since the last encoded
    /// one, which still stands for it (no embeddings).
    held: bool,
}

// SAFETY: the fields are Send + Sync Rust values.
unsafe impl Send for VlmFrameMeta {}
unsafe impl Sync for VlmFrameMeta {}

impl VlmFrameMeta {
    /// Attach encoded embeddings to `buffer` (vlmencode), in place of any meta it had (a buffer
    /// carries one: its readers take the first).
    pub fn add(buffer: &mut gst::BufferRef, frame: Arc<Frame>) -> gst::MetaRefMut<'_, Self, gst::meta::Standalone> {
        let mut meta = Self::fresh(buffer);
        meta.frame = Some(frame);
        meta
    }

    /// Mark `buffer` as a due frame that did not change since the last encoded one
    /// (`vlmencode min-change`): it carries no embeddings, the last encoded frame stands for it.
    pub fn add_held(buffer: &mut gst::BufferRef) -> gst::MetaRefMut<'_, Self, gst::meta::Standalone> {
        let mut meta = Self::fresh(buffer);
        meta.held = true;
        meta
    }

    /// A meta with every field at its initial value, the buffer's only one.
    fn fresh(buffer: &mut gst::BufferRef) -> gst::MetaRefMut<'_, Self, gst::meta::Standalone> {
        while let Some(old) = buffer.meta_mut::<Self>() {
            old.remove().expect("a VlmFrameMeta is not locked");
        }
        // SAFETY: info() registers a meta whose init writes every field; the returned pointer is
        // a VlmFrameMeta owned by the buffer.
        unsafe {
            let meta =
                gst::ffi::gst_buffer_add_meta(buffer.as_mut_ptr(), info(), ptr::null_mut()).cast::<VlmFrameMeta>();
            Self::from_mut_ptr(buffer, meta)
        }
    }

    /// Whether this frame was held by `vlmencode min-change` (see [`VlmFrameMeta::add_held`]).
    pub fn held(&self) -> bool {
        self.held
    }

    pub fn frame(&self) -> Option<&Arc<Frame>> {
        self.frame.as_ref()
    }

    /// Stream id (see `vlm_runtime::stream::lookup`) and frame number, once `vlmcontext` has
    /// registered the frame; `None` before. On a held frame ([`VlmFrameMeta::held`]), the
    /// position of the registered frame that stands for it.
    pub fn position(&self) -> Option<(u64, u64)> {
        (self.number > 0).then_some((self.stream, self.number))
    }

    pub fn set_position(&mut self, stream: u64, number: u64) {
        self.stream = stream;
        self.number = number;
    }
}

unsafe impl MetaAPI for VlmFrameMeta {
    type GstType = VlmFrameMeta;

    fn meta_api() -> glib::Type {
        // SAFETY: info() registers the API type first.
        unsafe { glib::translate::from_glib((*info()).api) }
    }
}

impl fmt::Debug for VlmFrameMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VlmFrameMeta")
            .field("frame", &self.frame)
            .field("stream", &self.stream)
            .field("number", &self.number)
            .field("held", &self.held)
            .finish()
    }
}

unsafe extern "C" fn init(
    meta: *mut gst::ffi::GstMeta,
    _: glib::ffi::gpointer,
    _: *mut gst::ffi::GstBuffer,
) -> glib::ffi::gboolean {
    // SAFETY: GStreamer allocated size_of::<VlmFrameMeta>() bytes; the Rust fields are written
    // before anything reads them.
    unsafe {
        let m = meta.cast::<VlmFrameMeta>();
        ptr::write(&mut (*m).frame, None);
        ptr::write(&mut (*m).stream, 0);
        ptr::write(&mut (*m).number, 0);
        ptr::write(&mut (*m).held, false);
    }
    glib::ffi::GTRUE
}

unsafe extern "C" fn free(meta: *mut gst::ffi::GstMeta, _: *mut gst::ffi::GstBuffer) {
    // SAFETY: init ran on this meta; the Arc is dropped exactly once.
    unsafe { ptr::drop_in_place(&mut (*meta.cast::<VlmFrameMeta>()).frame) }
}

unsafe extern "C" fn transform(
    dest: *mut gst::ffi::GstBuffer,
    meta: *mut gst::ffi::GstMeta,
    _src: *mut gst::ffi::GstBuffer,
    _kind: glib::ffi::GQuark,
    _data: glib::ffi::gpointer,
) -> glib::ffi::gboolean {
    // SAFETY: `meta` is a VlmFrameMeta; the copy (the one `dest` has already, or a new one) gets
    // clones of its shared handles.
    unsafe {
        let src = &*meta.cast::<VlmFrameMeta>();
        let mut copy =
            gst::ffi::gst_buffer_get_meta(dest, glib::translate::IntoGlib::into_glib(VlmFrameMeta::meta_api()))
                .cast::<VlmFrameMeta>();
        if copy.is_null() {
            copy = gst::ffi::gst_buffer_add_meta(dest, info(), ptr::null_mut()).cast::<VlmFrameMeta>();
        }
        if copy.is_null() {
            return glib::ffi::GFALSE;
        }
        (*copy).frame = src.frame.clone();
        (*copy).stream = src.stream;
        (*copy).number = src.number;
        (*copy).held = src.held;
    }
    glib::ffi::GTRUE
}

struct Info(*const gst::ffi::GstMetaInfo);
// SAFETY: GstMetaInfo is immutable after registration.
unsafe impl Send for Info {}
unsafe impl Sync for Info {}

fn info() -> *const gst::ffi::GstMetaInfo {
    static INFO: OnceLock<Info> = OnceLock::new();
    INFO.get_or_init(|| {
        // SAFETY: registration with NUL-terminated names and an empty, NULL-terminated tag list.
        unsafe {
            let mut tags = [ptr::null::<std::ffi::c_char>()];
            let api = gst::ffi::gst_meta_api_type_register(c"GstVlmFrameMetaAPI".as_ptr(), tags.as_mut_ptr());
            Info(gst::ffi::gst_meta_register(
                api,
                c"GstVlmFrameMeta".as_ptr(),
                std::mem::size_of::<VlmFrameMeta>(),
                Some(init),
                Some(free),
                Some(transform),
            ))
        }
    })
    .0
}

/// Name of the custom meta (`GstCustomMeta`) that names an answer's question, on two kinds of
/// buffer:
///
/// - every `vlmquery` text buffer (`src`): `id`, `stream` and `status` (`answered`, `cancelled`,
///   `failed`, or `partial` for the answer so far, streamed with `stream-tokens`);
/// - the video buffers leaving `video_src`: each answered or failed question's answer rides on the
///   first video buffer that leaves after its `vlm-answer` message and carries no other answer
///   (one answer per buffer, in question order): `id`, `stream`, `status` (`answered` or
///   `failed`), `text` (the answer, as in `vlm-answer`; empty when failed) and, unless answered
///   with text, `reason`.
///
/// Applications read it with `gst_buffer_get_custom_meta (buffer, "VlmAnswerMeta")` and its
/// structure (Python: `buffer.get_custom_meta("VlmAnswerMeta").get_structure()`; Rust:
/// [`answer_of`]).
pub const ANSWER_META: &str = "VlmAnswerMeta";

/// Register [`ANSWER_META`] (once, at plugin load).
pub fn register_answer_meta() {
    if !gst::meta::CustomMeta::is_registered(ANSWER_META) {
        gst::meta::CustomMeta::register(ANSWER_META, &[]);
    }
}

/// Tag an answer buffer with its question.
pub fn add_answer_meta(buffer: &mut gst::BufferRef, id: &str, stream: &str, status: &str) {
    if let Ok(mut meta) = gst::meta::CustomMeta::add(buffer, ANSWER_META) {
        let s = meta.mut_structure();
        s.set("id", id);
        s.set("stream", stream);
        s.set("status", status);
    }
}

/// Attach an answer (`id`, `stream`, `status`, `text`, maybe `reason`: the fields of `answer`,
/// whatever its name) to a video buffer.
pub fn add_video_answer_meta(buffer: &mut gst::BufferRef, answer: &gst::StructureRef) {
    if let Ok(mut meta) = gst::meta::CustomMeta::add(buffer, ANSWER_META) {
        let s = meta.mut_structure();
        for (name, value) in answer.iter() {
            s.set_value(name, value.clone());
        }
    }
}

/// The answer a buffer carries (a copy of [`ANSWER_META`]'s structure), if any.
pub fn answer_of(buffer: &gst::BufferRef) -> Option<gst::Structure> {
    gst::meta::CustomMeta::from_buffer(buffer, ANSWER_META).ok().map(|m| m.structure().to_owned())
}

/// Name of the custom meta (`GstCustomMeta`) with a stream's alert states (`vlmquery alerts`) on
/// the video buffers leaving `video_src`: the states reported (`vlm-alert`) for the buffer's
/// stream when it leaves, once the stream has one: `stream` (its name) and, one entry per alert
/// in the same order, `ids` (strings), `states` (booleans), `probabilities` (doubles: P(yes) of
/// the evaluation that decided the state) and `frames` (uint64: the frame that decided it).
/// Python: `buffer.get_custom_meta("VlmAlertMeta").get_structure()`; Rust: [`alerts_of`].
pub const ALERT_META: &str = "VlmAlertMeta";

/// Register [`ALERT_META`] (once, at plugin load).
pub fn register_alert_meta() {
    if !gst::meta::CustomMeta::is_registered(ALERT_META) {
        gst::meta::CustomMeta::register(ALERT_META, &[]);
    }
}

/// The alert states a video buffer carries (a copy of [`ALERT_META`]'s structure), if any.
pub fn alerts_of(buffer: &gst::BufferRef) -> Option<gst::Structure> {
    gst::meta::CustomMeta::from_buffer(buffer, ALERT_META).ok().map(|m| m.structure().to_owned())
}
