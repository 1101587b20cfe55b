/* The layout `llama::kv_pages` mirrors (runtime/src/llama/kv_pages.rs: `BufferType`, `Buffer`),
 * checked against ggml's private header of the llama.cpp that llama-cpp-sys-2 builds: the
 * runtime's build script compiles this file, and the hook is only built in when it compiles.
 * Offsets are counted in pointers, as the Rust structs (`#[repr(C)]`) state them. */
#include <stddef.h>
#include "ggml-backend-impl.h"

#define P sizeof(void *)

_Static_assert(offsetof(struct ggml_backend_buffer_type, iface.get_name) == 0 * P, "get_name");
_Static_assert(offsetof(struct ggml_backend_buffer_type, iface.alloc_buffer) == 1 * P, "alloc_buffer");
_Static_assert(offsetof(struct ggml_backend_buffer_type, iface.is_host) == 7 * P, "is_host");
_Static_assert(offsetof(struct ggml_backend_buffer_type, device) == 8 * P, "device");
_Static_assert(offsetof(struct ggml_backend_buffer_type, context) == 9 * P, "buffer type context");
_Static_assert(sizeof(struct ggml_backend_buffer_type) == 10 * P, "buffer type size");

_Static_assert(offsetof(struct ggml_backend_buffer, iface.clear) == 9 * P, "clear");
_Static_assert(offsetof(struct ggml_backend_buffer, buft) == 11 * P, "buft");
_Static_assert(offsetof(struct ggml_backend_buffer, context) == 12 * P, "buffer context");
_Static_assert(offsetof(struct ggml_backend_buffer, size) == 13 * P, "size");
_Static_assert(offsetof(struct ggml_backend_buffer, usage) == 14 * P, "usage");
