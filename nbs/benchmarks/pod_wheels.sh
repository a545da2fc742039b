#!/usr/bin/env bash
# Fill a folder with the wheels lmbook's pod path needs besides torch: numpy, pyyaml, tokenizers, safetensors, fastcore,
# papermill, ipykernel, matplotlib and what they need, and setuptools and wheel to install lmbook itself. For a
# GPU machine that has torch but no package index: run this where an index is reachable, then carry the folder
# there; the rehearsal (pod_rehearsal.sh) installs from it with --no-index.
# usage: bash nbs/benchmarks/pod_wheels.sh PYTHON_VERSION [DIR]      e.g. bash nbs/benchmarks/pod_wheels.sh 3.11
# About 67 MB (Python 3.11 and 3.12). WITHOUT="numpy" drops the wheels named there once resolved: numpy (16 MB) is
# not needed where the GPU machine's Python already has it (python3 -c 'import numpy').
set -euo pipefail
cd "$(dirname "$0")/../.."
pyver=${1:?give the GPU machine\'s Python version, e.g. 3.11}
dir=${2:-nbs/benchmarks/pod-wheels}
python3 -m pip download -q -d "$dir" --only-binary=:all: --python-version "$pyver" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
  numpy pyyaml tokenizers safetensors fastcore papermill ipykernel matplotlib setuptools wheel
for n in ${WITHOUT:-}; do rm -f "$dir/$n"-*.whl; done
echo "$(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
