#!/usr/bin/env bash
# Print a pipelines/*.pipeline description ready for gst-launch-1.0 from any folder: comments
# dropped, `model=` / `mmproj=` values replaced whole by VLM_MODEL / VLM_MMPROJ when they are set,
# and every relative file (`model=`, `mmproj=`, `rknn-model=`, `location=`) made absolute: against
# the pipeline file's own folder when it is there (a user's pipeline beside its files), else
# against the repository root when it is there (the repository's pipelines name models/ and
# pipelines/ from it), else (a file to be written: a filesink's output) against the current
# folder, as gst-launch-1.0 itself would; VLM_MODEL / VLM_MMPROJ against the current folder.
#   gst-launch-1.0 -m $(scripts/pipeline.sh pipelines/two-streams.pipeline)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
absolute() { [ -z "$1" ] || realpath -m -- "$1"; }
here=$(cd "$(dirname "$1")" && pwd)
grep -v '^[[:space:]]*#' "$1" | tr '\n' ' ' | awk -v root="$root" -v here="$here" -v cwd="$PWD" \
  -v model="$(absolute "${VLM_MODEL:-}")" -v mmproj="$(absolute "${VLM_MMPROJ:-}")" '
{
  for (i = 1; i <= NF; i++) {
    if (match($i, /^(model|mmproj|rknn-model|location)=/)) {
      key = substr($i, 1, RLENGTH - 1); value = substr($i, RLENGTH + 1)
      if (key == "model" && model != "") value = model
      else if (key == "mmproj" && mmproj != "") value = mmproj
      else if (value !~ /^\//) {
        if (system("test -e \"" here "/" value "\"") == 0) value = here "/" value
        else if (system("test -e \"" root "/" value "\"") == 0) value = root "/" value
        else value = cwd "/" value
      }
      $i = key "=" value
    }
  }
  print
}'
