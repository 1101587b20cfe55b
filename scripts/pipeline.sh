#!/usr/bin/env bash
# Print a pipelines/*.pipeline description with the model paths taken from VLM_MODEL / VLM_MMPROJ
# when they are set (the files name the defaults in models/).
set -euo pipefail
sed -e "s#models/SmolLM2-135M-Instruct.Q4_1.gguf#${VLM_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}#g" \
    -e "s#models/test-mmproj-mlp.gguf#${VLM_MMPROJ:-models/test-mmproj-mlp.gguf}#g" "$1" | grep -v '^#'
