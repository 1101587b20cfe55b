#!/usr/bin/env bash
# Called by meson.build: build the plugin with cargo and copy libgstvlm.so to meson's output.
#   meson-cargo.sh SOURCE_ROOT dev|release OUTPUT
set -euo pipefail
src=$1 profile=$2 out=$3
# Cargo runs from the source root, so it reads .cargo/config.toml (VULKAN_SDK, GGML_RPC) as every
# other build does; OUTPUT stays relative to meson's build directory.
(cd "$src" && cargo build -p gst-plugin-vlm --profile "$profile")
target_dir=$(cd "$src" && cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
dir=$([ "$profile" = dev ] && echo debug || echo "$profile")
cp "$target_dir/$dir/libgstvlm.so" "$out"
