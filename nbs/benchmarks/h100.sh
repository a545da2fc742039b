#!/bin/bash
# One H100, one call: the nanoGPT-recipe baselines and the profiles that must fit an 80 GB card.
# Usage (repo root): BUDGET=480 bash nbs/benchmarks/h100.sh OUT.jsonl    (rows are appended to OUT.jsonl)
O=${1:-h100.jsonl}; START=$(date +%s); BUDGET=${BUDGET:-540}
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
. "$(dirname "$0")/budget.sh"   # run LIMIT_S ARGS...: one bench row within the call's budget
G2B="n_layer=24 n_embd=2560 n_head=40"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
run 100 --profile gpt2_124m --label h100-124m-nanogpt --steps 3
run 110 --profile gpt2_124m --label h100-2b-nanogpt-b4 --set $G2B grad_accum=8 --batch-sizes 4 --steps 3
run 110 --profile gpt2_124m --label h100-2b-b16 --set $G2B grad_accum=2 --batch-sizes 16 --steps 3
run 100 --profile runpod_2b --label h100-runpod2b-b8 --set grad_accum=4 --batch-sizes 8 --steps 3
run 110 --profile runpod_4b --label h100-runpod4b-b2 --set grad_accum=4 --batch-sizes 2 --steps 2
python3 -c "
import json, sys; from lmbook.bench import format_rows
print(format_rows([r for r in map(json.loads, open('$O')) if r.get('tok_per_s')]))"
