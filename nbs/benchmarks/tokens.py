"""Real tokens for the benchmark scripts, on any machine without a download.

`python3 nbs/benchmarks/tokens.py WORKSPACE EXPERIMENT [DATASET] [MB]` prints the train and validation token
folders (one per line), preparing them first with lmbook's own `prepare_data` (shard, BPE tokenizer of
8192 tokens, tokenize) when they are not there yet. DATASET is `sources` (default: the Python source files
of this interpreter's standard library and installed packages, sorted by path, up to MB megabytes, written
once as a JSON-lines corpus), `builtin` (the standard library's docstrings: about 0.5M tokens, too few for
runs of a few hundred 64k-token steps) or anything `dataset=` accepts. The models keep their own
vocabulary size (50304 for GPT-2 shapes): only the token ids are smaller.
"""
import json, site, sys, sysconfig
from pathlib import Path

def source_corpus(out:Path, max_mb:float=40) -> Path:
    "A JSON-lines corpus of this Python's .py files (stdlib first, then site-packages), sorted, up to `max_mb` MB."
    if out.is_file(): return out
    paths = sysconfig.get_paths()
    roots = [Path(paths['stdlib']), Path(paths['purelib']), Path(paths['platlib']), *map(Path, site.getsitepackages())]
    n, tmp, seen = 0, out.with_suffix('.tmp'), set()  # site-packages may sit inside the stdlib folder: each file once
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, 'w') as f:
        for root in roots:
            for p in sorted(root.rglob('*.py')) if root.is_dir() else []:
                if (r := p.resolve()) in seen: continue
                seen.add(r)
                try: txt = p.read_text(encoding='utf-8')
                except (UnicodeDecodeError, OSError): continue
                if len(txt) < 200: continue
                f.write(json.dumps(dict(text=txt)) + '\n'); n += len(txt)
                if n > max_mb*1e6: break
            if n > max_mb*1e6: break
    tmp.rename(out)
    return out

def prepare(ws:Path, exp:str, dataset:str='sources', max_mb:float=40) -> tuple[Path, Path]:
    "Train and validation token folders of `dataset` in workspace `ws`."
    from lmbook.profiles import get_config
    from lmbook.core import paths_for
    from lmbook.data.loader import prepare_data
    if dataset == 'sources': dataset = str(source_corpus(Path(ws)/'corpus'/f'sources-{max_mb:g}MB.jsonl', max_mb))
    cfg = get_config('gpt2_124m', dict(dataset=dataset, dataset_config='', vocab_size=8192, val_ratio=0.1, tokenizer=''))  # its own 8192-token BPE
    pd = prepare_data(cfg, paths_for(exp, root=ws))
    return pd.train_tokens, pd.val_tokens

def add_arm_options(ap, profile:str, steps:int, batch_size:int, mb:float, eval_every:int=100):
    "The options of a script that trains one arm a process on these tokens: rows, arm, prepare, verdict, shape."
    ap.add_argument('out', type=Path, help='JSON-lines file rows are appended to')
    ap.add_argument('--prepare', action='store_true', help='prepare the tokens and stop (once, before the arms)')
    ap.add_argument('--verdict', action='store_true', help='print the comparison of the arms in OUT and stop')
    ap.add_argument('--profile', default=profile, help='the profile whose model is trained')
    ap.add_argument('--steps', type=int, default=steps, help='optimizer steps of an arm')
    ap.add_argument('--batch-size', type=int, default=batch_size, help='micro-batch')
    ap.add_argument('--grad-accum', type=int, default=1, help='micro-batches a step')
    ap.add_argument('--eval-every', type=int, default=eval_every, help='steps between validation rows')
    ap.add_argument('--eval-batches', type=int, default=20, help='validation batches')
    ap.add_argument('--dataset', default='sources', help='real tokens (see tokens.py)')
    ap.add_argument('--mb', type=float, default=mb, help='megabytes of source text to tokenize')
    ap.add_argument('--workspace', type=Path, help='where tokens are prepared, kept (default: a scratch folder)')
    ap.add_argument('--tiny', action='store_true', help='toy shapes for a CPU check of the script')

def arm_tokens(ap, a, exp:str) -> tuple[Path, Path]:
    "The train and validation tokens of an arm script's options `a` (experiment `exp`), prepared if need be."
    import time
    from scratch import scratch
    if a.prepare and not a.workspace: ap.error('--prepare keeps the tokens for the arms: give them a --workspace')
    t0 = time.time()
    train, val = prepare(a.workspace or scratch(f'{exp}-'), exp, a.dataset, 1 if a.tiny else a.mb)
    print(f"tokens ready in {time.time() - t0:.0f}s: {train}", flush=True)
    return train, val

if __name__ == '__main__':
    a = sys.argv[1:]
    tr, va = prepare(Path(a[0]), a[1], a[2] if len(a) > 2 else 'sources', float(a[3]) if len(a) > 3 else 40)
    print(tr); print(va)
