#!/usr/bin/env bash
# The tests: set up (packages, headers, models), then build and run every test of the workspace
# (runtime unit and integration tests, element harness tests, every file in pipelines/).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
cargo test --workspace "$@"
