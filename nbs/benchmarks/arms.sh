# Sourced (from the repo root) by the scripts that train one arm a GPU at the same time: fp8_parity.sh,
# fp8_time_to_loss.sh, muon_scale.sh. It makes $tmp, a scratch folder for the wheels' install and the tokens the arms
# share, removed however the script ends with the arms stopped first; installs the wheels of .whl/ there (a GPU
# machine without a package index); and sets the environment the arms run in.
set -e
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait; rm -rf "$tmp"' EXIT  # removed however it ends, arms stopped first
trap 'exit 130' INT; trap 'exit 143' TERM  # on a signal, the running command ends first, then the line above runs
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$tmp/site" .whl/*.whl && export PYTHONPATH=$tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
