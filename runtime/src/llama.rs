//! The small safe layer over `llama-cpp-sys-2`.
//!
//! llama-cpp-2 keeps its raw `llama_model`/`llama_context`/`mtmd_context` pointers crate-private
//! and has no safe call for `mtmd_get_output_embd` or `mtmd_helper_decode_image_chunk`, which the
//! split between vision encoding (`vlmencode`) and language prefill (`vlmcontext`) needs. So the
//! model, the context and the projector are driven through the sys crate here, and every `unsafe`
//! of the project lives in this file, each with the invariant it relies on.

use std::ffi::{CStr, CString, c_char, c_void};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::ptr::{NonNull, null_mut};
use std::sync::{Arc, OnceLock};

use llama_cpp_sys_2 as sys;
use parking_lot::{Mutex, RwLock};

use crate::error::{Error, Result};

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
    if let Some(sink) = LOG_SINK.read().as_ref() {
        sink(level, text.trim_end());
    }
}

/// Threads that run llama.cpp work (engine threads), and whether the process is exiting.
static WORKERS: (Mutex<usize>, parking_lot::Condvar) = (Mutex::new(0), parking_lot::Condvar::new());
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Held by a thread that runs llama.cpp work, for its whole life (drop it last, after the
/// contexts it used are freed).
pub(crate) struct WorkerThread(());

impl WorkerThread {
    pub(crate) fn register() -> WorkerThread {
        *WORKERS.0.lock() += 1;
        WorkerThread(())
    }
}

impl Drop for WorkerThread {
    fn drop(&mut self) {
        *WORKERS.0.lock() -= 1;
        WORKERS.1.notify_all();
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
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
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
    });
}

/// Make sure worker threads are stopped before llama.cpp's static objects are destroyed at
/// exit. Called by each engine thread after its first computation, when the lazily built
/// statics of the backends it uses exist: exit handlers run in reverse order of registration,
/// so this one runs before their destructors. (Registering twice is harmless.)
pub(crate) fn stop_workers_before_exit() {
    // SAFETY: registering a plain `extern "C"` function that lives as long as the process.
    unsafe {
        libc::atexit(stop_workers_at_exit);
    }
}

/// Whether llama.cpp has a GPU device (Vulkan by default; Mesa's lavapipe counts only when
/// GGML_VK_VISIBLE_DEVICES lists it).
pub fn gpu_available() -> bool {
    !gpu_device().is_null()
}

/// llama.cpp's first discrete GPU, else its first integrated one (an RK3588's Mali is
/// integrated, as libmtmd also accepts); null when it has neither.
fn gpu_device() -> sys::ggml_backend_dev_t {
    init_backend();
    // SAFETY: the backend registry is initialised; the calls only look devices up.
    unsafe {
        let discrete = sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_GPU);
        if discrete.is_null() { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_IGPU) } else { discrete }
    }
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
    /// The first GPU device llama.cpp was built with (Vulkan by default).
    Gpu,
}

impl Device {
    pub fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::BadInput(format!("path {} contains a NUL byte", path.display())))
}

/// Fail early, with the file's name, when a model file cannot be read: llama.cpp itself only
/// logs the reason and returns null.
pub fn check_readable(path: &Path, what: &str) -> Result<()> {
    if path.as_os_str().is_empty() {
        return Err(Error::Config(format!("no {what} file set")));
    }
    std::fs::File::open(path)
        .and_then(|f| f.metadata())
        .map_err(|e| Error::File { path: path.to_path_buf(), reason: format!("cannot read {what} file: {e}") })
        .and_then(|m| {
            if m.is_file() {
                Ok(())
            } else {
                Err(Error::File { path: path.to_path_buf(), reason: format!("{what} path is not a regular file") })
            }
        })
}

/// A loaded language model (weights + vocabulary). Immutable once loaded, so one copy is shared
/// by every context that names the same file on the same device (see [`crate::models`]).
pub struct Model {
    ptr: NonNull<sys::llama_model>,
    path: PathBuf,
    device: Device,
    /// [`Model::identity`], fixed at load: a file replaced on disk while it runs changes neither
    /// prefix keys nor compatibility tags mid-run (the weights in memory are the loaded ones).
    identity: String,
}

// SAFETY: a llama_model is not mutated after llama_model_load_from_file returns; llama.cpp's
// server shares one model between contexts on several threads the same way.
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

impl Model {
    pub fn load(path: &Path, device: &Device) -> Result<Model> {
        init_backend();
        check_readable(path, "model")?;
        let cpath = c_path(path)?;
        // SAFETY: default params are plain data; `devices` points at a null-terminated list
        // that outlives the call.
        let ptr = unsafe {
            let mut params = sys::llama_model_default_params();
            let mut devices: [sys::ggml_backend_dev_t; 2] = [null_mut(), null_mut()];
            match device {
                Device::Cpu => params.n_gpu_layers = 0,
                Device::Gpu => {
                    let gpu = gpu_device();
                    if gpu.is_null() {
                        return Err(Error::Config(
                            "no GPU device: llama.cpp found none (for Mesa's lavapipe set GGML_VK_VISIBLE_DEVICES=0)"
                                .into(),
                        ));
                    }
                    devices[0] = gpu;
                    params.n_gpu_layers = 999;
                }
            }
            params.devices = devices.as_mut_ptr();
            sys::llama_model_load_from_file(cpath.as_ptr(), params)
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::File {
            path: path.to_path_buf(),
            reason:
                "llama.cpp could not load it as a language model (not a GGUF model, or an unsupported architecture)"
                    .into(),
        })?;
        let mut model = Model { ptr, path: path.to_path_buf(), device: device.clone(), identity: String::new() };
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        model.identity = format!("{name} {} bytes={size} n_embd={}", model.description(), model.n_embd());
        Ok(model)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn vocab(&self) -> *const sys::llama_vocab {
        // SAFETY: the model pointer is valid for self's lifetime.
        unsafe { sys::llama_model_get_vocab(self.ptr.as_ptr()) }
    }

    /// Width of an input embedding row (what a projector must produce).
    pub fn n_embd(&self) -> usize {
        // SAFETY: valid model pointer.
        unsafe { sys::llama_model_n_embd_inp(self.ptr.as_ptr()) as usize }
    }

    pub fn n_vocab(&self) -> usize {
        // SAFETY: valid vocab pointer.
        unsafe { sys::llama_vocab_n_tokens(self.vocab()) as usize }
    }

    /// A short description such as "llama 135M Q4_1", part of the model's identity.
    pub fn description(&self) -> String {
        let mut buf = [0u8; 128];
        // SAFETY: the buffer and its length agree; llama writes at most len bytes incl. NUL.
        let n = unsafe { sys::llama_model_desc(self.ptr.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        String::from_utf8_lossy(&buf[..n.clamp(0, buf.len() as i32 - 1) as usize]).into_owned()
    }

    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<Token>> {
        let len = i32::try_from(text.len()).map_err(|_| Error::BadInput("text too long to tokenize".into()))?;
        let mut tokens = vec![0; text.len() + 8];
        // A negative result is the capacity llama.cpp needs: retry once with it.
        let mut n = -1;
        for _ in 0..2 {
            // SAFETY: text/len describe a valid byte slice, tokens/capacity a writable buffer.
            n = unsafe {
                sys::llama_tokenize(
                    self.vocab(),
                    text.as_ptr().cast(),
                    len,
                    tokens.as_mut_ptr(),
                    tokens.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n >= 0 {
                break;
            }
            tokens.resize((-n) as usize, 0);
        }
        if n < 0 {
            return Err(Error::BadInput("tokenization failed".into()));
        }
        tokens.truncate(n as usize);
        Ok(tokens)
    }

    /// The bytes of one token (special tokens rendered as nothing). Pieces may split a UTF-8
    /// character; [`crate::text::Utf8Stream`] reassembles them.
    pub fn token_bytes(&self, token: Token) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        loop {
            // SAFETY: buf/len describe a writable buffer.
            let n = unsafe {
                sys::llama_token_to_piece(self.vocab(), token, buf.as_mut_ptr().cast(), buf.len() as i32, 0, false)
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return buf;
            }
            buf.resize((-n) as usize, 0);
        }
    }

    pub fn is_eog(&self, token: Token) -> bool {
        // SAFETY: valid vocab pointer; any token id is accepted.
        unsafe { sys::llama_vocab_is_eog(self.vocab(), token) }
    }

    /// Whether the vocabulary knows `text` as one special token.
    pub fn has_special_token(&self, text: &str) -> bool {
        matches!(self.tokenize(text, false, true).as_deref(), Ok([_]))
    }

    /// Render a conversation with the model's own chat template (ChatML when it has none).
    /// The GGUF's own chat template, if it has one.
    fn chat_template(&self) -> Option<*const std::ffi::c_char> {
        // SAFETY: valid model pointer; a null name asks for the default template, which may be
        // null; a non-null one lives as long as the model.
        let tmpl = unsafe { sys::llama_model_chat_template(self.ptr.as_ptr(), std::ptr::null()) };
        (!tmpl.is_null()).then_some(tmpl)
    }

    /// Whether the GGUF carries a chat template; without one, prompts use ChatML (as llama.cpp's
    /// own tools do).
    pub fn has_chat_template(&self) -> bool {
        self.chat_template().is_some()
    }

    pub fn apply_chat_template(&self, messages: &[(&str, &str)], add_assistant: bool) -> Result<String> {
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .map(|(r, c)| Ok((CString::new(*r)?, CString::new(*c)?)))
            .collect::<std::result::Result<_, std::ffi::NulError>>()
            .map_err(|_| Error::BadInput("message contains a NUL byte".into()))?;
        let chat: Vec<sys::llama_chat_message> =
            owned.iter().map(|(r, c)| sys::llama_chat_message { role: r.as_ptr(), content: c.as_ptr() }).collect();
        let tmpl = self.chat_template().unwrap_or(c"chatml".as_ptr());
        let mut buf = vec![0u8; 1024];
        for _ in 0..2 {
            // SAFETY: chat points at owned.len() messages whose strings live in `owned`; buf/len
            // describe a writable buffer.
            let n = unsafe {
                sys::llama_chat_apply_template(
                    tmpl,
                    chat.as_ptr(),
                    chat.len(),
                    add_assistant,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                )
            };
            if n < 0 {
                return Err(Error::Config("the model's chat template is not supported by llama.cpp".into()));
            }
            if (n as usize) <= buf.len() {
                buf.truncate(n as usize);
                return String::from_utf8(buf)
                    .map_err(|_| Error::Config("chat template produced invalid UTF-8".into()));
            }
            buf.resize(n as usize, 0);
        }
        Err(Error::Config("chat template output kept growing".into()))
    }

    /// A metadata string of the GGUF file (e.g. `general.architecture`).
    pub fn meta_str(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        // SAFETY: valid model pointer; `key` is NUL-terminated; buf/len describe a writable
        // buffer and llama.cpp writes at most len bytes including the NUL (snprintf), returning
        // the full length or -1 when the key is missing.
        let n = unsafe {
            sys::llama_model_meta_val_str(self.ptr.as_ptr(), key.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        };
        (n >= 0).then(|| String::from_utf8_lossy(&buf[..(n as usize).min(buf.len() - 1)]).into_owned())
    }

    /// Why plain image embeddings (rows on consecutive 1-D positions, decoded causally: what the
    /// NPU encoder gives) cannot feed this model, if they cannot. M-RoPE models (Qwen2-VL,
    /// Qwen2.5-VL) place an image on 2-D positions that only libmtmd computes, and llama.cpp
    /// reads 4 positions per embedding row of such a model; Gemma 3 decodes an image
    /// non-causally.
    pub fn plain_embeddings_refusal(&self) -> Option<String> {
        // SAFETY: valid model pointer.
        let rope = unsafe { sys::llama_model_rope_type(self.ptr.as_ptr()) };
        let name = self.path.display();
        if rope == sys::LLAMA_ROPE_TYPE_MROPE || rope == sys::LLAMA_ROPE_TYPE_IMROPE {
            return Some(format!(
                "the language model {name} uses M-RoPE: embeddings from the NPU need 2-D M-RoPE positions that this build does not give; use backend=cpu|gpu"
            ));
        }
        if self.meta_str("general.architecture").as_deref() == Some("gemma3") {
            return Some(format!(
                "the language model {name} (gemma3) decodes images non-causally: embeddings from the NPU are decoded causally on 1-D positions in this build; use backend=cpu|gpu"
            ));
        }
        None
    }

    /// What makes two loaded models the same model: part of every prefix key. Read from the
    /// file once, at load.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn as_ptr(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: every Context and Projector holds an Arc<Model>, so none outlives this.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

/// A llama.cpp batch this side owns: either tokens or embedding rows, each entry with its
/// position, one sequence and whether its logits are kept. Invariant: the first `n` entries of
/// every array are filled, `n <= capacity`, and rows are `width` floats.
pub struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
    /// Floats per row (0: a token batch).
    width: usize,
    n: usize,
}

impl Batch {
    /// A batch of at most `capacity` tokens.
    pub fn tokens(capacity: usize) -> Batch {
        Batch::init(capacity, 0)
    }

    /// A batch of at most `capacity` embedding rows of `width` floats.
    pub fn embeddings(capacity: usize, width: usize) -> Batch {
        Batch::init(capacity, width)
    }

    fn init(capacity: usize, width: usize) -> Batch {
        let capacity = capacity.max(1);
        // SAFETY: llama_batch_init allocates arrays for `capacity` entries with one sequence id
        // each (and `width` floats per entry when width > 0); freed in Drop.
        let raw = unsafe { sys::llama_batch_init(capacity as i32, width as i32, 1) };
        Batch { raw, capacity, width, n: 0 }
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// (position, sequence) of the first entry.
    fn first(&self) -> (i32, i32) {
        if self.n == 0 {
            return (0, 0);
        }
        // SAFETY: entry 0 is filled (n > 0).
        unsafe { (*self.raw.pos, **self.raw.seq_id) }
    }

    fn push_meta(&mut self, pos: i32, seq: i32, logits: bool) {
        let j = self.n;
        // SAFETY: j < capacity (checked by the callers' asserts); the arrays have `capacity`
        // entries and seq_id[j] points at room for one id.
        unsafe {
            *self.raw.pos.add(j) = pos;
            *self.raw.n_seq_id.add(j) = 1;
            **self.raw.seq_id.add(j) = seq;
            *self.raw.logits.add(j) = logits as i8;
        }
        self.n += 1;
        self.raw.n_tokens = self.n as i32;
    }

    pub fn push_token(&mut self, token: Token, pos: i32, seq: i32, logits: bool) {
        assert!(self.width == 0 && self.n < self.capacity, "token batch full or not a token batch");
        // SAFETY: token batch with n < capacity entries.
        unsafe { *self.raw.token.add(self.n) = token };
        self.push_meta(pos, seq, logits);
    }

    pub fn push_row(&mut self, row: &[f32], pos: i32, seq: i32, logits: bool) {
        assert!(self.width > 0 && row.len() == self.width && self.n < self.capacity, "bad embedding row");
        // SAFETY: the embd array holds capacity*width floats; row n starts at n*width and the
        // source has exactly width floats.
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), self.raw.embd.add(self.n * self.width), self.width) };
        self.push_meta(pos, seq, logits);
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: allocated by llama_batch_init, freed once.
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

/// The element type of the KV cache (llama.cpp's `--cache-type-k/-v`, both alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvType {
    #[default]
    F16,
    Q8_0,
    Q4_0,
}

impl KvType {
    pub const ALL: [KvType; 3] = [KvType::F16, KvType::Q8_0, KvType::Q4_0];

    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }

    pub fn parse(name: &str) -> Option<KvType> {
        KvType::ALL.into_iter().find(|t| t.name() == name)
    }

    fn ggml(self) -> sys::ggml_type {
        match self {
            KvType::F16 => sys::GGML_TYPE_F16,
            KvType::Q8_0 => sys::GGML_TYPE_Q8_0,
            KvType::Q4_0 => sys::GGML_TYPE_Q4_0,
        }
    }
}

/// Settings of one language context (one engine).
#[derive(Debug, Clone)]
pub struct ContextParams {
    /// Cells per sequence.
    pub n_ctx_per_seq: u32,
    /// Sequences (streams + answer branches).
    pub n_seq: u32,
    pub n_batch: u32,
    pub threads: i32,
    /// `Some(cells)`: one KV pool of `cells` shared by all sequences, where a branch shares its
    /// prefix's cells; `None`: one buffer of `n_ctx_per_seq` cells per sequence (see
    /// [`Context::new`] for what each costs).
    pub kv_unified: Option<u32>,
    /// Flash attention (also decides the V layout: contexts that exchange snapshots must agree).
    pub flash_attention: bool,
    pub kv_type: KvType,
}

/// A language context: the KV memory of several sequences plus compute buffers. Owned by one
/// engine thread (it is `Send`, not `Sync`).
pub struct Context {
    ptr: NonNull<sys::llama_context>,
    model: Arc<Model>,
    n_batch: u32,
    n_ctx_per_seq: u32,
    unified: bool,
    /// Bytes of the whole state with no cell in use (see [`Context::kv_bytes_in_use`]).
    empty_state_bytes: usize,
    /// Set when batches of embedding rows (1-D positions, causal) must not reach this model
    /// ([`Model::plain_embeddings_refusal`]).
    plain_rows_refused: Option<String>,
}

// SAFETY: a llama_context may move between threads; it is only used through &mut self.
unsafe impl Send for Context {}

impl Context {
    pub fn new(model: Arc<Model>, p: &ContextParams) -> Result<Context> {
        if p.kv_type != KvType::F16 && !p.flash_attention {
            return Err(Error::Config(format!(
                "kv-type {} quantizes V, which llama.cpp allows only with flash attention: set flash-attention=true",
                p.kv_type.name()
            )));
        }
        // SAFETY: default params are plain data; the model outlives the context (Arc held).
        let ptr = unsafe {
            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = p.kv_unified.unwrap_or(p.n_ctx_per_seq * p.n_seq);
            cp.n_seq_max = p.n_seq;
            cp.n_batch = p.n_batch;
            cp.n_ubatch = p.n_batch;
            // Logits are kept for one entry a sequence at most (a prefill chunk's last token, a
            // decode step's token of each answer): reserving the output projection for n_seq
            // rows instead of n_batch saves n_batch x n_vocab floats of compute buffer (100 MiB
            // for a 49k vocabulary).
            cp.n_outputs_max = p.n_seq;
            cp.n_threads = p.threads;
            cp.n_threads_batch = p.threads;
            // KV layout. With one unified buffer, a sequence's attention runs over every used
            // cell of the buffer, other sequences' cells masked to -inf: the masked entries add
            // exact zeros, but the reductions (K·Q, softmax, V-weighted sum) run over a longer
            // and differently ordered KV axis once branches have taken cells, so the float
            // summation order changes and a greedy continuation can part from a fresh context's
            // after some tokens. `cargo run -p vlm-runtime --example kv_layout` measures it (CPU,
            // 32 greedy tokens after a prompt + 3 frames + question): unified and alone 32/32
            // with identical logits; unified after two branches took cells, step-0 logits off
            // by up to 0.91; unified with an *unrelated* sequence in the buffer, off by 0.47 and
            // parted at token 27. An unrelated sequence moves the numbers as much as a branch, so
            // this is the layout's summation order, not a branch's data leaking; per-sequence KV
            // gave 0.0 difference and 32/32 in all three. Per-sequence streams give each sequence its own cells in position
            // order, so retained, branched and re-prefilled histories are bit-identical, which
            // the equality tests rely on; the price is that a branch copies its prefix
            // (`seq_copy_prefix`) instead of sharing cells, and every sequence has its cells
            // whether it uses them or not. The unified pool costs what is in use, a branch
            // only its suffix (docs/benchmarks.md, "Memory").
            cp.kv_unified = p.kv_unified.is_some();
            cp.type_k = p.kv_type.ggml();
            cp.type_v = p.kv_type.ggml();
            // Contexts that exchange snapshots must agree on flash attention (V layout).
            cp.flash_attn_type = if p.flash_attention {
                sys::LLAMA_FLASH_ATTN_TYPE_ENABLED
            } else {
                sys::LLAMA_FLASH_ATTN_TYPE_DISABLED
            };
            cp.no_perf = true;
            sys::llama_init_from_model(model.as_ptr(), cp)
        };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::Engine("llama.cpp could not create a context (out of memory?)".into()))?;
        // SAFETY: valid context pointer; the size query only counts (no cell is in use yet).
        let (n_ctx_seq, empty_state_bytes) =
            unsafe { (sys::llama_n_ctx_seq(ptr.as_ptr()), sys::llama_state_get_size(ptr.as_ptr())) };
        // A unified pool holds every sequence's cells: one sequence's limit is the engine's.
        let n_ctx_per_seq = if p.kv_unified.is_some() { p.n_ctx_per_seq.min(n_ctx_seq) } else { n_ctx_seq };
        let plain_rows_refused = model.plain_embeddings_refusal();
        Ok(Context {
            ptr,
            model,
            n_batch: p.n_batch,
            n_ctx_per_seq,
            unified: p.kv_unified.is_some(),
            empty_state_bytes,
            plain_rows_refused,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Threads for computations from now on (decode steps and batches alike).
    pub fn set_threads(&mut self, threads: i32) {
        // SAFETY: valid context; llama.cpp reads the counts at its next computation.
        unsafe { sys::llama_set_n_threads(self.ptr.as_ptr(), threads, threads) }
    }

    /// Most inputs one `llama_decode` takes.
    pub fn n_batch(&self) -> u32 {
        self.n_batch
    }

    /// KV cells of the context, all sequences together.
    pub fn n_ctx(&self) -> usize {
        // SAFETY: valid context pointer.
        unsafe { sys::llama_n_ctx(self.ptr.as_ptr()) as usize }
    }

    /// KV cells available to one sequence.
    pub fn n_ctx_per_seq(&self) -> u32 {
        self.n_ctx_per_seq
    }

    fn memory(&self) -> sys::llama_memory_t {
        // SAFETY: valid context pointer.
        unsafe { sys::llama_get_memory(self.ptr.as_ptr()) }
    }

    /// Decode one batch (several sequences may share it); the logits of the entries that asked
    /// for them are read with [`Context::logits`] until the next decode.
    pub fn decode(&mut self, batch: &Batch) -> Result<()> {
        if batch.len() > self.n_batch as usize {
            return Err(Error::Engine(format!("a batch of {} exceeds n_batch {}", batch.len(), self.n_batch)));
        }
        if batch.is_empty() {
            return Ok(());
        }
        if batch.width > 0
            && let Some(why) = &self.plain_rows_refused
        {
            // Also a memory-safety guard: a Batch holds one position per entry, and llama.cpp
            // would read four per embedding row of an M-RoPE model.
            return Err(Error::BadInput(why.clone()));
        }
        // SAFETY: the batch's arrays are filled for its first n_tokens entries (Batch's
        // invariant); llama_decode only reads them. GPU backends compute asynchronously:
        // synchronise, so that stage timings are real.
        let rc = unsafe {
            let rc = sys::llama_decode(self.ptr.as_ptr(), batch.raw);
            sys::llama_synchronize(self.ptr.as_ptr());
            rc
        };
        if rc == 1 && self.unified {
            let (first, seq) = batch.first();
            return Err(Error::Engine(format!(
                "the unified KV pool ({} cells) has no room for {} inputs at position {first} of sequence {seq}",
                self.n_ctx(),
                batch.len()
            )));
        }
        if rc != 0 {
            let (first, seq) = batch.first();
            return Err(Error::Engine(format!(
                "llama_decode of {} inputs failed ({rc}) at position {first} of sequence {seq}",
                batch.len()
            )));
        }
        Ok(())
    }

    /// Decode `tokens` into `seq` at positions `pos..`, in batches of n_batch. The logits of the
    /// last token are kept when `logits_last`.
    pub fn decode_tokens(&mut self, tokens: &[Token], pos: i32, seq: i32, logits_last: bool) -> Result<()> {
        let n_batch = self.n_batch as usize;
        for (i, part) in tokens.chunks(n_batch).enumerate() {
            let mut batch = Batch::tokens(part.len());
            let start = pos + (i * n_batch) as i32;
            let last_part = (i + 1) * n_batch >= tokens.len();
            for (j, &t) in part.iter().enumerate() {
                batch.push_token(t, start + j as i32, seq, logits_last && last_part && j + 1 == part.len());
            }
            self.decode(&batch)?;
        }
        Ok(())
    }

    /// Decode an image's precomputed embeddings into `seq` at `pos`; returns the next position
    /// (which differs from pos + rows for M-RoPE models).
    pub fn decode_image(&mut self, image: &ImageEmbeddings, pos: i32, seq: i32) -> Result<i32> {
        if image.width != self.model.n_embd() {
            return Err(Error::BadInput(format!(
                "embeddings are {} wide but the language model takes {}",
                image.width,
                self.model.n_embd()
            )));
        }
        let ImageSource::Mtmd { chunk, projector, non_causal } = &image.source else {
            return self.decode_rows(image, 0..image.rows, pos, seq).map(|()| pos + image.rows as i32);
        };
        // libmtmd's helper cuts an image into batches of n_batch; a non-causal image (Gemma 3)
        // must attend to all its rows at once, and would be cut silently.
        if *non_causal && image.rows > self.n_batch as usize {
            return Err(Error::BadInput(format!(
                "a non-causal image of {} embedding rows does not fit in one batch of {} (the language model {} decodes images whole)",
                image.rows,
                self.n_batch,
                self.model.path().display()
            )));
        }
        let mut next = 0;
        // SAFETY: the chunk was produced by mtmd_input_chunk_save for this projector; `load`
        // returns null on malformed bytes. The helper only reads `encoded_embd` (it stores the
        // pointer in a view used for llama_decode), so passing the shared slice as *mut is sound,
        // and its length is rows*width as the chunk declares. The mtmd context is used without
        // the projector's mutex (see [`DecodeView`]): an encode may run meanwhile.
        let rc = unsafe {
            let chunk = sys::mtmd_input_chunk_load(chunk.as_ptr().cast(), chunk.len());
            if chunk.is_null() {
                return Err(Error::BadInput("malformed image chunk metadata".into()));
            }
            let rc = sys::mtmd_helper_decode_image_chunk(
                projector.decode_view.0.as_ptr(),
                self.ptr.as_ptr(),
                chunk,
                image.data.as_ptr() as *mut f32,
                pos,
                seq,
                self.n_batch as i32,
                &mut next,
                None,
                null_mut(),
            );
            sys::mtmd_input_chunk_free(chunk);
            sys::llama_synchronize(self.ptr.as_ptr());
            rc
        };
        if rc != 0 {
            return Err(Error::Engine(format!(
                "decoding image embeddings failed ({rc}) at position {pos} of sequence {seq}"
            )));
        }
        Ok(next)
    }

    /// Decode rows `rows` of a causal, 1-D image ([`ImageEmbeddings::causal_rows`]) into `seq`,
    /// the first at `pos`, in batches of n_batch.
    pub fn decode_rows(&mut self, image: &ImageEmbeddings, rows: Range<usize>, pos: i32, seq: i32) -> Result<()> {
        if !image.causal_rows || rows.end > image.rows || image.width != self.model.n_embd() {
            return Err(Error::BadInput(format!(
                "rows {rows:?} of a {}-row image cannot be decoded apart",
                image.rows
            )));
        }
        let n_batch = self.n_batch as usize;
        let mut row = rows.start;
        while row < rows.end {
            let n = (rows.end - row).min(n_batch);
            let mut batch = Batch::embeddings(n, image.width);
            for r in row..row + n {
                batch.push_row(image.row(r), pos + (r - rows.start) as i32, seq, false);
            }
            self.decode(&batch)?;
            row += n;
        }
        Ok(())
    }

    /// Logits of entry `i` of the last decoded batch (an entry that asked for them).
    pub fn logits(&self, i: usize) -> Result<&[f32]> {
        self.logits_ith(i as i32)
    }

    /// Logits of the last decoded entry that asked for them.
    pub fn last_logits(&self) -> Result<&[f32]> {
        self.logits_ith(-1)
    }

    fn logits_ith(&self, i: i32) -> Result<&[f32]> {
        // SAFETY: valid context; llama.cpp returns null (and logs) for an entry without logits.
        let ptr = unsafe { sys::llama_get_logits_ith(self.ptr.as_ptr(), i) };
        if ptr.is_null() {
            return Err(Error::Engine(format!("no logits for batch entry {i}")));
        }
        // SAFETY: a non-null row has n_vocab floats and stays valid until the next decode, which
        // needs &mut self.
        Ok(unsafe { std::slice::from_raw_parts(ptr, self.model.n_vocab()) })
    }

    /// Make `dst` hold the first `end` positions of `src` (a branch of a pinned version).
    pub fn seq_copy_prefix(&mut self, src: i32, dst: i32, end: i32) {
        // SAFETY: valid memory handle; sequence ids are < n_seq (checked by callers' allocators).
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), dst, -1, -1);
            if self.unified {
                // The prefix's cells gain `dst`'s id: shared, nothing copied.
                sys::llama_memory_seq_cp(self.memory(), src, dst, -1, end);
            } else {
                // Per-sequence streams are copied whole (a partial copy asserts): copy, then
                // drop the tail beyond the version.
                sys::llama_memory_seq_cp(self.memory(), src, dst, -1, -1);
                sys::llama_memory_seq_rm(self.memory(), dst, end, -1);
            }
        }
    }

    /// Bytes of KV cells in use, each counted once however many sequences share it (the
    /// whole state's serialised size, less the empty context's: K and V rows plus a few bytes
    /// of position and sequence ids per cell).
    pub fn kv_bytes_in_use(&mut self) -> usize {
        // SAFETY: valid context; the size query serialises into a counting writer only.
        let size = unsafe { sys::llama_state_get_size(self.ptr.as_ptr()) };
        size.saturating_sub(self.empty_state_bytes)
    }

    /// Export the KV state of `seq` (cells, positions, sequence metadata) into a buffer.
    pub fn seq_snapshot(&mut self, seq: i32) -> Result<Vec<u8>> {
        // SAFETY: the size query and the export use the same valid context and sequence; the
        // buffer has exactly the size llama.cpp asked for.
        unsafe {
            let size = sys::llama_state_seq_get_size(self.ptr.as_ptr(), seq);
            let mut bytes = vec![0u8; size];
            let written = sys::llama_state_seq_get_data(self.ptr.as_ptr(), bytes.as_mut_ptr(), size, seq);
            if written != size {
                return Err(Error::Engine(format!("snapshot of sequence {seq}: {written} of {size} bytes written")));
            }
            Ok(bytes)
        }
    }

    /// Replace the KV state of `seq` with a snapshot taken by [`Context::seq_snapshot`] from a
    /// compatible context. llama.cpp validates the layout and refuses a mismatch.
    pub fn seq_restore(&mut self, seq: i32, snapshot: &[u8]) -> Result<()> {
        // SAFETY: the slice is valid for its length; llama.cpp reads at most that much and
        // returns 0 on malformed or incompatible input.
        let read = unsafe { sys::llama_state_seq_set_data(self.ptr.as_ptr(), snapshot.as_ptr(), snapshot.len(), seq) };
        if read == 0 {
            return Err(Error::Engine(format!("snapshot of {} bytes refused for sequence {seq}", snapshot.len())));
        }
        Ok(())
    }

    /// Largest position held by `seq` (-1 when empty).
    pub fn seq_pos_max(&self, seq: i32) -> i32 {
        // SAFETY: valid memory handle.
        unsafe { sys::llama_memory_seq_pos_max(self.memory(), seq) }
    }

    /// Forget the cells of `seq` from position `end` on.
    pub fn seq_truncate(&mut self, seq: i32, end: i32) {
        // SAFETY: valid memory handle.
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), seq, end, -1);
        }
    }

    /// Forget the positions `from..to` of `seq` and move its later cells down by `to - from`
    /// (llama.cpp applies the K-shift, re-rotating their keys, at the next decode).
    pub fn seq_shift_out(&mut self, seq: i32, from: i32, to: i32) {
        // SAFETY: valid memory handle.
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), seq, from, to);
            sys::llama_memory_seq_add(self.memory(), seq, to, -1, from - to);
        }
    }

    /// Why this context cannot shift positions in place, if it cannot: M-RoPE positions are
    /// not one number a cell, and a cell of a unified pool may be shared with a reader whose
    /// positions must not move.
    pub fn shift_refusal(&self) -> Option<String> {
        // SAFETY: valid model and memory handles.
        let (rope, can_shift) =
            unsafe { (sys::llama_model_rope_type(self.model.as_ptr()), sys::llama_memory_can_shift(self.memory())) };
        if rope == sys::LLAMA_ROPE_TYPE_MROPE || rope == sys::LLAMA_ROPE_TYPE_IMROPE {
            return Some(format!("{} uses M-RoPE", self.model.path.display()));
        }
        if self.unified {
            return Some("the KV pool is unified (kv-layout=unified)".into());
        }
        (!can_shift).then(|| "llama.cpp cannot shift this model's KV cache".into())
    }

    /// Forget every cell of `seq`.
    pub fn seq_clear(&mut self, seq: i32) {
        // SAFETY: valid memory handle.
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), seq, -1, -1);
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context is owned and not used after this.
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
    }
}

struct MtmdPtr(NonNull<sys::mtmd_context>);
// SAFETY: the mtmd context is only touched under the Projector's mutex (except through
// [`DecodeView`]).
unsafe impl Send for MtmdPtr {}

/// The projector's mtmd context as `mtmd_helper_decode_image_chunk` uses it while a language
/// context decodes an image: it reads only what `mtmd_init_from_file` fixed (the position type
/// for M-RoPE, the projector type and width for the attention rule: `mtmd_decode_use_mrope`,
/// `mtmd_decode_use_non_causal`) and never the encoder's state. So a decode does not take the
/// projector's mutex, and an answer's decode steps never wait behind a vision encode that holds
/// it for its whole run.
struct DecodeView(NonNull<sys::mtmd_context>);
// SAFETY: only the load-time fields above are read through it, which nothing writes after
// `mtmd_init_from_file`; the context outlives the view (both are the Projector's, freed in its
// Drop).
unsafe impl Send for DecodeView {}
unsafe impl Sync for DecodeView {}

/// A loaded libmtmd projector (vision tower + projector), bound to the language model whose
/// vocabulary and embedding width it uses.
pub struct Projector {
    ctx: Mutex<MtmdPtr>,
    decode_view: DecodeView,
    path: PathBuf,
    model: Arc<Model>,
    marker: CString,
}

/// Projected embeddings of one image, as the language model consumes them.
pub struct ImageEmbeddings {
    /// rows × width floats, row-major.
    pub data: Box<[f32]>,
    pub rows: usize,
    pub width: usize,
    /// Positions the image occupies in the language sequence (≠ rows for M-RoPE models).
    pub n_pos: i32,
    /// Row `i` sits at position start + i and attends causally (LLaVA-style projectors, the
    /// NPU's rows): the rows may be decoded in any chunks, as plain embeddings. False for M-RoPE
    /// (2-D positions) and non-causal (Gemma 3) images, which are decoded whole by libmtmd.
    pub causal_rows: bool,
    source: ImageSource,
}

/// Who produced image embeddings, which says how they are decoded.
enum ImageSource {
    /// libmtmd: its chunk description (`mtmd_input_chunk_save`) and projector, so that
    /// `mtmd_helper_decode_image_chunk` applies the projector's positions and attention rule
    /// (`non_causal`: the rows attend to each other, so they are decoded in one batch).
    Mtmd { chunk: Vec<u8>, projector: Arc<Projector>, non_causal: bool },
    /// Another encoder (the NPU): plain rows on 1-D positions, decoded causally.
    Plain,
}

impl std::fmt::Debug for ImageEmbeddings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageEmbeddings")
            .field("rows", &self.rows)
            .field("width", &self.width)
            .field("n_pos", &self.n_pos)
            .finish()
    }
}

impl ImageEmbeddings {
    /// Embeddings made by an encoder other than libmtmd: `rows` rows of `width` floats on 1-D
    /// positions, decoded causally (what LLaVA-style projectors need).
    pub fn plain(data: Box<[f32]>, rows: usize, width: usize) -> Result<ImageEmbeddings> {
        if rows == 0 || data.len() != rows * width {
            return Err(Error::BadInput(format!("{} floats are not {rows} rows of {width}", data.len())));
        }
        Ok(ImageEmbeddings { data, rows, width, n_pos: rows as i32, causal_rows: true, source: ImageSource::Plain })
    }

    /// The language model whose vocabulary and width a libmtmd encoder made these for (none for
    /// plain rows, which carry only their width).
    pub fn model(&self) -> Option<&Arc<Model>> {
        match &self.source {
            ImageSource::Mtmd { projector, .. } => Some(projector.model()),
            ImageSource::Plain => None,
        }
    }

    /// Row `i` (width floats).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.width..(i + 1) * self.width]
    }
}

/// What one image becomes in the language sequence: the projector's wrapper text around it (for
/// models that have one) and the image itself.
#[derive(Debug)]
pub enum Segment {
    Text(Vec<Token>),
    Image(ImageEmbeddings),
}

/// Projector identity: its file plus the language model it is bound to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProjectorKey {
    pub mmproj: PathBuf,
    pub model: PathBuf,
    pub use_gpu: bool,
}

impl Projector {
    pub fn load(path: &Path, model: Arc<Model>, use_gpu: bool, threads: i32) -> Result<Projector> {
        init_backend();
        check_readable(path, "mmproj")?;
        crate::gguf::check_projector(path, &model)?;
        let cpath = c_path(path)?;
        // SAFETY: default params are plain data; the model outlives the projector (Arc held).
        let ptr = unsafe {
            let mut p = sys::mtmd_context_params_default();
            p.use_gpu = use_gpu;
            p.n_threads = threads;
            p.print_timings = false;
            p.warmup = true;
            sys::mtmd_init_from_file(cpath.as_ptr(), model.as_ptr(), p)
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::File {
            path: path.to_path_buf(),
            reason: format!(
                "libmtmd could not load it as a projector for {} (wrong file type, or its output width does not match the model's {})",
                model.path().display(),
                model.n_embd()
            ),
        })?;
        // SAFETY: the default marker is a static NUL-terminated string.
        let marker = unsafe { CStr::from_ptr(sys::mtmd_default_marker()) }.to_owned();
        Ok(Projector {
            ctx: Mutex::new(MtmdPtr(ptr)),
            decode_view: DecodeView(ptr),
            path: path.to_path_buf(),
            model,
            marker,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Hold the vision encoder as an encode holds it for its whole run, until the guard drops:
    /// stands in for a long encode in tests (decodes of this projector's images must go on).
    #[doc(hidden)]
    pub fn hold_encoder(&self) -> impl Sized + '_ {
        self.ctx.lock()
    }

    /// Encode one packed RGB image (width × height × 3 bytes) into the segments it becomes in
    /// the language sequence.
    pub fn encode(self: &Arc<Self>, rgb: &[u8], width: u32, height: u32) -> Result<Vec<Segment>> {
        if width == 0 || height == 0 || rgb.len() != width as usize * height as usize * 3 {
            return Err(Error::BadInput(format!(
                "image of {width}x{height} with {} bytes is not packed RGB",
                rgb.len()
            )));
        }
        let ctx = self.ctx.lock();
        let n_embd = self.model.n_embd();
        let mut segments = Vec::new();
        // SAFETY: the bitmap copies `rgb` (w*h*3 bytes, checked above); the input text points at
        // the marker, alive for the call; chunks are freed before return; the output embedding
        // buffer holds n_tokens*n_embd floats after a successful encode and is copied out before
        // the mutex is released.
        unsafe {
            let bitmap = sys::mtmd_bitmap_init(width, height, rgb.as_ptr());
            if bitmap.is_null() {
                return Err(Error::Engine("mtmd_bitmap_init failed".into()));
            }
            let chunks = sys::mtmd_input_chunks_init();
            let text = sys::mtmd_input_text {
                text: self.marker.as_ptr(),
                text_len: self.marker.as_bytes().len(),
                add_special: false,
                parse_special: true,
            };
            let bitmaps = [bitmap as *const sys::mtmd_bitmap];
            let rc = sys::mtmd_tokenize(ctx.0.as_ptr(), chunks, &text, bitmaps.as_ptr(), 1);
            sys::mtmd_bitmap_free(bitmap);
            let result = if rc != 0 {
                Err(Error::Engine(format!("mtmd_tokenize failed ({rc})")))
            } else {
                (|| {
                    for i in 0..sys::mtmd_input_chunks_size(chunks) {
                        let c = sys::mtmd_input_chunks_get(chunks, i);
                        if sys::mtmd_input_chunk_get_type(c) == sys::MTMD_INPUT_CHUNK_TYPE_TEXT {
                            let mut n = 0usize;
                            let p = sys::mtmd_input_chunk_get_tokens_text(c, &mut n);
                            if n > 0 {
                                segments.push(Segment::Text(std::slice::from_raw_parts(p, n).to_vec()));
                            }
                            continue;
                        }
                        let rows = sys::mtmd_input_chunk_get_n_tokens(c);
                        let rc = sys::mtmd_encode_chunk(ctx.0.as_ptr(), c);
                        if rc != 0 {
                            return Err(Error::Engine(format!("mtmd_encode_chunk failed ({rc})")));
                        }
                        let data =
                            std::slice::from_raw_parts(sys::mtmd_get_output_embd(ctx.0.as_ptr()), rows * n_embd).into();
                        let mut len = 0usize;
                        sys::mtmd_input_chunk_save(c, null_mut(), 0, &mut len);
                        let mut chunk = vec![0u8; len];
                        if sys::mtmd_input_chunk_save(c, chunk.as_mut_ptr().cast(), len, &mut len) != 0 {
                            return Err(Error::Engine("mtmd_input_chunk_save failed".into()));
                        }
                        let n_pos = sys::mtmd_input_chunk_get_n_pos(c);
                        let non_causal = sys::mtmd_decode_use_non_causal(ctx.0.as_ptr(), c);
                        let causal_rows =
                            n_pos == rows as i32 && !sys::mtmd_decode_use_mrope(ctx.0.as_ptr()) && !non_causal;
                        let source = ImageSource::Mtmd { chunk, projector: Arc::clone(self), non_causal };
                        segments.push(Segment::Image(ImageEmbeddings {
                            data,
                            rows,
                            width: n_embd,
                            n_pos,
                            causal_rows,
                            source,
                        }));
                    }
                    Ok(())
                })()
            };
            sys::mtmd_input_chunks_free(chunks);
            result?;
        }
        Ok(segments)
    }
}

impl Drop for Projector {
    fn drop(&mut self) {
        // SAFETY: owned context, no other user (we are being dropped).
        unsafe { sys::mtmd_free(self.ctx.get_mut().0.as_ptr()) }
    }
}
