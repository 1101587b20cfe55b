#!/usr/bin/env bash
# The demo: set up (packages, headers, models), build the plugin, and run pipelines/demo.pipeline
# through gst-launch-1.0, printing every answer with its timings.
#   scripts/demo.sh [PIPELINE_FILE]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
echo "[demo] building the plugin (the first build compiles llama.cpp: about 7 minutes on 2 cores)"
cargo build -p gst-plugin-vlm
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
export GST_PLUGIN_PATH="$target_dir/debug${GST_PLUGIN_PATH:+:$GST_PLUGIN_PATH}"
pipeline=$(scripts/pipeline.sh "${1:-pipelines/demo.pipeline}")
echo "[demo] gst-launch-1.0 $pipeline"
# -m prints bus messages; each vlm-answer carries the answer and its timings.
# shellcheck disable=SC2086
# (Bounded: a pipeline that never ends fails the demo instead of hanging it.)
timeout 600 gst-launch-1.0 -m $pipeline 2>&1 | python3 scripts/print_answers.py
