#!/bin/bash
# Table "Activation checkpointing and the micro-batch fit" of nbs/benchmarks.md on ONE Hopper GPU, from the repo root,
# two calls of about 7 minutes each:   bash nbs/benchmarks/act_ckpt.sh 4b   and   bash nbs/benchmarks/act_ckpt.sh 2b
# (rows go to $OUT/act_ckpt.jsonl). torchao comes as a wheel in .whl/ (see levers.sh for the download command).
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 nbs/benchmarks/act_ckpt.py "${OUT:-.}/act_ckpt.jsonl" --part "${1:-4b}" --steps "${2:-3}"
