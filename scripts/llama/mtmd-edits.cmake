# libmtmd as gst-vlm builds it: the encoder contexts of one projector share one copy of its
# weights (issue 31: each context used to load its own, ~190 MiB for SmolVLM-500M's projector on
# the GPU). A `vlmencode` or vlm-bench process loads 1 to 4 contexts of the same file so that
# frames encode side by side; each keeps its own backend, scheduler and compute buffers, and now
# reads the weights of the first (llama.cpp's contexts of one model do the same). The edits are made
# on a copy of the sources in the build directory, never on the originals: .cargo/config.toml sets
# CMAKE_PROJECT_INCLUDE to this file (llama-cpp-sys-2 forwards CMAKE_* variables to cmake;
# scripts/cuda-libs.sh passes it too), and after llama.cpp's top-level CMakeLists the `mtmd`
# target compiles the edited copy. GGML_GST_VLM_EDITS there names this file's hash (the crate
# rebuilds when a GGML_* variable changes; a unit test in runtime/src/llama/mtmd.rs checks the
# two agree).
#
# A second edit makes SmolVLM's encoder (idefics3) cheaper on a GPU (issue 28), where a 512-px
# tile is ~460 small kernels and their launches and conversions cost more than the matrix
# products: the loader places a layer's Q, K and V weights (and biases) one after another, so the
# layer reads them as one QKV matrix (build_vit's fused path: one product, one conversion of its
# input and one bias add instead of three), and with flash attention K and V are converted to
# F16 by one contiguous cast of that product instead of two strided casts after the permutes.
# GST_VLM_MTMD_FUSE_QKV=0, read when weights load, keeps the three products.
#
# The crate is pinned (Cargo.toml), so sources that do not read as expected are an error: the
# runtime calls gst_vlm_clip_weight_copies and gst_vlm_clip_fused_qkv_layers, which only the
# edits define.

# One edit of `file` under `dir`: in mode "check", fails where the file has neither `old` nor
# `new`; in mode "apply", writes `new` in place of `old` (once only).
function(gst_vlm_edit mode dir file old new)
    file(READ "${dir}/${file}" text)
    string(FIND "${text}" "${new}" done)
    string(FIND "${text}" "${old}" at)
    if(mode STREQUAL "check")
        if(done EQUAL -1 AND at EQUAL -1)
            message(FATAL_ERROR "gst-vlm: ${dir}/${file} is not the libmtmd scripts/llama/mtmd-edits.cmake was written for (llama-cpp-sys-2 0.1.160)")
        endif()
    elseif(done EQUAL -1)
        string(REPLACE "${old}" "${new}" text "${text}")
        file(WRITE "${dir}/${file}" "${text}")
    endif()
endfunction()

# Every edit is checked first, so the sources are either all edited or left alone.
function(gst_vlm_patch_mtmd dir)
    foreach(mode check apply)
        # A context holds the weights it shares (declared after `buf`, so freed before the
        # weights it may own itself and after its scheduler).
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
    ggml_backend_buffer_ptr buf;
]=] [=[
    ggml_backend_buffer_ptr buf;
    std::shared_ptr<void> gst_vlm_weights; // gst-vlm: the weights this context shares
]=])
        # clip_init loads a vision projector's weights once a process.
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
            loader.load_hparams(ctx_vision->model, CLIP_MODALITY_VISION);
            loader.load_tensors(*ctx_vision);
]=] [=[
            loader.load_hparams(ctx_vision->model, CLIP_MODALITY_VISION);
            gst_vlm_load_tensors_shared(loader, *ctx_vision, fname);
]=])
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
struct clip_init_result clip_init(const char * fname, struct clip_context_params ctx_params) {
]=] [=[
// gst-vlm: the vision contexts of one projector file (however named, unchanged on disk, on one
// buffer type) share one copy of its weights; the last context to go frees it.
struct gst_vlm_shared_weights {
    clip_model model;
    ggml_context_ptr ctx_data;
    ggml_backend_buffer_ptr buf;
    ggml_context_ptr fused; // the layers' QKV matrices, over the Q, K and V in `buf`
    int fused_layers = 0;
};

// gst-vlm: where a SmolVLM (idefics3) layer's Q, K and V weights, and biases if any, lie one
// after another in one buffer, as the loader now places them, the layer reads them as one QKV
// matrix of the same bytes (build_vit's fused path). Nothing is copied; a layer laid out
// otherwise keeps its three products. GST_VLM_MTMD_FUSE_QKV=0 turns it off.
static void gst_vlm_fuse_qkv(clip_model & model, gst_vlm_shared_weights & holder) {
    const char * off = getenv("GST_VLM_MTMD_FUSE_QKV");
    if ((off && strcmp(off, "0") == 0) || model.proj_type != PROJECTOR_TYPE_IDEFICS3) {
        return;
    }
    auto in_a_row = [](const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v) {
        return q && k && v && q->buffer && q->buffer == k->buffer && k->buffer == v->buffer
            && q->type == k->type && k->type == v->type && ggml_n_dims(q) <= 2
            && ggml_are_same_shape(q, k) && ggml_are_same_shape(k, v)
            && ggml_is_contiguous(q) && ggml_is_contiguous(k) && ggml_is_contiguous(v)
            && (const char *) k->data == (const char *) q->data + ggml_nbytes(q)
            && (const char *) v->data == (const char *) k->data + ggml_nbytes(k);
    };
    auto fusable = [&](const clip_layer & l) {
        const bool no_bias = !l.q_b && !l.k_b && !l.v_b;
        return !l.qkv_w && !l.q_norm && !l.k_norm && in_a_row(l.q_w, l.k_w, l.v_w)
            && (no_bias || (in_a_row(l.q_b, l.k_b, l.v_b) && ggml_n_dims(l.q_b) == 1));
    };
    int n = 0;
    for (const auto & l : model.layers) {
        n += fusable(l);
    }
    if (n == 0) {
        return;
    }
    const ggml_init_params params = { (size_t) 2 * n * ggml_tensor_overhead(), NULL, true };
    holder.fused.reset(ggml_init(params));
    if (!holder.fused) {
        return;
    }
    // A tensor of Q's rows, K's and V's over their bytes (nullptr where the buffer refuses it).
    auto over = [&](ggml_tensor * q) -> ggml_tensor * {
        ggml_tensor * t = ggml_n_dims(q) == 1
            ? ggml_new_tensor_1d(holder.fused.get(), q->type, 3 * q->ne[0])
            : ggml_new_tensor_2d(holder.fused.get(), q->type, q->ne[0], 3 * q->ne[1]);
        ggml_format_name(t, "%s+k+v", q->name);
        return ggml_backend_tensor_alloc(q->buffer, t, q->data) == GGML_STATUS_SUCCESS ? t : nullptr;
    };
    n = 0;
    for (auto & l : model.layers) {
        if (!fusable(l)) {
            continue;
        }
        ggml_tensor * w = over(l.q_w);
        ggml_tensor * b = l.q_b ? over(l.q_b) : nullptr;
        if (w && (b || !l.q_b)) {
            l.qkv_w = w;
            l.qkv_b = b;
            n += 1;
        }
    }
    holder.fused_layers = n;
    LOG_INF("%s: %d of %zu layers read Q, K and V as one matrix\n", __func__, n, model.layers.size());
}

static std::mutex gst_vlm_weights_mutex;
static std::map<std::string, std::weak_ptr<gst_vlm_shared_weights>> gst_vlm_weights_loaded;

// The file named however it is (relative, absolute, through links).
static std::string gst_vlm_canonical(const char * fname) {
    std::error_code ec;
    const auto path = std::filesystem::weakly_canonical(fname, ec);
    return ec ? std::string(fname) : path.string();
}

// Empty where the file's version cannot be read (its weights are then not shared).
static std::string gst_vlm_weights_key(const char * fname, const clip_ctx & ctx) {
    std::error_code size_ec, mtime_ec;
    const auto size = std::filesystem::file_size(fname, size_ec);
    const auto mtime = std::filesystem::last_write_time(fname, mtime_ec).time_since_epoch().count();
    if (size_ec || mtime_ec) {
        return "";
    }
    return string_format("%s|%llu|%lld|%s", gst_vlm_canonical(fname).c_str(), (unsigned long long) size,
        (long long) mtime, ggml_backend_buft_name(ggml_backend_get_default_buffer_type(ctx.backend)));
}

// Loads `ctx`'s tensors, or points them at a copy already loaded; its hyperparameters (read by
// load_hparams, with its own image token limits) stay its own.
static void gst_vlm_load_tensors_shared(clip_model_loader & loader, clip_ctx & ctx, const char * fname) {
    const std::string key = ctx.no_alloc ? "" : gst_vlm_weights_key(fname, ctx);
    if (key.empty()) {
        loader.load_tensors(ctx);
        auto holder = std::make_shared<gst_vlm_shared_weights>();
        gst_vlm_fuse_qkv(ctx.model, *holder);
        if (holder->fused) {
            ctx.gst_vlm_weights = holder;
        }
        return;
    }
    std::lock_guard<std::mutex> lock(gst_vlm_weights_mutex);
    for (auto it = gst_vlm_weights_loaded.begin(); it != gst_vlm_weights_loaded.end();) {
        it = it->second.expired() && it->first != key ? gst_vlm_weights_loaded.erase(it) : std::next(it);
    }
    if (auto shared = gst_vlm_weights_loaded[key].lock()) {
        const clip_hparams hparams = ctx.model.hparams;
        ctx.model = shared->model;
        ctx.model.hparams = hparams;
        ctx.gst_vlm_weights = shared;
        LOG_INF("%s: sharing the weights of %s (%ld contexts)\n", __func__, fname, shared.use_count() - 1);
        return;
    }
    loader.load_tensors(ctx);
    auto shared = std::make_shared<gst_vlm_shared_weights>();
    gst_vlm_fuse_qkv(ctx.model, *shared);
    shared->model = ctx.model;
    shared->ctx_data = std::move(ctx.ctx_data);
    shared->buf = std::move(ctx.buf);
    ctx.gst_vlm_weights = shared;
    gst_vlm_weights_loaded[key] = shared;
}

// The copies of `fname`'s weights alive in the process (one per buffer type),
// and in `users` the contexts reading them.
extern "C" __attribute__((visibility("default"))) size_t gst_vlm_clip_weight_copies(const char * fname, size_t * users) {
    std::lock_guard<std::mutex> lock(gst_vlm_weights_mutex);
    const std::string prefix = gst_vlm_canonical(fname) + "|";
    size_t copies = 0;
    *users = 0;
    for (const auto & [key, weights] : gst_vlm_weights_loaded) {
        if (!weights.expired() && key.rfind(prefix, 0) == 0) {
            copies += 1;
            *users += weights.use_count();
        }
    }
    return copies;
}

// The layers of the live copy of `fname`'s weights that read one QKV matrix (0 where none is
// loaded).
extern "C" __attribute__((visibility("default"))) int gst_vlm_clip_fused_qkv_layers(const char * fname) {
    std::lock_guard<std::mutex> lock(gst_vlm_weights_mutex);
    const std::string prefix = gst_vlm_canonical(fname) + "|";
    int layers = 0;
    for (const auto & [key, weights] : gst_vlm_weights_loaded) {
        if (auto w = weights.lock(); w && key.rfind(prefix, 0) == 0) {
            layers = std::max(layers, w->fused_layers);
        }
    }
    return layers;
}

struct clip_init_result clip_init(const char * fname, struct clip_context_params ctx_params) {
]=])
        # Q before K, so that a layer's Q, K and V lie in that order in the weights' buffer.
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
            layer.k_w    = get_tensor(string_format(TN_ATTN_K,      prefix, il, "weight"), false);
            layer.q_w    = get_tensor(string_format(TN_ATTN_Q,      prefix, il, "weight"), false);
]=] [=[
            layer.q_w    = get_tensor(string_format(TN_ATTN_Q,      prefix, il, "weight"), false);
            layer.k_w    = get_tensor(string_format(TN_ATTN_K,      prefix, il, "weight"), false);
]=])
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
            layer.k_b    = get_tensor(string_format(TN_ATTN_K,      prefix, il, "bias"), false);
            layer.q_b    = get_tensor(string_format(TN_ATTN_Q,      prefix, il, "bias"), false);
]=] [=[
            layer.q_b    = get_tensor(string_format(TN_ATTN_Q,      prefix, il, "bias"), false);
            layer.k_b    = get_tensor(string_format(TN_ATTN_K,      prefix, il, "bias"), false);
]=])
        # The fused QKV product cast to F16 once for flash attention's K and V.
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
                /* offset */ ggml_row_size(cur->type, 2 * n_head * d_head));

                if (layer.q_norm) {
]=] [=[
                /* offset */ ggml_row_size(cur->type, 2 * n_head * d_head));

                // gst-vlm: SmolVLM's K and V for flash attention from one contiguous cast of the
                // product (build_attn leaves F16 views as they are), not two strided casts after
                // the permutes (the Q third is cast for nothing: still the cheaper kernel).
                if (proj_type == PROJECTOR_TYPE_IDEFICS3 && flash_attn_type == CLIP_FLASH_ATTN_TYPE_ENABLED
                        && cur->type == GGML_TYPE_F32 && !layer.k_norm && !add_pos) {
                    ggml_tensor * kv16 = ggml_cast(ctx0, cur, GGML_TYPE_F16);
                    Kcur = ggml_view_4d(ctx0, kv16, d_head, n_head, n_pos, B,
                        ggml_row_size(kv16->type, d_head), kv16->nb[1], kv16->nb[1] * n_pos,
                        ggml_row_size(kv16->type, n_head * d_head));
                    Vcur = ggml_view_4d(ctx0, kv16, d_head, n_head, n_pos, B,
                        ggml_row_size(kv16->type, d_head), kv16->nb[1], kv16->nb[1] * n_pos,
                        ggml_row_size(kv16->type, 2 * n_head * d_head));
                }

                if (layer.q_norm) {
]=])
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
        k = ggml_cast(ctx0, k, GGML_TYPE_F16);
        v = ggml_cast(ctx0, v, GGML_TYPE_F16);
]=] [=[
        if (k->type != GGML_TYPE_F16) {
            k = ggml_cast(ctx0, k, GGML_TYPE_F16);
        }
        if (v->type != GGML_TYPE_F16) {
            v = ggml_cast(ctx0, v, GGML_TYPE_F16);
        }
]=])
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
#include <map>
]=] [=[
#include <map>
#include <filesystem>
#include <memory>
#include <mutex>
]=])
    endforeach()
    message(STATUS "gst-vlm: libmtmd in ${dir} shares a projector's weights between its contexts and fuses SmolVLM's QKV")
endfunction()

# Included after a project() call: only llama.cpp's own, and only once its targets exist.
if(NOT PROJECT_NAME STREQUAL "llama.cpp" OR NOT CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)
    return()
endif()

function(gst_vlm_mtmd_from_edited_copy)
    if(NOT TARGET mtmd)
        return()
    endif()
    set(src "${CMAKE_SOURCE_DIR}/tools/mtmd")
    set(copy "${CMAKE_BINARY_DIR}/gst-vlm-mtmd")
    file(REMOVE_RECURSE "${copy}")
    file(COPY "${src}/" DESTINATION "${copy}")
    gst_vlm_patch_mtmd("${copy}")
    get_target_property(sources mtmd SOURCES)
    set(edited "")
    foreach(s IN LISTS sources)
        if(NOT IS_ABSOLUTE "${s}")
            set(s "${src}/${s}")
        endif()
        string(REPLACE "${src}/" "${copy}/" s "${s}")
        list(APPEND edited "${s}")
    endforeach()
    set_property(TARGET mtmd PROPERTY SOURCES ${edited})
    target_include_directories(mtmd BEFORE PRIVATE "${copy}")
endfunction()
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL gst_vlm_mtmd_from_edited_copy)
