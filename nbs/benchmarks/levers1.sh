#!/bin/bash
# One GPU, one call: nanoGPT-equivalent baselines and the model levers, one process per configuration.
# Usage (repo root): bash nbs/benchmarks/levers1.sh OUT.jsonl    (rows are appended to OUT.jsonl)
O=${1:-levers.jsonl}; START=$(date +%s); BUDGET=${BUDGET:-540}
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
. "$(dirname "$0")/budget.sh"   # run LIMIT_S ARGS...: one bench row within the call's budget
G2B="n_layer=24 n_embd=2560 n_head=40"
run 150 --profile gpt2_124m --label 124m-nanogpt      --set ce_chunk=0 grad_accum=1 --batch-sizes 64
run 150 --profile gpt2_124m --label 124m-chunkce      --set grad_accum=1 --batch-sizes 64
run 150 --profile gpt2_124m --label 124m-chunkce-cudnn --set grad_accum=1 attn_backend=cudnn --batch-sizes 64
run 180 --profile gpt2_124m --label 2b-nanogpt        --set $G2B ce_chunk=0 grad_accum=8 --batch-sizes 4 --steps 4
run 180 --profile gpt2_124m --label 2b-chunkce-cudnn  --set $G2B grad_accum=8 attn_backend=cudnn --batch-sizes 4 --steps 4
run 180 --profile runpod_2b --label runpod2b-cudnn    --set grad_accum=2 attn_backend=cudnn --batch-sizes 8 --steps 4
run 200 --profile runpod_4b --label runpod4b-cudnn    --set grad_accum=2 attn_backend=cudnn --batch-sizes 1 --steps 3
left=$(( BUDGET - ($(date +%s) - START) ))
if (( left > 60 )); then echo "== kernels 124m chunkce-cudnn"; timeout $((left-5)) python3 nbs/benchmarks/kernels.py gpt2_124m grad_accum=1 attn_backend=cudnn batch_size=64 2>&1 | tail -17; fi
