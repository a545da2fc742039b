#!/bin/bash
# Table "Per-document attention (doc_mask)" of nbs/benchmarks.md on ONE GPU, from the repo root, in one call:
#   bash nbs/benchmarks/doc_mask.sh            (rows go to $OUT/doc_mask.jsonl; about 10 minutes on an H100)
# Needs only lmbook's own dependencies (no torchao); extra wheels in .whl/ are installed as levers.sh does.
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 nbs/benchmarks/doc_mask.py "${OUT:-.}/doc_mask.jsonl" --part "${1:-all}" --quiet
