"""A local stand-in for FineWeb's `sample-10BT`, for timing data preparation where the Hub cannot be reached: parquet
files with a `text` column, documents of English-like text whose lengths follow FineWeb's (log-normal, median about
2 KB, mean about 3 KB), in row groups of 1,000, as many files as the size asked for.

The text is this machine's own: the paragraphs of /usr/share/doc (READMEs, changelogs, copyright files) and of the
Python standard library's docstrings, drawn at random and joined into documents, so the corpus has natural words and
punctuation, though fewer distinct words than the web (a BPE trains a little faster on it than on FineWeb). The same
seed gives the same corpus.

    PYTHONPATH=$PWD python3 nbs/benchmarks/fineweb_like.py OUT_DIR --gb 8
"""
import argparse, gzip, sys
from pathlib import Path
import numpy as np


def paragraphs(min_chars:int=80) -> list[str]:
    "English-like paragraphs of this machine: /usr/share/doc's text files and the stdlib's docstrings."
    out = []
    for p in sorted(Path('/usr/share/doc').rglob('*')):
        if not p.is_file() or p.stat().st_size > 4 << 20: continue
        try: raw = gzip.decompress(p.read_bytes()) if p.name.endswith('.gz') else p.read_bytes()
        except (OSError, EOFError): continue
        try: text = raw.decode('utf-8')
        except UnicodeDecodeError: continue
        out += [' '.join(b.split()) for b in text.split('\n\n') if len(b) >= min_chars and '\x00' not in b]
    from lmbook.data.corpus import builtin_docs
    out += [' '.join(d.split()) for d in builtin_docs() if len(d) >= min_chars]
    return out


def write_corpus(out:Path, gb:float, docs_per_file:int=100_000, seed:int=0) -> list[Path]:
    "Parquet files of FineWeb-shaped documents in `out`, about `gb` GB of text in all."
    import pyarrow as pa, pyarrow.parquet as pq
    pool = paragraphs()
    lens = np.array([len(p) for p in pool])
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    files, total, i = [], 0, 0
    while total < gb*1e9:
        # FineWeb's document lengths: log-normal with a median near 2 KB and a mean near 3 KB
        target = np.clip(rng.lognormal(np.log(1500), 0.9, docs_per_file), 200, 100_000).astype(int)
        picks = rng.integers(0, len(pool), int(target.sum()//lens.mean()) + 4*docs_per_file)
        docs, k = [], 0
        for t in target:
            parts, n = [], 0
            while n < t:
                parts.append(pool[picks[k % len(picks)]])
                n += lens[picks[k % len(picks)]] + 2
                k += 1
            docs.append('\n\n'.join(parts))
        f = out/f'train-{i:05d}.parquet'
        pq.write_table(pa.table({'text': docs}), f, row_group_size=1000)
        files.append(f)
        total += sum(map(len, docs))
        i += 1
        print(f"{f.name}: {len(docs):,} documents, {total/1e9:.2f} GB of text so far", file=sys.stderr)
    return files


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path)
    ap.add_argument('--gb', type=float, default=1.0, help='gigabytes of text')
    ap.add_argument('--docs-per-file', type=int, default=100_000)
    a = ap.parse_args()
    write_corpus(a.out, a.gb, a.docs_per_file)
