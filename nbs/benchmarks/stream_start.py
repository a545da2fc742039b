"""The data wait: seconds from `lmbook train` to the end of the first step of a FineWeb-shaped run whose data is not
prepared, for corpora of several sizes (the goal: within 2 minutes, however large the corpus).

Each size gets a local stand-in for FineWeb's sample (`fineweb_like.py`: parquet files of English-like documents,
FineWeb's lengths) and a fresh workspace; the command is `lmbook train -p runpod_2b` with its data settings (its own
BPE of 32,768 tokens, validation 5%, 3.93B tokens to read: 3.84M steps of one sequence of 1,024 here, 30,000
of 131,072 there) and a model small enough for a CPU (2 layers of 128, no compile, no fit, no float8, two
validation batches: on two cores, the profile's 20 batches of 16 sequences at 32,768 logits a token take
minutes of compute, not of data). How many validation tokens were ready at the first step is reported: the
profile's validation reads 20 x 16 windows of 1,025 tokens. The trainer's clock (`meta.json`'s `startup`)
says where the seconds went, and its log how far the preparation got; the preparation goes on in the background
after the first step, and the run is stopped there (SIGTERM) with what it had prepared reported.

CPU, from the repo root (a few minutes and 2-3 GB of disk a GB of text; the corpora are kept in --corpora):
    PYTHONPATH=$PWD python3 nbs/benchmarks/stream_start.py --gb 1 8 --corpora /tmp/fw --out stream_start.json
"""
import argparse, json, os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch
from fineweb_like import write_corpus

ROOT = Path(__file__).resolve().parents[2]
# the profile's 3.93B tokens to read, in steps of one sequence (a CPU's step), and two validation batches
SMALL = ['n_layer=2', 'n_embd=128', 'n_head=4', 'device=cpu', 'compile=false', 'batch_fit=false', 'fp8=off',
         'batch_size=1', 'grad_accum=1', 'max_steps=3840000', 'eval_steps=2', 'dataset_config=',
         'tensorboard=false', 'log_every=1', 'force=true']


def one(corpus:Path, ws:Path, limit_s:float) -> dict:
    "`lmbook train` on `corpus` in workspace `ws` until its first step is done; what its clock and log say."
    env = {**os.environ, 'LMBOOK_WORKSPACE': str(ws), 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1',
           'PYTHONUNBUFFERED': '1'}
    cmd = [sys.executable, '-m', 'lmbook.cli', 'train', '-p', 'runpod_2b', '-e', 'fw', '--set',
           f'dataset={corpus}', *SMALL]
    run, out = ws/'runs'/'fw', ws/'train.out'
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out, 'w'), stderr=subprocess.STDOUT,
                         start_new_session=True)
    st = None
    while time.time() - t0 < limit_s and p.poll() is None:
        try: st = json.loads((run/'meta.json').read_text()).get('startup')
        except (FileNotFoundError, json.JSONDecodeError): st = None
        if st: break
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGTERM)  # the run checkpoints and stops; its preparation stops at its next shard
    try: p.wait(120)
    except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL); p.wait()
    log = out.read_text()
    data = [l for l in log.splitlines() if 'data:' in l or 'start-up' in l]
    if not st: return dict(error=f"no first step within {limit_s:.0f} s", log=log[-3000:])
    tm, vm = (json.loads((ws/'cache'/'fw'/'tokens'/k/'manifest.json').read_text()) for k in ('train', 'val'))
    return dict(command_to_first_step_s=round(st['ended'] - t0, 1), command_to_trainer_s=round(st['started'] - t0, 1),
                parts=st['parts'], train_files_at_stop=len(tm['files']),
                train_tokens_at_stop=sum(f['tokens'] for f in tm['files']),
                val_tokens_at_stop=sum(f['tokens'] for f in vm['files']), lines=data[-12:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--gb', type=float, nargs='+', default=[1.0, 8.0], help='corpus sizes, GB of text')
    ap.add_argument('--corpora', type=Path, required=True, help='where the stand-in corpora are made and kept')
    ap.add_argument('--limit', type=float, default=600, help='seconds a start may take to its first step')
    ap.add_argument('--out', type=Path)
    a = ap.parse_args()
    import torch
    res = dict(date=time.strftime('%Y-%m-%d'), torch=torch.__version__, cpus=os.cpu_count(),
               load=os.getloadavg(), runs={})
    for gb in a.gb:
        corpus = a.corpora/f'fineweb-like-{gb:g}GB'
        if not corpus.is_dir(): write_corpus(corpus, gb)
        size = sum(f.stat().st_size for f in corpus.glob('*.parquet'))
        r = one(corpus, scratch('lmbook-stream-start-'), a.limit)
        res['runs'][f'{gb:g} GB'] = dict(parquet_bytes=size, files=len(list(corpus.glob('*.parquet'))), **r)
        print(json.dumps(res, indent=1), flush=True)
        if a.out: a.out.write_text(json.dumps(res, indent=1) + '\n')


if __name__ == '__main__': main()
