#!/bin/bash
# Two GPUs of one host: a DDP training run whose torchrun is killed with SIGKILL mid-run (a pod dying),
# rerun with the same command, must continue from its newest checkpoint and finish; its losses after the
# resume are compared with the same run left uninterrupted. Real data: the built-in corpus, m3_medium.
# Usage (repo root): bash nbs/benchmarks/ddp_kill_resume.sh OUTDIR      (section "A DDP run killed mid-run resumes")
# It keeps only OUTDIR. The runs' workspace (data, checkpoints; TMPDIR too, for torchrun's log folders) is a fresh
# scratch folder, removed when the script ends, however it ends: a second call starts both runs afresh.
source nbs/benchmarks/arms.sh  # the one preamble: $tmp, the wheels of .whl/ this Python lacks, the checks
set +e                         # a run that fails is reported by its exit line, and the script goes on
O=${1:-ddp_resume}; mkdir -p "$O"
ws=$tmp/ws; mkdir -p "$ws/tmp"   # the runs' workspace, removed however it ends (the killed run stopped first)
export LMBOOK_WORKSPACE=$ws TMPDIR=$ws/tmp NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L='import sys; from lmbook.cli import main; sys.exit(main())'
ARGS="--profile m3_medium --nproc 2 --parallel ddp --set max_steps=90 --set ckpt_every=20 --set eval_every=30 --set log_every=5 --set compile=false"
M=$ws/runs
python3 -c "$L" train --experiment ref  $ARGS > "$O/ref.log" 2>&1; echo "ref exit $?"
python3 -c "$L" train --experiment kill $ARGS > "$O/kill1.log" 2>&1 &
RUN=$!   # this script's run: only its torchrun (a child of it) is killed below
for i in $(seq 600); do   # wait until step 50 is logged (checkpoints at 20 and 40), then kill -9 torchrun
  s=$(tail -n 1 $M/kill/metrics.jsonl 2>/dev/null | python3 -c 'import json,sys; print(json.loads(sys.stdin.read() or "{}").get("step", 0))' 2>/dev/null)
  [ "${s:-0}" -ge 50 ] && break; sleep 0.5; done
pkill -9 -P "$RUN" -f torch.distributed.run; sleep 3; echo "killed at step $s; left: $(pgrep -fc 'lmbook.train.launch' || true) worker processes"
ls $M/kill/checkpoints | tee "$O/ckpts_after_kill.txt"
python3 -c "$L" train --experiment kill $ARGS > "$O/kill2.log" 2>&1; echo "resume exit $?"
grep -iE "resum|step +9?0/|done" "$O/kill2.log" | head -5
cp $M/ref/metrics.jsonl "$O/ref_metrics.jsonl"; cp $M/kill/metrics.jsonl "$O/kill_metrics.jsonl"
python3 - "$O" <<'PY'
import json, sys
from lmbook.runs.analysis import read_metrics
o = sys.argv[1]
ref = {r['step']: r for r in read_metrics(f'{o}/ref_metrics.jsonl') if 'loss' in r}
kill = {r['step']: r for r in read_metrics(f'{o}/kill_metrics.jsonl') if 'loss' in r}
rows = [(s, ref[s]['loss'], kill[s]['loss']) for s in sorted(ref) if s in kill]
d = max(abs(a - b) for _, a, b in rows)
print('step  ref_loss  resumed_loss'); [print(f'{s:4d}  {a:.4f}    {b:.4f}') for s, a, b in rows if s >= 40]
print(f'max |loss diff| over {len(rows)} logged steps: {d:.4f}; final step ref {max(ref)}, resumed {max(kill)}')
PY
