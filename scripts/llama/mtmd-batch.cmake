# libmtmd encodes SmolVLM's tiles (the idefics3 projector) as one batch: a frame's 13 tiles of
# 512 px go through SigLIP in one graph instead of 13 (issue 28: vision encoding that scales on the
# GPU). llama.cpp's graph builder is already batch-aware (build_vit takes a batch dimension, and
# libmtmd has mtmd_batch_*); its idefics3 path only lacks a pixel shuffle that keeps the batch and
# the flag that says so. Two edits, made on a copy of the sources, never on the originals:
#
#  - as llama-cpp-sys-2 builds llama.cpp: .cargo/config.toml sets CMAKE_PROJECT_INCLUDE to this
#    file (the crate forwards CMAKE_* variables to cmake); after llama.cpp's top-level
#    CMakeLists, the `mtmd` target compiles a patched copy of tools/mtmd from the build directory;
#  - on a llama.cpp tree (scripts/cuda-libs.sh): cmake -DMTMD_DIR=<tree>/tools/mtmd -P this-file
#    edits that tree in place.
#
# Where the sources do not read as expected (another llama.cpp release), nothing is changed and a
# warning says so: libmtmd then encodes one tile at a time, as before, and
# `Projector::batches_images` reports false.

# One edit of `file` under `dir`: in mode "check", clears GST_VLM_MTMD_OK in the caller where the
# file has neither `old` nor `new`; in mode "apply", writes `new` in place of `old` (once only).
function(gst_vlm_edit mode dir file old new)
    file(READ "${dir}/${file}" text)
    string(FIND "${text}" "${new}" done)
    string(FIND "${text}" "${old}" at)
    if(mode STREQUAL "check")
        if(done EQUAL -1 AND at EQUAL -1)
            set(GST_VLM_MTMD_OK FALSE PARENT_SCOPE)
        endif()
    elseif(done EQUAL -1)
        string(REPLACE "${old}" "${new}" text "${text}")
        file(WRITE "${dir}/${file}" "${text}")
    endif()
endfunction()

# Every edit is checked first, so the sources are either all edited or left alone.
function(gst_vlm_patch_mtmd dir)
    set(GST_VLM_MTMD_OK TRUE)
    foreach(mode check apply)
        if(NOT GST_VLM_MTMD_OK)
            message(WARNING "gst-vlm: ${dir} is not the libmtmd this edit was written for: idefics3 tiles will encode one at a time")
            return()
        endif()
        # The SigLIP graph builder says it batches, for idefics3.
        gst_vlm_edit(${mode} "${dir}" models/models.h [=[
struct clip_graph_siglip : clip_graph {
    clip_graph_siglip(clip_ctx * ctx, const clip_image_f32 & img) : clip_graph(ctx, img) {}
    ggml_cgraph * build() override;
};]=] [=[
struct clip_graph_siglip : clip_graph {
    clip_graph_siglip(clip_ctx * ctx, const clip_image_f32 & img) : clip_graph(ctx, img) {}
    ggml_cgraph * build() override;
    bool support_batch() const override { return proj_type == PROJECTOR_TYPE_IDEFICS3; } // gst-vlm
};]=])
        # The pixel shuffle keeps the batch as its outermost dimension (one image each).
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
    cur = ggml_reshape_3d(ctx0, cur, n_embd, width, height);
    if (pad_width || pad_height) {]=] [=[
    cur = ggml_reshape_4d(ctx0, cur, n_embd, width, height, n_batch); // gst-vlm: batch outermost
    if (pad_width || pad_height) {]=])
        gst_vlm_edit(${mode} "${dir}" clip.cpp [=[
    cur = ggml_reshape_3d(ctx0, cur, n_embd * scale_factor, width / scale_factor, height);
    cur = ggml_permute(ctx0, cur, 0, 2, 1, 3);

    // unshuffle w
    cur = ggml_cont_3d(ctx0, cur, n_embd * scale_factor * scale_factor, height / scale_factor, width / scale_factor);
    cur = ggml_permute(ctx0, cur, 0, 2, 1, 3);

    cur = ggml_cont_2d(ctx0, cur, cur->ne[0], cur->ne[1] * cur->ne[2]);]=] [=[
    cur = ggml_reshape_4d(ctx0, cur, n_embd * scale_factor, width / scale_factor, height, n_batch);
    cur = ggml_permute(ctx0, cur, 0, 2, 1, 3);

    // unshuffle w
    cur = ggml_cont_4d(ctx0, cur, n_embd * scale_factor * scale_factor, height / scale_factor, width / scale_factor, n_batch);
    cur = ggml_permute(ctx0, cur, 0, 2, 1, 3);

    cur = ggml_cont_3d(ctx0, cur, cur->ne[0], cur->ne[1] * cur->ne[2], n_batch);]=])
    endforeach()
    message(STATUS "gst-vlm: libmtmd in ${dir} batches idefics3 tiles")
endfunction()

if(CMAKE_SCRIPT_MODE_FILE)
    if(NOT MTMD_DIR)
        message(FATAL_ERROR "usage: cmake -DMTMD_DIR=<llama.cpp>/tools/mtmd -P mtmd-batch.cmake")
    endif()
    gst_vlm_patch_mtmd("${MTMD_DIR}")
    return()
endif()

# Included after a project() call: only llama.cpp's own, and only once its targets exist.
if(NOT PROJECT_NAME STREQUAL "llama.cpp" OR NOT CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)
    return()
endif()

function(gst_vlm_mtmd_from_patched_copy)
    if(NOT TARGET mtmd)
        return()
    endif()
    set(src "${CMAKE_SOURCE_DIR}/tools/mtmd")
    set(copy "${CMAKE_BINARY_DIR}/gst-vlm-mtmd")
    file(REMOVE_RECURSE "${copy}")
    file(COPY "${src}/" DESTINATION "${copy}")
    gst_vlm_patch_mtmd("${copy}")
    get_target_property(sources mtmd SOURCES)
    set(patched "")
    foreach(s IN LISTS sources)
        if(NOT IS_ABSOLUTE "${s}")
            set(s "${src}/${s}")
        endif()
        string(REPLACE "${src}/" "${copy}/" s "${s}")
        list(APPEND patched "${s}")
    endforeach()
    set_property(TARGET mtmd PROPERTY SOURCES ${patched})
    target_include_directories(mtmd BEFORE PRIVATE "${copy}")
endfunction()
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL gst_vlm_mtmd_from_patched_copy)
