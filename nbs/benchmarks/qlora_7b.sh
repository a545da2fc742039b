#!/bin/bash
# The QLoRA/LoRA rows of nbs/benchmarks.md on ONE H100, one call of about 8 minutes, from the repo root:
#   bash nbs/benchmarks/qlora_7b.sh            (rows to $OUT/qlora_7b.json; extra arguments go to qlora_7b.py)
# The GPU machine has torch, transformers and peft but no package index: bitsandbytes comes as a wheel in .whl/,
# which `bash .ci/gpu-wheels` fills where an index is reachable (bitsandbytes 0.50.2 with its CUDA 13 libraries only,
# 7 MB; it needs only torch, numpy and packaging, which the machine has). Carry .whl in the call.
set -e
tmp=$(mktemp -d)                           # scratch: the wheel's install folder
trap 'rm -rf "$tmp"' EXIT                  # removed however the script ends
trap 'exit 130' INT; trap 'exit 143' TERM  # on a signal, the running command ends first, then the line above runs
if ls .whl/bitsandbytes-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$tmp/site" .whl/bitsandbytes-*.whl && export PYTHONPATH=$tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import bitsandbytes, peft, transformers; print("bitsandbytes", bitsandbytes.__version__, "peft", peft.__version__, "transformers", transformers.__version__)'
python3 nbs/benchmarks/qlora_7b.py "${OUT:-.}/qlora_7b.json" "$@"
