#!/bin/bash
# The GPU rows of "Serving" in nbs/benchmarks.md on ONE GPU, from the repo root, one call of about 5 minutes:
#   bash nbs/benchmarks/serve_load.sh           (rows to $OUT/serve_load_gpu.jsonl)
# A random model of Llama-2-7B's shape in bf16 (13.5 GB, written to a scratch folder under $TMPDIR and removed however
# the script ends; nothing else is written but the rows), then, each in its own process:
#   1. transformers' own `generate` on it at batch 1 and 32 (greedy, 128 new tokens);
#   2. lmbook serve on 127.0.0.1 (64 rows of 1,024 positions: 32 GB of KV cache, CUDA graphs) with 1, 32 and 64
#      concurrent clients, 4 streamed chat requests of 128 new tokens each: first plain requests (mix 0), then with
#      stop sequences and log-probabilities (logprobs, top_logprobs 5) in half of them (mix 0.5), on the same server.
# Goals on an H100, mix 0.5: one stream >= 120 tok/s, 32 clients >= 2,500, 64 clients >= 4,500, none dropped.
# Needs torch with CUDA, transformers, starlette and uvicorn (bash .ci/gpu-wheels carries the last two); no internet.
needs='transformers starlette uvicorn'
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks (and the model)
py=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
df -h "${TMPDIR:-/tmp}" | tail -1
dir=$tmp/llama7b
"$py" -c "
import sys; sys.path.insert(0, 'nbs/benchmarks')
from pathlib import Path
from qlora_7b import make_model, SHAPE_7B
make_model(Path('$dir'), SHAPE_7B, 'cuda')"
out=${OUT:-.}/serve_load_gpu.jsonl
load() { "$py" nbs/benchmarks/serve_load.py "$dir" --max-tokens 128 --out "$out" "$@"; }
[ "${HF_GENERATE:-1}" = 0 ] || load --hf-generate 1,32   # HF_GENERATE=0: lmbook's rows alone
load --clients 1,32,64 --mix 0,0.5 --requests 4 --max-batch 64 --context 1024
echo "rows in $out"
