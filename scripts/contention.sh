#!/usr/bin/env bash
# W1 (vlm-bench B1) quiet and with one busy process per core, alternating, under thread settings
# given as "NAME=ENV..." words (docs/benchmarks.md, "Sharing the cores"). Prints one line a run:
#   round load setting answered answers/s mean-TTFT-from-capture-ms load-ms decode-tok/s
#   scripts/contention.sh "t2=" "t1=VLM_ENGINE=cpu:cpu:1" "passive=OMP_WAIT_POLICY=passive"
# ROUNDS (default 2) rounds; each prints busy/quiet per setting, and the last line the minimum.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The persistent target directory of .ci/run (llama.cpp takes 10 minutes to build into a new one).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gst-vlm-target}"
cargo build -q -p vlm-bench
bench="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/vlm-bench"
out=$(mktemp -d)
cores=$(nproc)
for round in $(seq "${ROUNDS:-2}"); do
  for load in quiet busy; do
    pids=()
    if [ "$load" = busy ]; then
      for _ in $(seq "$cores"); do (while :; do :; done) & pids+=($!); done
    fi
    for setting in "$@"; do
      name=${setting%%=*}
      read -r -a envs <<<"${setting#*=}"
      json="$out/$name-$load-$round.json"
      engine=()
      for e in "${envs[@]}"; do [[ $e == VLM_ENGINE=* ]] && engine=(--engine "${e#VLM_ENGINE=}"); done
      env "${envs[@]}" "$bench" --configs B1 --rounds 1 "${engine[@]}" --json "$json" >"$json.log" 2>&1
      python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['summaries'][0]; print(sys.argv[2], s['answered'], round(s['throughput'], 3), round(s['ttft_from_capture_mean_ms']), round(s['load_ms']), round(s['decode_tok_s'], 1))" "$json" "$round $load $name"
    done
    [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}"
  done
done
# busy / quiet throughput per round and setting, and each setting's minimum over the rounds.
python3 - "$out" "$@" <<'PY'
import json, sys
out, settings = sys.argv[1], [s.split("=", 1)[0] for s in sys.argv[2:]]
tput = lambda n, l, r: json.load(open(f"{out}/{n}-{l}-{r}.json"))["summaries"][0]["throughput"]
for n in settings:
    rounds, ratios = 1, []
    while True:
        try:
            ratios.append(tput(n, "busy", rounds) / tput(n, "quiet", rounds))
        except FileNotFoundError:
            break
        rounds += 1
    print(f"{n}: busy/quiet by round {' '.join(f'{r:.2f}' for r in ratios)}; minimum {min(ratios):.2f}")
PY
echo "JSON in $out"
