//! The plain-libmtmd reference of the family checks (`runtime/tests/families.rs` and
//! `runtime/examples/families.rs`): a language model and its projector loaded a second time,
//! straight through llama-cpp-sys-2 and apart from the runtime's [`Model`] and
//! [`Projector`](crate::llama::Projector) (which keep their pointers private), to run libmtmd's own
//! helpers (`mtmd_helper_eval_chunks`, what llama.cpp's mtmd-cli runs, and
//! `mtmd_helper_get_n_pos`) on the same prompt as the runtime, so that the runtime's positions and
//! greedy tokens can be compared with libmtmd's. Not used by the runtime itself.

use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr::{NonNull, null_mut};

use llama_cpp_sys_2 as sys;

use super::model::c_path;
use super::{Model, Token, argmax, init_backend};
use crate::error::{Error, Result};

/// Width of a [`picture`], the only size [`Reference::chunks`] takes.
pub const PICTURE_WIDTH: u32 = 64;
/// Height of a [`picture`].
pub const PICTURE_HEIGHT: u32 = 48;

/// A deterministic 64x48 RGB picture; different `variant`s give different pictures.
pub fn picture(variant: u32) -> Vec<u8> {
    let (w, h) = (PICTURE_WIDTH, PICTURE_HEIGHT);
    let mut v = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let on = ((x + variant * 7) / 8 + y / 8).is_multiple_of(2);
            v.extend_from_slice(&[(x * 4) as u8, (y * 5) as u8, if on { 230 } else { (20 + 30 * variant) as u8 }]);
        }
    }
    v
}

/// Pictures `0..frames`, the frames of the family checks in order.
pub fn pictures(frames: usize) -> Vec<Vec<u8>> {
    (0..frames as u32).map(picture).collect()
}

/// libmtmd's default image marker: where a picture goes in a prompt's text.
pub fn marker() -> String {
    // SAFETY: libmtmd's default marker is a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::mtmd_default_marker()) }.to_string_lossy().into_owned()
}

/// The runtime's prompt with `frames` pictures as one text for libmtmd: the model's chat template
/// around `system`, the frames' markers and `question`, with the assistant's turn opened; and the
/// length of its history, the text up to the end of the last marker. [`Reference::history`] and
/// [`Reference::whole`] give it the runtime's system prompt (`prompt::DEFAULT_SYSTEM_PROMPT`): they
/// are implemented beside it, in `prompt/reference.rs`, so that `llama` reads nothing built on it.
pub fn prompt(model: &Model, system: &str, frames: usize, question: &str) -> Result<(String, usize)> {
    let marker = marker();
    let user = format!("{}\n{question}", marker.repeat(frames));
    let full = model.apply_chat_template(&[("system", system), ("user", &user)], true)?;
    let history_end = full
        .rfind(&marker)
        .map(|i| i + marker.len())
        .ok_or_else(|| Error::Config("the template dropped the frames".into()))?;
    Ok((full, history_end))
}

/// A language model and its projector loaded through llama-cpp-sys-2 alone, on the CPU.
pub struct Reference {
    model: NonNull<sys::llama_model>,
    mtmd: NonNull<sys::mtmd_context>,
    threads: i32,
}

/// Chunks of one prompt as libmtmd tokenized it (freed on drop).
pub struct Chunks {
    ptr: NonNull<sys::mtmd_input_chunks>,
    /// The reference's projector that made them (the only one that may evaluate them).
    mtmd: NonNull<sys::mtmd_context>,
}

impl Drop for Chunks {
    fn drop(&mut self) {
        // SAFETY: owned chunks from mtmd_input_chunks_init, not used after this.
        unsafe { sys::mtmd_input_chunks_free(self.ptr.as_ptr()) }
    }
}

impl Chunks {
    /// Chunks: runs of text tokens and images.
    pub fn len(&self) -> usize {
        // SAFETY: valid chunks.
        unsafe { sys::mtmd_input_chunks_size(self.ptr.as_ptr()) }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions the chunks take in the language sequence (`mtmd_helper_get_n_pos`).
    pub fn n_pos(&self) -> i32 {
        // SAFETY: valid chunks.
        unsafe { sys::mtmd_helper_get_n_pos(self.ptr.as_ptr()) }
    }

    /// One line a chunk: a text chunk with its tokens as `reference` renders them, an image chunk
    /// with its rows and positions.
    pub fn describe(&self, reference: &Reference) -> Vec<String> {
        let mut lines = vec![];
        let mut pos = 0;
        for i in 0..self.len() {
            // SAFETY: i < size; the chunk and its token buffer live as long as self.
            unsafe {
                let c = sys::mtmd_input_chunks_get(self.ptr.as_ptr(), i);
                let n_pos = sys::mtmd_input_chunk_get_n_pos(c);
                if sys::mtmd_input_chunk_get_type(c) == sys::MTMD_INPUT_CHUNK_TYPE_TEXT {
                    let mut n = 0usize;
                    let p = sys::mtmd_input_chunk_get_tokens_text(c, &mut n);
                    let tokens = if n == 0 { &[][..] } else { std::slice::from_raw_parts(p, n) };
                    let text = reference.render(tokens);
                    let shown = if text.chars().count() > 60 {
                        format!("{}...", text.chars().take(57).collect::<String>())
                    } else {
                        text
                    };
                    lines.push(format!("{i:>2} text  {n:>3} tokens  pos {pos:>3}..  {shown:?}"));
                } else {
                    let rows = sys::mtmd_input_chunk_get_n_tokens(c);
                    lines.push(format!("{i:>2} image {rows:>3} rows (n_pos {n_pos:>3})  pos {pos:>3}.."));
                }
                pos += n_pos;
            }
        }
        lines
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        // SAFETY: owned; the mtmd context refers to the model, so it goes first.
        unsafe {
            sys::mtmd_free(self.mtmd.as_ptr());
            sys::llama_model_free(self.model.as_ptr());
        }
    }
}

impl Reference {
    /// Load the pair on the CPU; libmtmd and the contexts of [`Reference::eval_and_generate`]
    /// compute with `threads` threads.
    pub fn load(lm: &Path, mmproj: &Path, threads: i32) -> Result<Reference> {
        init_backend();
        let (lm_c, mmproj_c) = (c_path(lm)?, c_path(mmproj)?);
        // SAFETY: default params are plain data; a device list of one null entry keeps the model
        // on the CPU and outlives the load; both paths are NUL-terminated and outlive the calls;
        // the model is freed if the projector fails, else owned by the returned value.
        unsafe {
            let mut mp = sys::llama_model_default_params();
            let mut devices: [sys::ggml_backend_dev_t; 1] = [null_mut()];
            mp.devices = devices.as_mut_ptr();
            mp.n_gpu_layers = 0;
            let model = NonNull::new(sys::llama_model_load_from_file(lm_c.as_ptr(), mp)).ok_or_else(|| {
                Error::File { path: lm.to_path_buf(), reason: "reference model: llama.cpp could not load it".into() }
            })?;
            let mut p = sys::mtmd_context_params_default();
            p.use_gpu = false;
            p.n_threads = threads;
            p.print_timings = false;
            let Some(mtmd) = NonNull::new(sys::mtmd_init_from_file(mmproj_c.as_ptr(), model.as_ptr(), p)) else {
                sys::llama_model_free(model.as_ptr());
                return Err(Error::File {
                    path: mmproj.to_path_buf(),
                    reason: "reference projector: libmtmd could not load it".into(),
                });
            };
            Ok(Reference { model, mtmd, threads })
        }
    }

    fn vocab(&self) -> *const sys::llama_vocab {
        // SAFETY: valid model.
        unsafe { sys::llama_model_get_vocab(self.model.as_ptr()) }
    }

    /// Tokens as text, special tokens with their own text.
    pub fn render(&self, tokens: &[Token]) -> String {
        let mut bytes = vec![];
        for &t in tokens {
            let mut buf = [0u8; 128];
            // SAFETY: buf/len describe a writable buffer.
            let n = unsafe { sys::llama_token_to_piece(self.vocab(), t, buf.as_mut_ptr().cast(), 128, 0, true) };
            bytes.extend_from_slice(&buf[..n.clamp(0, 128) as usize]);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// libmtmd's tokenization of `text`, its markers replaced by the first `pictures` in order
    /// (each a [`picture`]: 64x48 packed RGB).
    pub fn chunks(&self, text: &str, pictures: &[Vec<u8>]) -> Result<Chunks> {
        let n_markers = text.matches(&marker()).count();
        let pictures = pictures.get(..n_markers).ok_or_else(|| {
            Error::BadInput(format!("{n_markers} markers in the text but {} pictures", pictures.len()))
        })?;
        let size = (PICTURE_WIDTH * PICTURE_HEIGHT * 3) as usize;
        if let Some(p) = pictures.iter().find(|p| p.len() != size) {
            return Err(Error::BadInput(format!(
                "a picture of {} bytes is not {PICTURE_WIDTH}x{PICTURE_HEIGHT} packed RGB",
                p.len()
            )));
        }
        let text_c = CString::new(text).map_err(|_| Error::BadInput("text contains a NUL byte".into()))?;
        // SAFETY: each bitmap copies its picture (64*48*3 bytes, checked above) and is freed after
        // tokenizing (mtmd_bitmap_free accepts null); the text outlives the call; the chunks are
        // owned by the returned value.
        unsafe {
            let ptr = NonNull::new(sys::mtmd_input_chunks_init())
                .ok_or_else(|| Error::Engine("mtmd_input_chunks_init failed".into()))?;
            let chunks = Chunks { ptr, mtmd: self.mtmd };
            let bitmaps: Vec<*const sys::mtmd_bitmap> = pictures
                .iter()
                .map(|rgb| {
                    sys::mtmd_bitmap_init(PICTURE_WIDTH, PICTURE_HEIGHT, rgb.as_ptr()) as *const sys::mtmd_bitmap
                })
                .collect();
            let input = sys::mtmd_input_text {
                text: text_c.as_ptr(),
                text_len: text.len(),
                add_special: true,
                parse_special: true,
            };
            let rc = if bitmaps.iter().any(|b| b.is_null()) {
                None
            } else {
                Some(sys::mtmd_tokenize(self.mtmd.as_ptr(), ptr.as_ptr(), &input, bitmaps.as_ptr(), bitmaps.len()))
            };
            for b in bitmaps {
                sys::mtmd_bitmap_free(b as *mut _);
            }
            match rc {
                Some(0) => Ok(chunks),
                Some(rc) => Err(Error::Engine(format!("mtmd_tokenize failed ({rc})"))),
                None => Err(Error::Engine("mtmd_bitmap_init failed".into())),
            }
        }
    }

    /// `mtmd_helper_eval_chunks` of `chunks` into a fresh context (what mtmd-cli does), then up to
    /// `n` greedy tokens (fewer when an end-of-generation token comes first): (n_past after the
    /// chunks, tokens).
    pub fn eval_and_generate(&self, chunks: &Chunks, n: u32) -> Result<(i32, Vec<Token>)> {
        if chunks.mtmd != self.mtmd {
            return Err(Error::BadInput("chunks tokenized by another reference".into()));
        }
        // SAFETY: the chunks were tokenized by this reference's projector (checked above); the
        // context is created from the valid model and freed before return; each batch is
        // allocated for one token (one position: llama.cpp reads one per token, M-RoPE or not)
        // and freed after use; a non-null logits row holds n_vocab floats and is read before the
        // next decode.
        unsafe {
            let vocab = self.vocab();
            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = 1024;
            cp.n_batch = 512;
            cp.n_ubatch = 512;
            cp.n_seq_max = 1;
            cp.n_threads = self.threads;
            cp.n_threads_batch = self.threads;
            cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
            let ctx = NonNull::new(sys::llama_init_from_model(self.model.as_ptr(), cp))
                .ok_or_else(|| Error::Engine("reference context: llama.cpp could not create it".into()))?;
            let ctx = ctx.as_ptr();
            let mut n_past = 0;
            let rc = sys::mtmd_helper_eval_chunks(
                self.mtmd.as_ptr(),
                ctx,
                chunks.ptr.as_ptr(),
                0,
                0,
                512,
                true,
                &mut n_past,
            );
            let mut out = vec![];
            let mut failed = (rc != 0).then(|| format!("mtmd_helper_eval_chunks failed ({rc})"));
            let n_vocab = sys::llama_vocab_n_tokens(vocab) as usize;
            for pos in n_past..n_past + n as i32 {
                if failed.is_some() {
                    break;
                }
                let row = sys::llama_get_logits_ith(ctx, -1);
                if row.is_null() {
                    failed = Some(format!("no logits at {pos}"));
                    break;
                }
                let token = argmax(std::slice::from_raw_parts(row, n_vocab));
                if sys::llama_vocab_is_eog(vocab, token) {
                    break;
                }
                out.push(token);
                if out.len() == n as usize {
                    break;
                }
                let mut b = sys::llama_batch_init(1, 0, 1);
                *b.token = token;
                *b.pos = pos;
                *b.n_seq_id = 1;
                **b.seq_id = 0;
                *b.logits = 1;
                b.n_tokens = 1;
                let rc = sys::llama_decode(ctx, b);
                sys::llama_batch_free(b);
                if rc != 0 {
                    failed = Some(format!("llama_decode failed ({rc}) at {pos}"));
                }
            }
            sys::llama_free(ctx);
            match failed {
                Some(e) => Err(Error::Engine(e)),
                None => Ok((n_past, out)),
            }
        }
    }
}
