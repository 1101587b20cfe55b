//! Giving the host pages of empty KV cells back to the OS, so that a context's KV costs the
//! memory its cells use rather than the memory it reserved.
//!
//! llama.cpp clears a KV buffer when it creates it (a `memset` "to avoid NaNs in the padding"),
//! which made the whole reservation resident: a pool of 8192 cells cost its 180 MiB of RSS from
//! the start while W1 used 32 MiB of it (docs/benchmarks.md, "Memory"). The CPU backend's
//! buffers are private anonymous memory (`posix_memalign`), where `madvise(MADV_DONTNEED)`
//! hands pages back and a later touch maps a fresh zero page: it is a clear to zero that makes
//! nothing resident. So, once per process ([`lazy_zero_cpu_buffers`]), every buffer the CPU
//! buffer type allocates clears to zero that way (what is not a whole page is still `memset`),
//! and the KV costs the pages its cells have been written to.
//!
//! The same holds for the pages of cells no sequence uses any more: llama.cpp never reads an
//! empty cell's values unmasked, and zero is what it writes there itself. So a context also
//! gives back
//! - the whole KV when no cell is in use (after the engine's calibration run, or when every
//!   stream and answer has ended), and
//! - with one KV stream per sequence (`kv-layout=per-sequence`), a sequence's block when the
//!   sequence is cleared (an answer's branch, which copies its stream's whole block while it
//!   lives, when the answer ends).
//!
//! The KV tensors are not in llama.cpp's API; they are found during the first decode through
//! the scheduler's evaluation callback (`cb_eval`), as the tensors the graph's `SET_ROWS` nodes
//! write into, named `cache_*k_l*` / `cache_*v_l*`, and only those in a buffer of the CPU
//! backend's own type (never a mapped file, pinned memory or a device buffer).
//!
//! The clear needs two structs of ggml's private header (`ggml-backend-impl.h`) of the llama.cpp
//! release that `llama-cpp-sys-2` pins (`=0.1.160` in the workspace). Their offsets are checked
//! at build time against that header (`runtime/layout/kv_pages.c`, compiled by the build
//! script: a header that disagrees fails the build; one not found leaves the hook out, as
//! `cfg(kv_pages_layout)`), the Rust structs against the same offsets below, and at run time
//! the values against the public API before anything is changed; a mismatch leaves llama.cpp's
//! own clear in place (the KV is then resident from the start, until the engine's first release).
//!
//! The peak is what the hook saves: the release after the engine's calibration run uses public
//! API only, but without the hook the whole KV is resident between the context's creation and
//! that release (`runtime/tests/kv_pages.rs` checks the peak). Transparent huge pages do not
//! undo it: a KV buffer's pages are only faulted in where cells are written, and
//! `MADV_DONTNEED` splits a huge page it covers in part.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;

/// The host KV tensors of one context (see the module doc). Boxed and owned by the context;
/// llama.cpp calls [`find`] with a pointer to it, on the thread that decodes.
#[derive(Default)]
pub(super) struct HostKv {
    /// Set after the first decode: the tensors are known and the callback returns at once.
    pub(super) found: bool,
    /// (data, bytes of one stream's block, streams) of each layer's K and V tensor.
    tensors: Vec<(usize, usize, usize)>,
}

impl HostKv {
    /// Give back the pages of KV stream `stream` (every stream when `None`); the caller has
    /// made sure that no cell there is in use. Returns the bytes given back.
    pub(super) fn release(&self, stream: Option<usize>) -> usize {
        let page = page_size();
        let mut released = 0;
        for &(data, block, streams) in &self.tensors {
            let range = match stream {
                Some(s) if s < streams => data + s * block..data + (s + 1) * block,
                Some(_) => continue,
                None => data..data + streams * block,
            };
            let (start, end) = (range.start.next_multiple_of(page), range.end / page * page);
            if end > start {
                // SAFETY: [start, end) lies inside a live KV tensor of the CPU backend's buffer
                // (private anonymous memory owned by the context), whose cells there are empty:
                // after MADV_DONTNEED they read as zeros, the contents llama.cpp gives empty cells.
                if unsafe { libc::madvise(start as *mut c_void, end - start, libc::MADV_DONTNEED) } == 0 {
                    released += end - start;
                }
            }
        }
        released
    }
}

/// llama.cpp's evaluation callback (`cb_eval`): records the KV tensors the graph writes into.
/// Never asks for a node's data (returns false), so the graph computes as without it.
///
/// # Safety
/// `user` is the context's `HostKv`, used by no one else during a decode; `t` is a graph node.
pub(super) unsafe extern "C" fn find(t: *mut sys::ggml_tensor, ask: bool, user: *mut c_void) -> bool {
    // SAFETY: see the function's contract; tensors of a graph being computed are valid.
    unsafe {
        let kv = &mut *(user as *mut HostKv);
        // A SET_ROWS node is a view of the tensor it writes into (`view_src`: the base tensor,
        // whatever views or reshapes led there); its `src[0]` is what it writes.
        if !ask || kv.found || t.is_null() || (*t).op != sys::GGML_OP_SET_ROWS || (*t).view_src.is_null() {
            return false;
        }
        let layer = &*(*t).view_src;
        let name = CStr::from_ptr(layer.name.as_ptr()).to_bytes();
        let is_kv = name.starts_with(b"cache_") && (name.windows(3).any(|w| w == b"k_l" || w == b"v_l"));
        if !is_kv || layer.buffer.is_null() || layer.data.is_null() || !sys::ggml_backend_buffer_is_host(layer.buffer) {
            return false;
        }
        // The CPU backend's own buffers only ("CPU"; not "CPU_Mapped" or a pinned host type).
        if CStr::from_ptr(sys::ggml_backend_buffer_name(layer.buffer)).to_bytes() != b"CPU" {
            return false;
        }
        let entry = (layer.data as usize, layer.nb[2], layer.ne[2].max(1) as usize);
        if !kv.tensors.contains(&entry) {
            kv.tensors.push(entry);
        }
        false
    }
}

type Buft = BufferType;
type AllocFn = unsafe extern "C" fn(*mut Buft, usize) -> *mut Buffer;
type ClearFn = unsafe extern "C" fn(*mut Buffer, u8);

/// `struct ggml_backend_buffer_type_i` / `ggml_backend_buffer_type` (ggml-backend-impl.h).
#[repr(C)]
struct BufferType {
    get_name: Option<unsafe extern "C" fn(*mut Buft) -> *const c_char>,
    alloc_buffer: Option<AllocFn>,
    alloc_buffer_n: *const c_void,
    get_alignment: *const c_void,
    get_max_size: *const c_void,
    get_alloc_size: *const c_void,
    get_alloc_size_n: *const c_void,
    is_host: Option<unsafe extern "C" fn(*mut Buft) -> bool>,
    device: *mut c_void,
    context: *mut c_void,
}

/// `struct ggml_backend_buffer_i` / `ggml_backend_buffer` (ggml-backend-impl.h).
#[repr(C)]
struct Buffer {
    free_buffer: *const c_void,
    get_base: *const c_void,
    init_tensor: *const c_void,
    memset_tensor: *const c_void,
    set_tensor: *const c_void,
    get_tensor: *const c_void,
    set_tensor_2d: *const c_void,
    get_tensor_2d: *const c_void,
    cpy_tensor: *const c_void,
    clear: Option<ClearFn>,
    reset: *const c_void,
    buft: *mut Buft,
    context: *mut c_void,
    size: usize,
    usage: c_int,
}

/// The offsets `runtime/layout/kv_pages.c` checks in the C header, in pointers.
const P: usize = std::mem::size_of::<usize>();
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(offset_of!(BufferType, alloc_buffer) == P && offset_of!(BufferType, is_host) == 7 * P);
    assert!(offset_of!(BufferType, device) == 8 * P && size_of::<BufferType>() == 10 * P);
    assert!(offset_of!(Buffer, clear) == 9 * P && offset_of!(Buffer, buft) == 11 * P);
    assert!(offset_of!(Buffer, context) == 12 * P && offset_of!(Buffer, size) == 13 * P);
    assert!(offset_of!(Buffer, usage) == 14 * P);
};

/// The CPU buffer type's own allocation, and its buffers' own clear (set once each).
static ORIGINAL_ALLOC: OnceLock<AllocFn> = OnceLock::new();
static ORIGINAL_CLEAR: OnceLock<ClearFn> = OnceLock::new();

/// Buffers smaller than this clear with `memset` (a page-aligned interior is not worth it).
const LAZY_FROM: usize = 1 << 20;

/// Make the CPU buffer type's buffers clear to zero without touching their pages (see the
/// module doc). Call once, before any llama.cpp buffer exists (`init_backend`). Returns whether
/// it is in place (false when the layout check fails).
pub(super) fn lazy_zero_cpu_buffers() -> bool {
    if cfg!(not(kv_pages_layout)) {
        return false; // the header was not there to check the layout against
    }
    // SAFETY: the CPU buffer type is a static struct of ggml's that lives as long as the
    // process; its layout is checked against the public API (name, host) before its
    // allocation function is replaced, which happens before any other thread allocates
    // through it (the caller's contract).
    unsafe {
        let buft = sys::ggml_backend_cpu_buffer_type() as *mut Buft;
        let public_name = CStr::from_ptr(sys::ggml_backend_buft_name(buft.cast()));
        let (Some(get_name), Some(is_host), Some(alloc)) = ((*buft).get_name, (*buft).is_host, (*buft).alloc_buffer)
        else {
            return false;
        };
        if public_name.to_bytes() != b"CPU" || CStr::from_ptr(get_name(buft)) != public_name || !is_host(buft) {
            return false;
        }
        if ORIGINAL_ALLOC.set(alloc).is_err() {
            return true; // already in place
        }
        (*buft).alloc_buffer = Some(alloc_lazily_zeroed);
        true
    }
}

/// The CPU buffer type's allocation, whose buffers then clear lazily (checked per buffer).
unsafe extern "C" fn alloc_lazily_zeroed(buft: *mut Buft, size: usize) -> *mut Buffer {
    // SAFETY: `ORIGINAL_ALLOC` is set before this function is installed; the buffer it returns
    // is either null or a valid `ggml_backend_buffer`, whose layout is checked against the
    // public API (base, size) before its clear is replaced.
    unsafe {
        let buf = ORIGINAL_ALLOC.get().expect("set before installing")(buft, size);
        if buf.is_null() || (*buf).buft != buft || (*buf).size != size {
            return buf;
        }
        let public = (sys::ggml_backend_buffer_get_base(buf.cast()), sys::ggml_backend_buffer_get_size(buf.cast()));
        let Some(clear) = (*buf).clear else { return buf };
        if public != ((*buf).context, size) || !std::ptr::fn_addr_eq(*ORIGINAL_CLEAR.get_or_init(|| clear), clear) {
            return buf;
        }
        (*buf).clear = Some(clear_lazily);
        buf
    }
}

/// A CPU buffer's clear: to zero by giving its whole pages back, other values as before.
unsafe extern "C" fn clear_lazily(buf: *mut Buffer, value: u8) {
    // SAFETY: `buf` is a CPU buffer whose memory is [context, context + size), private
    // anonymous (posix_memalign) and owned by the buffer, checked in `alloc_lazily_zeroed`.
    unsafe {
        let (base, size) = ((*buf).context as usize, (*buf).size);
        if value == 0 && size >= LAZY_FROM && zero_lazily(base, size) {
            return;
        }
        ORIGINAL_CLEAR.get().expect("set before installing")(buf, value);
    }
}

/// Zero [base, base + size): `memset` on the partial pages at its ends, `MADV_DONTNEED` on the
/// whole pages between. False (nothing done) when the advice is refused.
///
/// # Safety
/// The range is private anonymous memory owned by the caller, used by no other thread now.
unsafe fn zero_lazily(base: usize, size: usize) -> bool {
    let page = page_size();
    let (start, end) = (base.next_multiple_of(page), (base + size) / page * page);
    // SAFETY: the caller's contract; [start, end) lies inside the range.
    unsafe {
        if end <= start || libc::madvise(start as *mut c_void, end - start, libc::MADV_DONTNEED) != 0 {
            return false;
        }
        std::ptr::write_bytes(base as *mut u8, 0, start - base);
        std::ptr::write_bytes(end as *mut u8, 0, base + size - end);
    }
    true
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}
