#!/bin/bash
# The QLoRA/LoRA rows of nbs/benchmarks.md on ONE H100, from the repo root (rows to $OUT/qlora_7b.json; extra arguments
# go to qlora_7b.py):
#   bash nbs/benchmarks/qlora_7b.sh                                                  (every row: about 9 minutes)
#   bash nbs/benchmarks/qlora_7b.sh --rows lmbook-qlora-ckpt-full,peft-qlora-parity  (the parity alone: about 3)
# The GPU machine has torch, transformers and peft but no package index: the rest (bitsandbytes, fastcore, ...) comes
# as wheels in .whl/, which `bash .ci/gpu-wheels` fills where an index is reachable (bitsandbytes 0.50.2 with its
# CUDA 13 libraries only). Carry .whl in the call; arms.sh installs what this Python lacks and checks the imports.
needs='bitsandbytes peft transformers'
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import bitsandbytes, peft, transformers; print("bitsandbytes", bitsandbytes.__version__, "peft", peft.__version__, "transformers", transformers.__version__)'
python3 nbs/benchmarks/qlora_7b.py "${OUT:-.}/qlora_7b.json" "$@"
