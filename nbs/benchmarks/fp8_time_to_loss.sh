#!/bin/bash
# fp8 against bf16 by time to a loss, one seed a call, from the repo root:
#   bash nbs/benchmarks/fp8_time_to_loss.sh [SEED [PROFILE]]  (rows: $OUT/fp8-time-to-loss-PROFILE-seedSEED.jsonl)
# PROFILE is runpod_2b (the default), runpod_1b or runpod_1b-equal. Each arm runs at its fit on an 80 GB card,
# bf16 for 1,500 steps and fp8 at the micro-batch it frees for the steps that take the same wall time at the
# tokens/s measured for it:
#   runpod_2b: bf16 at micro-batch 8, fp8 at 16 for 960 steps (1.28x bf16's tokens/s, 2026-11-26);
#   runpod_1b: bf16 at micro-batch 16, fp8 at 32 for 915 steps (1.22x, 2026-11-27);
#   runpod_1b-equal: equal tokens a step, as batch_fit keeps them: bf16 at 16 x 2 for 750 steps, fp8 at 32 x 1 for
#   947 (a step 0.49 s against 0.388 s, from the two arms above on one H200 host, 2026-11-27).
# Both on the same real tokens with the same first validation sequences (as many for each); the verdict says when fp8
# first reaches bf16's final validation loss. Two GPUs of one host run both arms at once (about 8 minutes); one GPU
# runs them one after the other; CUDA_VISIBLE_DEVICES picks the GPUs. torchao comes as a wheel in .whl/ where no
# package index is reachable. ARMS_LIMIT_S stops the arms after that many seconds so that the verdict still runs
# in a call of limited time (runpod_1b-equal took about 10.5 minutes: ARMS_LIMIT_S=520 in a call of ten); an fp8
# arm stopped early still gives the step at which it reached bf16's loss. ARMS=bf16 or ARMS=fp8 runs one arm (on the
# first GPU): one GPU then runs the two arms in two calls back to back on the same machine, the second call's
# $OUT holding the first call's rows file before it starts (the verdict reads both arms from it).
seed=${1:-1337}; profile=${2:-runpod_2b}; bacc=1; bsteps=1500; bevery=100
case $profile in
  runpod_2b) bmb=8; fmb=16; fsteps=960 ;;
  runpod_1b) bmb=16; fmb=32; fsteps=915 ;;
  runpod_1b-equal) bmb=16; bacc=2; bsteps=750; bevery=50; fmb=32; fsteps=947 ;;
  *) echo "fp8_time_to_loss.sh: no arms for $profile: runpod_2b, runpod_1b or runpod_1b-equal" >&2; exit 2 ;;
esac
arms=${ARMS:-both}
case $arms in both|bf16|fp8) ;; *) echo "fp8_time_to_loss.sh: ARMS=$arms: write both, bf16 or fp8" >&2; exit 2 ;; esac
needs='torchao'
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
out=${OUT:-.}/fp8-time-to-loss-$profile-seed$seed.jsonl; P=nbs/benchmarks/fp8_parity.py
limit="timeout ${ARMS_LIMIT_S:-0}"  # 0: no limit
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
python3 $P "$out" --prepare --profile ${profile%-equal} --workspace "$tmp/ws"
bf16="--arm bf16 --batch-size $bmb --grad-accum $bacc --steps $bsteps --eval-every $bevery --eval-batches 20"
fp8="--arm fp8 --batch-size $fmb --steps $fsteps --eval-every 40 --eval-batches 10"
common="--seed $seed --profile ${profile%-equal} --workspace $tmp/ws"
gpus=(${CUDA_VISIBLE_DEVICES//,/ })  # the GPUs given (two seeds at once on four GPUs: 0,1 and 2,3), else all
[ ${#gpus[@]} -gt 0 ] || gpus=($(seq 0 $(($(nvidia-smi -L | wc -l) - 1))))
if [ "$arms" = both ] && [ ${#gpus[@]} -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=${gpus[0]} $limit python3 $P "$out" $bf16 $common > "${OUT:-.}/bf16-seed$seed.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=${gpus[1]} $limit python3 $P "$out" $fp8 $common > "${OUT:-.}/fp8-seed$seed.log" 2>&1 &
  wait || true
else  # one after the other on the first GPU, or the one arm asked for
  [ "$arms" = fp8 ] || CUDA_VISIBLE_DEVICES=${gpus[0]} $limit python3 $P "$out" $bf16 $common || true
  [ "$arms" = bf16 ] || CUDA_VISIBLE_DEVICES=${gpus[0]} $limit python3 $P "$out" $fp8 $common || true
fi
python3 $P "$out" --verdict
