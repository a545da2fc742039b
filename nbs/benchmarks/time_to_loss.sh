#!/bin/bash
# Table "Time to loss" of nbs/benchmarks.md on ONE GPU, from the repo root, in about 7 minutes:
#   bash nbs/benchmarks/time_to_loss.sh [STEPS [MUON_RUNS]]   (defaults 600 and 0.55@0.0018,0.75; rows go to $OUT/time_to_loss.jsonl)
# then, anywhere: python3 nbs/benchmarks/plot_time_to_loss.py time_to_loss.jsonl time_to_loss.png
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 nbs/benchmarks/time_to_loss.py "${OUT:-.}/time_to_loss.jsonl" --steps "${1:-600}" --muon-runs "${2:-0.55@0.0018,0.75}"
