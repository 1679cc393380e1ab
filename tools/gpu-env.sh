# Source on a CUDA machine where beamfx cannot be installed (no network, no pip install):
# lays the package out as installed (kernels/ and passes/ inside beamfx/) in a temporary
# folder and puts it on PYTHONPATH. Run Python with -P there, so that the repository root
# does not shadow the laid-out package.      source tools/gpu-env.sh
_beamfx_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_beamfx_site=$(mktemp -d)
cp -r "$_beamfx_root/beamfx" "$_beamfx_site/beamfx"
ln -s "$_beamfx_root/kernels" "$_beamfx_site/beamfx/kernels"
ln -s "$_beamfx_root/passes" "$_beamfx_site/beamfx/passes"
export PYTHONPATH="$_beamfx_site${PYTHONPATH:+:$PYTHONPATH}"
