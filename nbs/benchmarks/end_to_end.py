"""End to end as a user meets it: `lmbook train` from the command to a validation loss, levers on against off.

Two arms, the same `lmbook train -p PROFILE` command but for their `--set` values:
  on    the profile as shipped (on CUDA: compile and batch_fit; fp8='auto' at runpod_2b and 4b), plus --on
        (default none: the profile alone; 2026-11-27 measured `--on 'optimizer=muon,fp8=auto'`);
  off   every lever off: compile=false, fp8=off, act_ckpt=none, batch_fit=false, doc_mask=false, optimizer=adamw.
Both train on the same tokens, prepared once before either starts (`lmbook prepare`, the `sources` corpus of
tokens.py with a BPE of 8192 tokens), with the same schedule (--steps, warmup over a tenth, the profile's
micro-batch, accumulation and lr), a validation every --eval-every steps and checkpoints as the profile writes
them. The script starts each arm's command and watches its metrics.jsonl: every validation row gets the seconds
since that command started, so compiling, data loading, evaluations and checkpoints all count.

The target is --target, else the off arm's final validation loss. The result gives, for each arm, the seconds from
its command to its first validation at or below the target, times its GPUs (GPU-seconds), and the on arm's share
of the off arm's. The goal for the levers: at most 0.5x. With two GPUs or more the arms run at the same time, one a
GPU; with one they run one after the other. One JSON object, printed and written to --out. Everything else (the
corpus, the tokens, both runs) goes in a scratch folder, removed when the script ends (see scratch.py).

GPU, from the repo root (at most about 9 minutes on two H100s at the defaults: 100 steps of 131k tokens):
    PYTHONPATH=$PWD python3 nbs/benchmarks/end_to_end.py --out ${OUT:-.}/end_to_end.json
CPU, to check the script itself (about 1 minute):
    PYTHONPATH=$PWD python3 nbs/benchmarks/end_to_end.py --profile smoke --dataset builtin --steps 20 \\
        --eval-every 10 --out /tmp/e2e.json
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

ROOT = Path(__file__).resolve().parents[2]
OFF = 'compile=false,fp8=off,act_ckpt=none,batch_fit=false,doc_mask=false,optimizer=adamw'


def data_sets(a, ws:Path) -> list[str]:
    "The data values both arms and the prepare step share."
    dataset = a.dataset
    if dataset == 'sources':
        import tokens
        dataset = str(tokens.source_corpus(ws/'corpus'/f'sources-{a.mb:g}MB.jsonl', a.mb))
    return [f'dataset={dataset}', 'dataset_config=', 'tokenizer=', 'vocab_size=8192', 'val_ratio=0.02',
            *filter(None, a.set.split(','))]


def start(a, arm:str, sets:list[str], env:dict, gpu:str|None, log:Path) -> subprocess.Popen:
    "Arm `arm`'s `lmbook train`, on GPU `gpu` (None: as the environment says)."
    env = {**env, **({'CUDA_VISIBLE_DEVICES': gpu} if gpu is not None else {}),
           'LMBOOK_TRAIN_DIR': 'datasets/train/e2e', 'LMBOOK_VAL_DIR': 'datasets/val/e2e',
           'LMBOOK_TOKENIZER_DIR': 'artifacts/tokenizer/e2e', 'LMBOOK_CACHE_DIR': 'cache/e2e'}
    cmd = [sys.executable, '-m', 'lmbook.cli', 'train', '-p', a.profile, '-e', f'e2e-{arm}', '--set', *sets]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, 'w'), stderr=subprocess.STDOUT,
                            start_new_session=True)


def follow(procs:dict, runs:dict, limit_s:float) -> dict:
    "Each arm's validation rows as (step, val_loss, seconds since its command started), until all have ended."
    from lmbook.runs.metrics import read_metrics
    seen = {arm: {} for arm in procs}
    while True:
        for arm, (p, t0) in procs.items():
            try: rows = read_metrics(runs[arm])
            except (FileNotFoundError, ValueError): rows = []
            for r in rows:
                if r.get('val_loss') is not None and r['step'] not in seen[arm]:
                    seen[arm][r['step']] = (r['step'], round(r['val_loss'], 4), round(time.time() - t0, 1))
            if p.poll() is None and time.time() - t0 > limit_s: p.kill()
        if all(p.poll() is not None for p, _ in procs.values()): break
        time.sleep(0.5)
    return {arm: sorted(v.values()) for arm, v in seen.items()}


def log_ends(log:Path, head:int=2500, tail:int=1200) -> str:
    "The start of an arm's log (its start-up: the fit's trials, compilation) and its end."
    text = log.read_text()
    return text if len(text) <= head + tail else f"{text[:head]}\n[...]\n{text[-tail:]}"


def seconds_to(vals:list[tuple], target:float) -> float|None:
    "Seconds from the command to the first validation at or below `target` (None: never)."
    return next((s for _, v, s in vals if v <= target), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_1b')
    ap.add_argument('--on', default='', help='the on arm\'s values on top of the profile, k=v,k=v')
    ap.add_argument('--off', default=OFF, help='the off arm\'s values, k=v,k=v')
    ap.add_argument('--steps', type=int, default=100, help="both arms' optimizer steps (their schedule)")
    ap.add_argument('--eval-every', type=int, default=10)
    ap.add_argument('--target', type=float, help="the validation loss (default: the off arm's final one)")
    ap.add_argument('--dataset', default='sources', help="'sources' (tokens.py) or anything dataset= takes")
    ap.add_argument('--mb', type=float, default=60, help='megabytes of source text for the sources corpus')
    ap.add_argument('--minutes', type=float, default=8, help='each arm is stopped after this long')
    ap.add_argument('--set', default='', help='more values for the preparation and both arms, k=v,k=v')
    ap.add_argument('--out', type=Path)
    a = ap.parse_args()
    ws = scratch('lmbook-end-to-end-')
    env = {**os.environ, 'LMBOOK_WORKSPACE': str(ws), 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1',
           'PYTHONUNBUFFERED': '1'}
    data = data_sets(a, ws)
    common = [*data, f'max_steps={a.steps}', f'warmup_steps={max(1, a.steps//10)}', f'eval_every={a.eval_every}',
              'tensorboard=false']
    t0 = time.time()
    p = subprocess.run([sys.executable, '-m', 'lmbook.cli', 'prepare', '-p', a.profile, '-e', 'e2e', '-q', '--set',
                        *data], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode: raise SystemExit(f"prepare failed: {p.stderr[-800:]}")
    res = dict(profile=a.profile, steps=a.steps, prepare_s=round(time.time() - t0, 1), on=a.on, off=a.off)
    import torch
    gpus = torch.cuda.device_count()
    arms = {'off': a.off, 'on': a.on}
    runs = {arm: ws/'runs'/f'e2e-{arm}' for arm in arms}
    together = gpus >= 2
    vals = {}
    for group in ([list(arms)] if together else [[arm] for arm in arms]):
        procs = {arm: (start(a, arm, common + [s for s in arms[arm].split(',') if s], env,
                             str(i) if together else None, ws/f'{arm}.log'), time.time())
                 for i, arm in enumerate(group)}
        vals |= follow(procs, runs, a.minutes*60)
        res |= {f'{arm}_exit': p.returncode for arm, (p, _) in procs.items()}
    target = a.target if a.target is not None else (vals['off'][-1][1] if vals['off'] else None)
    res |= dict(target=target, together=together, validations=vals,
                logs={arm: log_ends(ws/f'{arm}.log') for arm in arms})
    for arm in arms: res[f'{arm}_seconds_to_target'] = seconds_to(vals[arm], target) if target else None
    on, off = res['on_seconds_to_target'], res['off_seconds_to_target']
    res['on_over_off'] = round(on/off, 3) if on and off else None
    res |= dict(card=torch.cuda.get_device_name(0) if gpus else 'cpu', gpus_per_arm=1, torch=torch.__version__,
                date=time.strftime('%Y-%m-%d'))
    print(json.dumps(res, indent=1))
    if a.out: a.out.write_text(json.dumps(res, indent=1) + '\n')


if __name__ == '__main__': main()
