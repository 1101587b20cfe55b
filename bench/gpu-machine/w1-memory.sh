#!/usr/bin/env bash
# On the GPU machine after `. DIR/setup.sh`, from the repository root: where W1's GPU memory goes
# with SmolVLM-500M (docs/benchmarks.md, "W1's memory on a GPU with the defaults"): the runtime
# alone (B1), 2 rounds of the defaults (auto, 0) and of each KV layout x encoder contexts; vlm-bench's JSON has each run's peak
# host RSS and GPU memory (nvidia-smi), KV and TTFT from capture. JSON and logs under $OUT.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
for v in "auto 0" "per-sequence 4" "unified 4" "unified 2" "unified 1"; do
    set -- $v
    name="w1-gpu-$1-ctx$2"
    vlm-bench --pair smolvlm-500m --engine g0:gpu --encoder gpu --encoder-contexts "$2" --kv-layout "$1" \
        --flash-attention --configs B1 --rounds 2 --json "$out/$name.json" > "$out/$name.log" 2>&1
    python3 - "$out/$name.json" "$1, $2 encoder contexts" <<'PY'
import json, sys
s = [x for x in json.load(open(sys.argv[1]))["summaries"] if x["config"] == "B1"][0]
print(f'{sys.argv[2]}: peak GPU {s["peak_gpu_mib"]} MiB, peak RSS {s["peak_rss_mib"]:.0f} MiB, '
      f'KV {s["kv_allocated_mib"]:.0f} MiB allocated, TTFT from capture mean {s["ttft_from_capture_mean_ms"]:.0f} ms '
      f'(rounds {[round(r) for r in s["ttft_from_capture_mean_rounds"]]}), p95 {s["ttft_from_capture_p95_ms"]:.0f} ms, '
      f'{s["answered"]}/{s["expected"]} answered')
PY
done
