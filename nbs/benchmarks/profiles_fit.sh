#!/bin/bash
# Table "Baselines and the profiles that must fit one 80 GB card" of nbs/benchmarks.md: ONE GPU, one call, repo root:
#   bash nbs/benchmarks/profiles_fit.sh       (rows go to $OUT/profiles_fit.jsonl; about 6 minutes on an H100)
# The nanoGPT-recipe rows (arch=gpt2, whole-logits loss, torch's attention kernel) at 124M and at the 2B shape, the
# 2B shape at micro-batch 16 and the big llama profiles at the micro-batches that fit, each with its memory estimate.
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
O="${OUT:-.}/profiles_fit.jsonl"
B='from lmbook.train.bench import main; main()'
R="ce_chunk=0 attn_backend=sdpa"; G2B="n_layer=24 n_embd=2560 n_head=40"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "$B" --profile gpt2_124m --label 124m-recipe    --set $R grad_accum=8 --batch-sizes 64 --steps 3 --out "$O" | tail -1
python3 -c "$B" --profile gpt2_124m --label 2b-recipe-b4   --set $R $G2B grad_accum=8 --batch-sizes 4 --steps 3 --out "$O" | tail -1
python3 -c "$B" --profile gpt2_124m --label 2b-recipe-b16  --set $R $G2B grad_accum=2 --batch-sizes 16 --steps 3 --out "$O" | tail -1
python3 -c "$B" --profile runpod_2b --label runpod2b-b8    --set grad_accum=4 --batch-sizes 8 --steps 3 --out "$O" | tail -1
python3 -c "$B" --profile runpod_4b --label runpod4b-b2    --set grad_accum=4 --batch-sizes 2 --steps 2 --out "$O" | tail -1
python3 -c "import json; from lmbook.train.bench import format_rows; print(format_rows([json.loads(l) for l in open('$O')]))"
