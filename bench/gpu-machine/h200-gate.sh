#!/usr/bin/env bash
# On the GPU machine (the folder `GST=1 pack.sh` filled), from the repository root, as one
# call: set-up (`setup.sh`: the CUDA libraries, ~350 s on 16 cores, and the SmolVLM-500M timing
# pair), GStreamer (`gst.sh`), then
# issue 29's gate scenes with SmolVLM-500M on the GPU (docs/benchmarks.md, "The change gate and
# tile reuse": gate off against on in one run), then the CUDA libraries in 15 MiB parts as
# save-cuda.sh does (SAVE_CUDA=0: not). Runs on whichever card the lease gives (the device's
# rules: an H200 is asked for only for work that does not fit an H100's memory, never because an
# issue names it; the card is in gpu.txt and the JSON). JSON and logs under $OUT.
set -u
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
. "$D/setup.sh" || exit 1
. "$D/gst.sh"
t=$(date +%s)
gate_scenes --seconds 60 --model models/timing/smolvlm-500m-lm.gguf --mmproj models/timing/smolvlm-500m-mmproj.gguf \
    --json "$out/gate-scenes-smolvlm500m.json" > "$out/gate-scenes.log" 2>&1
echo "[gate scenes] rc $?, $(( $(date +%s) - t )) s"
grep -E "^\|" "$out/gate-scenes.log"
# The CUDA libraries built above, for the next machine (save-cuda.sh; SAVE_CUDA=0: not).
if [ "${SAVE_CUDA:-1}" = 1 ]; then
    t=$(date +%s)
    tar cf - -C /tmp/cuda/build/bin . | xz -T0 -6 | split -b 15M - "$out/cuda-libs.tar.xz.part-"
    echo "[cuda libraries saved] $(( $(date +%s) - t )) s, $(cat "$out"/cuda-libs.tar.xz.part-* | wc -c) bytes"
fi
