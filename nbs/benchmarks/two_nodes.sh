#!/bin/bash
# Table "Two nodes on one host" of nbs/benchmarks.md: training tokens/s of two "nodes" of one GPU each (two torchrun
# agents meeting in a c10d rendezvous on 127.0.0.1, as two machines would, each seeing only its own GPU) against one
# node of the same two GPUs, the same model, micro-batch and accumulation, in one call:
#   bash nbs/benchmarks/two_nodes.sh OUTDIR       (from the repo root; rows go to OUTDIR/two_nodes.jsonl)
# DDP at gpt2_124m (micro-batch 32) and FSDP2 at runpod_1b (micro-batch 8), each 1 x 2 and 2 x 1, and HSDP 2 x 1
# at runpod_1b (sharded within a node of one GPU: replicated across the two). A host of 2 GPUs or more (it uses
# the first two that CUDA_VISIBLE_DEVICES names, else 0 and 1); about 8 minutes on two H100s. The last lines give each 2 x 1 row's tokens/s against its 1 x 2 row.
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
O=${1:?usage: bash nbs/benchmarks/two_nodes.sh OUTDIR}; mkdir -p "$O"; J="$O/two_nodes.jsonl"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B='from lmbook.train.bench import main; main()'
IFS=, read -r G0 G1 _ <<< "${CUDA_VISIBLE_DEVICES:-0,1}"; G1=${G1:-1}   # the two GPUs it uses
one() {  # one node, both GPUs
  CUDA_VISIBLE_DEVICES=$G0,$G1 python3 -m torch.distributed.run --standalone --nproc_per_node 2 --log-dir "$tmp" --no-python \
    python3 -c "$B" "$@" --out "$J" > "$O/$label.log" 2>&1 || { echo "$label failed: $O/$label.log"; return 1; }
  tail -n 1 "$O/$label.log"
}
two() {  # two nodes of one GPU each, as on two machines
  local port=$((29600 + RANDOM % 1000)) pids='' r p bad=0
  for r in 0 1; do
    g=$G0; [ $r = 1 ] && g=$G1
    CUDA_VISIBLE_DEVICES=$g python3 -m torch.distributed.run --nnodes 2 --node-rank $r --nproc_per_node 1 --rdzv-backend c10d \
      --rdzv-endpoint 127.0.0.1:$port --rdzv-id "$label" --log-dir "$tmp" --no-python \
      python3 -c "$B" "$@" --out "$J" > "$O/$label-node$r.log" 2>&1 &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p" || bad=1; done
  [ $bad = 0 ] || { echo "$label failed: $O/$label-node*.log"; return 1; }
  grep -h "^$label " "$O/$label-node0.log" "$O/$label-node1.log" | tail -n 1  # rank 0's row, on either node
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -2 || true
# the two configurations; A124= and A1B= in the environment replace them (a dry run: smoke on the CPU)
A124=${A124:-'--profile gpt2_124m --batch-sizes 32 --set grad_accum=1 --steps 20'}
A1B=${A1B:-'--profile runpod_1b --batch-sizes 8 --set grad_accum=1 batch_fit=false --steps 10'}
# a row that fails says so and the others still run
label=124m-ddp-1x2; one $A124 --label $label --set parallel=ddp || true
label=124m-ddp-2x1; two $A124 --label $label --set parallel=ddp || true
label=1b-fsdp-1x2;  one $A1B --label $label --set parallel=fsdp || true
label=1b-fsdp-2x1;  two $A1B --label $label --set parallel=fsdp || true
label=1b-hsdp-2x1;  two $A1B --label $label --set parallel=hsdp || true
python3 - "$J" <<'PY'
import json, sys
rows = {r['label']: r for r in map(json.loads, open(sys.argv[1])) if r.get('tok_per_s')}
for two, one in [('124m-ddp-2x1', '124m-ddp-1x2'), ('1b-fsdp-2x1', '1b-fsdp-1x2'), ('1b-hsdp-2x1', '1b-fsdp-1x2')]:
    if two in rows and one in rows:
        print(f"{two}: {rows[two]['tok_per_s']:,.0f} tok/s = {rows[two]['tok_per_s']/rows[one]['tok_per_s']:.2f}x "
              f"{one} ({rows[one]['tok_per_s']:,.0f}), {rows[two]['card']}, torch {rows[two]['torch']}, {rows[two]['date']}")
from lmbook.train.bench import format_rows
print(format_rows(list(rows.values())))
PY
