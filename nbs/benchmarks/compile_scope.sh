#!/bin/bash
# What compiling the whole model (compile=true) against each block on its own (compile=blocks) costs at the
# start and per step: the `bench` rows of PROFILE (tok/s, and `warmup_s`: the first two optimizer steps with
# their compilation), one arm per GPU at once (true on GPU 0, blocks on GPU 1), each arm twice: cold (an empty
# compile cache, a fresh TMPDIR and HOME as on a new pod) and warm (that cache again, in a new process, as a
# resume on the same volume); on one GPU the arms run one after the other. From the repo root on a machine of two
# GPUs, about 4 minutes at runpod_2b:
#   bash nbs/benchmarks/compile_scope.sh [PROFILE] [STEPS] [--set k=v ...]   (rows: $OUT/compile_scope.jsonl)
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
profile=${1:-runpod_2b}; steps=${2:-8}; shift 2 2>/dev/null || shift $#
sets=${*:---set batch_size=32 grad_accum=4}  # default: the micro-batch the fit chose for runpod_2b on an H200
out=${OUT:-.}/compile_scope.jsonl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
arm() {  # arm GPU COMPILE: cold then warm, in two processes on one cache folder
  local gpu=$1 mode=$2 cache=$tmp/cache-$2
  for start in cold warm; do
    mkdir -p "$tmp/home-$mode-$start"
    CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_CACHE_DIR=$cache TMPDIR=$tmp/home-$mode-$start \
      HOME=$tmp/home-$mode-$start python3 -m lmbook.cli bench -p "$profile" $sets compile=$mode \
      --steps "$steps" --label "$mode-$start" --out "$out" > "$tmp/$mode-$start.log" 2>&1 \
      || { echo "arm $mode $start failed:"; tail -20 "$tmp/$mode-$start.log"; return 1; }
    grep '^{' "$tmp/$mode-$start.log" | python3 -c "import json,sys; r=json.loads(sys.stdin.readline()); \
print(r['label'], 'tok/s', r['tok_per_s'], 'warmup_s', r['warmup_s'], 'mem_gb', r.get('mem_gb'))"
  done
}
unset TRITON_CACHE_DIR
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then arm 0 true & arm 1 blocks & wait
else arm 0 true; arm 0 blocks; fi  # one GPU: the arms one after the other
