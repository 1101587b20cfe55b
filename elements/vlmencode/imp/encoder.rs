//! The vision encoder of `vlmencode`: the projector, loaded on a thread of its own (the
//! encoding task waits for it, a `leaky` element lets frames pass meanwhile), the language model
//! asked of downstream when `model` is unset; each due frame encoded (or taken from the cache)
//! and its embeddings attached as meta.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gst::prelude::*;
use gst::subclass::prelude::*;
use vlm_runtime::encoder::{EncoderBackend, FrameEncoder, TileReuse, open_encoder};
use vlm_runtime::llama::Turn;
use vlm_runtime::{Device, models};

use super::{Backend, CAT, Due, TileReuseKind, VlmEncode, pixel_format};
use crate::events::{DemandQuery, ModelQuery};
use crate::meta::VlmFrameMeta;

impl VlmEncode {
    /// Load the projector, asking downstream for the language model when `model` is unset. A
    /// load that a stop and a new start overtook (a `leaky` one, on its own thread) is not kept:
    /// the new run loads with its own settings.
    fn encoder(&self) -> Result<Arc<FrameEncoder>, gst::ErrorMessage> {
        if let Some(e) = self.state.lock().encoder.clone() {
            return Ok(e);
        }
        let _loading = self.load.lock();
        let run = self.runs.load(Ordering::Acquire);
        if let Some(e) = self.state.lock().encoder.clone() {
            return Ok(e); // loaded meanwhile by the other loader
        }
        let settings = self.settings.lock().clone();
        let model_path = if settings.model.is_empty() {
            let mut q = ModelQuery::query();
            let srcpad = self.obj().static_pad("src").expect("src pad");
            srcpad.peer_query(&mut q);
            ModelQuery::model(&q).ok_or_else(|| {
                gst::error_msg!(
                    gst::LibraryError::Settings,
                    ("No language model: set vlmencode's 'model' property or link it to a vlmcontext with 'model' set"),
                    ["vlmencode model is empty and no downstream element answered the vlm-model query"]
                )
            })?
        } else {
            settings.model.clone()
        };
        // The message names the cause (the file); the debug text the element's settings.
        let fail = |e: vlm_runtime::Error| {
            gst::error_msg!(
                gst::ResourceError::OpenRead,
                ("{}", e),
                ["vlmencode mmproj={} model={} backend={:?}", settings.mmproj, model_path, settings.backend]
            )
        };
        // The projector needs the model's vocabulary and width only: bind it to the copy the
        // engines loaded (on the GPU when every engine is there), or load one on the CPU.
        let model = match models::any_loaded(&PathBuf::from(&model_path)) {
            Some(model) => model,
            None => models::model(&PathBuf::from(&model_path), &Device::Cpu).map_err(fail)?,
        };
        let backend = match settings.backend {
            Backend::Auto => EncoderBackend::Auto,
            Backend::Cpu => EncoderBackend::Cpu,
            Backend::Gpu => EncoderBackend::Gpu,
            Backend::Rknn => EncoderBackend::Rknn,
        };
        let rknn_model = (!settings.rknn_model.is_empty()).then(|| PathBuf::from(&settings.rknn_model));
        let choice = open_encoder(
            backend,
            &PathBuf::from(&settings.mmproj),
            rknn_model.as_deref(),
            &model,
            settings.threads as i32,
            settings.contexts as usize,
        )
        .map_err(fail)?;
        if let Some(why) = &choice.fallback {
            gst::info!(CAT, imp = self, "NPU unavailable ({why}): falling back to {}", choice.backend);
            let _ = self.obj().post_message(
                gst::message::Info::builder(
                    gst::LibraryError::Init,
                    &format!("vlmencode: NPU unavailable, using {}", choice.backend),
                )
                .debug(why)
                .src(&*self.obj())
                .build(),
            );
        }
        gst::info!(
            CAT,
            imp = self,
            "{} vision encoder loaded for {} ({} encoder contexts, encoder-contexts={})",
            choice.backend,
            model_path,
            choice.encoder.contexts(),
            settings.contexts
        );
        let encoder =
            Arc::new(FrameEncoder::new(choice.encoder, settings.cache_entries as usize, settings.cache_bytes as usize));
        let mut state = self.state.lock();
        if self.runs.load(Ordering::Acquire) == run {
            state.backend = choice.backend;
            state.encoder = Some(Arc::clone(&encoder));
        }
        Ok(encoder)
    }

    /// Whether the projector is loaded; if not, start loading it on a thread of its own (once).
    /// A failure is posted and fails the stream.
    pub(super) fn encoder_ready(&self) -> bool {
        let mut state = self.state.lock();
        if state.encoder.is_some() {
            return true;
        }
        if !state.loading {
            state.loading = true;
            let this = self.ref_counted();
            let run = self.runs.load(Ordering::Acquire);
            let load = move || {
                // (A panic in the load is a failed load: the frames waiting for it must hear.)
                let loaded =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| this.encoder())).unwrap_or_else(|_| {
                        Err(gst::error_msg!(gst::LibraryError::Init, ["the projector's load panicked"]))
                    });
                if this.runs.load(Ordering::Acquire) != run {
                    return; // stopped and started again meanwhile: that run loads its own
                }
                this.state.lock().loading = false;
                if let Err(e) = loaded {
                    this.post_error_message(e);
                    this.queue.lock().flow = Some(gst::FlowError::Error);
                }
                // (A frame waiting for it on the encoding task: `wait_encoder`.)
                let _q = this.queue.lock();
                this.changed.notify_all();
            };
            if let Err(e) = std::thread::Builder::new().name("vlmencode-load".into()).spawn(load) {
                gst::warning!(CAT, imp = self, "cannot start the loading thread: {e}; loading on the encoding task");
                state.loading = false;
                return true;
            }
        }
        false
    }

    /// The projector for a due frame, on the encoding task: loaded on a thread of its own while
    /// the task waits, so that a flush or a stop meanwhile ends the wait at once (the task's
    /// iteration returns `Flushing`; the load goes on, and is dropped if a stop overtook it).
    fn wait_encoder(&self) -> Result<Arc<FrameEncoder>, gst::FlowError> {
        let mut q = self.queue.lock();
        loop {
            if let Some(e) = self.state.lock().encoder.clone() {
                return Ok(e);
            }
            if q.flushing {
                return Err(gst::FlowError::Flushing);
            }
            if let Some(flow) = q.flow {
                return Err(flow); // the load failed (and said so)
            }
            if self.encoder_ready() {
                // (No thread for it: loaded here.)
                drop(q);
                return self.encoder().map_err(|e| {
                    self.post_error_message(e);
                    gst::FlowError::Error
                });
            }
            self.changed.wait(&mut q);
        }
    }

    /// A frame that cannot be read (a buffer smaller than its caps or meta say, a picture the
    /// projector refuses): as GstVideoFilter treats an invalid buffer, a warning (for the first
    /// and every 100th) and the frame goes on, without embeddings (`frames-skipped`); the
    /// stream and the next frames are not its fault. The gate then encodes the next due frame.
    fn unreadable(&self, why: &str) -> Result<(), gst::FlowError> {
        let n = {
            let mut st = self.stats.lock();
            st.skipped += 1;
            st.unreadable += 1;
            st.unreadable
        };
        self.reset_gate();
        if n == 1 || n.is_multiple_of(100) {
            gst::element_imp_warning!(
                self,
                gst::StreamError::Format,
                ("frame not encoded ({n} so far): {why}; it passes without embeddings")
            );
        }
        Ok(())
    }

    /// The demand of the stream these frames feed, asked downstream (`vlm-demand`) at each
    /// encode (the pad's stream may have closed and another opened): while a reader waits on
    /// it, this element's encodes go first.
    fn demand(&self) -> Option<vlm_runtime::llama::Demand> {
        let mut q = DemandQuery::query();
        if !self.obj().static_pad("src").expect("src pad").peer_query(&mut q) {
            return None;
        }
        DemandQuery::demand(&q)
    }

    /// Encode one frame (or take it from the cache, or some of its tiles from the frame before)
    /// and attach the embeddings.
    pub(super) fn encode(&self, buffer: &mut gst::Buffer, due: &Due) -> Result<(), gst::FlowError> {
        let info = &due.info;
        let encoder = self.wait_encoder()?;
        let format = pixel_format(info).ok_or(gst::FlowError::NotNegotiated)?;
        let started = Instant::now();
        let reuse = match (self.settings.lock().tile_reuse, &due.luma) {
            (TileReuseKind::Off, _) | (TileReuseKind::Threshold, None) => TileReuse::Off,
            // A refresh (`max-unchanged`) takes only identical tiles.
            (TileReuseKind::Exact, _) | (TileReuseKind::Threshold, Some(_)) if due.refresh => TileReuse::Exact,
            (TileReuseKind::Exact, _) => TileReuse::Exact,
            (TileReuseKind::Threshold, Some(luma)) => TileReuse::Unchanged(luma),
        };
        let encoded = {
            let vframe = match super::map_frame(buffer.as_ref(), info) {
                Ok(vframe) => vframe,
                Err(why) => return self.unreadable(&why),
            };
            let demand = self.demand();
            let flushing = || self.flushing.load(std::sync::atomic::Ordering::Acquire);
            // (A refresh the last encoded frame stands for goes after the other encodes.)
            let turn = Turn { demand: demand.as_ref(), cancelled: Some(&flushing), background: due.stands };
            match encoder.encode_reusing(&super::picture(&vframe, info, format), reuse, turn) {
                Ok(encoded) => encoded,
                Err(vlm_runtime::Error::Cancelled) => return Err(gst::FlowError::Flushing),
                Err(e @ vlm_runtime::Error::BadInput(_)) => return self.unreadable(&e.to_string()),
                Err(e) => {
                    gst::element_imp_error!(self, gst::StreamError::Decode, ("vision encoding failed: {}", e));
                    return Err(gst::FlowError::Error);
                }
            }
        };
        let (frame, hit, tiles) = (encoded.frame, encoded.hit, encoded.tiles);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        gst::debug!(
            CAT,
            imp = self,
            "frame {:?}: {} in {:.1} ms ({} images encoded on {} contexts, {} reused; prepared in {:.1} ms, \
             {:.1} ms waiting for a context, {:.1} ms encoding)",
            buffer.pts(),
            if hit { "cache hit" } else { "encoded" },
            ms,
            tiles.encoded,
            tiles.contexts,
            tiles.reused,
            tiles.prepare_ms,
            tiles.wait_ms,
            tiles.encode_ms
        );
        if !hit && tiles.tiles.len() <= 1 && !matches!(reuse, TileReuse::Off) && !self.state.lock().untiled_said {
            self.state.lock().untiled_said = true;
            gst::info!(
                CAT,
                imp = self,
                "the projector encodes a frame as one image: tile-reuse has no tiles to reuse, the change gate works on whole frames"
            );
        }
        VlmFrameMeta::add(buffer.make_mut(), frame);
        if !hit {
            let mut st = self.stats.lock();
            st.encoded += 1;
            st.tiles_encoded += tiles.encoded as u64;
            st.tiles_reused += tiles.reused as u64;
            st.encode_ms_total += ms;
            st.prepare_ms_total += tiles.prepare_ms;
            st.wait_ms_total += tiles.wait_ms;
            // Frames leave an encoding later: a live pipeline must know, or its sinks drop them.
            // Grown by a quarter or more, the latency is reported again. (A refresh waits behind
            // every other encode on purpose: not a delay of the frames that matter.)
            let grown = !due.stands && ms > st.slowest_ms * 1.25;
            if !due.stands {
                st.slowest_ms = st.slowest_ms.max(ms);
            }
            drop(st);
            if grown {
                gst::debug!(CAT, imp = self, "latency now {ms:.1} ms (slowest encoding)");
                let _ = self.obj().post_message(gst::message::Latency::builder().src(&*self.obj()).build());
            }
        }
        Ok(())
    }
}
