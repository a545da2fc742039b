#!/bin/bash
# One command with the benchmarks' preamble (arms.sh): how a .py script of nbs/benchmarks/ runs on a bare GPU machine
# (torch, no package index, the wheels in .whl/), from the repo root:
#   bash nbs/benchmarks/run.sh python3 nbs/benchmarks/end_to_end.py --steps 150 ...
#   bash nbs/benchmarks/run.sh torchrun --standalone --nproc_per_node 2 nbs/benchmarks/sharded_ckpt.py ...
#   NEEDS='transformers starlette' bash nbs/benchmarks/run.sh ...    (modules it needs besides lmbook's training stack)
needs=${NEEDS:-}
source nbs/benchmarks/arms.sh
"$@"
