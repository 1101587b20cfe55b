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
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::ptr::null_mut;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;
use parking_lot::Mutex;

use super::Token;

/// Rows cached per model: a projector's wrapper tokens are a few dozen.
const CACHED: usize = 4096;

pub(super) struct TokenRows {
    /// The model file as it was opened at load (a file renamed over its path later is not read).
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
    /// Find `token_embd.weight` in the open model `file` and check that it is the table of the
    /// loaded model: `n_vocab` rows of `n_embd` floats (a model whose input rows are wider than
    /// its token table, or a table of another shape, gets no token rows). Called once, at load,
    /// on the file the model was loaded from.
    pub(super) fn open(file: File, n_embd: usize, n_vocab: usize) -> Result<TokenRows, String> {
        // The metadata of this open file, whatever its path names now: through its descriptor.
        let cpath = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("no NUL");
        // SAFETY: metadata only (no_alloc): gguf_init_from_file fills `meta` with a ggml context of
        // tensor descriptions (no data); both are freed before returning, and the tensor is read
        // while they live.
        let (offset, ty, size, ne) = unsafe {
            let mut meta: *mut sys::ggml_context = null_mut();
            let params = sys::gguf_init_params { no_alloc: true, ctx: &mut meta };
            let gguf = sys::gguf_init_from_file(cpath.as_ptr(), params);
            if gguf.is_null() {
                return Err("not a readable GGUF file".into());
            }
            let id = sys::gguf_find_tensor(gguf, c"token_embd.weight".as_ptr());
            let tensor =
                if meta.is_null() { null_mut() } else { sys::ggml_get_tensor(meta, c"token_embd.weight".as_ptr()) };
            let found = (id >= 0 && !tensor.is_null()).then(|| {
                (
                    (sys::gguf_get_data_offset(gguf) + sys::gguf_get_tensor_offset(gguf, id)) as u64,
                    sys::gguf_get_tensor_type(gguf, id),
                    sys::gguf_get_tensor_size(gguf, id),
                    (*tensor).ne,
                )
            });
            if !meta.is_null() {
                sys::ggml_free(meta);
            }
            sys::gguf_free(gguf);
            found.ok_or("no token_embd.weight tensor")?
        };
        if ne != [n_embd as i64, n_vocab as i64, 1, 1] {
            return Err(format!(
                "token_embd.weight is {} x {} (x {} x {}), not the model's {n_vocab} tokens of {n_embd} values",
                ne[1], ne[0], ne[2], ne[3]
            ));
        }
        // SAFETY: ggml_row_size takes any type id; an unknown one fails the size check below.
        let row_bytes = unsafe { sys::ggml_row_size(ty, n_embd as i64) };
        if row_bytes == 0 || size != row_bytes * n_vocab || !(ty == sys::GGML_TYPE_F32 || to_float(ty).is_some()) {
            return Err(format!("token_embd.weight of type {ty} and {size} bytes is not rows of {n_embd}"));
        }
        Ok(TokenRows { file, offset, row_bytes, n_embd, n_vocab, ty, cache: Mutex::default() })
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

#[cfg(test)]
mod tests {
    use std::ffi::CString;

    use llama_cpp_sys_2 as sys;

    use super::TokenRows;

    /// A GGUF holding only an F32 `token_embd.weight` of `rows` x `width` (row r, column c holds
    /// r * 1000 + c).
    fn table(path: &std::path::Path, width: i64, rows: i64) {
        let cpath = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a ggml context large enough for the one tensor and its data; the gguf context
        // refers to the tensor until it is written; both are freed after.
        unsafe {
            let params = sys::ggml_init_params {
                mem_size: (width * rows * 4) as usize + 4096,
                mem_buffer: std::ptr::null_mut(),
                no_alloc: false,
            };
            let ctx = sys::ggml_init(params);
            let t = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, width, rows);
            sys::ggml_set_name(t, c"token_embd.weight".as_ptr());
            let data = std::slice::from_raw_parts_mut((*t).data.cast::<f32>(), (width * rows) as usize);
            for (i, x) in data.iter_mut().enumerate() {
                *x = ((i as i64 / width) * 1000 + i as i64 % width) as f32;
            }
            let gguf = sys::gguf_init_empty();
            sys::gguf_add_tensor(gguf, t);
            assert!(sys::gguf_write_to_file(gguf, cpath.as_ptr(), false));
            sys::gguf_free(gguf);
            sys::ggml_free(ctx);
        }
    }

    #[test]
    fn a_token_table_of_another_width_gives_no_rows() {
        let dir = std::env::temp_dir().join(format!("vlm-token-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("table.gguf");
        // 8 tokens of 16 values: as many bytes as 16 tokens of 8, or 4 of 32.
        table(&path, 16, 8);
        let open = |width, vocab| TokenRows::open(std::fs::File::open(&path).unwrap(), width, vocab);
        let rows = open(16, 8).expect("the table's own shape");
        assert_eq!(&rows.row(3).unwrap()[..3], &[3000.0, 3001.0, 3002.0]);
        assert!(rows.row(8).is_err(), "a token past the table");
        for (width, vocab) in [(8, 16), (32, 4), (8, 8), (16, 9)] {
            let err = open(width, vocab).err().unwrap_or_else(|| panic!("a {vocab} x {width} model took the table"));
            assert!(err.contains("8 x 16"), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
