#!/bin/bash
# Table "Activation checkpointing and the micro-batch fit" of nbs/benchmarks.md on ONE Hopper GPU, from the repo root,
# two calls of about 7 minutes each:   bash nbs/benchmarks/act_ckpt.sh 4b   and   bash nbs/benchmarks/act_ckpt.sh 2b
# (rows go to $OUT/act_ckpt.jsonl). torchao comes as a wheel in .whl/ (see levers.sh for the download command).
set -e
tmp=$(mktemp -d)                           # scratch: the wheels' install folder
trap 'rm -rf "$tmp"' EXIT                  # removed however the script ends
trap 'exit 130' INT; trap 'exit 143' TERM  # on a signal, the running command ends first, then the line above runs
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$tmp/site" .whl/*.whl && export PYTHONPATH=$tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 nbs/benchmarks/act_ckpt.py "${OUT:-.}/act_ckpt.jsonl" --part "${1:-4b}" --steps "${2:-3}"
