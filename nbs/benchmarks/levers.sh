#!/bin/bash
# Table "Levers" of nbs/benchmarks.md on ONE Hopper GPU, from the repo root, in about 8 minutes:
#   bash nbs/benchmarks/levers.sh [PARITY_STEPS [SHAPES]]   (defaults 120 and 2b,124m; rows go to $OUT/levers.jsonl)
# 300 loss-parity steps of all five 124M rows do not fit one 10-minute call beside the 2B rows: run
#   bash nbs/benchmarks/levers.sh 300 124m   as a second call for them.
# Optional packages come as wheels in .whl/ (torchao for fp8, liger-kernel for the fused loss); without them the
# rows say fp8=off / loss_kernel=chunked. Fetch them once on a machine with a package index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl torchao==0.18.0 liger-kernel==0.8.5
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__)"
python3 nbs/benchmarks/levers.py "${OUT:-.}/levers.jsonl" --parity-steps "${1:-120}" --shapes "${2:-2b,124m}"
