//! Loading the engines of `vlmcontext`: started on a worker thread at NULL→READY, made the
//! element's at READY→PAUSED (asynchronously inside a bin), dropped at PAUSED→READY; a load
//! still running at READY→NULL is abandoned.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gst::prelude::*;
use gst::subclass::prelude::*;
use vlm_runtime::prompt::Prompt;
use vlm_runtime::snapshot::PrefixCache;
use vlm_runtime::{DEFAULT_ANSWER_RESERVE, Engine, EngineConfig, Error, Gpu, KvLayout, KvType, models};

use super::{CAT, KvLayoutKind, KvTypeKind, Settings, State, VlmContext};

/// A load of the engines running on its own thread (see `VlmContext::preload`).
pub(super) struct Loading {
    settings: Settings,
    handle: std::thread::JoinHandle<Loaded>,
    cancel: Arc<AtomicBool>,
}

/// Engines and prompt loaded for some settings.
pub(super) type Loaded = Result<(Vec<Arc<Engine>>, Arc<Prompt>), gst::ErrorMessage>;

/// The KV layout and flash attention the engines get: `kv-layout=auto` is
/// [`KvLayout::auto`] for the engines and the streams the load sizes (the unified pool on CPU
/// engines, and on a GPU for at most two streams; per-sequence KV for more streams on a GPU,
/// where every sequence's attention in the pool would span the cells of all streams, and with a
/// remote engine). `flash-attention` unset is on with the unified pool (its compute buffer is
/// what keeps the pool small) and on a GPU; a quantized `kv-type` needs it (llama.cpp quantizes V
/// only with flash attention).
fn resolved(s: &Settings) -> (KvLayout, bool) {
    let devices = vlm_runtime::engine_spec::devices(&s.engines).unwrap_or_default();
    let off_cpu = devices.iter().any(|d| *d != vlm_runtime::engine_spec::SpecDevice::Cpu);
    let layout = match s.kv_layout {
        KvLayoutKind::PerSequence => KvLayout::PerSequence,
        KvLayoutKind::Unified => KvLayout::Unified,
        KvLayoutKind::Auto => KvLayout::auto(&devices, s.max_streams),
    };
    let flash = if s.flash_attention_set { s.flash_attention } else { layout == KvLayout::Unified || off_cpu };
    (layout, flash || s.kv_type != KvTypeKind::F16)
}

impl VlmContext {
    /// Start loading the engines on a worker thread (at NULL→READY), so an application that
    /// goes to READY early finds them loaded when it starts streaming.
    pub(super) fn preload(&self) {
        let s = self.load_settings();
        if s.model.is_empty() {
            return;
        }
        let this = self.ref_counted();
        let settings = s.clone();
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cancel);
        let before = std::mem::take(&mut *self.abandoned.lock());
        let load = move || {
            // (What an abandoned load holds is freed before this one allocates.)
            for handle in before {
                let _ = handle.join();
            }
            this.load(&settings, &flag)
        };
        match std::thread::Builder::new().name("vlmcontext-load".into()).spawn(load) {
            Ok(handle) => *self.loading.lock() = Some(Loading { settings: s, handle, cancel }),
            Err(e) => gst::warning!(CAT, imp = self, "cannot start the loading thread: {e}; loading at READY->PAUSED"),
        }
    }

    /// The settings a load uses: `max-streams`, unset, raised to the sink pads requested by
    /// then (a third camera on default settings works; a pad requested after the load finds
    /// the streams the load sized).
    fn load_settings(&self) -> Settings {
        let mut s = self.settings.lock().clone();
        if !s.max_streams_set {
            s.max_streams = s.max_streams.max(self.pads.lock().len().min(64) as u32);
        }
        s
    }

    /// Abandon a load still running, without waiting for it: its engines stop their
    /// calibration run at its next computation and are dropped on the loading thread.
    pub(super) fn abandon_preload(&self) {
        if let Some(loading) = self.loading.lock().take() {
            self.abandon(loading);
        }
    }

    fn abandon(&self, loading: Loading) {
        loading.cancel.store(true, Ordering::Release);
        let mut abandoned = self.abandoned.lock();
        abandoned.retain(|h| !h.is_finished());
        abandoned.push(loading.handle);
    }

    /// READY→PAUSED: with the engines loaded (or their load failed) at once, finish now;
    /// otherwise finish asynchronously once the load started at NULL→READY ends, so that an
    /// application's NULL→PLAYING never blocks its main loop (ASYNC_START now, ASYNC_DONE then,
    /// as a sink that prerolls does).
    pub(super) fn start(&self) -> Result<gst::StateChangeSuccess, gst::ErrorMessage> {
        let current = self.load_settings();
        let mut preloaded = self.loading.lock().take();
        if let Some(stale) = preloaded.take_if(|l| l.settings != current) {
            self.abandon(stale);
        }
        if preloaded.is_none() {
            // Nothing loading with these settings (set after NULL→READY): start it now.
            self.preload();
            preloaded = self.loading.lock().take();
        }
        // Asynchronous only inside a bin, which completes the pipeline's state on ASYNC_DONE; a
        // lone element (a test harness, which requires a synchronous change) waits for the load.
        let in_bin = self.obj().parent().is_some();
        let loading = match preloaded {
            Some(l) if in_bin && !l.handle.is_finished() => l,
            done => {
                self.install(self.take_loaded(done)?);
                return Ok(gst::StateChangeSuccess::Success);
            }
        };
        // A stop meanwhile cancels the load (its calibration) and its completion.
        let abandon = Arc::clone(&loading.cancel);
        {
            let mut st = self.state.lock();
            st.loading = true;
            st.abandon = Arc::clone(&abandon);
        }
        let this = self.ref_counted();
        let finish = move || {
            let loaded = this.take_loaded(Some(loading));
            let obj = this.obj();
            // The waiting streams wake when `loading` ends: the engines installed, or the error
            // posted first (theirs, "not started", must not come before it).
            if loaded.is_ok() {
                this.ensure_prefix_cache();
            }
            // The completion runs under the element's state lock, as continue_state and
            // abort_state require, with the abandon check made under it: an application's
            // PAUSED→READY either ran before (abandoned: nothing to complete) or waits for it.
            let _state_lock = StateLock::new(obj.upcast_ref());
            if abandon.load(Ordering::Acquire) {
                return; // stopped meanwhile: `stop` has reset the state
            }
            match loaded {
                Ok((engines, prompt)) => {
                    let mut st = this.state.lock();
                    (st.engines, st.prompt, st.loading) = (engines, Some(prompt), false);
                    drop(st);
                    this.loaded.notify_all();
                    let _ = obj.continue_state(gst::StateChangeSuccess::Success);
                    let _ = obj.post_message(gst::message::AsyncDone::builder().src(&*obj).build());
                }
                Err(e) => {
                    this.post_error_message(e);
                    this.state.lock().loading = false;
                    this.loaded.notify_all();
                    obj.abort_state();
                }
            }
        };
        // ASYNC_START goes out before the thread that posts ASYNC_DONE starts: a load that ends
        // at once must not complete before the bin knows it is waiting for it.
        let _ = self.obj().post_message(gst::message::AsyncStart::builder().src(&*self.obj()).build());
        if let Err(e) = std::thread::Builder::new().name("vlmcontext-start".into()).spawn(finish) {
            self.state.lock().loading = false;
            self.loaded.notify_all();
            let _ = self.obj().post_message(gst::message::AsyncDone::builder().src(&*self.obj()).build());
            return Err(gst::error_msg!(gst::CoreError::StateChange, ["cannot start the loading thread: {}", e]));
        }
        Ok(gst::StateChangeSuccess::Async)
    }

    /// The engines of `loading` (waiting for it to end: `start` chose it with the settings of
    /// READY→PAUSED, and pads requested since find the streams it sized), else loaded now.
    fn take_loaded(&self, loading: Option<Loading>) -> Loaded {
        match loading {
            Some(l) => l
                .handle
                .join()
                .unwrap_or_else(|_| Err(gst::error_msg!(gst::CoreError::StateChange, ["the loading thread panicked"]))),
            None => self.load(&self.load_settings(), &Arc::new(AtomicBool::new(false))),
        }
    }

    /// Make loaded engines the element's.
    fn install(&self, (engines, prompt): (Vec<Arc<Engine>>, Arc<Prompt>)) {
        self.ensure_prefix_cache();
        let mut st = self.state.lock();
        st.engines = engines;
        st.prompt = Some(prompt);
    }

    /// The prefix cache, made again when its limits changed.
    fn ensure_prefix_cache(&self) {
        let s = self.settings.lock().clone();
        let mut cache = self.prefix_cache.lock();
        let limits = (s.prefix_cache_entries as usize, s.prefix_cache_size as usize);
        if cache.as_ref().is_none_or(|c| c.limits() != limits) {
            *cache = Some(Arc::new(PrefixCache::new(limits.0, limits.1)));
        }
    }

    /// Load the model on every engine `s` names, with `Progress` messages; `cancel` abandons it.
    fn load(&self, s: &Settings, cancel: &Arc<AtomicBool>) -> Loaded {
        // The message names the cause (the file, the property); the debug text the details.
        let fail = |e: Error| {
            if !matches!(e, Error::Cancelled) {
                self.progress(gst::ProgressType::Error, &format!("loading {} failed", s.model));
            }
            match e {
                Error::File { .. } => {
                    gst::error_msg!(gst::ResourceError::OpenRead, ("{}", e), ["vlmcontext model={}", s.model])
                }
                Error::Config(_) => gst::error_msg!(
                    gst::ResourceError::Settings,
                    ("{}", e),
                    [
                        "vlmcontext model={} engines={} gpu-device={} gpu-layers={} context-size={}",
                        s.model,
                        s.engines,
                        s.gpu_device,
                        s.gpu_layers,
                        s.context_size
                    ]
                ),
                e => gst::error_msg!(gst::ResourceError::Failed, ("{}", e), ["vlmcontext model={}", s.model]),
            }
        };
        self.progress(gst::ProgressType::Start, &format!("loading {} ({} engines)", s.model, s.engines));
        let (kv_layout, flash_attention) = resolved(s);
        gst::info!(
            CAT,
            imp = self,
            "KV layout {} (kv-layout={:?}), flash attention {}, {} streams{}",
            kv_layout.name(),
            s.kv_layout,
            if flash_attention { "on" } else { "off" },
            s.max_streams,
            if s.max_streams_set { "" } else { " (max-streams unset: the sink pads requested, at least 2)" }
        );
        let base = EngineConfig {
            threads: s.threads as i32,
            context_per_sequence: s.context_size,
            max_streams: s.max_streams,
            max_branches: s.max_answers,
            flash_attention,
            gpu: Gpu { index: s.gpu_device as usize, layers: u32::try_from(s.gpu_layers).ok() },
            kv_layout,
            kv_type: match s.kv_type {
                KvTypeKind::F16 => KvType::F16,
                KvTypeKind::Q8_0 => KvType::Q8_0,
                KvTypeKind::Q4_0 => KvType::Q4_0,
            },
            answer_cells: DEFAULT_ANSWER_RESERVE as u32,
            step_budget_ms: s.step_budget_ms,
            ingest_share: s.ingest_share,
            encode_first: s.encode_first,
            ..EngineConfig::default()
        };
        let mut engines = vec![];
        for config in EngineConfig::parse_list(&s.engines, &base).map_err(fail)? {
            if cancel.load(Ordering::Acquire) {
                return Err(fail(Error::Cancelled));
            }
            let engine = Engine::start_cancellable(&PathBuf::from(&s.model), config, cancel).map_err(fail)?;
            gst::info!(
                CAT,
                imp = self,
                "engine {} ready: {} ({} owners of its weights), {} cells per sequence, rates {:?}",
                engine.name(),
                s.model,
                models::model_owners(&PathBuf::from(&s.model)),
                engine.n_ctx_per_seq(),
                engine.rates()
            );
            engines.push(engine);
        }
        let prompt = Prompt::new(engines[0].model(), &s.system_prompt)
            .map_err(|e| gst::error_msg!(gst::LibraryError::Settings, ("{}", e), ["vlmcontext model={}", s.model]))?;
        if !engines[0].model().has_chat_template() {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Settings,
                ("{} has no chat template: questions are laid out in ChatML, as llama.cpp does", s.model)
            );
        }
        self.progress(gst::ProgressType::Complete, &format!("{} loaded", s.model));
        Ok((engines, Arc::new(prompt)))
    }

    /// A `Progress` message about model loading.
    fn progress(&self, kind: gst::ProgressType, text: &str) {
        let msg = gst::message::Progress::builder(kind, "load-model", text).src(&*self.obj()).build();
        let _ = self.obj().post_message(msg);
    }

    pub(super) fn stop(&self) {
        // (Streams opening now are opened and closed here, or see `cancel` and do not open.)
        let _opening = self.opening.lock();
        for pads in self.pads.lock().iter() {
            pads.stopped.store(true, Ordering::SeqCst);
            pads.cancel.store(true, Ordering::SeqCst);
            pads.refused.store(false, Ordering::Release);
            if let Some(s) = pads.stream.lock().take() {
                s.close();
            }
        }
        // Streams still referenced downstream (by pending questions) keep the engine alive; an
        // asynchronous start still loading is abandoned.
        let mut st = self.state.lock();
        st.abandon.store(true, Ordering::Release);
        *st = State::default();
        drop(st);
        self.loaded.notify_all();
    }
}

/// The element's state lock (`GST_STATE_LOCK`, a recursive mutex that `gst_element_set_state`
/// holds through a state change), held while this guard lives; gstreamer-rs has no safe call.
struct StateLock<'a>(&'a gst::Element);

impl<'a> StateLock<'a> {
    fn new(element: &'a gst::Element) -> Self {
        use glib::translate::ToGlibPtr;
        let ptr: *mut gst::ffi::GstElement = element.to_glib_none().0;
        // SAFETY: `state_lock` is the GRecMutex GstElement initialises for each instance, and
        // `element` is alive for the guard's lifetime; the guard unlocks it once, on this thread.
        unsafe { glib::ffi::g_rec_mutex_lock(std::ptr::addr_of_mut!((*ptr).state_lock)) };
        Self(element)
    }
}

impl Drop for StateLock<'_> {
    fn drop(&mut self) {
        use glib::translate::ToGlibPtr;
        let ptr: *mut gst::ffi::GstElement = self.0.to_glib_none().0;
        // SAFETY: locked by `new` on this thread and not yet unlocked.
        unsafe { glib::ffi::g_rec_mutex_unlock(std::ptr::addr_of_mut!((*ptr).state_lock)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_the_unified_pool_on_cpu_engines_and_for_few_streams_on_a_gpu() {
        let with = |engines: &str, kv_layout| Settings { engines: engines.into(), kv_layout, ..Settings::default() };
        assert_eq!(resolved(&with("cpu", KvLayoutKind::Auto)), (KvLayout::Unified, true));
        assert_eq!(resolved(&with("big:cpu:4,little:cpu:2", KvLayoutKind::Auto)), (KvLayout::Unified, true));
        // The default two streams on a GPU: the pool; more: per-sequence KV.
        assert_eq!(resolved(&with("cpu,gpu", KvLayoutKind::Auto)), (KvLayout::Unified, true));
        let many = Settings { max_streams: 3, ..with("cpu,gpu", KvLayoutKind::Auto) };
        assert_eq!(resolved(&many), (KvLayout::PerSequence, true));
        assert_eq!(resolved(&with("cpu,far:rpc:10.0.0.2:50052", KvLayoutKind::Auto)), (KvLayout::PerSequence, true));
        // Set, a layout is kept; flash attention unset follows the layout and the devices.
        assert_eq!(resolved(&with("gpu", KvLayoutKind::Unified)), (KvLayout::Unified, true));
        assert_eq!(resolved(&with("cpu", KvLayoutKind::PerSequence)), (KvLayout::PerSequence, false));
        let set_off = Settings { flash_attention_set: true, flash_attention: false, ..with("gpu", KvLayoutKind::Auto) };
        assert_eq!(resolved(&set_off), (KvLayout::Unified, false));
    }
}
