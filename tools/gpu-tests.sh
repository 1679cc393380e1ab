#!/usr/bin/env bash
# Run the GPU tests on a CUDA machine where beamfx is not installed (see gpu-env.sh).
#     bash tools/gpu-tests.sh [pytest args, default: tests]
set -euo pipefail
source "$(dirname "$0")/gpu-env.sh"
cd "$(dirname "$0")/.."
python3 -P -m pytest -m gpu -p no:cacheprovider "${@:-tests}"
