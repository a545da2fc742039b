"""Checkpoint writes against the disk's own speed, in one call on one machine: the goal is a full checkpoint written
at 70% or more of the disk's sequential write speed.

1. The disk: `dd` of --disk-gb GB (default: as many as the checkpoint) in 64 MB blocks, synced at the end (conv=fsync), and the same through a plain Python
   writer (one stream, 64 MB writes, fsync), before each checkpoint write (--rounds): the disk's speed is the median
   of them all (a virtual disk's speed can change from one write to the next).
2. A full checkpoint of PROFILE's state as a run holds it in CPU memory before a background write: fp32 weights
   and AdamW's two moments (runpod_2b: 1.99B parameters, 23.9 GB), written by `write_checkpoint`, the trainer's own
   write (every file hashed as it is written, the optimizer's state in up to four files written at once), then
   read back and checked the way a resume does (`verify_checkpoint`, its hashes), --rounds times, the checkpoint
   removed in between; its speed is the median of the rounds'.
3. The same state through the writer used before (safetensors' `save_file`, `torch.save` of the optimizer's
   state, then every file read back and hashed), once, for the ratio in the same call (--no-before skips it).
Each write counts from the call to the folder's rename into place; GB are 1e9 bytes. No GPU is needed: the state
is made on the CPU; the disk is the GPU machine's, where the trainer writes.

GPU machine, from the repo root (host RAM for the state plus about 10%, and twice the checkpoint's size of free
disk; about 7 minutes at runpod_2b, where each round writes 25 GB three times; the disk test writes as much as
the checkpoint, since a virtual disk can be faster for its first GB than for the rest):
    PYTHONPATH=$PWD python3 nbs/benchmarks/ckpt_speed.py --out $OUT/ckpt_speed.json
CPU, to check the script itself (a few seconds):
    PYTHONPATH=$PWD python3 nbs/benchmarks/ckpt_speed.py --profile smoke --disk-gb 0.2 --out /tmp/ckpt_speed.json
"""
import argparse, json, os, shutil, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch


def disk_speed(folder:Path, gb:float) -> dict:
    "GB/s of `dd` (conv=fsync) and of a Python writer (64 MB writes, fsync) writing `gb` GB into `folder`."
    n, block = max(1, int(gb*1e9/(64 << 20))), 64 << 20
    p = folder/'dd.bin'
    t0 = time.perf_counter()
    subprocess.run(['dd', 'if=/dev/zero', f'of={p}', 'bs=64M', f'count={n}', 'conv=fsync'], check=True,
                   capture_output=True)
    dd = n*block/1e9/(time.perf_counter() - t0)
    p.unlink()
    buf = os.urandom(block)
    t0 = time.perf_counter()
    with open(p, 'wb', buffering=0) as f:
        for _ in range(n): f.write(buf)
        os.fsync(f.fileno())
    py = n*block/1e9/(time.perf_counter() - t0)
    p.unlink()
    return dict(bytes=n*block, dd_gb_s=round(dd, 3), python_gb_s=round(py, 3), disk_gb_s=round(max(dd, py), 3))


def state(profile:str) -> tuple[dict, dict, int]:
    "(weights, AdamW's full state dict, bytes) of `profile`'s model, as CPU tensors that hold memory."
    import torch
    from lmbook.profiles import get_config
    from lmbook.model.gpt import GPT
    cfg = get_config(profile)
    with torch.device('meta'): names = {k: (v.shape, v.dtype) for k, v in GPT(cfg.model).state_dict().items()}
    full = lambda s: torch.full(s, 0.5, dtype=torch.float32)  # every page touched, as a snapshot's are
    msd = {k: full(s) for k, (s, _) in names.items()}
    osd = dict(state={k: dict(step=torch.tensor(10.0), exp_avg=full(s), exp_avg_sq=full(s))
                      for k, (s, _) in names.items()},
               param_groups=[dict(lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, params=list(names))])
    return msd, osd, 12*sum(v.numel() for v in msd.values())


def before(tmp:Path, snap:dict) -> None:
    "The write used before: save_file, torch.save, then every file read back and hashed (into the manifest)."
    import torch
    from safetensors.torch import save_file
    from lmbook.core import sha256_file
    from lmbook.runs.checkpoint.formats import dedupe
    from lmbook.runs.checkpoint.writer import _fsync
    weights, aliases = dedupe(snap['model'])
    save_file(weights, tmp/'model.safetensors', metadata=dict(aliases=json.dumps(aliases)))
    _fsync(tmp/'model.safetensors')
    torch.save(snap['optim'], tmp/'optim.pt')
    _fsync(tmp/'optim.pt')
    return {n: dict(size=(tmp/n).stat().st_size, sha256=sha256_file(tmp/n)) for n in ('model.safetensors', 'optim.pt')}


def write(folder:Path, snap:dict, step:int, old:bool=False) -> float:
    "Seconds `write_checkpoint` takes for `snap` (with the old writer in place of its own: `old`)."
    import lmbook.runs.checkpoint.writer as ck
    keep = ck._write_full
    if old: ck._write_full = before
    try:
        t0 = time.perf_counter()
        ck.write_checkpoint(folder, step, snap, dict(tokens=0), keep=1)  # not read back, as in the trainer
        return time.perf_counter() - t0
    finally: ck._write_full = keep


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_2b')
    ap.add_argument('--disk-gb', type=float, default=None,
                    help="GB each disk test writes (default: the checkpoint's own size: a virtual disk can be faster "
                         "for its first GB than for the rest)")
    ap.add_argument('--rounds', type=int, default=3, help='rounds of (disk test, checkpoint write)')
    ap.add_argument('--no-before', action='store_true', help='skip the writer used before')
    ap.add_argument('--dir', type=Path, help='where to write (default: a scratch folder on this disk)')
    ap.add_argument('--out', type=Path)
    a = ap.parse_args()
    import statistics, torch
    from lmbook.runs.checkpoint.formats import ckpt_name, rng_state, verify_checkpoint
    folder = a.dir or scratch('lmbook-ckpt-speed-', Path(__file__).resolve().parents[2])
    folder.mkdir(parents=True, exist_ok=True)
    res = dict(profile=a.profile, date=time.strftime('%Y-%m-%d'), torch=torch.__version__,
               card=torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')
    msd, osd, n = state(a.profile)
    snap = dict(model=msd, optim=osd, ranks=[dict(rng=rng_state(), loader=dict(pos=0))])
    res['checkpoint_gb'] = round(n/1e9, 2)
    gb = a.disk_gb or n/1e9
    disks, rows = [], []
    # disk tests and checkpoint writes alternate: a virtual disk's speed drifts from one write to the next
    for i, old in enumerate([False]*a.rounds + ([] if a.no_before else [True])):
        if not old: disks.append(disk_speed(folder, gb))
        s = write(folder, snap, i + 1, old)
        path = folder/ckpt_name(i + 1)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        t0 = time.perf_counter()
        verify_checkpoint(path)
        rows.append(dict(writer='before' if old else 'now', seconds=round(s, 3), gb=round(size/1e9, 3),
                         gb_s=round(size/1e9/s, 3), verify_s=round(time.perf_counter() - t0, 1)))
        shutil.rmtree(path)
        print(json.dumps(dict(disk=disks[-1], **rows[-1])), flush=True)
    now, old = [r for r in rows if r['writer'] == 'now'], [r for r in rows if r['writer'] == 'before']
    disk = statistics.median(x for d in disks for x in (d['dd_gb_s'], d['python_gb_s']))
    write_gb_s = statistics.median(r['gb_s'] for r in now)
    res.update(disk_tests=disks, writes=rows, disk_gb_s=round(disk, 3), write_gb_s=round(write_gb_s, 3),
               write_of_disk=round(write_gb_s/disk, 3))
    if old: res['now_over_before'] = round(old[0]['seconds']/statistics.median(r['seconds'] for r in now), 2)
    print(json.dumps(res, indent=1))
    if a.out: a.out.write_text(json.dumps(res, indent=1) + '\n')


if __name__ == '__main__': main()
