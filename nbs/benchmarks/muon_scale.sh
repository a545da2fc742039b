#!/bin/bash
# Muon against a tuned AdamW at runpod_1b, from the repo root, one arm a GPU at the same time:
#   bash nbs/benchmarks/muon_scale.sh [STEPS [ARMS [ACCUM [SEED]]]]    (rows go to $OUT/muon-scale-seedSEED.jsonl)
# ARMS (comma-separated, see muon_scale.py): by default AdamW at the profile's lr and at twice it, Muon over 55% of
# the steps with its AdamW part at 3x the profile's lr, and the same with fp8. 516 s for 1,600 steps on four H200s
# (2026-11-27); with fewer GPUs than arms, each GPU runs its arms one after another. ACCUM: micro-batches a step
# (1; at 8, the profile's own tokens a step, each step takes about eight times as long). SEED: the model's initial
# weights (1337). Validation every twentieth of the steps. At the profile's tokens, two arms a call of ten minutes:
#   bash nbs/benchmarks/muon_scale.sh 200 adamw@3e-4,muon@0.55@9e-4 8 7   (two GPUs; about 7 minutes by the step
#   times of 2026-11-27: 0.21 s a micro-step, 0.17 s for Muon's orthogonalisation). ARMS_LIMIT_S stops each arm
#   after that many seconds so that the verdict still runs in a call of limited time (an arm stopped early still
#   gives the step at which it reached the target). GPUS (comma-separated ids) picks the GPUs it uses, so that two
#   seeds run side by side on four: GPUS=0,1 bash nbs/benchmarks/muon_scale.sh ... 1337 & GPUS=2,3 ... 7.
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
steps=${1:-1600}; arms=${2:-adamw@3e-4,adamw@6e-4,muon@0.55@9e-4,muon@0.55@9e-4@fp8}; accum=${3:-1}; seed=${4:-1337}
every=$(( steps/20 > 1 ? steps/20 : 1 ))
out=${OUT:-.}/muon-scale-seed$seed.jsonl; P=nbs/benchmarks/muon_scale.py
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
python3 $P "$out" --prepare --workspace "$tmp/ws"
IFS=, read -ra gpus <<< "${GPUS:-$(seq -s, 0 $(($(nvidia-smi -L | wc -l) - 1)))}"
n=${#gpus[@]}
IFS=, read -ra list <<< "$arms"
for g in $(seq 0 $((n - 1))); do     # the g-th GPU runs arms g, g+n, g+2n, ... one after another
  (for ((k = g; k < ${#list[@]}; k += n)); do
     CUDA_VISIBLE_DEVICES=${gpus[$g]} timeout ${ARMS_LIMIT_S:-0} python3 $P "$out" --arm "${list[$k]}" \
       --steps "$steps" --grad-accum "$accum" --seed "$seed" --eval-every "$every" --workspace "$tmp/ws" \
       > "${OUT:-.}/muon-arm-seed$seed-$k.log" 2>&1 || true  # the next arm runs
   done) &
done
wait
python3 $P "$out" --verdict
