#!/usr/bin/env bash
# The tests: set up (packages, headers, models), then build and run every test of the workspace
# (runtime unit and integration tests, element harness tests, every file in pipelines/, and the
# RKNN encoder glue against a stand-in NPU runtime).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
cargo test --workspace "$@"
# The NPU (RKNN) glue, against the stand-in librknnrt built from runtime/rknn-standin (no NPU here).
VLM_RKNN_STANDIN=1 cargo test -p vlm-runtime --features rknn --test rknn "$@"
