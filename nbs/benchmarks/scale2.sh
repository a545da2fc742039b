#!/bin/bash
# Two GPUs of one host, one call: the one-GPU references and the torchrun rows (DDP at 124M, FSDP2 at 2B and
# runpod_4b) on the same machine, then the scaling efficiencies.
# Usage (repo root): BUDGET=540 bash nbs/benchmarks/scale2.sh OUT.jsonl
O=${1:-scale.jsonl}; START=$(date +%s); BUDGET=${BUDGET:-540}; PY=${PY:-python3}; TORCHRUN=${TORCHRUN:-torchrun}
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
B='from lmbook.bench import main; main()'
lim() { local want=$1 left=$(( BUDGET - ($(date +%s) - START) )); (( left < 40 )) && { echo 0; return; }; (( want > left )) && want=$left; echo $want; }
one() { local l=$(lim $1); shift; (( l == 0 )) && { echo "SKIP $*"; return; }; echo "== 1 GPU: $*"
  CUDA_VISIBLE_DEVICES=0 timeout $l $PY -c "$B" "$@" --out "$O" 2>&1 | grep -v '^{' | tail -3; }
two() { local l=$(lim $1); shift; (( l == 0 )) && { echo "SKIP $*"; return; }; echo "== 2 GPUs: $*"
  timeout $l $TORCHRUN --standalone --nproc_per_node 2 --no-python $PY -c "$B" "$@" --out "$O" 2>&1 | grep -v '^{' | tail -3; }
G2B="n_layer=24 n_embd=2560 n_head=40"
one 110 --profile gpt2_124m --label 124m-1gpu    --steps 3
two 150 --profile gpt2_124m --label 124m-ddp2    --steps 3
one 130 --profile gpt2_124m --label 2b-1gpu-b16  --set $G2B grad_accum=2 --batch-sizes 16 --steps 3
two 170 --profile gpt2_124m --label 2b-fsdp2-b16 --set $G2B grad_accum=2 parallel=fsdp --batch-sizes 16 --steps 3
two 170 --profile runpod_4b --label 4b-fsdp2-b2  --set grad_accum=4 parallel=fsdp --batch-sizes 2 --steps 2
$PY - "$O" <<'PY'
import json, sys
rows = {r['label']: r for r in map(json.loads, open(sys.argv[1])) if r.get('tok_per_s')}
for one, two in [('124m-1gpu', '124m-ddp2'), ('2b-1gpu-b16', '2b-fsdp2-b16')]:
    if one in rows and two in rows:
        print(f"{two}: {rows[two]['tok_per_s']:,.0f} tok/s = {rows[two]['tok_per_s']/(2*rows[one]['tok_per_s']):.1%} of 2x {one}")
from lmbook.bench import format_rows
print(format_rows(list(rows.values())))
PY
