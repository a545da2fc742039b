#!/bin/bash
# Table "Scaling" of nbs/benchmarks.md: one host with N GPUs, one call, from the repo root:
#   bash nbs/benchmarks/scaling.sh [N]      (default: every visible GPU; rows go to $OUT/scaling.jsonl)
# One-GPU references and N-GPU torchrun rows on the same machine: DDP at gpt2_124m (micro-batch 64, accum 8) and
# FSDP2 at runpod_4b (micro-batch 2, accum 4), then each N-GPU row's tokens/s per GPU against the one-GPU row.
# About 6 minutes on 4 H100s.
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks (torchrun logs too)
N=${1:-$(nvidia-smi -L | wc -l)}; O="${OUT:-.}/scaling.jsonl"
export NCCL_NVLS_ENABLE=0
B='from lmbook.train.bench import main; main()'
one() { CUDA_VISIBLE_DEVICES=0 python3 -c "$B" "$@" --out "$O" | tail -2; }
many() { torchrun --standalone --nproc_per_node "$N" --log-dir "$tmp" --no-python python3 -c "$B" "$@" --out "$O" | tail -2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
one  --profile gpt2_124m --label 124m-1gpu          --set grad_accum=8 --batch-sizes 64 --steps 5
many --profile gpt2_124m --label "124m-ddp$N"       --set grad_accum=8 --batch-sizes 64 --steps 5
one  --profile runpod_4b --label 4b-1gpu            --set grad_accum=4 --batch-sizes 2 --steps 3
many --profile runpod_4b --label "4b-fsdp$N"        --set grad_accum=4 parallel=fsdp --batch-sizes 2 --steps 3
python3 - "$O" "$N" <<'PY'
import json, sys
rows = {r['label']: r for r in map(json.loads, open(sys.argv[1])) if r.get('tok_per_s')}
n = int(sys.argv[2])
for one, many in [('124m-1gpu', f'124m-ddp{n}'), ('4b-1gpu', f'4b-fsdp{n}')]:
    if one in rows and many in rows:
        print(f"{many}: {rows[many]['tok_per_s']:,.0f} tok/s = {rows[many]['tok_per_s_per_gpu']/rows[one]['tok_per_s']:.1%} per GPU of {one}")
from lmbook.train.bench import format_rows
print(format_rows(list(rows.values())))
PY
