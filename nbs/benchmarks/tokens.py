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
    from lmbook.config import get_config
    from lmbook.core import paths_for
    from lmbook.data.loader import prepare_data
    if dataset == 'sources': dataset = str(source_corpus(Path(ws)/'corpus'/f'sources-{max_mb:g}MB.jsonl', max_mb))
    cfg = get_config('gpt2_124m', dict(dataset=dataset, dataset_config='', vocab_size=8192, val_ratio=0.1, tokenizer=''))  # its own 8192-token BPE
    pd = prepare_data(cfg, paths_for(exp, root=ws))
    return pd.train_tokens, pd.val_tokens

if __name__ == '__main__':
    a = sys.argv[1:]
    tr, va = prepare(Path(a[0]), a[1], a[2] if len(a) > 2 else 'sources', float(a[3]) if len(a) > 3 else 40)
    print(tr); print(va)
