"""Start-up of `papermill nbs/train.ipynb -p profile PROFILE` on one GPU, cold and warm, from the notebook's start to
the end of the first optimizer step (the first step holds the compilation of the training graph).

Three starts of the same command on one workspace (a folder standing for the pod's volume), each with empty
machine-local caches (a fresh TMPDIR and HOME, TRITON_CACHE_DIR unset, as on a new pod: inductor then keeps Triton's
kernels in its own cache folder, the workspace's `cache/warm/_compile`):
  cold    a new experiment, nothing in the workspace's caches (`cache/warm/_compile`, `cache/warm/_fit`); it
          trains its --steps steps and writes its final checkpoint;
  resume  the same experiment with twice the steps: it resumes from that checkpoint (the micro-batch its first
          start chose, no step-0 validation), the compiled kernels found in `cache/warm/_compile`;
  new     another experiment of the same profile: the fit found in `cache/warm/_fit`, the kernels in
          `cache/warm/_compile`, and the step-0 validation (its graph compiled from the cache too).
Before the resume the checkpoint's pages are dropped from the page cache (a new pod reads its volume cold), and
the seconds to read it off the disk alone are recorded (`cold_read`): what the launcher's read-ahead overlaps with
the trainer's start. The resume and new starts are killed (SIGKILL to the trainer) once their first step is recorded. Each start's
parts (setup, data, fit, model, loaders, resume or run files, validation, first step) come from the trainer's own
clock (`meta.json`'s `startup`, the `start-up:` line of its log); the script adds the seconds from its command to
the trainer's start (papermill, the kernel, the launch). The data (the `sources` corpus of tokens.py, the profile's
vocabulary) is prepared once before the first start and reported apart. Goals at runpod_2b on one H100: warm <= 45 s,
cold <= 120 s.

GPU, from the repo root (one GPU, 60 GB of disk: one 24 GB checkpoint). At runpod_2b on an H200 the cold start and
the resume took about 9 minutes together (the cold start's final checkpoint, `best/` and samples included), so the
new experiment's start goes in a second call, after a cold start that writes no checkpoint (--no-resume):
    bash -c 'source nbs/benchmarks/arms.sh; python3 nbs/benchmarks/warm_start.py --out $OUT/warm_start.json'
    bash -c 'source nbs/benchmarks/arms.sh; python3 nbs/benchmarks/warm_start.py --no-resume --out $OUT/warm_new.json'
CPU, to check the script itself (half a minute; at 2 MB none of its 148 documents goes to validation):
    PYTHONPATH=$PWD python3 nbs/benchmarks/warm_start.py --profile smoke --mb 4 --steps 2 --out /tmp/warm.json \\
        --set device=cpu take=3000
"""
import argparse, json, os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

ROOT = Path(__file__).resolve().parents[2]
SHARED = {'LMBOOK_TRAIN_DIR': 'datasets/train/warm', 'LMBOOK_VAL_DIR': 'datasets/val/warm',
          'LMBOOK_TOKENIZER_DIR': 'artifacts/tokenizer/warm', 'LMBOOK_CACHE_DIR': 'cache/warm'}


def data_sets(a, ws:Path) -> list[str]:
    "The data values the starts and the preparation share: a local corpus, the profile's own BPE."
    import tokens
    corpus = tokens.source_corpus(ws/'corpus'/f'sources-{a.mb:g}MB.jsonl', a.mb)
    return [f'dataset={corpus}', 'dataset_config=', 'tokenizer=', 'val_ratio=0.02']


def drop_cached(run:Path) -> float:
    "Evict the run's checkpoints from the page cache, as a new pod's volume holds them; their GB."
    gb = 0.0
    for f in (run/'checkpoints').rglob('*'):
        if not f.is_file(): continue
        fd = os.open(f, os.O_RDONLY)
        try: os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally: os.close(fd)
        gb += f.stat().st_size/1e9
    return gb


def cold_read(run:Path) -> dict:
    "Seconds to read the newest checkpoint off the disk as the launcher reads ahead, the page cache emptied first."
    from lmbook.runs.checkpoint.resume import prefetch_checkpoint
    drop_cached(run)
    t = time.time()
    pf = prefetch_checkpoint(run/'checkpoints', ram_gb=1e6)
    pf.join()
    s, gb = time.time() - t, sum(f.stat().st_size for f in pf.files)/1e9
    drop_cached(run)
    return dict(checkpoint=pf.path.name if pf.path else None, gb=round(gb, 2), seconds=round(s, 1),
                gb_s=round(gb/s, 3) if s else None)


def meta(run:Path) -> dict:
    try: return json.loads((run/'meta.json').read_text())
    except (FileNotFoundError, json.JSONDecodeError): return {}


def start(a, ws:Path, env:dict, exp:str, steps:int, sets:list[str], kill:bool, limit_s:float) -> dict:
    "One papermill start of `exp`, timed from its command to the end of its first step; killed then if `kill`."
    run, tmp = ws/'runs'/exp, ws/f'tmp-{exp}-{steps}'
    tmp.mkdir()
    env = {**env, 'TMPDIR': str(tmp), 'HOME': str(tmp)}  # the machine's own caches, empty, as on a new pod
    before = meta(run).get('startup', {}).get('ended')
    cmd = [sys.executable, '-m', 'papermill', 'nbs/train.ipynb', str(ws/f'{exp}-{steps}.ipynb'), '-p', 'profile',
           a.profile, '-p', 'experiment', exp, '-p', 'max_steps', str(steps), '-p', 'overrides', ','.join(sets)]
    log = open(ws/f'{exp}-{steps}.log', 'w')
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    st = None
    while time.time() - t0 < limit_s:
        st = meta(run).get('startup')
        if st and st.get('ended') != before: break
        if p.poll() is not None: break
        time.sleep(0.2)
    if st and st.get('ended') != before and kill:
        pid = json.loads((run/'.lock').read_text()).get('pid') if (run/'.lock').is_file() else None
        if pid: os.kill(int(pid), signal.SIGKILL)  # no stop checkpoint: the next start is measured alone
    try: p.wait(max(1, limit_s - (time.time() - t0)))
    except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL); p.wait()
    log.close()
    text = (ws/f'{exp}-{steps}.log').read_text()
    if not (st and st.get('ended') != before):
        return dict(experiment=exp, error=f"no first step within {limit_s:.0f} s", log=text[-3000:])
    lines = [l.strip() for l in ((run/'train.log').read_text().splitlines() if (run/'train.log').is_file() else [])
             if any(k in l for k in ('batch_fit', 'start-up:', 'fp8=', 'resumed at step'))]
    return dict(experiment=exp, steps=steps, command_to_first_step_s=round(st['ended'] - t0, 1),
                command_to_trainer_s=round(st['started'] - t0, 1), before_trainer=before_trainer(
                    ws/f'{exp}-{steps}.ipynb', t0, st['started']), trainer_s=st['total_s'], parts=st['parts'],
                notes=st.get('notes', {}), exit=p.returncode, lines=lines[-12:])


def before_trainer(nb:Path, t0:float, started:float) -> dict:
    """Where the seconds from the command to the trainer's start went, by papermill's own cell times: to the
    first cell (papermill and the kernel starting), each finished cell, the launching cell to the trainer."""
    from datetime import datetime
    def ts(v): return datetime.fromisoformat(v.replace('Z', '+00:00')).timestamp()
    try: cells = [c['metadata'].get('papermill', {}) for c in json.loads(nb.read_text())['cells']
                  if c['cell_type'] == 'code']
    except (OSError, ValueError, KeyError): return {}
    ran = [c for c in cells if c.get('start_time')]
    if not ran: return {}
    out, last = {'to the first cell': round(ts(ran[0]['start_time']) - t0, 1)}, ts(ran[0]['start_time'])
    for i, c in enumerate(ran):
        if c.get('end_time') and ts(c['end_time']) <= started:
            out[f'cell {i + 1}'], last = round(ts(c['end_time']) - ts(c['start_time']), 1), ts(c['end_time'])
    out['the launching cell to the trainer'] = round(started - last, 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_2b')
    ap.add_argument('--steps', type=int, default=2, help="the cold start's optimizer steps (the resume: twice)")
    ap.add_argument('--mb', type=float, default=40, help='megabytes of source text for the corpus')
    ap.add_argument('--set', nargs='*', default=[], help='more config values for every start, k=v')
    ap.add_argument('--no-resume', action='store_true', help='skip the resume (and the cold start\'s checkpoint wait)')
    ap.add_argument('--limit', type=float, default=420, help='seconds a start may take to its first step')
    ap.add_argument('--out', type=Path)
    a = ap.parse_args()
    ws = scratch('lmbook-warm-start-')
    env = {**os.environ, **SHARED, 'LMBOOK_WORKSPACE': str(ws), 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1',
           'PYTHONUNBUFFERED': '1'}
    for k in ('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR'): env.pop(k, None)  # the trainer's choice, as on a pod
    data = data_sets(a, ws)
    t0 = time.time()
    p = subprocess.run([sys.executable, '-m', 'lmbook.cli', 'prepare', '-p', a.profile, '-e', 'warm-a', '-q',
                        '--set', *data, *a.set], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode: raise SystemExit(f"prepare failed: {p.stderr[-800:]}")
    import torch
    res = dict(profile=a.profile, prepare_s=round(time.time() - t0, 1), date=time.strftime('%Y-%m-%d'),
               card=torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', torch=torch.__version__,
               set=a.set, fp8_graph_cache=os.environ.get('LMBOOK_FP8_GRAPH_CACHE') == '1')
    sets = [*data, *a.set, 'eval_every=1000', 'ckpt_every=1000', 'log_every=1', 'tensorboard=false']
    def save():
        print(json.dumps(res, indent=1))
        if a.out: a.out.write_text(json.dumps(res, indent=1) + '\n')
    res['cold'] = start(a, ws, env, 'warm-a', a.steps, sets, kill=a.no_resume, limit_s=a.limit + 300)
    save()
    if not a.no_resume:  # the resume finds the checkpoint on the disk, not in memory, as on a new pod
        res['cold_read'] = cold_read(ws/'runs'/'warm-a')
        save()
        res['resume'] = start(a, ws, env, 'warm-a', 2*a.steps, sets, kill=True, limit_s=a.limit)
        save()
    res['new'] = start(a, ws, env, 'warm-b', a.steps, sets, kill=True, limit_s=a.limit)
    cache = ws/SHARED['LMBOOK_CACHE_DIR']/'_compile'  # where the runs keep torch.compile's caches
    res['compile_cache_mb'] = round(sum(f.stat().st_size for f in cache.rglob('*') if f.is_file())/1e6, 1)
    save()


if __name__ == '__main__': main()
