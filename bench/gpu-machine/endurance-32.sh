#!/usr/bin/env bash
# On the GPU machine (the folder `GST=1 pack.sh` filled), after h200-gate.sh in the same warm machine:
# issue 31 item 3, 32 live SmolVLM-500M streams at one frame a second, every frame due, a
# question every 10 s a stream, two GPU engines, every other property at its default, for SECS
# (480) seconds: 15,360 frames due (docs/benchmarks.md, "32 streams ..."). GPU memory every 5 s.
# Logs under $OUT.
set -u
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out"
. "$D/setup.sh" > /dev/null 2>&1 || exit 1
. "$D/gst.sh" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
(while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done) > "$out/gpumem-s32.csv" &
mon=$!
t=$(date +%s)
VLM_ENDURANCE=1 VLM_MODEL=models/timing/smolvlm-500m-lm.gguf VLM_MMPROJ=models/timing/smolvlm-500m-mmproj.gguf \
VLM_ENDURANCE_STREAMS=32 VLM_ENDURANCE_SECS=${SECS:-480} VLM_ENDURANCE_ASK_SECS=10 \
VLM_ENDURANCE_ENCODE="interval=0 min-change=0" VLM_ENDURANCE_CONTEXT="engines=g0:gpu,g1:gpu context-size=8192" \
    /tmp/bin/endurance a_long --nocapture > "$out/endurance-s32.log" 2>&1
rc=$?
kill $mon
echo "[endurance] rc $rc, $(( $(date +%s) - t )) s"
grep -E '^\{"endurance"|test result|panicked|assert' "$out/endurance-s32.log" | cut -c1-600
