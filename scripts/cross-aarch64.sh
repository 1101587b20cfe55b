#!/usr/bin/env bash
# Cross-build the plugin (libgstvlm.so, crate gst-plugin-vlm) for 64-bit ARM Linux
# (aarch64-unknown-linux-gnu: RK3588, Jetson) on a Debian 12 x86-64 machine, then check it:
# `file`, `readelf -d` (every NEEDED library found among the arm64 packages) and, under
# qemu-user, Debian's arm64 `gst-inspect-1.0` loading it and listing its elements.
#
#   scripts/cross-aarch64.sh                 # build (release, default features) and check
#   scripts/cross-aarch64.sh --no-qemu       # build, `file` and `readelf` only
#   scripts/cross-aarch64.sh --demo          # also run pipelines/demo.pipeline under qemu-user
#                                            # (about 4 minutes; models from scripts/setup.sh)
#   scripts/cross-aarch64.sh -- -v           # arguments after `--` go to cargo build
#
# Idempotent; what it sets up, once:
# - host packages (apt, only those missing; it stops if apt would remove any package):
#   gcc/g++-aarch64-linux-gnu, qemu-user, and the host tools the build needs (cmake, clang and
#   libclang for bindgen, glslc, spirv-headers, pkg-config, file);
# - the Rust standard library for the target (rustup);
# - an arm64 sysroot, $VLM_AARCH64_DEPS/sysroot (default .deps/aarch64/sysroot, ~440 MB): Debian
#   12's arm64 packages (GStreamer 1.22 + plugins-base development files, libvulkan, libgomp,
#   libstdc++, spirv-headers, gstreamer1.0-tools and -plugins-base and their dependencies),
#   resolved by apt with a private state and unpacked with `dpkg -x`. Nothing goes into the
#   system's dpkg database: a multiarch install (`dpkg --add-architecture arm64`) must keep
#   every Multi-Arch: same package at one version for both architectures, and on this machine
#   apt wanted to upgrade ~30 amd64 libraries and remove libgstreamer-plugins-base1.0-dev:amd64
#   for it;
# - Vulkan >= 1.4 headers ($VLM_AARCH64_DEPS/vulkan-sdk/include, Debian 13's libvulkan-dev,
#   fetched the way scripts/setup.sh does), since Debian 12's lack vk::LayerSettingEXT, which
#   ggml's Vulkan backend uses; that directory's lib/libvulkan.so is the sysroot's arm64 one and
#   bin/glslc the host's.
#
# Environment: CARGO_TARGET_DIR (default /var/tmp/gst-vlm-target-aarch64), VLM_AARCH64_DEPS.
# The build itself is plain `cargo build --release --target aarch64-unknown-linux-gnu -p
# gst-plugin-vlm` with the cross compilers, pkg-config and bindgen pointed at the sysroot
# through target-specific environment variables (printed by the script); the x86-64 build is
# untouched. llama.cpp's cmake is run by the cmake crate, which sets CMAKE_SYSTEM_NAME=Linux and
# CMAKE_SYSTEM_PROCESSOR=aarch64 when the target is not the host; llama-cpp-sys-2's build script
# sets GGML_NATIVE=OFF and GGML_CPU_ARM_ARCH=armv8-a for aarch64 (a portable baseline without
# the dotprod/i8mm kernels); ggml's vulkan-shaders-gen is built for the host by llama.cpp's own
# cmake (it detects the host compiler when cross-compiling).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

triple=aarch64-unknown-linux-gnu
gnu=aarch64-linux-gnu
target_dir=${CARGO_TARGET_DIR:-/var/tmp/gst-vlm-target-aarch64}
deps=${VLM_AARCH64_DEPS:-$root/.deps/aarch64}
sysroot="$deps/sysroot"
sdk="$deps/vulkan-sdk"

run_qemu=1
run_demo=0
cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-qemu) run_qemu=0 ;;
    --demo) run_demo=1 ;;
    --) shift; cargo_args=("$@"); break ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf '[cross-aarch64] %s\n' "$*"; }
die() { printf '[cross-aarch64] error: %s\n' "$*" >&2; exit 1; }
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == *"install ok installed"* ]]; }

# 1. Host packages ----------------------------------------------------------------------------
host_packages=(
  gcc-aarch64-linux-gnu g++-aarch64-linux-gnu binutils-aarch64-linux-gnu qemu-user file
  cmake clang libclang-dev pkg-config glslc spirv-headers
)
missing=()
for p in "${host_packages[@]}"; do installed "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  sudo_ apt-get update -qq
  sim=$(apt-get -s install --no-install-recommends "${missing[@]}")
  if grep -q '^Remv' <<<"$sim"; then
    grep '^Remv' <<<"$sim" >&2
    die "apt would remove the packages above; install ${missing[*]} by hand"
  fi
  sudo_ env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! rustup target list --installed | grep -qx "$triple"; then
  say "adding the Rust target $triple"
  rustup target add "$triple"
fi

# A private apt: the system's sources (or those in $1/parts), its own lists, cache and an empty
# dpkg status, for architecture arm64. Nothing touches the system's package state.
private_apt() { # <state dir> <apt-get arguments...>
  local st=$1; shift
  local src=(-o Dir::Etc::SourceList=/etc/apt/sources.list
             -o Dir::Etc::SourceParts=/etc/apt/sources.list.d)
  [ -d "$st/parts" ] && src=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$st/parts")
  mkdir -p "$st/lists/partial" "$st/cache/archives/partial"
  touch "$st/status"
  apt-get "${src[@]}" -o "Dir::State::Lists=$st/lists" -o "Dir::State::status=$st/status" \
    -o "Dir::Cache=$st/cache" -o APT::Architecture=arm64 -o APT::Architectures::=arm64 \
    -o APT::Install-Recommends=0 -o APT::Sandbox::User=root -o Debug::NoLocking=1 "$@"
}

# 2. The arm64 sysroot --------------------------------------------------------------------------
sysroot_packages=(
  libgstreamer1.0-dev libgstreamer-plugins-base1.0-dev libvulkan-dev libstdc++6 libgomp1
  gstreamer1.0-tools gstreamer1.0-plugins-base spirv-headers
)
stamp="$sysroot/.gst-vlm-packages"
if [ "$(cat "$stamp" 2>/dev/null)" != "${sysroot_packages[*]}" ]; then
  say "building the arm64 sysroot in $sysroot (${sysroot_packages[*]} and their dependencies)"
  st=$(mktemp -d)
  private_apt "$st" update -qq
  private_apt "$st" install -y -qq --download-only "${sysroot_packages[@]}" >/dev/null
  rm -rf "$sysroot" && mkdir -p "$sysroot"
  n=0
  for deb in "$st"/cache/archives/*.deb; do dpkg -x "$deb" "$sysroot"; n=$((n + 1)); done
  # Absolute symlinks (libz.so -> /lib/aarch64-linux-gnu/libz.so.1...) would point into the
  # host: make them relative, inside the sysroot.
  while IFS= read -r link; do
    dest=$(readlink "$link")
    ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$sysroot$dest")" "$link"
  done < <(find "$sysroot" -type l -lname '/*')
  rm -rf "$st"
  say "unpacked $n arm64 packages"
  printf '%s' "${sysroot_packages[*]}" > "$stamp"
fi

# 3. Vulkan >= 1.4 headers (Debian 13's libvulkan-dev, headers only) -----------------------------
if [ ! -f "$sdk/include/vulkan/vulkan_core.h" ]; then
  say "fetching Vulkan 1.4 headers into $sdk"
  st=$(mktemp -d)
  mkdir -p "$st/parts"
  # the bookworm entry of the system's sources, renamed to trixie (as scripts/setup.sh does)
  awk 'BEGIN{RS="";ORS="\n\n"} /Suites:[^\n]*bookworm( |$|\n)/ && !/security/' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
    | sed -E 's/^Suites:.*/Suites: trixie/' > "$st/parts/trixie.sources"
  if [ ! -s "$st/parts/trixie.sources" ]; then
    rm -f "$st/parts/trixie.sources"
    awk '/^deb .* bookworm / {sub(/ bookworm /, " trixie "); print; exit}' /etc/apt/sources.list > "$st/parts/trixie.list"
  fi
  private_apt "$st" update -qq
  (cd "$st" && private_apt "$st" download libvulkan-dev >/dev/null)
  dpkg -x "$st"/libvulkan-dev_*.deb "$st/x"
  rm -rf "$sdk/include" && mkdir -p "$sdk"
  cp -r "$st/x/usr/include" "$sdk/"
  rm -rf "$st"
fi
mkdir -p "$sdk/lib" "$sdk/bin"
ln -sfn "$sysroot/usr/lib/$gnu/libvulkan.so.1" "$sdk/lib/libvulkan.so"
ln -sfn "$(command -v glslc)" "$sdk/bin/glslc"

# 4. The cross build -----------------------------------------------------------------------------
t=${triple//-/_}
T=${t^^}
export CARGO_TARGET_DIR="$target_dir"
export "CARGO_TARGET_${T}_LINKER=$gnu-gcc"
export "CARGO_TARGET_${T}_RUSTFLAGS=-C link-arg=--sysroot=$sysroot"
export "CC_$t=$gnu-gcc" "CXX_$t=$gnu-g++" "AR_$t=$gnu-ar"
export "CFLAGS_$t=--sysroot=$sysroot" "CXXFLAGS_$t=--sysroot=$sysroot"
export "BINDGEN_EXTRA_CLANG_ARGS_$t=--sysroot=$sysroot"
export PKG_CONFIG_ALLOW_CROSS=1
export "PKG_CONFIG_SYSROOT_DIR_$t=$sysroot"
export "PKG_CONFIG_LIBDIR_$t=$sysroot/usr/lib/$gnu/pkgconfig:$sysroot/usr/share/pkgconfig"
# Overrides .cargo/config.toml's (x86-64) VULKAN_SDK; GGML_RPC=ON from there still applies.
export VULKAN_SDK="$sdk"
say "environment:"
per_target="(CC|CXX|AR|CFLAGS|CXXFLAGS|BINDGEN_EXTRA_CLANG_ARGS|PKG_CONFIG_SYSROOT_DIR|PKG_CONFIG_LIBDIR)_$t"
env | grep -E "^(CARGO_TARGET_DIR|CARGO_TARGET_${T}_|$per_target|PKG_CONFIG_ALLOW_CROSS|VULKAN_SDK)=" \
  | sort | sed 's/^/    /'

say "cargo build --release --target $triple -p gst-plugin-vlm ${cargo_args[*]}"
start=$SECONDS
cargo build --release --target "$triple" -p gst-plugin-vlm "${cargo_args[@]}"
say "build took $((SECONDS - start)) s"
plugin="$target_dir/$triple/release/libgstvlm.so"
[ -f "$plugin" ] || die "no $plugin after the build"

# 5. Checks ----------------------------------------------------------------------------------------
kind=$(file -L "$plugin")
echo "$kind"
[[ "$kind" == *"ELF 64-bit LSB shared object, ARM aarch64"* ]] \
  || die "$plugin is not an aarch64 shared object"

# Every NEEDED library must be in the arm64 packages (sysroot), as it would be on a Debian board.
unresolved=()
while read -r lib; do
  found=
  for dir in "$sysroot/lib/$gnu" "$sysroot/usr/lib/$gnu"; do
    if [ -e "$dir/$lib" ]; then found="$dir/$lib"; break; fi
  done
  if [ -n "$found" ]; then
    printf '    NEEDED %-24s /%s\n' "$lib" "${found#"$sysroot"/}"
  else
    unresolved+=("$lib")
  fi
done < <(readelf -d "$plugin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
[ ${#unresolved[@]} -eq 0 ] || die "NEEDED but not in the arm64 packages: ${unresolved[*]}"
say "readelf -d: every NEEDED library is in the arm64 sysroot"

if [ "$run_qemu" = 1 ]; then
  # Debian's arm64 gst-inspect-1.0 under qemu-user, with only this plugin on its path. The
  # registry is scanned in-process (no fork of the arm64 gst-plugin-scanner) into a fresh file.
  reg=$(mktemp -d)
  inspect() {
    GST_REGISTRY="$reg/registry.bin" GST_REGISTRY_FORK=no GST_PLUGIN_PATH="$(dirname "$plugin")" \
      qemu-aarch64 -L "$sysroot" "$sysroot/usr/bin/gst-inspect-1.0" "$@"
  }
  start=$(date +%s%N)
  out=$(inspect vlm)
  echo "$out"
  # gst-inspect-1.0 <element> also creates an instance of it (to read its properties' defaults).
  for element in vlmencode vlmcontext vlmquery; do
    grep -q "^  $element: " <<<"$out" || die "gst-inspect-1.0 did not list $element"
    inspect "$element" >/dev/null || die "gst-inspect-1.0 $element failed under qemu"
  done
  say "qemu-aarch64: gst-inspect-1.0 loads the plugin, lists vlmencode, vlmcontext, vlmquery and" \
    "inspects each ($(( ($(date +%s%N) - start) / 1000000 )) ms for the 4 runs)"

  if [ "$run_demo" = 1 ]; then
    # The demo pipeline (videotestsrc, subparse: the sysroot's arm64 plugins-base) through Debian's
    # arm64 gst-launch-1.0, llama.cpp's arm64 CPU code emulated: no Vulkan driver in the sysroot.
    model=${VLM_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
    mmproj=${VLM_MMPROJ:-models/test-mmproj-mlp.gguf}
    if [ ! -s "$model" ] || [ ! -s "$mmproj" ]; then
      die "no $model or $mmproj: run scripts/setup.sh first (or set VLM_MODEL, VLM_MMPROJ)"
    fi
    read -ra desc < <(VLM_MODEL="$model" VLM_MMPROJ="$mmproj" \
      scripts/pipeline.sh pipelines/demo.pipeline)
    say "qemu-aarch64 gst-launch-1.0 pipelines/demo.pipeline (a few minutes)"
    start=$SECONDS
    log=$(GST_REGISTRY="$reg/registry.bin" GST_REGISTRY_FORK=no GST_PLUGIN_PATH="$(dirname "$plugin")" \
      qemu-aarch64 -L "$sysroot" "$sysroot/usr/bin/gst-launch-1.0" -m "${desc[@]}" 2>&1) \
      || { echo "$log" >&2; die "the demo pipeline failed under qemu"; }
    python3 scripts/print_answers.py <<<"$log" || die "the demo pipeline reported an error"
    grep -q 'status=(string)answered' <<<"$log" || die "no answer from the demo pipeline"
    say "qemu-aarch64: the demo pipeline answered in $((SECONDS - start)) s"
  fi
  rm -rf "$reg"
fi
say "built: $plugin"
