//! libmtmd's projector and the image embeddings it encodes.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use llama_cpp_sys_2 as sys;
use parking_lot::{Condvar, Mutex};

use super::cut::{Cutter, Layout, Place, Prepared};
use super::gguf::TileGeometry;
use super::model::{FileId, c_path};
use super::{Model, Token, check_readable, init_backend};
use crate::error::{Error, Result};

// Defined by libmtmd as this project builds it (scripts/llama/mtmd-edits.cmake, which makes the
// encoder contexts of one projector file share its weights and SmolVLM's layers read Q, K and V
// as one matrix).
unsafe extern "C" {
    fn gst_vlm_clip_weight_copies(fname: *const std::ffi::c_char, users: *mut usize) -> usize;
    fn gst_vlm_clip_fused_qkv_layers(fname: *const std::ffi::c_char) -> std::ffi::c_int;
}

#[derive(Clone, Copy)]
struct MtmdPtr(NonNull<sys::mtmd_context>);

// SAFETY: an mtmd context is used by one thread at a time: the one holding its lease from the
// Projector's pool (except through [`DecodeView`]).
unsafe impl Send for MtmdPtr {}

/// The most encoder contexts one projector loads.
pub const MAX_ENCODER_CONTEXTS: usize = 16;

/// The projector's encoder contexts: libmtmd contexts loaded from the one file, each encoding
/// one image at a time. An encode leases one and, for a frame of several tiles, every other
/// one free at that moment, so the tiles of a frame and the frames of several streams are
/// encoded side by side (on a GPU each context has its own streams and graphs).
///
/// A context returned goes to the encode that has waited longest among those of streams a
/// reader waits on (a question waiting for the frame, a standing alert: the stream's
/// [`Demand`]), and otherwise to the encode that has waited longest, background ones
/// ([`Turn::background`]) after the others: never to one that asks
/// later (a new frame taking it as it comes back would send the waiting one to the back, again
/// and again under load). A frame takes contexts beyond its first only while no other frame
/// waits for one.
struct Contexts {
    pool: Mutex<Pool>,
    returned: Condvar,
    /// Every context loaded (freed in the Projector's Drop), the first being the decode view's.
    loaded: Mutex<Vec<MtmdPtr>>,
    /// How many are loaded (read without waiting for a load in progress).
    count: std::sync::atomic::AtomicUsize,
}

/// How many readers wait for a stream's next frames (questions waiting for a frame not yet
/// published, standing alerts): the stream's (`Stream::demand`), read by the encoder to put
/// that stream's frames first and by the engine to put their ingestion first.
pub type Demand = Arc<std::sync::atomic::AtomicUsize>;

/// What an encode goes with: its stream's [`Demand`] (while a reader waits on the stream, its
/// encodes go first) and what says it is no longer wanted (its element flushing or stopping):
/// it then stops waiting for a context and encodes no further image, ending in
/// [`Error::Cancelled`], so a flush or a state change never waits behind other streams' encodes.
///
/// A `background` encode (a picture encoded again that nothing waits for: `vlmencode`'s
/// `max-unchanged` refresh) goes after the other encodes waiting (passed at most
/// [`MAX_PASSED`] times, as any), takes a context one image at a time, so that a frame that
/// comes meanwhile waits for one image at most, and does not count as an encode that needs the
/// cores (`encode-first` pauses no answer for it).
#[derive(Clone, Copy, Default)]
pub struct Turn<'a> {
    pub demand: Option<&'a Demand>,
    pub cancelled: Option<&'a (dyn Fn() -> bool + Sync)>,
    pub background: bool,
}

impl<'a> Turn<'a> {
    /// The turn of an encode for the stream whose demand is given.
    pub fn of(demand: Option<&'a Demand>) -> Turn<'a> {
        Turn { demand, ..Turn::default() }
    }

    fn cancelled(&self) -> bool {
        self.cancelled.is_some_and(|c| c())
    }
}

/// How often an encode waiting for a context looks whether it is still wanted.
const CANCEL_POLL: Duration = Duration::from_millis(20);

/// One context leased from the pool, returned when dropped.
struct Lease<'a> {
    ctx: Option<MtmdPtr>,
    pool: &'a Contexts,
    since: Instant,
}

impl Lease<'_> {
    fn ptr(&self) -> *mut sys::mtmd_context {
        self.ctx.as_ref().expect("held until dropped").0.as_ptr()
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx.take() {
            self.pool.give(ctx, self.since.elapsed());
        }
    }
}

/// An encode waiting for a context: its place in the order of arrival, its stream's demand and,
/// once granted, its context.
struct Waiter {
    ticket: u64,
    demand: Option<Demand>,
    background: bool,
    granted: Option<MtmdPtr>,
    /// Times an encode that goes first (a waited-on stream's, or any before a background one)
    /// was granted a context before it, the longest-waiting.
    passed: u32,
}

/// Most times the longest-waiting encode is passed by encodes that go first: a stream nobody
/// waits on is never held back for good by streams that always have readers (standing alerts
/// count as readers for as long as they stand), nor a background encode by a busy encoder.
const MAX_PASSED: u32 = 2;

/// The contexts free now and the encodes waiting for one, in their order of arrival; the time
/// contexts were leased since `measured` ([`Contexts::busy_share`]).
#[derive(Default)]
struct Pool {
    free: Vec<MtmdPtr>,
    waiting: std::collections::VecDeque<Waiter>,
    next_ticket: u64,
    busy: Duration,
    measured: Option<Instant>,
}

impl Pool {
    /// Hand the free contexts to the waiting encodes whose turn it is: a waited-on stream's
    /// longest-waiting encode first, then the longest-waiting of the others, background encodes
    /// last; the longest-waiting of all is passed at most [`MAX_PASSED`] times. Whether anything
    /// was granted.
    fn grant(&mut self) -> bool {
        // (0 goes first.)
        fn rank(w: &Waiter) -> u8 {
            match w {
                _ if w.demand.as_ref().is_some_and(|d| d.load(Ordering::Acquire) > 0) => 0,
                Waiter { background: false, .. } => 1,
                _ => 2,
            }
        }
        let mut granted = false;
        while !self.free.is_empty() {
            let mut open = self.waiting.iter_mut().filter(|w| w.granted.is_none());
            let Some(first) = open.next() else { break };
            let mut before: Option<&mut Waiter> = None;
            if first.passed < MAX_PASSED {
                for w in open {
                    if rank(w) < before.as_deref().map_or(rank(first), rank) {
                        before = Some(w);
                    }
                }
            }
            let next = match before {
                Some(w) => {
                    first.passed += 1;
                    w
                }
                None => first,
            };
            next.granted = self.free.pop();
            granted = true;
        }
        granted
    }

    /// An encode that waits no longer: its context, if one was granted, goes to the next.
    fn leave(&mut self, ticket: u64) -> Option<MtmdPtr> {
        let at = self.waiting.iter().position(|w| w.ticket == ticket).expect("a waiting encode");
        self.waiting.remove(at).expect("in range").granted
    }
}

impl Contexts {
    fn new(first: MtmdPtr) -> Contexts {
        Contexts {
            pool: Mutex::new(Pool { free: vec![first], measured: Some(Instant::now()), ..Pool::default() }),
            returned: Condvar::new(),
            loaded: Mutex::new(vec![first]),
            count: 1.into(),
        }
    }

    /// A context, waiting behind the encodes whose turn comes first (see [`Contexts`]), or
    /// [`Error::Cancelled`] once the turn is no longer wanted.
    fn lease(&self, turn: Turn<'_>) -> Result<Lease<'_>> {
        let mut pool = self.pool.lock();
        if pool.waiting.is_empty()
            && let Some(ctx) = pool.free.pop()
        {
            return Ok(Lease { ctx: Some(ctx), pool: self, since: Instant::now() });
        }
        let ticket = pool.next_ticket;
        pool.next_ticket += 1;
        let background = turn.background;
        pool.waiting.push_back(Waiter { ticket, demand: turn.demand.cloned(), background, granted: None, passed: 0 });
        if pool.grant() {
            self.returned.notify_all();
        }
        while pool.waiting.iter().any(|w| w.ticket == ticket && w.granted.is_none()) {
            if turn.cancelled() {
                // A context granted meanwhile goes to the next in turn.
                if let Some(ctx) = pool.leave(ticket) {
                    pool.free.push(ctx);
                    if pool.grant() {
                        self.returned.notify_all();
                    }
                }
                return Err(Error::Cancelled);
            }
            self.returned.wait_for(&mut pool, CANCEL_POLL);
        }
        Ok(Lease { ctx: pool.leave(ticket), pool: self, since: Instant::now() })
    }

    /// Up to `n` contexts free now, without waiting; none while another encode waits for one.
    fn lease_free(&self, n: usize) -> Vec<Lease<'_>> {
        let mut pool = self.pool.lock();
        if !pool.waiting.is_empty() {
            return vec![];
        }
        let at = pool.free.len().saturating_sub(n);
        let since = Instant::now();
        pool.free.drain(at..).map(|ctx| Lease { ctx: Some(ctx), pool: self, since }).collect()
    }

    /// A context back in the pool (returned after `busy` leased, or newly loaded): granted to
    /// the encode whose turn it is.
    fn give(&self, ctx: MtmdPtr, busy: Duration) {
        let mut pool = self.pool.lock();
        pool.busy += busy;
        pool.free.push(ctx);
        if pool.grant() {
            self.returned.notify_all();
        }
    }

    /// The share of the loaded contexts' time they were leased (a lease counted when it ends)
    /// since the last measure, once `window` has passed since it (`None` before); the next
    /// measure starts now.
    fn busy_share(&self, window: Duration) -> Option<f64> {
        self.busy_share_at(window, Instant::now())
    }

    /// [`Contexts::busy_share`] measured at `now`.
    fn busy_share_at(&self, window: Duration, now: Instant) -> Option<f64> {
        let mut pool = self.pool.lock();
        let since = now.saturating_duration_since(pool.measured?);
        if since < window {
            return None;
        }
        let contexts = self.count.load(Ordering::Acquire).max(1) as f64;
        let share = std::mem::take(&mut pool.busy).as_secs_f64() / (since.as_secs_f64() * contexts);
        pool.measured = Some(now);
        Some(share)
    }
}

/// An image's index among a frame's images, and its rows.
type EncodedImage = (usize, Box<[f32]>);

/// A chunk of a tokenized frame, encoded on another thread: libmtmd only reads a chunk while
/// encoding it (its preprocessed pixels) and writes the encoding context's own output.
#[derive(Clone, Copy)]
pub(super) struct ChunkPtr(pub(super) *const sys::mtmd_input_chunk);
// SAFETY: see above; the chunks outlive the scoped threads that encode them.
unsafe impl Send for ChunkPtr {}
unsafe impl Sync for ChunkPtr {}

/// A picture prepared for its encode: its layout, the rows of the images reused, the images to
/// encode (`todo`) and their chunks (`images[i]` for each `i` of `todo`), kept alive by the
/// owners beside them.
struct Preparation {
    layout: Arc<Layout>,
    rows_of: Vec<Option<Box<[f32]>>>,
    todo: Vec<usize>,
    images: Vec<ChunkPtr>,
    _whole: Option<OwnedChunks>,
    _cut: Vec<(usize, Prepared)>,
    count: TileCount,
}

/// Chunks libmtmd tokenized (freed on drop).
pub(super) struct OwnedChunks(NonNull<sys::mtmd_input_chunks>);

impl OwnedChunks {
    pub(super) fn new() -> Result<OwnedChunks> {
        // SAFETY: a new empty list, owned by the value.
        NonNull::new(unsafe { sys::mtmd_input_chunks_init() })
            .map(OwnedChunks)
            .ok_or_else(|| Error::Engine("mtmd_input_chunks_init failed".into()))
    }

    pub(super) fn ptr(&self) -> *mut sys::mtmd_input_chunks {
        self.0.as_ptr()
    }

    /// Every chunk, text and images, in order (valid while `self` lives).
    pub(super) fn all(&self) -> Vec<ChunkPtr> {
        // SAFETY: valid chunks; the indices are in range.
        unsafe {
            (0..sys::mtmd_input_chunks_size(self.ptr()))
                .map(|i| ChunkPtr(sys::mtmd_input_chunks_get(self.ptr(), i)))
                .collect()
        }
    }

    /// The image chunks, in order.
    pub(super) fn images(&self) -> Vec<ChunkPtr> {
        // SAFETY: valid chunks.
        self.all()
            .into_iter()
            .filter(|c| unsafe { sys::mtmd_input_chunk_get_type(c.0) } != sys::MTMD_INPUT_CHUNK_TYPE_TEXT)
            .collect()
    }
}

impl Drop for OwnedChunks {
    fn drop(&mut self) {
        // SAFETY: owned chunks from mtmd_input_chunks_init, not used after this.
        unsafe { sys::mtmd_input_chunks_free(self.ptr()) }
    }
}

// SAFETY: the chunks are plain data owned by this value; libmtmd keeps no reference to them.
unsafe impl Send for OwnedChunks {}

/// The projector's mtmd context as `mtmd_helper_decode_image_chunk` uses it while a language
/// context decodes an image: it reads only what `mtmd_init_from_file` fixed (the position type
/// for M-RoPE, the projector type and width for the attention rule: `mtmd_decode_use_mrope`,
/// `mtmd_decode_use_non_causal`) and never the encoder's state; `mtmd_tokenize` (a frame's
/// preparation, a const function) reads the same. So a decode or a preparation leases no encoder
/// context, and an answer's decode steps never wait behind a vision encode that holds one for
/// its whole run.
pub(super) struct DecodeView(pub(super) NonNull<sys::mtmd_context>);
// SAFETY: only the load-time fields above are read through it, which nothing writes after
// `mtmd_init_from_file`; the context outlives the view (both are the Projector's, freed in its
// Drop).
unsafe impl Send for DecodeView {}
unsafe impl Sync for DecodeView {}

/// A loaded libmtmd projector (vision tower + projector), bound to the language model whose
/// vocabulary and embedding width it uses.
pub struct Projector {
    /// What prepares a tiled picture's images one by one on the second context ([`Cutter`]):
    /// with two encoder contexts or more.
    cutter: OnceLock<Cutter>,
    contexts: Contexts,
    pub(super) decode_view: DecodeView,
    path: PathBuf,
    /// The file's version its first context loaded: no context is added from another.
    file: FileId,
    model: Arc<Model>,
    marker: CString,
    use_gpu: bool,
    /// A tiled projector's tiles, where its pictures are resized here
    /// ([`resample`](super::resample)) before libmtmd cuts them.
    tiled: Option<TileGeometry>,
    /// Threads that resize a picture and prepare its tiles (0: libmtmd prepares it whole on the
    /// encode's thread).
    prepare_threads: std::sync::atomic::AtomicUsize,
    /// CPU threads each context encodes on (0 on a GPU): counted while it encodes
    /// ([`crate::threads::CpuEncode`]).
    cpu_threads: std::sync::atomic::AtomicUsize,
    /// A context failed to load (no memory left, or the file changed): [`Projector::load_failed`].
    load_failed: std::sync::atomic::AtomicBool,
}

/// The most threads one picture's resize is split over.
pub const PREPARE_THREADS: usize = 4;

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
    pub(super) source: ImageSource,
}

/// Who produced image embeddings, which says how they are decoded.
pub(super) enum ImageSource {
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

/// Where an image of a frame comes from in the picture: one cell of the grid libmtmd cut the
/// picture into (idefics3/SmolVLM tiles: 1-based `row` and `col` of `rows` × `cols`, as the
/// `<row_R_col_C>` markers before it say), or the whole picture (an overview, or a projector
/// that encodes the picture as one image).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tile {
    Cell { row: u32, col: u32, rows: u32, cols: u32 },
    Whole,
}

impl Tile {
    /// The part of a `width` × `height` picture the tile shows, as (x0, y0, x1, y1) pixels:
    /// libmtmd resizes the whole picture to the grid, so a cell is a fraction of it.
    pub fn region(&self, width: u32, height: u32) -> (u32, u32, u32, u32) {
        match *self {
            Tile::Whole => (0, 0, width, height),
            Tile::Cell { row, col, rows, cols } => (
                (col - 1) * width / cols,
                (row - 1) * height / rows,
                (col * width).div_ceil(cols),
                (row * height).div_ceil(rows),
            ),
        }
    }
}

/// The markers of a frame's images (the wrapper text before each), as tiles: `None` for an
/// image whose place cannot be told.
pub(super) fn tiles(markers: &[String]) -> Vec<Option<Tile>> {
    let cell = |m: &str| -> Option<(u32, u32)> {
        let at = m.rfind("<row_")?;
        let (row, rest) = m[at + 5..].split_once("_col_")?;
        let col = rest.split('>').next()?;
        Some((row.parse().ok()?, col.parse().ok()?))
    };
    let cells: Vec<Option<(u32, u32)>> = markers.iter().map(|m| cell(m)).collect();
    let rows = cells.iter().flatten().map(|c| c.0).max().unwrap_or(0);
    let cols = cells.iter().flatten().map(|c| c.1).max().unwrap_or(0);
    markers
        .iter()
        .zip(cells)
        .map(|(m, c)| match c {
            Some((row, col)) if row >= 1 && col >= 1 => Some(Tile::Cell { row, col, rows, cols }),
            Some(_) => None,
            None if markers.len() == 1 || m.contains("<global-img>") => Some(Tile::Whole),
            None => None,
        })
        .collect()
}

/// How a frame's images were made: encoded, or taken from an earlier frame (tile reuse), and
/// where each image is in the picture.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TileCount {
    pub encoded: usize,
    pub reused: usize,
    /// Encoder contexts the encoded images were spread over (0 when none was encoded).
    pub contexts: usize,
    /// One per image segment, in order.
    pub tiles: Vec<Option<Tile>>,
    /// Whether the picture was cut into its tiles here, each prepared on its own (a tiled
    /// projector's picture of a size libmtmd has prepared before), rather than prepared whole
    /// by libmtmd.
    pub cut: bool,
    /// Where the call's time went (ms): preparing the picture on the CPU (libmtmd's resize,
    /// tiling and normalisation), waiting for an encoder context, and encoding on the contexts.
    pub prepare_ms: f64,
    pub wait_ms: f64,
    pub encode_ms: f64,
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
    pub mmproj: FileId,
    pub model: FileId,
    pub use_gpu: bool,
}

/// Flash attention in the projectors loaded from now on: libmtmd's own choice (on where the
/// backend has it) unless set (0 unset, 1 off, 2 on).
static PROJECTOR_FLASH_ATTENTION: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Set flash attention in the vision encoders of the projectors loaded from now on (`None`:
/// libmtmd's automatic choice, the default): for a comparison with llama-server, whose `-fa`
/// sets its projector's too.
pub fn set_projector_flash_attention(on: Option<bool>) {
    PROJECTOR_FLASH_ATTENTION.store(on.map_or(0, |on| 1 + on as u8), Ordering::Relaxed);
}

/// Each of `contexts` contexts' share of `threads` CPU threads.
fn threads_each(threads: i32, contexts: usize) -> i32 {
    (threads / contexts.max(1) as i32).max(1)
}

/// One libmtmd context of the projector at `path` (`max_tokens`: its image token limit, as
/// `--image-max-tokens`; the file's own where `None`).
fn load_context(
    path: &Path,
    model: &Model,
    use_gpu: bool,
    threads: i32,
    max_tokens: Option<usize>,
) -> Result<NonNull<sys::mtmd_context>> {
    let cpath = c_path(path)?;
    // SAFETY: default params are plain data; the model outlives the projector (Arc held).
    let ptr = unsafe {
        let mut p = sys::mtmd_context_params_default();
        p.use_gpu = use_gpu;
        p.n_threads = threads;
        p.print_timings = false;
        p.warmup = true;
        match PROJECTOR_FLASH_ATTENTION.load(Ordering::Relaxed) {
            1 => p.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED,
            2 => p.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            _ => (),
        }
        if let Some(n) = max_tokens {
            p.image_max_tokens = n as i32;
        }
        sys::mtmd_init_from_file(cpath.as_ptr(), model.as_ptr(), p)
    };
    NonNull::new(ptr).ok_or_else(|| Error::File {
        path: path.to_path_buf(),
        reason: format!(
            "libmtmd could not load it as a projector for {} (a truncated or other kind of file, or its output width does not match the model's {})",
            model.path().display(),
            model.n_embd()
        ),
    })
}

impl Projector {
    /// Load the projector with `contexts` encoder contexts (1 to [`MAX_ENCODER_CONTEXTS`]) sharing
    /// `threads` CPU threads (each at least one).
    pub fn load(path: &Path, model: Arc<Model>, use_gpu: bool, threads: i32, contexts: usize) -> Result<Projector> {
        init_backend();
        check_readable(path, "mmproj")?;
        super::gguf::check_projector(path, &model)?;
        let file = FileId::of(path);
        let first = load_context(path, &model, use_gpu, threads_each(threads, contexts), None)?;
        // SAFETY: the default marker is a static NUL-terminated string.
        let marker = unsafe { CStr::from_ptr(sys::mtmd_default_marker()) }.to_owned();
        let projector = Projector {
            contexts: Contexts::new(MtmdPtr(first)),
            decode_view: DecodeView(first),
            path: path.to_path_buf(),
            file,
            model,
            marker,
            use_gpu,
            // Handed its tiled size, libmtmd copies a picture instead of resizing it only where
            // the longest edge is whole tiles (otherwise it resizes it back to that edge).
            tiled: super::gguf::tile_geometry(path).filter(|g| g.longest_edge % g.tile == 0),
            prepare_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(PREPARE_THREADS)).into(),
            cutter: OnceLock::new(),
            cpu_threads: if use_gpu { 0 } else { threads_each(threads, contexts) as usize }.into(),
            load_failed: false.into(),
        };
        projector.ensure_contexts(contexts, threads)?;
        Ok(projector)
    }

    /// Load encoder contexts until there are `contexts` (at most [`MAX_ENCODER_CONTEXTS`]), the
    /// new ones sharing `threads` as [`Projector::load`] does.
    pub fn ensure_contexts(&self, contexts: usize, threads: i32) -> Result<()> {
        let contexts = contexts.clamp(1, MAX_ENCODER_CONTEXTS);
        let mut loaded = self.contexts.loaded.lock();
        if !self.use_gpu && loaded.len() < contexts {
            self.cpu_threads.store(threads_each(threads, contexts) as usize, Ordering::Relaxed);
        }
        while loaded.len() < contexts {
            // The second context of a tiled projector takes one tile at most: it encodes as the
            // others do, and prepares the tiles of a picture cut here ([`Cutter`]).
            let tile_view = self.tiled.filter(|_| loaded.len() == 1).and_then(|g| Some((g.tile, g.tokens?)));
            let max_tokens = tile_view.map(|(_, tokens)| tokens);
            let ctx = load_context(&self.path, &self.model, self.use_gpu, threads_each(threads, contexts), max_tokens)
                // (Checked after the load: a file replaced while it loaded may have been read.)
                .and_then(|ctx| match self.unchanged(loaded.len()) {
                    Ok(()) => Ok(ctx),
                    Err(e) => {
                        // SAFETY: the context was just loaded and is referenced nowhere else.
                        unsafe { sys::mtmd_free(ctx.as_ptr()) };
                        Err(e)
                    }
                })
                .inspect_err(|_| self.load_failed.store(true, Ordering::Relaxed))?;
            loaded.push(MtmdPtr(ctx));
            self.contexts.count.store(loaded.len(), Ordering::Release);
            self.contexts.give(MtmdPtr(ctx), Duration::ZERO);
            if let Some((tile, tokens)) = tile_view {
                let _ = self.cutter.set(Cutter::new(DecodeView(ctx), tile, tokens));
            }
        }
        Ok(())
    }

    /// Whether the file is still the one the `loaded` contexts came from: a context loaded from a
    /// file replaced since would encode with other weights than theirs.
    fn unchanged(&self, loaded: usize) -> Result<()> {
        if loaded == 0 || FileId::of(&self.path) == self.file {
            return Ok(());
        }
        Err(Error::File {
            path: self.path.clone(),
            reason: format!(
                "changed on disk since this projector loaded it: it keeps its {loaded} encoder context(s) (an encoder started now loads the new file)"
            ),
        })
    }

    /// Split each picture's resize over `threads` threads (0: leave it to libmtmd, on the
    /// encode's thread, as before; for comparisons).
    pub fn set_prepare_threads(&self, threads: usize) {
        self.prepare_threads.store(threads, Ordering::Relaxed);
    }

    /// Whether pictures are resized here before libmtmd sees them (a tiled projector, threads
    /// set).
    pub fn resizes_pictures(&self) -> bool {
        self.tiled.is_some() && self.prepare_threads.load(Ordering::Relaxed) > 0
    }

    /// The picture as libmtmd's tiled preprocessor resizes it, resized here on several threads
    /// (bit for bit the same), or `None` where libmtmd resizes it itself.
    fn presized(&self, rgb: &[u8], width: u32, height: u32) -> Option<(Vec<u8>, u32, u32)> {
        let TileGeometry { tile, longest_edge: edge, .. } = self.tiled?;
        let threads = self.prepare_threads.load(Ordering::Relaxed);
        let ((rw, rh), (tw, th)) = super::resample::tiled_sizes(width, height, tile, edge);
        if threads == 0 || (tw, th) == (width, height) {
            return None;
        }
        let (w, h) = (width as usize, height as usize);
        let mut picture = super::resample::resize_lanczos(rgb, w, h, rw as usize, rh as usize, threads);
        if (rw, rh) != (tw, th) {
            picture =
                super::resample::resize_lanczos(&picture, rw as usize, rh as usize, tw as usize, th as usize, threads);
        }
        Some((picture, tw, th))
    }

    /// The file its contexts were loaded from, as it was then.
    pub fn file(&self) -> &FileId {
        &self.file
    }

    /// How many encoder contexts are loaded.
    pub fn contexts(&self) -> usize {
        self.contexts.count.load(Ordering::Acquire)
    }

    /// The copies of the weights of the projector file at `path` loaded in the process (one a
    /// device while the file is unchanged: every encoder context of it reads the same, whichever
    /// projector loaded it) and the encoder contexts reading them.
    pub fn weight_copies(path: &Path) -> Result<(usize, usize)> {
        let cpath = c_path(path)?;
        let mut users = 0;
        // SAFETY: a NUL-terminated path and a place for the count, both alive for the call.
        let copies = unsafe { gst_vlm_clip_weight_copies(cpath.as_ptr(), &mut users) };
        Ok((copies, users))
    }

    /// The layers of the loaded weights of the projector file at `path` that read Q, K and V as
    /// one matrix (0 where none are loaded or none does).
    pub fn fused_qkv_layers(path: &Path) -> Result<usize> {
        let cpath = c_path(path)?;
        // SAFETY: a NUL-terminated path alive for the call.
        Ok(unsafe { gst_vlm_clip_fused_qkv_layers(cpath.as_ptr()) }.max(0) as usize)
    }

    /// Whether a context failed to load (no memory left for another, or the file changed).
    pub fn load_failed(&self) -> bool {
        self.load_failed.load(Ordering::Relaxed)
    }

    /// The share of the loaded contexts' time that encodes held them since the last measure,
    /// once `window` has passed since it (`None` before); the next measure starts now.
    pub fn busy_share(&self, window: Duration) -> Option<f64> {
        self.contexts.busy_share(window)
    }

    /// Whether its contexts encode on the GPU.
    pub fn uses_gpu(&self) -> bool {
        self.use_gpu
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Whether libmtmd decodes this projector's images non-causally (`mtmd_decode_use_non_causal`:
    /// the image's rows attend to each other, so they are decoded whole).
    pub fn decodes_non_causally(&self) -> bool {
        // SAFETY: a valid mtmd context; a null chunk asks about its vision projector, reading only
        // what mtmd_init_from_file fixed (see DecodeView).
        unsafe { sys::mtmd_decode_use_non_causal(self.decode_view.0.as_ptr(), std::ptr::null()) }
    }

    /// Hold every encoder context as an encode holds one for its whole run, until the guard
    /// drops: stands in for long encodes in tests (decodes of this projector's images must go on).
    #[doc(hidden)]
    pub fn hold_encoder(&self) -> impl Sized + '_ {
        let n = self.contexts();
        (0..n).map(|_| self.contexts.lease(Turn::default()).expect("never cancelled")).collect::<Vec<_>>()
    }

    /// Encode one packed RGB image (width × height × 3 bytes) into the segments it becomes in
    /// the language sequence.
    pub fn encode(self: &Arc<Self>, rgb: &[u8], width: u32, height: u32) -> Result<Vec<Segment>> {
        Ok(self.encode_tiles(rgb, width, height, &mut |_, _| None, Turn::default())?.0)
    }

    /// [`Projector::encode`], asking `reuse` first for each image (its tile, its rows): rows of
    /// an earlier encode of the same tile are taken instead of encoding it. `turn`: the
    /// stream's demand, whose waiting readers put its encode before other streams' (see
    /// [`Contexts`]), and when to give up ([`Turn`]).
    pub fn encode_tiles(
        self: &Arc<Self>,
        rgb: &[u8],
        width: u32,
        height: u32,
        reuse: &mut dyn FnMut(Tile, usize) -> Option<Box<[f32]>>,
        turn: Turn<'_>,
    ) -> Result<(Vec<Segment>, TileCount)> {
        let started = Instant::now();
        let mut prep = self.prepare(rgb, width, height, reuse)?;
        // SAFETY: `images[i]` for each `i` of `todo` is a valid image chunk of this projector's
        // tokenization (or of its tile context: the same images), alive with `prep`.
        let (encoded, contexts, wait_ms) =
            unsafe { self.encode_chunks(&prep.images, &prep.todo, self.model.n_embd(), turn) }?;
        let count = &mut prep.count;
        count.contexts = contexts;
        count.wait_ms = wait_ms;
        count.encode_ms = started.elapsed().as_secs_f64() * 1e3 - count.prepare_ms - wait_ms;
        for (i, rows) in encoded {
            prep.rows_of[i] = Some(rows);
        }
        let rows = prep.rows_of.into_iter().map(|r| r.expect("every image reused or encoded")).collect();
        Ok((prep.layout.segments(rows, self), prep.count))
    }

    /// Prepare a picture as an encode does, and encode nothing: for the preparation's benchmark.
    #[doc(hidden)]
    pub fn prepare_picture(&self, rgb: &[u8], width: u32, height: u32) -> Result<TileCount> {
        Ok(self.prepare(rgb, width, height, &mut |_, _| None)?.count)
    }

    /// A picture's preparation: resized before libmtmd where it can be, then cut into its tiles
    /// here where libmtmd has prepared a picture of its size before (see `cut`), or tokenized
    /// whole by libmtmd, whose layout is then kept for the next pictures of its size; each image
    /// asked of `reuse` first, and the others' chunks made ready to encode.
    fn prepare(
        &self,
        rgb: &[u8],
        width: u32,
        height: u32,
        reuse: &mut dyn FnMut(Tile, usize) -> Option<Box<[f32]>>,
    ) -> Result<Preparation> {
        if width == 0 || height == 0 || rgb.len() != width as usize * height as usize * 3 {
            return Err(Error::BadInput(format!(
                "image of {width}x{height} with {} bytes is not packed RGB",
                rgb.len()
            )));
        }
        // A tiled preprocessor sets the longest edge: a picture more than that many times wider
        // than high (or higher than wide) would be resized to nothing, here and in libmtmd.
        if let Some(TileGeometry { tile, longest_edge, .. }) = self.tiled
            && let ((0, _) | (_, 0), _) = super::resample::tiled_sizes(width, height, tile, longest_edge)
        {
            return Err(Error::BadInput(format!(
                "image of {width}x{height}: this projector resizes its longest edge to {longest_edge} px, which leaves \
                 the other under one pixel (an aspect ratio of at most {longest_edge}:1 fits)"
            )));
        }
        let n_embd = self.model.n_embd();
        let mut count = TileCount::default();
        let started = Instant::now();
        let presized = self.presized(rgb, width, height);
        let (rgb, width, height) = presized.as_ref().map_or((rgb, width, height), |(p, w, h)| (&p[..], *w, *h));
        let cutter = self.cutter.get().filter(|_| self.resizes_pictures());
        let (layout, whole) = match cutter.and_then(|c| c.layout(width, height)) {
            Some(layout) => (layout, None),
            None => {
                let chunks = tokenize(&self.decode_view, &self.marker, rgb, width, height)?;
                // SAFETY: the chunks of this projector's tokenization, alive for the call.
                let layout = Arc::new(unsafe { Layout::of(&chunks.all(), self) }?);
                if let Some(cutter) = cutter {
                    cutter.keep(width, height, &layout);
                }
                (layout, Some(chunks))
            }
        };
        let places: Vec<&Place> = layout.places().collect();
        count.tiles = places.iter().map(|p| p.tile).collect();
        let rows_of: Vec<Option<Box<[f32]>>> = places
            .iter()
            .map(|p| p.tile.and_then(|t| reuse(t, p.rows)).filter(|d| d.len() == p.rows * n_embd))
            .collect();
        count.reused = rows_of.iter().flatten().count();
        let todo: Vec<usize> = (0..places.len()).filter(|&i| rows_of[i].is_none()).collect();
        count.encoded = todo.len();
        let (images, cut) = match &whole {
            Some(chunks) => (chunks.images(), vec![]),
            None => {
                let cutter = cutter.expect("a kept layout is the cutter's");
                let cut = self.prepare_cut(cutter, rgb, width, height, &places, &todo)?;
                let mut images = vec![ChunkPtr(std::ptr::null()); places.len()];
                for (i, p) in &cut {
                    images[*i] = p.image;
                }
                count.cut = true;
                (images, cut)
            }
        };
        count.prepare_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(Preparation { layout, rows_of, todo, images, _whole: whole, _cut: cut, count })
    }

    /// Prepare images `todo` of a picture cut here, each on its own, spread over the prepare
    /// threads (the overview first: the longest).
    fn prepare_cut(
        &self,
        cutter: &Cutter,
        picture: &[u8],
        width: u32,
        height: u32,
        places: &[&Place],
        todo: &[usize],
    ) -> Result<Vec<(usize, Prepared)>> {
        let mut order = todo.to_vec();
        order.sort_by_key(|&i| !matches!(places[i].tile, Some(Tile::Whole)));
        let threads = self.prepare_threads.load(Ordering::Relaxed).clamp(1, order.len().max(1));
        let next = std::sync::atomic::AtomicUsize::new(0);
        on_threads(vec![(); threads], |_| {
            let mut out = vec![];
            while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                out.push((i, cutter.prepare(picture, width, height, places[i], &self.marker)?));
            }
            Ok(out)
        })
    }

    /// Encode `images[i]` for each `i` of `todo` on a context (waiting for one) and on every other
    /// context free then (one thread each, taking the next image as they finish): each image's
    /// rows by its index, how many contexts encoded them and how long the first took to come (ms).
    ///
    /// # Safety
    /// The chunks are valid image chunks of this projector's tokenization, alive for the call.
    unsafe fn encode_chunks(
        &self,
        images: &[ChunkPtr],
        todo: &[usize],
        n_embd: usize,
        turn: Turn<'_>,
    ) -> Result<(Vec<EncodedImage>, usize, f64)> {
        if todo.is_empty() {
            return Ok((vec![], 0, 0.0));
        }
        let encode_one = |ctx: &Lease<'_>, i: usize| -> Result<EncodedImage> {
            if turn.cancelled() {
                return Err(Error::Cancelled);
            }
            let c = images[i].0;
            // SAFETY: the caller's chunks; the context is leased to this thread; its output holds
            // the chunk's rows after a successful encode.
            unsafe {
                let rc = sys::mtmd_encode_chunk(ctx.ptr(), c);
                if rc != 0 {
                    return Err(Error::Engine(format!("mtmd_encode_chunk failed ({rc})")));
                }
                let rows = sys::mtmd_input_chunk_get_n_tokens(c);
                Ok((i, std::slice::from_raw_parts(sys::mtmd_get_output_embd(ctx.ptr()), rows * n_embd).into()))
            }
        };
        let asked = Instant::now();
        if turn.background {
            // One image a lease: an encode that comes meanwhile goes before the next image.
            let (mut out, mut wait_ms) = (vec![], 0.0);
            for &i in todo {
                let asked = Instant::now();
                let ctx = self.contexts.lease(turn)?;
                wait_ms += asked.elapsed().as_secs_f64() * 1e3;
                // (Not counted as an encode that needs the cores: no answer pauses for it.)
                out.push(encode_one(&ctx, i)?);
            }
            return Ok((out, 1, wait_ms));
        }
        let mut leases = vec![self.contexts.lease(turn)?];
        let wait_ms = asked.elapsed().as_secs_f64() * 1e3;
        leases.extend(self.contexts.lease_free(todo.len() - 1));
        let used = leases.len();
        let _cores = (!self.use_gpu)
            .then(|| crate::threads::CpuEncode::begin(used * self.cpu_threads.load(Ordering::Relaxed).max(1)));
        let next = std::sync::atomic::AtomicUsize::new(0);
        let encode_on = |ctx: &Lease<'_>| -> Result<Vec<EncodedImage>> {
            let mut out = vec![];
            while let Some(&i) = todo.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                out.push(encode_one(ctx, i)?);
            }
            Ok(out)
        };
        Ok((on_threads(leases, |ctx| encode_on(ctx))?, used, wait_ms))
    }
}

/// libmtmd's tokenization of a packed RGB picture of `width` × `height` (checked by the caller)
/// on `view`'s context with `marker` as its text: the picture resized, tiled and normalised on
/// the CPU. It reads only what loading fixed, as llama-server's request threads do beside its
/// encodes: no context is leased for it, so pictures are prepared side by side while others
/// encode.
pub(super) fn tokenize(view: &DecodeView, marker: &CStr, rgb: &[u8], width: u32, height: u32) -> Result<OwnedChunks> {
    let chunks = OwnedChunks::new()?;
    // SAFETY: the bitmap copies `rgb` (w*h*3 bytes); the input text points at `marker`, alive
    // for the call.
    unsafe {
        let bitmap = sys::mtmd_bitmap_init(width, height, rgb.as_ptr());
        if bitmap.is_null() {
            return Err(Error::Engine("mtmd_bitmap_init failed".into()));
        }
        let text = sys::mtmd_input_text {
            text: marker.as_ptr(),
            text_len: marker.to_bytes().len(),
            add_special: false,
            parse_special: true,
        };
        let bitmaps = [bitmap as *const sys::mtmd_bitmap];
        let rc = sys::mtmd_tokenize(view.0.as_ptr(), chunks.ptr(), &text, bitmaps.as_ptr(), 1);
        sys::mtmd_bitmap_free(bitmap);
        if rc != 0 {
            return Err(Error::Engine(format!("mtmd_tokenize of a {width}x{height} picture failed ({rc})")));
        }
    }
    Ok(chunks)
}

/// Run `work` once for each of `workers` (the first on the calling thread, the others on threads
/// of their own) and gather what they return, or the first error.
fn on_threads<W: Send, T: Send>(workers: Vec<W>, work: impl Fn(&W) -> Result<Vec<T>> + Sync) -> Result<Vec<T>> {
    let mut workers = workers.into_iter();
    let Some(first) = workers.next() else { return Ok(vec![]) };
    if workers.len() == 0 {
        return work(&first);
    }
    let work = &work;
    std::thread::scope(|scope| {
        let others: Vec<_> = workers.map(|w| scope.spawn(move || work(&w))).collect();
        let mut all = work(&first);
        for other in others {
            let out =
                other.join().unwrap_or_else(|_| Err(Error::Engine("a preparation or encode thread panicked".into())));
            match (&mut all, out) {
                (Ok(all), Ok(out)) => all.extend(out),
                (Ok(_), Err(e)) => all = Err(e),
                (Err(_), _) => {}
            }
        }
        all
    })
}

impl Drop for Projector {
    fn drop(&mut self) {
        for ctx in self.contexts.loaded.get_mut().drain(..) {
            // SAFETY: owned contexts, no other user (we are being dropped).
            unsafe { sys::mtmd_free(ctx.0.as_ptr()) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama-cpp-sys-2 rebuilds llama.cpp when a GGML_* variable changes, not when the libmtmd
    /// edit does: `.cargo/config.toml`'s GGML_GST_VLM_EDITS names the edit's hash, so that a
    /// changed edit cannot leave a target directory with the libmtmd of the one before.
    #[test]
    fn the_build_names_the_libmtmd_edit_it_compiles() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let edit = std::fs::read(root.join("scripts/llama/mtmd-edits.cmake")).unwrap();
        let token = format!("mtmd-edits-{:016x}", xxhash_rust::xxh3::xxh3_64(&edit));
        let config = std::fs::read_to_string(root.join(".cargo/config.toml")).unwrap();
        assert!(
            config.contains(&format!("GGML_GST_VLM_EDITS = \"{token}\"")),
            "scripts/llama/mtmd-edits.cmake changed: set GGML_GST_VLM_EDITS = \"{token}\" in .cargo/config.toml"
        );
    }

    #[test]
    fn markers_give_the_grid_and_the_overview() {
        let m = |s: &str| s.to_string();
        let t = tiles(&[
            m("<fake_token_around_image><row_1_col_1>"),
            m("<fake_token_around_image><row_1_col_2>"),
            m("\n<fake_token_around_image><row_2_col_1>"),
            m("<fake_token_around_image><row_2_col_2>"),
            m("\n\n<fake_token_around_image><global-img>"),
        ]);
        let cell = |row, col| Some(Tile::Cell { row, col, rows: 2, cols: 2 });
        assert_eq!(t, [cell(1, 1), cell(1, 2), cell(2, 1), cell(2, 2), Some(Tile::Whole)]);
        assert_eq!(Tile::Cell { row: 2, col: 1, rows: 2, cols: 3 }.region(64, 48), (0, 24, 22, 48));
        assert_eq!(tiles(&[m("<image>")]), [Some(Tile::Whole)]);
        assert_eq!(tiles(&[m(""), m("")]), [None, None], "several images with no markers");
    }

    /// A pool of stand-in contexts (never dereferenced: only the pool's bookkeeping runs).
    fn pool(n: usize) -> Contexts {
        let ptr = || MtmdPtr(NonNull::dangling());
        let pool = Contexts::new(ptr());
        for _ in 1..n {
            pool.give(ptr(), Duration::ZERO);
        }
        pool.count.store(n, Ordering::Release);
        pool
    }

    /// The busy share is the time leases held contexts over the loaded contexts' time, measured
    /// once a window has passed, from then on.
    #[test]
    fn the_busy_share_is_the_leased_time_over_the_contexts_time() {
        let pool = pool(2);
        let start = pool.pool.lock().measured.expect("measured from the start");
        let at = |secs| start + Duration::from_secs(secs);
        let window = Duration::from_secs(5);
        assert_eq!(pool.busy_share_at(window, at(4)), None, "before its window");
        // A lease's time counts when it ends.
        drop(pool.lease(Turn::default()).unwrap());
        let leased = pool.pool.lock().busy;
        pool.pool.lock().busy = leased + Duration::from_secs(15);
        let share = pool.busy_share_at(window, at(10)).expect("a window has passed");
        let expected = (leased.as_secs_f64() + 15.0) / 20.0;
        assert!((share - expected).abs() < 1e-9, "15 s busy of 2 contexts x 10 s: {share}");
        assert_eq!(pool.busy_share_at(window, at(14)), None, "a new window began at 10 s");
        assert_eq!(pool.busy_share_at(window, at(20)), Some(0.0), "nothing leased since");
    }

    fn waiting(pool: &Contexts, n: usize) {
        while pool.pool.lock().waiting.len() < n {
            std::thread::yield_now();
        }
    }

    /// Three encodes wait, in order, for the one context; its holder returns it and at once asks
    /// again: the three get it first, in their order, and the holder after them.
    #[test]
    fn a_returned_context_goes_to_the_encode_that_waited_longest() {
        let pool = pool(1);
        let order = std::sync::Mutex::new(vec![]);
        let held = pool.lease(Turn::default()).unwrap();
        std::thread::scope(|scope| {
            for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
                let (pool, order) = (&pool, &order);
                scope.spawn(move || {
                    let _lease = pool.lease(Turn::default()).unwrap();
                    order.lock().unwrap().push(name);
                });
                waiting(pool, i + 1);
            }
            drop(held);
            let _again = pool.lease(Turn::default()).unwrap();
            order.lock().unwrap().push("holder");
        });
        assert_eq!(*order.lock().unwrap(), ["a", "b", "c", "holder"]);
    }

    /// Encodes of three streams wait for the one context, in order; a question starts waiting on
    /// the last stream's frame, then on the second's: the context goes to the last stream's
    /// encode (the longest-waiting of waited-on streams), then the second's, then the first's.
    #[test]
    fn a_stream_a_reader_waits_on_is_encoded_first() {
        let pool = pool(1);
        let order = std::sync::Mutex::new(vec![]);
        let demands: Vec<Demand> = (0..3).map(|_| Demand::default()).collect();
        let held = pool.lease(Turn::default()).unwrap();
        std::thread::scope(|scope| {
            for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
                let (pool, order, demand) = (&pool, &order, &demands[i]);
                scope.spawn(move || {
                    let _lease = pool.lease(Turn::of(Some(demand))).unwrap();
                    order.lock().unwrap().push(name);
                });
                waiting(pool, i + 1);
            }
            demands[2].fetch_add(1, Ordering::AcqRel);
            demands[1].fetch_add(1, Ordering::AcqRel);
            drop(held);
        });
        assert_eq!(*order.lock().unwrap(), ["b", "c", "a"]);
    }

    /// Streams with readers at every turn (standing alerts) pass the encode of a stream without
    /// any at most `MAX_PASSED` times: then it has the context.
    #[test]
    fn an_encode_nobody_waits_on_is_passed_only_so_often() {
        let mut pool = Pool::default();
        let demand = Demand::new(1.into());
        let waiter = |ticket, demand: Option<&Demand>| Waiter {
            ticket,
            demand: demand.cloned(),
            background: false,
            granted: None,
            passed: 0,
        };
        pool.waiting.push_back(waiter(0, None));
        let mut granted = vec![];
        for ticket in 1..=MAX_PASSED as u64 + 1 {
            pool.waiting.push_back(waiter(ticket, Some(&demand)));
            pool.free.push(MtmdPtr(NonNull::dangling()));
            assert!(pool.grant());
            let at = pool.waiting.iter().position(|w| w.granted.is_some()).unwrap();
            let ticket = pool.waiting[at].ticket;
            granted.push(ticket);
            pool.leave(ticket);
        }
        assert_eq!(granted, [1, 2, 0], "the encode nobody waits on waited for good");
    }

    /// A background encode (a refresh nothing waits for) waits behind an encode that asked
    /// after it.
    #[test]
    fn a_background_encode_waits_behind_the_encodes_after_it() {
        let pool = pool(1);
        let order = std::sync::Mutex::new(vec![]);
        let held = pool.lease(Turn::default()).unwrap();
        std::thread::scope(|scope| {
            for (i, (name, background)) in [("refresh", true), ("frame", false)].into_iter().enumerate() {
                let (pool, order) = (&pool, &order);
                scope.spawn(move || {
                    let _lease = pool.lease(Turn { background, ..Turn::default() }).unwrap();
                    order.lock().unwrap().push(name);
                });
                waiting(pool, i + 1);
            }
            drop(held);
        });
        assert_eq!(*order.lock().unwrap(), ["frame", "refresh"]);
    }

    /// An encode whose turn is cancelled (its element flushing) stops waiting while the context
    /// is still held, and leaves its place to the encode behind it.
    #[test]
    fn an_encode_no_longer_wanted_stops_waiting_for_a_context() {
        let pool = pool(1);
        let held = pool.lease(Turn::default()).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let cancelled = || stop.load(Ordering::Acquire);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let pool = &pool;
            scope.spawn(move || {
                let turn = Turn { cancelled: Some(&cancelled), ..Turn::default() };
                let _ = tx.send(pool.lease(turn).err());
            });
            waiting(pool, 1);
            let next = scope.spawn(|| pool.lease(Turn::default()).is_ok());
            waiting(pool, 2);
            stop.store(true, Ordering::Release);
            let gave_up = rx.recv_timeout(Duration::from_secs(60));
            drop(held);
            assert!(matches!(gave_up, Ok(Some(Error::Cancelled))), "still waiting: {gave_up:?}");
            assert!(next.join().unwrap(), "the encode behind it got the context");
        });
        assert_eq!(pool.pool.lock().waiting.len(), 0);
    }

    /// A frame takes extra contexts only while no other frame waits for one.
    #[test]
    fn extra_contexts_are_not_taken_while_another_encode_waits() {
        let pool = pool(3);
        let first = pool.lease(Turn::default()).unwrap();
        // An encode waiting for a context.
        pool.pool.lock().waiting.push_back(Waiter {
            ticket: 7,
            demand: None,
            background: false,
            granted: None,
            passed: 0,
        });
        assert!(pool.lease_free(2).is_empty(), "an extra context taken from a waiting encode");
        pool.pool.lock().waiting.clear();
        assert_eq!(pool.lease_free(5).len(), 2, "the free contexts once nobody waits");
        drop(first);
    }
}
