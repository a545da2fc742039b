#!/bin/bash
# fp8 against bf16 by time to a loss at runpod_2b, one seed a call, from the repo root:
#   bash nbs/benchmarks/fp8_time_to_loss.sh [SEED]      (rows go to $OUT/fp8-time-to-loss-seed$SEED.jsonl)
# Each arm at its fit on an 80 GB card: bf16 at micro-batch 8 for 1,500 steps; fp8 (tensorwise) at micro-batch 16,
# which it frees, for 960 steps: the same wall time at the 1.28x tokens/s measured for fp8 at 16. Both on the same
# real tokens with the same first validation sequences (160 of them); the verdict says when fp8 first reaches
# bf16's final validation loss. Two GPUs of one host run both arms at once (about 8 minutes); one GPU runs them
# one after the other. torchao comes as a wheel in .whl/ where no package index is reachable.
source nbs/benchmarks/arms.sh  # $tmp (removed at the end, arms stopped first), the wheels, the environment
seed=${1:-1337}; out=${OUT:-.}/fp8-time-to-loss-seed$seed.jsonl; P=nbs/benchmarks/fp8_parity.py
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
python3 $P "$out" --prepare --profile runpod_2b --workspace "$tmp/ws"
bf16="--arm bf16 --batch-size 8 --steps 1500 --eval-every 100 --eval-batches 20"
fp8="--arm fp8 --batch-size 16 --steps 960 --eval-every 40 --eval-batches 10"
common="--seed $seed --profile runpod_2b --workspace $tmp/ws"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 python3 $P "$out" $bf16 $common > "${OUT:-.}/bf16-seed$seed.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 $P "$out" $fp8 $common > "${OUT:-.}/fp8-seed$seed.log" 2>&1 &
  wait
else
  python3 $P "$out" $bf16 $common
  python3 $P "$out" $fp8 $common
fi
python3 $P "$out" --verdict
