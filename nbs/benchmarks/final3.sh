#!/bin/bash
# One GPU, one call: nanoGPT-equivalent baselines and the final numbers through the trainer step (call 3), one process per configuration.
# Usage (repo root): bash nbs/benchmarks/final3.sh OUT.jsonl    (rows are appended to OUT.jsonl)
O=${1:-levers.jsonl}; START=$(date +%s); BUDGET=${BUDGET:-540}
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
. "$(dirname "$0")/budget.sh"   # run LIMIT_S ARGS...: one bench row within the call's budget
G2B="n_layer=24 n_embd=2560 n_head=40"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
G2B="n_layer=24 n_embd=2560 n_head=40"; G354="n_layer=24 n_embd=1024 n_head=16"
run 110 --profile gpt2_124m --label 124m-nanogpt          --steps 3
run 130 --profile gpt2_124m --label 2b-nanogpt-b4         --set $G2B grad_accum=8 --batch-sizes 4 --steps 3
run 130 --profile gpt2_124m --label 2b-b16                --set $G2B grad_accum=2 --batch-sizes 16 --steps 3
run 110 --profile gpt2_124m --label 354m-nanogpt-b16      --set $G354 grad_accum=8 --batch-sizes 16 --steps 3
run 130 --profile runpod_4b --label runpod4b-b1           --set grad_accum=8 --batch-sizes 1 --steps 2
run 130 --profile runpod_4b --label runpod4b-b2           --set grad_accum=4 --batch-sizes 2 --steps 2
run 130 --profile runpod_2b --label runpod2b-b16          --set grad_accum=2 --batch-sizes 16 --steps 3
python3 -c "
import numpy as np; from lmbook.loader import write_token_dir
write_token_dir('/tmp/tok', [np.random.default_rng(0).integers(0, 8000, 3_000_000).astype(np.uint16)], eot_id=0)" &&
run 90 --profile m3_medium --label m3-tokenfiles --steps 3 --data /tmp/tok
run 130 --profile runpod_2b --label runpod2b-b8           --set grad_accum=4 --batch-sizes 8 --steps 3
