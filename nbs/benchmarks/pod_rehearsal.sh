#!/usr/bin/env bash
# The pod rehearsal (see pod_rehearsal.py): the pod's exact start command as PID 1, a fresh /workspace, the REST v2 fake as
# RunPod; runpod_1b through papermill on one GPU in three containers: the trainer killed by SIGKILL mid-run (the pod must
# stop itself, naming the newest checkpoint), a stop request after the resume (a stop checkpoint, no step lost, the pod
# stops itself), the run finished (the pod stops itself once, after the final checkpoint).
# On a GPU machine with torch and no package index, from the repository root, with the wheels of pod_wheels.sh beside it:
#   bash nbs/benchmarks/pod_rehearsal.sh --wheels nbs/benchmarks/pod-wheels --steps 60 --stop-at 35 \
#     --set ckpt_every=30 --out "${OUT:-.}/pod_rehearsal.json"
# On a CPU, the smoke profile checks the rehearsal itself (~2 minutes): bash nbs/benchmarks/pod_rehearsal.sh --tiny --wheels DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" nbs/benchmarks/pod_rehearsal.py "$@"
