"""How long a checkpoint stops training: synchronous against background (`ckpt_async`) writes, through the real trainer.

Each mode is one run of `train` in its own process (fresh workspace, nothing shared but the prepared data):
  none   checkpoints only at the end (after the last timed step): the throughput baseline;
  sync   a checkpoint every `--every` steps, written before training goes on (ckpt_async=false);
  async  the same, snapshot to (pinned) CPU memory, written by a background thread (ckpt_async=true).
Per checkpoint it reports the stall (seconds training stood still), split into waiting for the previous
write and taking the snapshot, and the write time. Per mode: the trainer's tok/s of the steps (median of
per-step rows, which exclude checkpoint time) and the wall-clock tok/s from step 10 to the last step,
which includes every stall. `overhead_at_5min` is the stall of the first checkpoint (no write in flight,
snapshot buffers allocated then) as a fraction of a 5-minute checkpoint interval; `later_snapshot_s`
is the snapshot time once the buffers exist. With a checkpoint every 20 steps (a few seconds on a GPU)
a 2B write cannot finish before the next save, so later stalls there are mostly `wait_s`.

GPU (one card; runpod_2b at micro-batch 8, grad_accum 1, 60 steps, a checkpoint every 20; about 45 GB
of free disk and 30 GB of free host memory for the pinned snapshot):
    python nbs/benchmarks/checkpoint_stall.py --out nbs/benchmarks/checkpoint_stall_h100.json
CPU, a tiny model, to check that the script works:
    python nbs/benchmarks/checkpoint_stall.py --tiny --out /tmp/checkpoint_stall_cpu.json
It keeps only --out: the runs' workspace is --workdir, kept, else a scratch folder removed when the script ends,
however it ends (see scratch.py); each mode's run folder (its checkpoints) goes as soon as the mode is measured.
"""
import argparse, json, os, shutil, statistics, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, vocab_size=4096, warmup_steps=3, eval_steps=2,
            device='cpu', compile='false')
GPU = dict(dataset='builtin', dataset_config='', take=0, batch_size=8, grad_accum=1, warmup_steps=10, eval_steps=2)

def one(mode:str, profile:str, overrides:dict, steps:int, every:int, root:Path) -> dict:
    "Train one mode in this process; return its timings."
    from lmbook.profiles import get_config
    from lmbook.train.trainer import train
    ov = dict(overrides, max_steps=steps, log_every=1, eval_every=10**6, sample_every=0, keep_ckpts=1, tensorboard=False,
              ckpt_every=every if mode != 'none' else 10**6, ckpt_async=mode == 'async')
    stamps = {}
    def log(*a):
        line = ' '.join(map(str, a))
        if line.startswith('step'): stamps[int(line.split()[1].split('/')[0])] = time.perf_counter()
        print(line, file=sys.stderr, flush=True)
    res = train(get_config(profile, ov), f'stall-{mode}', root=root, log=log)
    rows = [json.loads(l) for l in (Path(res['run_dir'])/'metrics.jsonl').read_text().splitlines()]
    tps = [r['tok_per_s'] for r in rows if r.get('tok_per_s') and r['step'] > 5]
    first, last = 10, steps - 1
    tokens_per_step = rows[-1]['tokens']//rows[-1]['step']
    ckpts = [c for c in res['checkpoints'] if c['step'] < steps]  # the final one comes after the timed steps
    out = dict(mode=mode, steps=steps, every=every, tokens_per_step=tokens_per_step, checkpoints=res['checkpoints'],
               step_tok_per_s=statistics.median(tps) if tps else None,
               wall_tok_per_s=tokens_per_step*(last - first)/(stamps[last] - stamps[first]))
    if ckpts: out['first_stall_s'] = ckpts[0]['stall_s']  # includes allocating the (pinned) snapshot buffers
    if len(ckpts) > 1: out['later_snapshot_s'] = statistics.median(c['snapshot_s'] for c in ckpts[1:])  # buffers reused
    shutil.rmtree(res['run_dir'], ignore_errors=True)
    return out

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--tiny', action='store_true', help='a tiny model on the CPU (checks the script)')
    ap.add_argument('--steps', type=int, default=None, help='steps per mode (default 60; 30 with --tiny)')
    ap.add_argument('--every', type=int, default=None, help='steps between checkpoints (default 20; 10 with --tiny)')
    ap.add_argument('--modes', default='none,sync,async')
    ap.add_argument('--workdir', default=None, help='workspace for the runs, kept (default: a scratch folder, removed)')
    ap.add_argument('--out', default=None, help='write the JSON here too')
    ap.add_argument('--one', default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    profile, ov = ('smoke', TINY) if a.tiny else ('runpod_2b', GPU)
    steps, every = a.steps or (30 if a.tiny else 60), a.every or (10 if a.tiny else 20)
    root = Path(a.workdir) if a.workdir else scratch('ckpt-stall-')  # removed when this process ends, however it ends
    if a.one:
        print('RESULT ' + json.dumps(one(a.one, profile, ov, steps, every, root)), flush=True)
        return
    import torch
    from lmbook.core import environment_info
    res = dict(benchmark='checkpoint_stall', profile=profile, overrides=ov, env=environment_info(), modes={})
    for mode in a.modes.split(','):
        cmd = [sys.executable, __file__, '--one', mode, '--workdir', str(root), '--steps', str(steps), '--every', str(every)] + (['--tiny'] if a.tiny else [])
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith('RESULT ')]
        if p.returncode or not line: sys.exit(f"mode {mode} failed with exit code {p.returncode}")
        res['modes'][mode] = json.loads(line[0][7:])
        if a.out: Path(a.out).write_text(json.dumps(res, indent=1))  # a run cut off later keeps the finished modes
    base = res['modes'].get('none', {}).get('wall_tok_per_s')
    for m in res['modes'].values():
        if base: m['wall_vs_none'] = m['wall_tok_per_s']/base
        if 'first_stall_s' in m: m['overhead_at_5min'] = m['first_stall_s']/300
    print(json.dumps(res, indent=1))
    if a.out: Path(a.out).write_text(json.dumps(res, indent=1))

if __name__ == '__main__': main()
