# The runs of docs/benchmarks.md, "The picture resized before libmtmd" and "A SmolVLM picture cut
# into its tiles here": the preparation alone, then capacity at 16 streams and alerts 16 x 4, the
# picture resized and cut here (4 threads) and prepared whole by libmtmd (0), alternating
# (ROUNDS, default 1: a machine sends back at most 8 files).
# JSON and logs under $OUT.
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh" || exit 1
prepare --model models/timing/smolvlm-500m-lm.gguf --mmproj models/timing/smolvlm-500m-mmproj.gguf \
    --threads 0,1,2,4 --frames 10 --sizes 320x240,640x480,1920x1080,2048x1536 > "$OUT/prepare.log" 2>&1
grep -E "^\|" "$OUT/prepare.log"
for r in ${ROUNDS:-1}; do
    for t in 4 0; do
        vlm-bench capacity --pair smolvlm-500m --encoder gpu --encoder-contexts 4 --fps 1 --frames 8 --every 4 \
            --tokens 32 --ttft-target-ms 300 --flash-attention --kv-layout per-sequence --engines g0:gpu:4,g1:gpu:4 \
            --configs P --levels 16 --no-history --prepare-threads $t --json "$OUT/cap16-p$t-r$r.json" >> "$OUT/capacity.log" 2>&1
        alerts --gpu --engines 2 --streams 16 --alerts 4 --fps 1 --frames 8 --prepare-threads $t \
            --model models/timing/smolvlm-500m-lm.gguf --mmproj models/timing/smolvlm-500m-mmproj.gguf \
            --json "$OUT/alerts16x4-p$t-r$r.json" >> "$OUT/alerts.log" 2>&1
        echo "[round $r, prepare threads $t] $(( $(date +%s) - t0 )) s"
    done
done
