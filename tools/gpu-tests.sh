#!/usr/bin/env bash
# Run the GPU tests on a CUDA machine where beamfx is not installed (no network, no pip
# install): lay out the package as installed (kernels/ and passes/ inside beamfx/) under a
# temporary folder and put it on PYTHONPATH.   bash tools/gpu-tests.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
site=$(mktemp -d)
cp -r "$root/beamfx" "$site/beamfx"
ln -s "$root/kernels" "$site/beamfx/kernels"
ln -s "$root/passes" "$site/beamfx/passes"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
# -P: the repository root must not shadow the laid-out package.
python3 -P -m pytest -m gpu -p no:cacheprovider "${@:-tests}"
