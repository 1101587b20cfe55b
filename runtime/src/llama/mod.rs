//! The small safe layer over `llama-cpp-sys-2`.
//!
//! llama-cpp-2 keeps its raw `llama_model`/`llama_context`/`mtmd_context` pointers crate-private
//! and has no safe call for `mtmd_get_output_embd` or `mtmd_helper_decode_image_chunk`, which the
//! split between vision encoding (`vlmencode`) and language prefill (`vlmcontext`) needs. So the
//! model, the context and the projector are driven through the sys crate here, and every `unsafe`
//! of the project lives in this module (`runtime/src/llama/`), each with the invariant it relies
//! on:
//!
//! - this file: llama.cpp's log routing and backend init, the worker-thread registry that stops
//!   engine threads before llama.cpp's static destructors, [`Device`], GPU lookup, core pinning;
//! - `model`: [`Model`] (weights, vocabulary, chat template) and [`check_readable`];
//! - `batch`: [`Batch`], a llama.cpp batch of tokens or embedding rows;
//! - `context`: [`KvType`], [`ContextParams`] and [`Context`] (KV memory, decode, snapshots);
//! - `mtmd`: libmtmd's [`Projector`] and what it encodes ([`ImageEmbeddings`], [`Segment`]);
//! - `cut`: a tiled picture cut into its tiles, each prepared by libmtmd on its own;
//! - `rpc`: llama.cpp's RPC backend (devices on `rpc-server`s) and containing its failures;
//! - `reference` (feature `reference`): plain libmtmd for the family checks (tests and an
//!   example), not the runtime; not in the default library.

use std::ffi::{CStr, c_char, c_void};
use std::ptr::null_mut;
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;
use parking_lot::{Mutex, RwLock};

use crate::error::{Error, Result};

pub mod arenas;
mod batch;
mod context;
mod cut;
mod gguf;
mod kv_pages;
mod model;
mod mtmd;
/// The plain-libmtmd reference the family checks compare the runtime with (the family test and
/// example); not used by the runtime, so only built with the `reference` feature, which the
/// runtime's own tests and examples turn on (a dev-dependency of the crate on itself).
#[cfg(feature = "reference")]
#[doc(hidden)]
pub mod reference;
mod resample;
pub(crate) mod rpc;
mod token_rows;

pub use batch::Batch;
pub use context::{Context, ContextParams, KvType};
pub use gguf::{projector_type, projector_type_non_causal};
pub use model::{FileId, Model, check_readable};
pub use mtmd::{
    Demand, ImageEmbeddings, MAX_ENCODER_CONTEXTS, Projector, ProjectorKey, Segment, Tile, TileCount, Turn,
    set_projector_flash_attention,
};

/// A token id of the language model's vocabulary.
pub type Token = i32;

/// Severity of a line logged by llama.cpp / libmtmd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

type LogSink = Box<dyn Fn(LogLevel, &str) + Send + Sync>;
static LOG_SINK: RwLock<Option<LogSink>> = RwLock::new(None);

/// Route llama.cpp's and libmtmd's own log lines to `sink` (by default they are dropped, so a
/// pipeline's console is not flooded). The GStreamer elements install a debug category here.
pub fn set_log_sink(sink: impl Fn(LogLevel, &str) + Send + Sync + 'static) {
    *LOG_SINK.write() = Some(Box::new(sink));
}

unsafe extern "C" fn log_callback(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for the duration of the call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let level = match level {
        sys::GGML_LOG_LEVEL_ERROR => LogLevel::Error,
        sys::GGML_LOG_LEVEL_WARN => LogLevel::Warn,
        sys::GGML_LOG_LEVEL_INFO => LogLevel::Info,
        _ => LogLevel::Debug,
    };
    if level == LogLevel::Error {
        // The first line is the cause; what follows reports the failure up the stack.
        let first = LAST_ERROR.take().unwrap_or_else(|| text.split_whitespace().collect::<Vec<_>>().join(" "));
        LAST_ERROR.set(Some(first));
    }
    if let Some(sink) = LOG_SINK.read().as_ref() {
        sink(level, text.trim_end());
    }
}

thread_local! {
    /// The first error llama.cpp logged on this thread since [`clear_last_error`]: its reason for
    /// a failed call, which it logs rather than returns.
    static LAST_ERROR: std::cell::Cell<Option<String>> = const { std::cell::Cell::new(None) };
}

/// Forget the error llama.cpp last logged on this thread (before a call whose failure should
/// name its own reason).
pub(crate) fn clear_last_error() {
    LAST_ERROR.set(None);
}

/// The first error llama.cpp logged on this thread since [`clear_last_error`], as `": why"`,
/// or nothing.
pub(crate) fn last_error() -> String {
    LAST_ERROR.take().map(|why| format!(": {why}")).unwrap_or_default()
}

/// Threads that run llama.cpp work (engine threads), and whether the process is exiting.
static WORKERS: (Mutex<usize>, parking_lot::Condvar) = (Mutex::new(0), parking_lot::Condvar::new());
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Held by a thread that runs llama.cpp work, for its whole life (drop it last, after the
/// contexts it used are freed).
pub(crate) struct WorkerThread(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl WorkerThread {
    pub(crate) fn register() -> WorkerThread {
        *WORKERS.0.lock() += 1;
        WorkerThread(Default::default())
    }

    /// Releases this registration from another thread, for a thread that will never end (stuck
    /// on a failed RPC server): the exit hook then does not wait for it.
    pub(crate) fn releaser(&self) -> impl Fn() + Send + Sync + 'static {
        let released = std::sync::Arc::clone(&self.0);
        move || release(&released)
    }
}

fn release(released: &std::sync::atomic::AtomicBool) {
    if !released.swap(true, std::sync::atomic::Ordering::AcqRel) {
        *WORKERS.0.lock() -= 1;
        WORKERS.1.notify_all();
    }
}

impl Drop for WorkerThread {
    fn drop(&mut self) {
        release(&self.0);
    }
}

/// Whether the process is exiting: worker threads stop taking work and free their contexts.
pub(crate) fn exiting() -> bool {
    EXITING.load(std::sync::atomic::Ordering::Acquire)
}

/// At process exit, before llama.cpp's static objects are destroyed: stop the worker threads and
/// wait (a bounded time) until they have freed their contexts, so that no computation or free
/// races those destructors. (Engines kept alive by queued work may outlive their users.)
extern "C" fn stop_workers_at_exit() {
    EXITING.store(true, std::sync::atomic::Ordering::Release);
    // (One bound for every registration of this handler.)
    static DEADLINE: OnceLock<std::time::Instant> = OnceLock::new();
    let deadline = *DEADLINE.get_or_init(|| std::time::Instant::now() + std::time::Duration::from_secs(30));
    let mut live = WORKERS.0.lock();
    while *live > 0 && !WORKERS.1.wait_until(&mut live, deadline).timed_out() {}
}

/// Send a line of the runtime's own to the same sink as llama.cpp's log.
pub(crate) fn log(level: LogLevel, line: &str) {
    if let Some(sink) = LOG_SINK.read().as_ref() {
        sink(level, line);
    }
}

/// Initialise llama.cpp's backends once per process and install the log router.
pub fn init_backend() {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: called once (OnceLock) before any other llama.cpp call of this crate; the
        // callback is a plain function that stays valid for the life of the process.
        unsafe {
            sys::llama_log_set(Some(log_callback), null_mut());
            sys::mtmd_log_set(Some(log_callback), null_mut());
            sys::mtmd_helper_log_set(Some(log_callback), null_mut());
            sys::llama_backend_init();
        }
        if !kv_pages::lazy_zero_cpu_buffers() {
            log(LogLevel::Warn, "the CPU buffer type's layout is not the one expected: KV buffers stay resident");
        }
        arenas::limit_once();
    });
}

/// Make sure worker threads are stopped before llama.cpp's static objects are destroyed at
/// exit. Called by each engine thread after its first computation, when the lazily built
/// statics of the backends it uses (`device`: its kind) exist: exit handlers run in reverse
/// order of registration, so this one runs before their destructors. Registered once a device
/// kind (later engines on it build no new statics; an application that starts engines again
/// and again does not grow the process's exit handlers).
pub(crate) fn stop_workers_before_exit(device: &str) {
    static REGISTERED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut registered = REGISTERED.lock();
    if registered.iter().any(|d| d == device) {
        return;
    }
    registered.push(device.to_string());
    // SAFETY: registering a plain `extern "C"` function that lives as long as the process.
    unsafe {
        libc::atexit(stop_workers_at_exit);
    }
}

/// The greedy choice: the first maximum on ties, like llama.cpp's greedy sampler.
pub(crate) fn argmax(logits: &[f32]) -> Token {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as Token
}

/// Whether llama.cpp has a GPU device (Vulkan by default; Mesa's lavapipe counts only when
/// GGML_VK_VISIBLE_DEVICES lists it).
pub fn gpu_available() -> bool {
    !gpu_devices().is_empty()
}

/// llama.cpp's GPUs, discrete ones first, then integrated ones (an RK3588's Mali is integrated,
/// as libmtmd also accepts): what [`Gpu::index`] counts.
fn gpu_devices() -> Vec<sys::ggml_backend_dev_t> {
    init_backend();
    // SAFETY: the backend registry is initialised; the calls only look devices up.
    unsafe {
        let all: Vec<_> = (0..sys::ggml_backend_dev_count()).map(|i| sys::ggml_backend_dev_get(i)).collect();
        let of = |kind| all.iter().copied().filter(move |&d| sys::ggml_backend_dev_type(d) == kind);
        of(sys::GGML_BACKEND_DEVICE_TYPE_GPU).chain(of(sys::GGML_BACKEND_DEVICE_TYPE_IGPU)).collect()
    }
}

/// The GPU `index` names, or why there is none.
fn gpu_device(index: usize) -> Result<sys::ggml_backend_dev_t> {
    let gpus = gpu_devices();
    gpus.get(index).copied().ok_or_else(|| {
        // SAFETY: valid device handles; their names are NUL-terminated and live for the process.
        let names: Vec<String> = gpus
            .iter()
            .map(|&d| unsafe { CStr::from_ptr(sys::ggml_backend_dev_name(d)) }.to_string_lossy().into_owned())
            .collect();
        Error::Config(if gpus.is_empty() {
            "no GPU device: llama.cpp found none (for Mesa's lavapipe set GGML_VK_VISIBLE_DEVICES=0)".into()
        } else {
            format!("no GPU {index}: llama.cpp found {} ({})", gpus.len(), names.join(", "))
        })
    })
}

/// Pin the calling thread (and the OpenMP workers it starts for llama.cpp, which inherit its
/// affinity) to `cores`, e.g. the big or the little cluster of a big.LITTLE SoC.
pub(crate) fn pin_current_thread(cores: &[usize]) -> Result<()> {
    // SAFETY: cpu_set_t is plain data, zeroed then filled with CPU_SET for valid indices (checked
    // against CPU_SETSIZE); sched_setaffinity(0, ...) only affects the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &core in cores {
            if core >= libc::CPU_SETSIZE as usize {
                return Err(Error::Config(format!("core {core} is out of range")));
            }
            libc::CPU_SET(core, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(Error::Config(format!("cannot pin to cores {cores:?}: {}", std::io::Error::last_os_error())));
        }
    }
    Ok(())
}

/// The cores the calling thread may run on.
pub fn current_thread_cores() -> Vec<usize> {
    // SAFETY: as above; sched_getaffinity fills the zeroed set for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return vec![];
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Where a model's weights and a context's compute live.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Device {
    /// llama.cpp's CPU backend.
    Cpu,
    /// A GPU of llama.cpp's (Vulkan by default; CUDA with the `cuda` feature), all or some of
    /// the model's layers on it.
    Gpu(Gpu),
    /// The devices of the llama.cpp `rpc-server`s at these `HOST:PORT` endpoints (every layer
    /// there; the layers split by their memory when there are several).
    Rpc(Vec<String>),
}

/// Which GPU, and how much of the model on it (llama.cpp's `--device` and `--n-gpu-layers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Gpu {
    /// Among llama.cpp's GPUs, discrete ones first, then integrated ones (0: the first).
    pub index: usize,
    /// Layers on the GPU, the last ones (the others run on the CPU); `None`: all of them.
    pub layers: Option<u32>,
}

impl Device {
    /// The first GPU, every layer on it.
    pub fn gpu() -> Device {
        Device::Gpu(Gpu::default())
    }

    pub fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu(_) => "gpu",
            Device::Rpc(_) => "rpc",
        }
    }

    /// The RPC endpoints, for [`Device::Rpc`].
    pub fn endpoints(&self) -> &[String] {
        match self {
            Device::Rpc(endpoints) => endpoints,
            _ => &[],
        }
    }
}
