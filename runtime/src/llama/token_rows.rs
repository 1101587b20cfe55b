//! A language model's input embedding rows for tokens, read from its GGUF file
//! (`token_embd.weight`) and dequantized with ggml's own routines: what lets a frame's wrapper
//! text (SmolVLM's `<fake_token_around_image><row_1_col_1>` between tiles) go into one batch of
//! embedding rows with the frame's image rows, one `llama_decode` a frame instead of one a
//! segment (issue 17: on a GPU a small model's decode costs its kernel launches, about the
//! same for 4 inputs as for 500, and a 13-tile frame had 27 segments).
//!
//! Whether a model's graph treats a token's row as it treats the token (it does not where the
//! token path alone is scaled, as in Gemma) is measured by the engine's calibration run
//! (`Model::rows_agree`), never assumed.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;
use parking_lot::Mutex;

use super::Token;

/// Rows cached per model: a projector's wrapper tokens are a few dozen.
const CACHED: usize = 4096;

pub(super) struct TokenRows {
    file: File,
    /// File offset of token 0's row, bytes of one row, floats in a row, tokens.
    offset: u64,
    row_bytes: usize,
    n_embd: usize,
    n_vocab: usize,
    ty: sys::ggml_type,
    cache: Mutex<HashMap<Token, Arc<[f32]>>>,
}

impl TokenRows {
    /// Find `token_embd.weight` in the model file (`n_embd` floats a row).
    pub(super) fn open(path: &Path, n_embd: usize) -> Result<TokenRows, String> {
        let cpath = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: metadata only (no_alloc); the context is freed before returning.
        let (offset, ty, size) = unsafe {
            let params = sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() };
            let gguf = sys::gguf_init_from_file(cpath.as_ptr(), params);
            if gguf.is_null() {
                return Err("not a readable GGUF file".into());
            }
            let id = sys::gguf_find_tensor(gguf, c"token_embd.weight".as_ptr());
            let found = (id >= 0).then(|| {
                (
                    (sys::gguf_get_data_offset(gguf) + sys::gguf_get_tensor_offset(gguf, id)) as u64,
                    sys::gguf_get_tensor_type(gguf, id),
                    sys::gguf_get_tensor_size(gguf, id),
                )
            });
            sys::gguf_free(gguf);
            found.ok_or("no token_embd.weight tensor")?
        };
        // SAFETY: ggml_row_size takes any type id; an unknown one fails the size check below.
        let row_bytes = unsafe { sys::ggml_row_size(ty, n_embd as i64) };
        if row_bytes == 0 || size % row_bytes != 0 || !(ty == sys::GGML_TYPE_F32 || to_float(ty).is_some()) {
            return Err(format!("token_embd.weight of type {ty} and {size} bytes is not rows of {n_embd}"));
        }
        let file = File::open(path).map_err(|e| e.to_string())?;
        Ok(TokenRows { file, offset, row_bytes, n_embd, n_vocab: size / row_bytes, ty, cache: Mutex::default() })
    }

    /// The input embedding row of `token`.
    pub(super) fn row(&self, token: Token) -> Result<Arc<[f32]>, String> {
        if let Some(row) = self.cache.lock().get(&token) {
            return Ok(Arc::clone(row));
        }
        let index = usize::try_from(token).ok().filter(|&t| t < self.n_vocab).ok_or(format!("token {token}"))?;
        let mut bytes = vec![0u8; self.row_bytes];
        self.file
            .read_exact_at(&mut bytes, self.offset + (index * self.row_bytes) as u64)
            .map_err(|e| format!("reading token {token}'s row: {e}"))?;
        let mut row = vec![0f32; self.n_embd];
        match to_float(self.ty) {
            // SAFETY: `bytes` holds one row of `n_embd` values of the tensor's type, `row` room
            // for as many floats: what ggml's row conversion reads and writes.
            Some(convert) => unsafe { convert(bytes.as_ptr().cast(), row.as_mut_ptr(), self.n_embd as i64) },
            None => row
                .iter_mut()
                .zip(bytes.chunks_exact(4))
                .for_each(|(f, b)| *f = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
        let row: Arc<[f32]> = row.into();
        let mut cache = self.cache.lock();
        if cache.len() >= CACHED {
            cache.clear();
        }
        cache.insert(token, Arc::clone(&row));
        Ok(row)
    }
}

/// ggml's conversion of a row of `ty` to floats (none for F32 itself).
fn to_float(ty: sys::ggml_type) -> Option<unsafe extern "C" fn(*const std::ffi::c_void, *mut f32, i64)> {
    // SAFETY: ggml returns its static traits table entry for a valid type id.
    unsafe {
        let traits = sys::ggml_get_type_traits(ty);
        if traits.is_null() { None } else { (*traits).to_float }
    }
}
