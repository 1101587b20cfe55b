//! A language context: KV memory, decoding, snapshots.

use std::ops::Range;
use std::ptr::{NonNull, null_mut};
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use super::kv_pages::{self, HostKv};
use super::mtmd::ImageSource;
use super::{Batch, Device, ImageEmbeddings, Model, Token};
use crate::error::{Error, Result};

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
    /// The KV tensors in host memory, whose empty cells' pages are given back (CPU contexts;
    /// `kv_pages`). Owned here, also written by llama.cpp's evaluation callback during a decode;
    /// freed after the context.
    host_kv: Option<NonNull<HostKv>>,
    /// Per-sequence copies (`seq_copy_prefix`: source, destination) waiting for the next decode,
    /// which moves the data: until then no page is given back (the source's cells may be cleared
    /// meanwhile), and no snapshot is restored into either sequence.
    copies: Vec<(i32, i32)>,
    /// No decode since the whole KV's pages were given back.
    pages_released: bool,
    /// In a unified pool, the branches holding a prefix of another sequence's cells (branch,
    /// source): a shift of the source would move their positions too.
    sharing: Vec<(i32, i32)>,
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
        let host_kv = (model.device() == &Device::Cpu).then(|| NonNull::from(Box::leak(Box::<HostKv>::default())));
        // SAFETY: default params are plain data; the model outlives the context (Arc held);
        // `host_kv` outlives the context (freed after it in Drop, or below if it is not made).
        let ptr = unsafe {
            let mut cp = sys::llama_context_default_params();
            if let Some(kv) = host_kv {
                cp.cb_eval = Some(kv_pages::find);
                cp.cb_eval_user_data = kv.as_ptr().cast();
            }
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
        let Some(ptr) = NonNull::new(ptr) else {
            if let Some(kv) = host_kv {
                // SAFETY: leaked above and never handed to a context.
                drop(unsafe { Box::from_raw(kv.as_ptr()) });
            }
            return Err(Error::Engine("llama.cpp could not create a context (out of memory?)".into()));
        };
        // SAFETY: valid context pointer; the size query only counts (no cell is in use yet).
        // (The batch read back: llama.cpp lowers it to the context's cells for causal models.)
        let (n_ctx_seq, empty_state_bytes, n_batch) = unsafe {
            (
                sys::llama_n_ctx_seq(ptr.as_ptr()),
                sys::llama_state_get_size(ptr.as_ptr()),
                sys::llama_n_batch(ptr.as_ptr()).min(sys::llama_n_ubatch(ptr.as_ptr())),
            )
        };
        // A unified pool holds every sequence's cells: one sequence's limit is the engine's.
        let n_ctx_per_seq = if p.kv_unified.is_some() { p.n_ctx_per_seq.min(n_ctx_seq) } else { n_ctx_seq };
        let plain_rows_refused = model.plain_embeddings_refusal();
        Ok(Context {
            ptr,
            model,
            n_batch,
            n_ctx_per_seq,
            unified: p.kv_unified.is_some(),
            empty_state_bytes,
            plain_rows_refused,
            host_kv,
            copies: Vec::new(),
            sharing: Vec::new(),
            pages_released: false,
        })
    }

    /// The host KV tensors once the first decode has found them (see `kv_pages`), and while no
    /// per-sequence copy waits.
    fn found_host_kv(&self) -> Option<&HostKv> {
        // SAFETY: owned by this context; llama.cpp writes it only inside a decode, which needs
        // &mut self.
        let kv = unsafe { self.host_kv?.as_ref() };
        (kv.found && self.copies.is_empty()).then_some(kv)
    }

    /// Give the pages of the whole KV back to the OS; the caller knows that no cell is in use
    /// (`kv_bytes_in_use` is 0). Returns the bytes given back (none again before a decode).
    pub fn release_all_pages(&mut self) -> usize {
        let released = match self.found_host_kv() {
            Some(kv) if !self.pages_released => kv.release(None),
            _ => return 0,
        };
        self.pages_released = true;
        released
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Threads for computations from now on (decode steps and batches alike).
    pub fn set_threads(&mut self, threads: i32) {
        // SAFETY: valid context; llama.cpp reads the counts at its next computation.
        unsafe { sys::llama_set_n_threads(self.ptr.as_ptr(), threads, threads) }
    }

    /// Whether every sequence's cells are in one pool (where a cell can belong to several).
    pub fn is_unified(&self) -> bool {
        self.unified
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
        super::clear_last_error();
        let rc = unsafe {
            let rc = sys::llama_decode(self.ptr.as_ptr(), batch.raw);
            sys::llama_synchronize(self.ptr.as_ptr());
            rc
        };
        if rc == 1 && self.unified {
            let (first, seq) = batch.first();
            return Err(Error::PoolFull(format!(
                "the unified KV pool ({} cells) has no room for {} inputs at position {first} of sequence {seq}",
                self.n_ctx(),
                batch.len()
            )));
        }
        if rc != 0 {
            let (first, seq) = batch.first();
            return Err(Error::Engine(format!(
                "llama_decode of {} inputs failed ({rc}) at position {first} of sequence {seq}{}",
                batch.len(),
                super::last_error()
            )));
        }
        self.decoded();
        Ok(())
    }

    /// After a decode: the callback has seen every KV tensor, and pending copies are done.
    fn decoded(&mut self) {
        self.copies.clear();
        self.pages_released = false;
        if let Some(mut kv) = self.host_kv {
            // SAFETY: as in `found_host_kv`; no decode runs now.
            unsafe { kv.as_mut().found = true };
        }
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
        // a lease from the projector's pool (see [`DecodeView`]): an encode may run meanwhile.
        super::clear_last_error();
        let rc = unsafe {
            let chunk = sys::mtmd_input_chunk_load(chunk.as_ptr().cast(), chunk.len());
            if chunk.is_null() {
                return Err(Error::BadInput("malformed image chunk metadata".into()));
            }
            // (The helper reads the chunk's rows of the model's input width from `data`.)
            let wanted = sys::mtmd_input_chunk_get_n_tokens(chunk) * image.width;
            if image.data.len() != wanted || image.width != self.model().n_embd() {
                sys::mtmd_input_chunk_free(chunk);
                return Err(Error::BadInput(format!(
                    "{} floats of width {} are not the image's {wanted} of width {}",
                    image.data.len(),
                    image.width,
                    self.model().n_embd()
                )));
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
        // No room in the unified pool, as for a batch of rows ([`Context::decode`]): the image's
        // batches decoded before the one that found none are taken out, so that it can be
        // decoded whole again once answers free their cells.
        if rc == 1 && self.unified {
            self.seq_truncate(seq, pos);
            return Err(Error::PoolFull(format!(
                "the unified KV pool ({} cells) has no room for an image of {} inputs at position {pos} of sequence {seq}",
                self.n_ctx(),
                image.rows
            )));
        }
        if rc != 0 {
            return Err(Error::Engine(format!(
                "decoding image embeddings failed ({rc}) at position {pos} of sequence {seq}{}",
                super::last_error()
            )));
        }
        self.decoded();
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
        self.forget_sharing(dst);
        if self.unified {
            self.sharing.push((dst, src));
        }
        // SAFETY: valid memory handle; sequence ids are < n_seq (checked by callers' allocators).
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), dst, -1, -1);
            if self.unified {
                // The prefix's cells gain `dst`'s id: shared, nothing copied.
                sys::llama_memory_seq_cp(self.memory(), src, dst, -1, end);
            } else {
                // Per-sequence streams are copied whole (a partial copy asserts): copy, then
                // drop the tail beyond the version. The data moves at the next decode.
                sys::llama_memory_seq_cp(self.memory(), src, dst, -1, -1);
                sys::llama_memory_seq_rm(self.memory(), dst, end, -1);
                self.copies.push((src, dst));
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

    /// Bytes [`Context::seq_snapshot`] of `seq` takes now (nothing is copied).
    pub fn seq_snapshot_size(&mut self, seq: i32) -> usize {
        // SAFETY: a size query on a valid context and sequence.
        unsafe { sys::llama_state_seq_get_size(self.ptr.as_ptr(), seq) }
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

    /// Whether a per-sequence copy ([`Context::seq_copy_prefix`]) from or to `seq` waits for the
    /// next decode: llama.cpp then copies the source's KV buffer over the destination's, so a
    /// snapshot restored into either before it would be overwritten, or copied along.
    pub fn copy_pending(&self, seq: i32) -> bool {
        self.copies.iter().any(|&(src, dst)| src == seq || dst == seq)
    }

    /// Replace the KV state of `seq` with a snapshot taken by [`Context::seq_snapshot`] from a
    /// compatible context. llama.cpp validates the layout and refuses a mismatch. Refused while
    /// a copy from or to `seq` is pending ([`Context::copy_pending`]: callers prefill instead).
    pub fn seq_restore(&mut self, seq: i32, snapshot: &[u8]) -> Result<()> {
        if self.copy_pending(seq) {
            return Err(Error::Engine(format!("sequence {seq} not restored: a KV copy waits for the next decode")));
        }
        self.forget_sharing(seq);
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

    /// The largest position a history may reach when a slide drops its oldest frames without
    /// moving the rest (leaving a gap of positions), if the model takes such gaps: M-RoPE
    /// models, whose positions may jump forward (llama.cpp cannot shift them), up to the
    /// context the model was trained on.
    pub fn position_gap_limit(&self) -> Option<i32> {
        // SAFETY: valid model handle.
        let (rope, trained) = unsafe {
            (sys::llama_model_rope_type(self.model.as_ptr()), sys::llama_model_n_ctx_train(self.model.as_ptr()))
        };
        (rope == sys::LLAMA_ROPE_TYPE_MROPE || rope == sys::LLAMA_ROPE_TYPE_IMROPE).then_some(trained)
    }

    /// Forget the positions `from..to` of `seq`, leaving the later cells where they are.
    pub fn seq_drop(&mut self, seq: i32, from: i32, to: i32) {
        // SAFETY: valid memory handle.
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), seq, from, to);
        }
    }

    /// Whether a branch holds a prefix of `seq`'s cells (a unified pool shares them): moving
    /// `seq`'s positions would move the branch's too.
    pub fn shares_cells(&self, seq: i32) -> bool {
        self.sharing.iter().any(|&(_, src)| src == seq)
    }

    fn forget_sharing(&mut self, dst: i32) {
        self.sharing.retain(|&(d, _)| d != dst);
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
        debug_assert!(!self.shares_cells(seq), "a shift would move a branch's positions");
        // SAFETY: valid memory handle.
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), seq, from, to);
            sys::llama_memory_seq_add(self.memory(), seq, to, -1, from - to);
        }
    }

    /// Why this context cannot shift positions in place, if it cannot: M-RoPE positions are
    /// not one number a cell. (In a unified pool a shift also needs no branch to share the
    /// sequence's cells: [`Context::shares_cells`].)
    pub fn shift_refusal(&self) -> Option<String> {
        // SAFETY: valid model and memory handles.
        let (rope, can_shift) =
            unsafe { (sys::llama_model_rope_type(self.model.as_ptr()), sys::llama_memory_can_shift(self.memory())) };
        if rope == sys::LLAMA_ROPE_TYPE_MROPE || rope == sys::LLAMA_ROPE_TYPE_IMROPE {
            return Some(format!("{} uses M-RoPE", self.model.path().display()));
        }
        (!can_shift).then(|| "llama.cpp cannot shift this model's KV cache".into())
    }

    /// Forget every cell of `seq`; with per-sequence KV, give its block's pages back (an
    /// answer's branch holds a whole copy of its stream's block while it lives).
    pub fn seq_clear(&mut self, seq: i32) {
        self.forget_sharing(seq);
        // SAFETY: valid memory handle.
        unsafe {
            sys::llama_memory_seq_rm(self.memory(), seq, -1, -1);
        }
        if !self.unified
            && let Some(kv) = self.found_host_kv()
        {
            kv.release(Some(seq as usize));
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let ptr = self.ptr.as_ptr() as usize;
        // SAFETY: the context is owned and not used after this; it is freed once, here or on the
        // thread `rpc::free` starts.
        let free = move || unsafe { sys::llama_free(ptr as *mut sys::llama_context) };
        match self.model.device() {
            super::Device::Rpc(endpoints) => super::rpc::free(endpoints, free),
            _ => free(),
        }
        if let Some(kv) = self.host_kv {
            // SAFETY: leaked in `new` for this context, which is freed now (a CPU context's
            // free runs above, on this thread).
            drop(unsafe { Box::from_raw(kv.as_ptr()) });
        }
    }
}
