#!/bin/bash
# Table "Per-document attention (doc_mask)" of nbs/benchmarks.md on ONE GPU, from the repo root, in one call:
#   bash nbs/benchmarks/doc_mask.sh            (rows go to $OUT/doc_mask.jsonl; about 10 minutes on an H100)
# Needs only lmbook's own dependencies (no torchao); extra wheels in .whl/ are installed as levers.sh does.
set -e
tmp=$(mktemp -d)                           # scratch: the wheels' install folder
trap 'rm -rf "$tmp"' EXIT                  # removed however the script ends
trap 'exit 130' INT; trap 'exit 143' TERM  # on a signal, the running command ends first, then the line above runs
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$tmp/site" .whl/*.whl && export PYTHONPATH=$tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 nbs/benchmarks/doc_mask.py "${OUT:-.}/doc_mask.jsonl" --part "${1:-all}" --quiet
