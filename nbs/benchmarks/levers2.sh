#!/bin/bash
# One GPU, one call: nanoGPT-equivalent baselines and the model levers (call 2: compile options, memory), one process per configuration.
# Usage (repo root): bash nbs/benchmarks/levers2.sh OUT.jsonl    (rows are appended to OUT.jsonl)
O=${1:-levers.jsonl}; START=$(date +%s); BUDGET=${BUDGET:-540}
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
. "$(dirname "$0")/budget.sh"   # run LIMIT_S ARGS...: one bench row within the call's budget
G2B="n_layer=24 n_embd=2560 n_head=40"
kern() { local left=$(( BUDGET - ($(date +%s) - START) )); (( left < 60 )) && { echo "SKIP kernels $*"; return; }
  echo "== kernels $*"; timeout $((left-5)) python3 nbs/benchmarks/kernels.py "$@" 2>&1 | grep -v Warn | tail -16; }
run 120 --profile gpt2_124m --label 124m-nanogpt-acc8  --steps 3
run 150 --profile gpt2_124m --label 124m-cdtune-acc8   --steps 3 --inductor coordinate_descent_tuning=1
kern gpt2_124m $G2B grad_accum=2 batch_size=4
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 150 --profile runpod_4b --label runpod4b-expseg --set grad_accum=4 --batch-sizes 1,2 --steps 2
run 150 --profile gpt2_124m --label 124m-cudagraphs-acc8 --steps 3 --compile-mode reduce-overhead
run 240 --profile gpt2_124m --label 124m-maxautotune-acc8 --steps 3 --compile-mode max-autotune-no-cudagraphs
kern gpt2_124m grad_accum=1 batch_size=64
