#!/usr/bin/env bash
# The tests: set up (packages, headers, models, llama.cpp's rpc-server), then build and run every
# test of the workspace
# (runtime unit and integration tests, element harness tests, every file in pipelines/, and the
# RKNN encoder glue against a stand-in NPU runtime).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
# llama.cpp's rpc-server from the same llama.cpp release, for the `rpc` engine's tests (built once
# into /var/tmp/gst-vlm-peer: a few minutes on 2 cores the first time).
VLM_RPC_SERVER=$(JOBS=$(nproc) scripts/build-llama-server.sh rpc | tail -n 1)
export VLM_RPC_SERVER
cargo test --workspace "$@"
# The NPU (RKNN) glue, against the stand-in librknnrt built from runtime/rknn-standin (no NPU here).
VLM_RKNN_STANDIN=1 cargo test -p vlm-runtime --features rknn --test rknn "$@"
# The example applications (Rust, and Python through Debian's PyGObject) against the built plugin.
cargo build -q -p gst-plugin-vlm
cargo run -q -p gst-plugin-vlm --example ask
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
GST_PLUGIN_PATH="$target_dir/debug" /usr/bin/python3 examples/ask.py
# The README's first command, as a user runs it: the demo prints its three answers.
demo=$(scripts/demo.sh) || { printf '%s\n[test] scripts/demo.sh failed\n' "$demo"; exit 1; }
if [ "$(grep -c '^\[q[0-9]*\] Q:' <<<"$demo")" != 3 ]; then
  printf '%s\n[test] the demo did not print its three answers\n' "$demo"
  exit 1
fi
echo "[test] scripts/demo.sh: three answers"
# meson drives cargo and installs the plugin where GStreamer finds it under its prefix.
prefix=$(mktemp -d)
meson setup --prefix="$prefix" --libdir=lib "$prefix/build" >/dev/null
meson install -C "$prefix/build" >/dev/null
# (Output captured first: `grep -q` closing the pipe early would kill gst-inspect with SIGPIPE.)
inspect=$(GST_PLUGIN_PATH="$prefix/lib/gstreamer-1.0" gst-inspect-1.0 vlm)
grep -q "vlmquery" <<<"$inspect"
rm -rf "$prefix"
echo "[test] meson install: gst-inspect-1.0 finds the plugin under its prefix"
