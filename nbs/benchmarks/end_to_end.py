"""End to end as a user meets it: `lmbook train` from the command to a validation loss, levers on against off.

Two arms, the same `lmbook train -p PROFILE` command but for their `--set` values:
  on    the profile as shipped (on CUDA: compile, batch_fit and fp8='auto' from 1B up), plus --on
        (default none: the profile alone; 2026-11-27 measured `--on 'optimizer=muon,fp8=auto'`);
  off   every lever off: compile=false, fp8=off, act_ckpt=none, batch_fit=false, doc_mask=false, optimizer=adamw.
Both train on the same tokens, prepared once before either starts (`lmbook prepare`, the `sources` corpus of
tokens.py with a BPE of 8192 tokens), with the same schedule (--steps, warmup over a tenth, the profile's
micro-batch, accumulation and lr), a validation every --eval-every steps and checkpoints as the profile writes
them (keeping one). The target is --target, else the off arm's final validation loss. The result gives, for each
arm, the seconds from its command to its first validation at or below the target, and the on arm's share of the
off arm's; and the sequences each arm's validations scored (`val_rows`): on two different sets there is no
share. Each arm's training loss at its metrics rows (`losses`, on the same tokens in both) goes with it.
The goal for the levers: at most 0.6x. With two GPUs or more the arms run at the same time, one a GPU;
with one they run one after the other (--arms off in one call, --arms on in the next: no arm starts just before
a call's budget ends).

Across calls. One call runs for at most --budget-s seconds (default 540, under a 10-minute limit): at
--budget-s minus --stop-s it asks each running arm to checkpoint and stop (lmbook's stop request), and kills
what still runs at --budget-s. The arms' workspace and the state live in --work (default: a folder under $TMPDIR
named after --out); the next call with the same --out (and --work) starts each unfinished arm's same command
again, which resumes from its checkpoint with lmbook's own resume, until both arms have run --steps. The JSON
(--out/end_to_end.json) is written after every call; `complete` says whether both arms are done. The workspace
is removed once they are (or by a call with --clean).

Each arm's clock, as one uninterrupted command would have paid it: its start-up once, the seconds from its first
command to that start's first metrics row less the training seconds that row counts; then lmbook's own training
clock (a row's `elapsed_s`: the seconds since each start's trainer began, the gaps between starts left out). A
validation's seconds are start-up + its row's `elapsed_s`. What each later start spent before its trainer began
(reading the checkpoint, building the model) is left out as an artifact of the call limit, and reported per arm
as `restart_s`; the steps a killed arm loses after its last checkpoint are run again and counted once (its rows
after the checkpoint are replaced by the resumed ones). The data preparation is `prepare_s`, counted in neither.

GPU, from the repo root, at runpod_1b for 20 minutes and more of training per arm (520 steps of 131k tokens, the
off arm ~2.36 s a step): call the same command until `complete` is true (3 calls of 555 s on two GPUs,
2026-11-29; about 6 on one):
    PYTHONPATH=$PWD python3 nbs/benchmarks/end_to_end.py --steps 520 --eval-every 40 --mb 150 \\
        --budget-s 555 --stop-s 70 --work cache/end_to_end --out ${OUT:-.}
(--work: in the checkout's ignored cache/, which the machine keeps from one call to the next.)
CPU, to check the script itself (under a minute):
    PYTHONPATH=$PWD python3 nbs/benchmarks/end_to_end.py --profile smoke --dataset builtin --steps 20 \\
        --eval-every 10 --out /tmp/e2e
"""
import argparse, hashlib, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OFF = 'compile=false,fp8=off,act_ckpt=none,batch_fit=false,doc_mask=false,optimizer=adamw'
ARMS = ('off', 'on')


def data_sets(a, ws:Path) -> list[str]:
    "The data values both arms and the prepare step share."
    dataset = a.dataset
    if dataset == 'sources':
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import tokens
        dataset = str(tokens.source_corpus(ws/'corpus'/f'sources-{a.mb:g}MB.jsonl', a.mb))
    return [f'dataset={dataset}', 'dataset_config=', 'tokenizer=', 'vocab_size=8192', 'val_ratio=0.02',
            *filter(None, a.set.split(','))]


def start(a, arm:str, sets:list[str], env:dict, gpu:str|None, log:Path) -> subprocess.Popen:
    "Arm `arm`'s `lmbook train`, on GPU `gpu` (None: as the environment says); its output appended to `log`."
    env = {**env, **({'CUDA_VISIBLE_DEVICES': gpu} if gpu is not None else {}),
           'LMBOOK_TRAIN_DIR': 'datasets/train/e2e', 'LMBOOK_VAL_DIR': 'datasets/val/e2e',
           'LMBOOK_TOKENIZER_DIR': 'artifacts/tokenizer/e2e', 'LMBOOK_CACHE_DIR': 'cache/e2e'}
    cmd = [sys.executable, '-m', 'lmbook.cli', 'train', '-p', a.profile, '-e', f'e2e-{arm}', '--set', *sets]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, 'a'), stderr=subprocess.STDOUT,
                            start_new_session=True)


def rows(run:Path) -> list[dict]:
    "The metrics rows of `run` (none yet: [])."
    from lmbook.runs.metrics import read_metrics
    try: return read_metrics(run)
    except (FileNotFoundError, ValueError): return []


def run_starts(procs:dict, runs:dict, deadline:float, stop_s:float) -> dict:
    "Watch the started arms until they end; a stop request at `deadline - stop_s`, a kill at `deadline`."
    from lmbook.runlock import request_stop
    seen = {arm: None for arm in procs}  # (wall time, elapsed_s) of each start's first new row
    before = {arm: max((r.get('elapsed_s', 0) for r in rows(runs[arm])), default=0.0) for arm in procs}
    asked = set()
    while any(p.poll() is None for p, _ in procs.values()):
        for arm, (p, t0) in procs.items():
            if seen[arm] is None:
                new = [r for r in rows(runs[arm]) if r.get('elapsed_s', 0) > before[arm]]
                if new: seen[arm] = (time.time(), min(r['elapsed_s'] for r in new))
            if p.poll() is None and time.time() > deadline - stop_s and arm not in asked and runs[arm].is_dir():
                request_stop(runs[arm], 'the call budget of end_to_end.py')
                asked.add(arm)
            if p.poll() is None and time.time() > deadline: p.kill()
        time.sleep(0.5)
    return {arm: dict(exit=p.returncode, wall_s=round(time.time() - t0, 1),
                      pre_train_s=round(seen[arm][0] - t0 - (seen[arm][1] - before[arm]), 1)
                      if seen[arm] else None) for arm, (p, t0) in procs.items()}


def log_ends(log:Path, head:int=2500, tail:int=1200) -> str:
    "The start of an arm's log (its start-up: the fit's trials, compilation) and its end."
    text = log.read_text() if log.is_file() else ''
    return text if len(text) <= head + tail else f"{text[:head]}\n[...]\n{text[-tail:]}"


def seconds_to(vals:list, target:float) -> float|None:
    "Seconds from the command to the first validation at or below `target` (None: never)."
    return next((s for _, v, s in vals if v <= target), None)


def arm_after(st:dict, arm:str, run:Path, ended:dict, steps:int):
    "Fold one start of `arm` into its state: start-up (the first start with a row), restarts, done."
    s = st['arms'][arm]
    s['starts'] += 1
    s['exits'].append(ended['exit'])
    if s['startup_s'] is None:  # the start-up of a start that wrote no row is paid again by the next
        s['startup_s'] = None if ended['pre_train_s'] is None else s['unfinished_s'] + ended['pre_train_s']
        if ended['pre_train_s'] is None: s['unfinished_s'] += ended['wall_s']
    elif ended['pre_train_s'] is not None: s['restart_s'].append(ended['pre_train_s'])
    s['done'] = ended['exit'] == 0 and max((r['step'] for r in rows(run)), default=-1) >= steps
    if s['done']: shutil.rmtree(run/'checkpoints', ignore_errors=True)  # its disk, for the other arm's


def val_rows(run:Path) -> int|None:
    "Sequences each validation of `run` scored, from the config it trained with (None: not started)."
    from lmbook.profiles import load_config_file
    from lmbook.rundir import RunDir
    try: return load_config_file(RunDir(run).config).val_rows
    except (FileNotFoundError, ValueError): return None


def summary(a, st:dict, runs:dict, work:Path) -> dict:
    "The result so far: each arm's validations on its own clock, the target and the on arm's share."
    import torch
    clock = lambda arm, r: round((st['arms'][arm]['startup_s'] or 0) + r['elapsed_s'], 1)
    recs = {arm: rows(runs[arm]) for arm in ARMS}  # each arm's metrics, read once
    vals = {arm: [(r['step'], round(r['val_loss'], 4), clock(arm, r)) for r in recs[arm]
                  if r.get('val_loss') is not None] for arm in ARMS}
    complete = all(st['arms'][arm]['done'] for arm in ARMS)
    target = a.target if a.target is not None else (vals['off'][-1][1] if st['arms']['off']['done'] else None)
    res = dict(profile=a.profile, steps=a.steps, prepare_s=st['prepare_s'], on=a.on, off=a.off, target=target,
               together=st['together'], complete=complete, calls=st['calls'], arms=st['arms'], validations=vals,
               # the training loss (the same tokens in both arms) at each metrics row
               losses={arm: [(r['step'], round(r['loss'], 4)) for r in recs[arm]
                             if r.get('loss') is not None] for arm in ARMS},
               logs={arm: log_ends(work/f'{arm}.log') for arm in ARMS})
    for arm in ARMS: res[f'{arm}_seconds_to_target'] = seconds_to(vals[arm], target) if target else None
    on, off = res['on_seconds_to_target'], res['off_seconds_to_target']
    res['on_over_off'] = round(on/off, 3) if on and off else None
    res['val_rows'] = rows_ = {arm: val_rows(runs[arm]) for arm in ARMS}
    if None not in rows_.values() and len(set(rows_.values())) > 1:  # no ratio of losses on two sets
        res['on_over_off'], res['not_comparable'] = None, f"the arms validated on different sets: {rows_}"
    gpus = torch.cuda.device_count()
    return res | dict(card=torch.cuda.get_device_name(0) if gpus else 'cpu', gpus_per_arm=1,
                      torch=torch.__version__, date=time.strftime('%Y-%m-%d'))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_1b')
    ap.add_argument('--on', default='', help='the on arm\'s values on top of the profile, k=v,k=v')
    ap.add_argument('--off', default=OFF, help='the off arm\'s values, k=v,k=v')
    ap.add_argument('--steps', type=int, default=100, help="both arms' optimizer steps (their schedule)")
    ap.add_argument('--eval-every', type=int, default=10)
    ap.add_argument('--target', type=float, help="the validation loss (default: the off arm's final one)")
    ap.add_argument('--dataset', default='sources', help="'sources' (tokens.py) or anything dataset= takes")
    ap.add_argument('--mb', type=float, default=60, help='megabytes of source text for the sources corpus')
    ap.add_argument('--set', default='', help='more values for the preparation and both arms, k=v,k=v')
    ap.add_argument('--budget-s', type=float, default=540, help='seconds this call runs at most')
    ap.add_argument('--stop-s', type=float, default=90, help='seconds before the budget the arms are asked to '
                    'checkpoint and stop')
    ap.add_argument('--out', type=Path, required=True, help='folder of end_to_end.json, written every call')
    ap.add_argument('--work', type=Path, help='folder of the arms\' workspace and state, kept between calls '
                    '(default: under $TMPDIR, named after --out)')
    ap.add_argument('--arms', default='off,on', help='the arms this call may start (on one GPU, --arms off in '
                    'one call and --arms on in the next keeps an arm from starting just before the budget ends)')
    ap.add_argument('--clean', action='store_true', help='start again: remove the work folder first')
    a = ap.parse_args()
    if not a.arms or set(a.arms.split(',')) - set(ARMS): ap.error(f"--arms {a.arms}: name off, on or off,on")
    a.arms = a.arms.split(',')
    return a


def main():
    a, t_call = parse(), time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(a.out.resolve()).encode()).hexdigest()[:12]
    work = (a.work or Path(tempfile.gettempdir())/f'lmbook-end-to-end-{key}').resolve()
    if a.clean: shutil.rmtree(work, ignore_errors=True)
    ws, state = work/'ws', work/'state.json'
    ws.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, 'LMBOOK_WORKSPACE': str(ws), 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1',
           'PYTHONUNBUFFERED': '1'}
    import torch
    st = json.loads(state.read_text()) if state.is_file() else dict(
        prepare_s=None, together=torch.cuda.device_count() >= 2, calls=[],
        arms={arm: dict(starts=0, exits=[], startup_s=None, unfinished_s=0.0, restart_s=[], done=False)
              for arm in ARMS})
    data = data_sets(a, ws)
    common = [*data, f'max_steps={a.steps}', f'warmup_steps={max(1, a.steps//10)}', f'eval_every={a.eval_every}',
              'tensorboard=false', 'keep_ckpts=1']
    if st['prepare_s'] is None:
        p = subprocess.run([sys.executable, '-m', 'lmbook.cli', 'prepare', '-p', a.profile, '-e', 'e2e', '-q',
                            '--set', *data, f'max_steps={a.steps}'], cwd=ROOT, env=env, capture_output=True,
                           text=True)
        if p.returncode: raise SystemExit(f"prepare failed: {p.stderr[-800:]}")
        st['prepare_s'] = round(time.time() - t_call, 1)
    arms = {'off': a.off, 'on': a.on}
    runs = {arm: ws/'runs'/f'e2e-{arm}' for arm in ARMS}
    todo = [arm for arm in ARMS if arm in a.arms and not st['arms'][arm]['done']]
    for i, group in enumerate([todo] if st['together'] else [[arm] for arm in todo]):
        if not group or (i and time.time() > t_call + a.budget_s - a.stop_s): break  # the next call goes on
        procs = {arm: (start(a, arm, common + [s for s in arms[arm].split(',') if s], env,
                             str(g) if st['together'] else None, work/f'{arm}.log'), time.time())
                 for g, arm in enumerate(group)}
        for arm, ended in run_starts(procs, runs, t_call + a.budget_s, a.stop_s).items():
            arm_after(st, arm, runs[arm], ended, a.steps)
    st['calls'].append(round(time.time() - t_call, 1))
    state.write_text(json.dumps(st, indent=1))
    res = summary(a, st, runs, work)
    (a.out/'end_to_end.json').write_text(json.dumps(res, indent=1) + '\n')
    print(json.dumps({k: v for k, v in res.items() if k != 'logs'}, indent=1))
    if res['complete']: shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__': main()
