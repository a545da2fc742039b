#!/bin/bash
# The GPU rows of "Serving" in nbs/benchmarks.md on ONE GPU, from the repo root, one call of about 3 minutes:
#   bash nbs/benchmarks/serve_load.sh           (rows to $OUT/serve_load_gpu.jsonl)
# A random model of Llama-2-7B's shape, in bf16, served by lmbook serve on 127.0.0.1 and loaded by 1, 8 and 32 concurrent
# clients (chat requests of up to 128 new tokens); then the same with --max-batch 1 (no batching) at 8 clients.
set -e
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
tmp=$(mktemp -d)                           # scratch: the 13 GB model
trap 'rm -rf "$tmp"' EXIT                  # removed however the script ends
trap 'exit 130' INT; trap 'exit 143' TERM  # on a signal, the running command ends first, then the line above runs
dir=$tmp/llama7b
python3 -c "
import sys; sys.path.insert(0, 'nbs/benchmarks')
from pathlib import Path
from qlora_7b import make_model, SHAPE_7B
make_model(Path('$dir'), SHAPE_7B, 'cuda')"
out=${OUT:-.}/serve_load_gpu.jsonl
for c in 1 8 32; do python3 nbs/benchmarks/serve_load.py "$dir" --clients $c --requests $((c*4)) --max-tokens 128 --max-batch 32 | tee -a "$out"; done
python3 nbs/benchmarks/serve_load.py "$dir" --clients 8 --requests 32 --max-tokens 128 --max-batch 1 | tee -a "$out"
