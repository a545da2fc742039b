"""Gathered against sharded checkpoints under FSDP2: how long a save stops training, how long until it is on disk,
and how long a resume takes, with the model sharded over the processes of one host (`ckpt_format` full or sharded).

Both formats save the same state, the profile's model after one AdamW step (fp32 weights and both moments),
through the trainer's own `Checkpointer`:
  full      the state gathered to rank 0's CPU memory, written and hashed there (one safetensors file, optim.pt);
  sharded   each rank copies its own part to CPU memory and writes it (torch.distributed.checkpoint); the ranks
            hash their files between them and rank 0 seals the checkpoint.
Modes: `background` (ckpt_async=true, the default): `stall_s` is how long training stands still (the snapshot),
`done_s` how long until the checkpoint is complete on disk; each format saves --repeats times, the first save
apart (a sharded one makes its pinned buffers then). `sync` (ckpt_async=false): the save is written before
training goes on, so the stall is the whole save. `resume_s`: every rank loading the newest checkpoint back
into the model and optimizer (full: every rank reads all of it; sharded: each rank its part).
One JSON row per format and mode, rank 0's seconds (the others wait for it at the next collective), printed and
appended to --out.

GPU, 4 GPUs of one host, runpod_4b (3.72B parameters: a checkpoint of about 45 GB; about 100 GB of free disk
under --dir or $TMPDIR and 60 GB of free host memory), from the repo root:
    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 4 \\
        nbs/benchmarks/sharded_ckpt.py --profile runpod_4b --out ${OUT:-.}/sharded_ckpt.jsonl
(not timed yet: one process writing and hashing 45 GB may take minutes a save; where a call's time is short,
`--formats full` and `--formats sharded` split it into two calls on the same machine, `--repeats 1` halves it.)
CPU, 2 gloo processes at the smoke profile, to check that the script works (about 15 s):
    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 2 nbs/benchmarks/sharded_ckpt.py --profile smoke \\
        --modes background,sync --out /tmp/sc.jsonl
Checkpoints go to --dir (kept), else to a scratch folder removed when the script ends however it ends (see
scratch.py); each format's checkpoints are removed as soon as they are measured.
"""
import argparse, json, shutil, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

def quiet(*a): pass

def build(profile:str, sets:dict, info):
    "The profile's model sharded with FSDP2 over this job's processes, after one AdamW step (its moments exist)."
    import torch
    from lmbook.profiles import get_config
    from lmbook.model.gpt import GPT
    from lmbook.train.step import make_trainable, train_step
    cfg = get_config(profile, dict(dict(batch_size=1, grad_accum=1, compile='false', device=info.device), **sets,
                                   parallel='fsdp'))
    torch.manual_seed(0)
    with torch.device(info.device): model = GPT(cfg.model)
    t = make_trainable(model, cfg, info)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.block_size))
    train_step(t, lambda: (x, x), 1e-5)
    return cfg, t

def timed(fn) -> float:
    "Seconds from every rank starting `fn` to every rank done with it."
    from lmbook.distributed import barrier
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0

def measure(cfg, t, info, folder:Path, fmt:str, mode:str, repeats:int) -> dict:
    "Save the state `repeats` times in `fmt` and `mode`, then resume from it; rank 0's figures."
    from lmbook.config import config_dict
    from lmbook.runs.checkpoint.formats import list_checkpoints
    from lmbook.runs.checkpoint.checkpointer import Checkpointer
    log = print if info.is_main else quiet
    ck = Checkpointer(folder, every=1, keep=1, background=mode == 'background', info=info, log=log, fmt=fmt)
    state, done = dict(tokens=0, config=config_dict(cfg)), []
    for step in range(1, repeats + 1):
        def save():
            ck.save(step, t.model, t.optimizer, state, dict(loader=dict(pos=step)), t.sharded)
            ck.wait()  # this rank's part (the barrier after: every rank's)
        done.append(timed(save))
    again = Checkpointer(folder, every=1, info=info, log=quiet)
    got = {}
    resume_s = timed(lambda: got.update(again.resume(t.model, t.optimizer, config_dict(cfg), None)))
    assert got['state']['step'] == repeats and got['shards'] == (fmt == 'sharded'), got['state']
    last = list_checkpoints(folder)[0]
    files = sorted(p for p in last.rglob('*') if p.is_file())
    recs, med = ck.timings, lambda k, rs: round(statistics.median(r[k] for r in rs), 3) if rs else None
    return dict(format=fmt, mode=mode, repeats=repeats, bytes=sum(p.stat().st_size for p in files),
                files=len(files), first_stall_s=round(recs[0]['stall_s'], 3) if recs else None,
                stall_s=med('stall_s', recs[1:] or recs), snapshot_s=med('snapshot_s', recs[1:] or recs),
                write_s=med('write_s', recs[1:] or recs), first_done_s=round(done[0], 3),
                done_s=round(statistics.median(done[1:] or done), 3), resume_s=round(resume_s, 3))

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_4b')
    ap.add_argument('--set', nargs='*', default=[], help='config overrides, NAME=VALUE (e.g. n_layer=8)')
    ap.add_argument('--formats', default='full,sharded')
    ap.add_argument('--modes', default='background', help="'background', 'sync' or both, comma-separated")
    ap.add_argument('--repeats', type=int, default=2, help='saves per format and mode (the first one apart)')
    ap.add_argument('--dir', default=None, help='where the checkpoints go, kept (default: a scratch folder)')
    ap.add_argument('--out', default=None, help='append the JSON rows to this file too')
    a = ap.parse_args()
    import torch
    from lmbook.config import count_params
    from lmbook.overrides import parse_assignments
    from lmbook.core import environment_info
    from lmbook.distributed import init_distributed, cleanup_distributed, barrier
    info = init_distributed('cuda' if torch.cuda.is_available() else 'cpu')
    # rank 0's folder, for every rank (a scratch one is removed by rank 0 when it ends)
    root = Path(_shared(a.dir or (str(scratch('sharded-ckpt-')) if info.is_main else None)))
    cfg, t = build(a.profile, parse_assignments(a.set), info)
    env = environment_info() if info.is_main else {}
    for fmt in a.formats.split(','):
        for mode in a.modes.split(','):
            folder = root/f'{fmt}-{mode}'
            row = dict(benchmark='sharded_ckpt', profile=a.profile, overrides=a.set, parallel='fsdp',
                       world_size=info.world_size,
                       params=count_params(cfg.model), **measure(cfg, t, info, folder, fmt, mode, a.repeats))
            barrier()
            if not info.is_main: continue
            shutil.rmtree(folder, ignore_errors=True)
            row.update(env=env, time=time.time())
            print('RESULT ' + json.dumps(row), flush=True)
            if a.out:
                with open(a.out, 'a') as f: f.write(json.dumps(row) + '\n')
    cleanup_distributed()

def _shared(value:str|None) -> str:
    "Rank 0's `value`, on every rank."
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()): return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]

if __name__ == '__main__': main()
