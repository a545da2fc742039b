#!/bin/bash
# Table "fp8 loss parity" of nbs/benchmarks.md, from the repo root: both arms at once on a host with two GPUs
# (one arm a GPU), in about 9 minutes for 1,500 steps of runpod_2b at micro-batch 8:
#   bash nbs/benchmarks/fp8_parity.sh [STEPS [BATCH_SIZE [PROFILE]]]     (rows go to $OUT/fp8_parity.jsonl)
# torchao comes as a wheel in .whl/ (see levers.sh for the download command).
needs='torchao'
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
out=${OUT:-.}/fp8_parity.jsonl
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
args="--steps ${1:-1500} --batch-size ${2:-8} --profile ${3:-runpod_2b} --workspace $tmp/ws"
python3 nbs/benchmarks/fp8_parity.py "$out" --prepare $args
n=$(nvidia-smi -L | wc -l)
if [ "$n" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 python3 nbs/benchmarks/fp8_parity.py "$out" --arm bf16 $args > "${OUT:-.}/bf16.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 nbs/benchmarks/fp8_parity.py "$out" --arm fp8 $args > "${OUT:-.}/fp8.log" 2>&1 &
  wait
else
  python3 nbs/benchmarks/fp8_parity.py "$out" --arm bf16 $args
  python3 nbs/benchmarks/fp8_parity.py "$out" --arm fp8 $args
fi
python3 nbs/benchmarks/fp8_parity.py "$out" --verdict
