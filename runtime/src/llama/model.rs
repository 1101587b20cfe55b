//! A loaded language model and the checks of model files.

use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::ptr::{NonNull, null_mut};
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;

use super::token_rows::TokenRows;
use super::{Device, Token, gpu_device, init_backend};
use crate::error::{Error, Result};

pub(super) fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::BadInput(format!("path {} contains a NUL byte", path.display())))
}

/// A weights file as loaded: its canonical path and which file it is there (device, inode,
/// length, modification time), so that a file replaced on disk is loaded anew rather than the
/// copy of the old one shared (the `models` registry's keys; a projector grows no encoder
/// context from a file that changed since it loaded). Replace a file by renaming a new one over
/// it: llama.cpp maps the weights, so a file rewritten in place changes what is loaded too.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FileId {
    pub path: PathBuf,
    version: Option<(u64, u64, u64, std::time::SystemTime)>,
}

impl FileId {
    /// The file at `path` now (the path as given where it cannot be resolved or read).
    pub fn of(path: &Path) -> FileId {
        FileId::opened(path, std::fs::metadata(path).ok().as_ref())
    }

    /// The file at `path` whose metadata (read from an open handle) is `meta`.
    fn opened(path: &Path, meta: Option<&std::fs::Metadata>) -> FileId {
        let version = meta.and_then(|m| Some((m.dev(), m.ino(), m.len(), m.modified().ok()?)));
        FileId { path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()), version }
    }

    /// Which file this is at its path, for identities that must tell versions apart.
    pub fn version(&self) -> String {
        self.version.map_or_else(String::new, |(dev, ino, len, modified)| {
            let ns = modified.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            format!("{dev}.{ino}.{len}.{ns}")
        })
    }
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
/// by every context that names the same file on the same device (see the `models` module).
pub struct Model {
    ptr: NonNull<sys::llama_model>,
    path: PathBuf,
    device: Device,
    /// The file it was loaded from (as it was then).
    file: FileId,
    /// [`Model::identity`], fixed at load: a file replaced on disk while it runs changes neither
    /// prefix keys nor compatibility tags mid-run (the weights in memory are the loaded ones).
    identity: String,
    /// Tokens' input embedding rows, from the file opened at load (checked against the model's
    /// width and vocabulary then; `token_rows`).
    token_rows: std::result::Result<TokenRows, String>,
    /// Whether this model on this device computes a token's row as it computes the token, as
    /// the first calibration run that asked measured ([`Model::rows_agree`]).
    rows_agree: OnceLock<bool>,
    /// Its RPC servers' use (none on other devices): dropped after `Drop` has freed the model.
    _rpc_lease: Option<super::rpc::Lease>,
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
        // Opened before llama.cpp opens the path, and checked to be the same file after: the
        // token rows, the identity's size and the weights then all come from one file.
        let file = std::fs::File::open(path)
            .map_err(|e| Error::File { path: path.to_path_buf(), reason: format!("cannot read model file: {e}") })?;
        // The RPC servers' use by this model (see `rpc::devices`), released after the model.
        let mut rpc_lease = None;
        // SAFETY: default params are plain data; `devices` points at a null-terminated list
        // that outlives the call.
        let ptr = unsafe {
            let mut params = sys::llama_model_default_params();
            let mut devices: Vec<sys::ggml_backend_dev_t> = vec![null_mut(); 2];
            match device {
                Device::Cpu => params.n_gpu_layers = 0,
                Device::Rpc(endpoints) => {
                    let (rpc_devices, lease) = super::rpc::devices(endpoints)?;
                    devices = rpc_devices;
                    rpc_lease = Some(lease);
                    devices.push(null_mut());
                    params.n_gpu_layers = 999;
                }
                Device::Gpu(gpu) => {
                    devices[0] = gpu_device(gpu.index)?;
                    params.n_gpu_layers = gpu.layers.map_or(999, |n| n.min(999) as i32);
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
        let mut model = Model {
            ptr,
            path: path.to_path_buf(),
            device: device.clone(),
            file: FileId::of(path),
            identity: String::new(),
            token_rows: Err(String::new()),
            rows_agree: OnceLock::new(),
            _rpc_lease: rpc_lease,
        };
        // What llama.cpp loads but cannot answer with, refused here: it would abort the process
        // at the first tokenization (no vocabulary), or a branch of a history would not hold
        // (a recurrent state cannot be cut back to a prefix).
        // SAFETY: valid model and vocabulary pointers.
        let (vocab_type, decoder, recurrent) = unsafe {
            (
                sys::llama_vocab_type(model.vocab()),
                sys::llama_model_has_decoder(ptr.as_ptr()),
                sys::llama_model_is_recurrent(ptr.as_ptr()) || sys::llama_model_is_hybrid(ptr.as_ptr()),
            )
        };
        let refused = if vocab_type == sys::LLAMA_VOCAB_TYPE_NONE || model.n_vocab() == 0 {
            Some("it has no vocabulary (not a language model)")
        } else if !decoder {
            Some("it has no decoder (an encoder-only model cannot answer)")
        } else if recurrent {
            Some(
                "recurrent and hybrid models (Mamba, RWKV, LFM2, ...) are not supported: their state cannot be branched at a frame of the history",
            )
        } else {
            None
        };
        if let Some(reason) = refused {
            return Err(Error::File { path: path.to_path_buf(), reason: reason.into() });
        }
        let opened = file.metadata().map_err(|e| Error::File { path: path.to_path_buf(), reason: e.to_string() })?;
        let same = std::fs::metadata(path).is_ok_and(|now| (now.dev(), now.ino()) == (opened.dev(), opened.ino()));
        if !same {
            return Err(Error::File {
                path: path.to_path_buf(),
                reason: "the file was replaced while it was being loaded: load it again".into(),
            });
        }
        model.file = FileId::opened(path, Some(&opened));
        let size = opened.len();
        let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        model.identity = format!("{name} {} bytes={size} n_embd={}", model.description(), model.n_embd());
        model.token_rows = TokenRows::open(file, model.n_embd(), model.n_vocab());
        Ok(model)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file it was loaded from, as it was then.
    pub fn file(&self) -> &FileId {
        &self.file
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

    /// Append the input embedding rows of `tokens` (`n_embd` floats each) to `out`.
    pub fn token_rows(&self, tokens: &[Token], out: &mut Vec<f32>) -> Result<()> {
        let rows = self.token_rows.as_ref();
        let bad = |reason: String| Error::File { path: self.path.clone(), reason };
        let rows = rows.map_err(|e| bad(e.clone()))?;
        for &t in tokens {
            out.extend_from_slice(&rows.row(t).map_err(bad)?);
        }
        Ok(())
    }

    /// Whether a token's embedding row decodes as the token does here; `measure` is run once
    /// per loaded model (the first engine's calibration) to find out.
    pub fn rows_agree(&self, measure: impl FnOnce() -> bool) -> bool {
        *self.rows_agree.get_or_init(measure)
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
        self.token_piece(token, false)
    }

    /// The bytes of one token, special tokens rendered as their text when `special`.
    pub fn token_piece(&self, token: Token, special: bool) -> Vec<u8> {
        // (llama.cpp throws, through C and so aborting, on an id outside the vocabulary.)
        if token < 0 || token as usize >= self.n_vocab() {
            return vec![];
        }
        let mut buf = vec![0u8; 64];
        loop {
            // SAFETY: buf/len describe a writable buffer.
            let n = unsafe {
                sys::llama_token_to_piece(self.vocab(), token, buf.as_mut_ptr().cast(), buf.len() as i32, 0, special)
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
    /// reads 4 positions per embedding row of such a model. Models whose projectors libmtmd
    /// decodes non-causally (its rule by projector type: Gemma 3, Gemma 4 but its E2B/E4B with
    /// the plain vision projector, DeepSeek V4's vision) need the image's rows to attend to each
    /// other. No projector is at hand here (the NPU replaces it), so the projector types that
    /// pair with the model's architecture are checked ([`super::gguf::paired_projector_types`]);
    /// a loaded [`super::Projector`] answers for itself (`decodes_non_causally`).
    pub fn plain_embeddings_refusal(&self) -> Option<String> {
        // SAFETY: valid model pointer.
        let rope = unsafe { sys::llama_model_rope_type(self.ptr.as_ptr()) };
        let name = self.path.display();
        if rope == sys::LLAMA_ROPE_TYPE_MROPE || rope == sys::LLAMA_ROPE_TYPE_IMROPE {
            return Some(format!(
                "the language model {name} uses M-RoPE: embeddings from the NPU need 2-D M-RoPE positions that this build does not give; use backend=cpu|gpu"
            ));
        }
        let arch = self.meta_str("general.architecture").unwrap_or_default();
        let non_causal: Vec<&str> = super::gguf::paired_projector_types(&arch)
            .iter()
            .copied()
            .filter(|t| super::gguf::projector_type_non_causal(t, self.n_embd()))
            .collect();
        if !non_causal.is_empty() {
            return Some(format!(
                "the language model {name} ({arch}) takes images from {} projectors, which libmtmd decodes non-causally: embeddings from the NPU are decoded causally on 1-D positions in this build; use backend=cpu|gpu",
                non_causal.join("/")
            ));
        }
        None
    }

    /// What makes two loaded models the same model: part of every prefix key. Read from the
    /// file once, at load.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub(super) fn as_ptr(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        let ptr = self.ptr.as_ptr() as usize;
        // SAFETY: every Context and Projector holds an Arc<Model>, so none outlives this; the
        // pointer is freed once, here or on the thread `rpc::free` starts.
        let free = move || unsafe { sys::llama_model_free(ptr as *mut sys::llama_model) };
        match &self.device {
            Device::Rpc(endpoints) => super::rpc::free(endpoints, free),
            _ => free(),
        }
    }
}
