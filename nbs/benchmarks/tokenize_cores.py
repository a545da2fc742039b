"""Tokenizing speed per CPU core, the figure `lmbook pod plan` scales by a pod's vCPUs for its data line.

`python3 nbs/benchmarks/tokenize_cores.py WORKDIR [MB] [CORES]` shards MB megabytes (default 60) of the
`pysource` corpus (this Python's installed source files, one document each) with lmbook's `shard_corpus`,
trains the BPE of `runpod_2b` (vocabulary 32768) on its first 20 MB with `ensure_tokenizer`, then times
`tokenize_split` on the shards in a fresh process pinned to core 0 and to CORES (default 0,1), in wall and CPU
seconds (CPU seconds stay honest on a machine that others load), and the part of it that runs on one thread
whatever the cores (reading the shards and packing the ids, in Python; thread CPU seconds), which bounds it on
many cores. Prints one JSON line.
"""
import json, os, platform, subprocess, sys, tempfile, time
from pathlib import Path

CHILD = '''import json, sys, time
from pathlib import Path
from lmbook.data.tokenizer import tokenize_split, load_tokenizer
shards, tok, out = map(Path, sys.argv[1:4])
t0, c0 = time.perf_counter(), time.process_time()
m = tokenize_split(shards, load_tokenizer(tok), out)
cpu = time.process_time() - c0
print(json.dumps(dict(seconds=time.perf_counter() - t0, cpu_seconds=cpu, tokens=m['tokens'], docs=m['docs'])))
'''

def serial_part(shards:Path, tok_dir:Path) -> dict:
    "Thread CPU seconds of tokenizing's single-thread Python work (reading shards, packing ids), encoding apart."
    from lmbook.data.prepare import check_shards
    from lmbook.data.tokenizer import load_tokenizer, shard_lines, _batches, _pack, token_dtype
    tk, sm = load_tokenizer(tok_dir), check_shards(shards, checksums=False)
    dt, read, pack, n = token_dtype(tk.vocab_size), 0.0, 0.0, 0
    for s in sm['shards']:
        t0 = time.thread_time()
        docs = list(shard_lines(shards/s['name'], s['sha256']))
        read += time.thread_time() - t0
        for b in _batches(docs):
            encs = tk.tok.encode_batch_fast(b, add_special_tokens=False)
            t0 = time.thread_time()
            n += len(_pack(encs, tk.eot_id, dt))
            pack += time.thread_time() - t0
    return dict(read_seconds=read, pack_seconds=pack, tokens=n, serial_tok_per_s=n/(read + pack))

def pinned(cores:str, shards:Path, tok_dir:Path, out:Path) -> dict:
    "`tokenize_split` in a fresh process pinned to `cores` (taskset), e.g. '0' or '0,1'."
    cmd = ['taskset', '-c', cores, sys.executable, '-c', CHILD, str(shards), str(tok_dir), str(out)]
    d = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    return dict(d, cores=len(cores.split(',')), tok_per_s=d['tokens']/d['seconds'],
                tok_per_cpu_s=d['tokens']/d['cpu_seconds'])

def main(work:str, mb:float=60, cores:str='0,1'):
    import tokenizers, torch
    from lmbook.data.corpus import pysource_docs
    from lmbook.data.prepare import shard_corpus
    from lmbook.data.tokenizer import ensure_tokenizer
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    def capped():
        n = 0
        for d in pysource_docs():
            if n >= mb*1e6: return
            n += len(d.encode())
            yield d
    t0 = time.perf_counter()
    ms = shard_corpus(work/'shards', dataset='pysource', mode='prod', lines_per_shard=2000, docs=capped())
    shard_s, t0 = time.perf_counter() - t0, time.perf_counter()
    tk = ensure_tokenizer(work/'tok', work/'shards', 32768, max_bytes=20_000_000)
    bpe_s = time.perf_counter() - t0
    runs = [pinned(c, work/'shards', work/'tok', work/f'tokens-{c}') for c in ('0', cores)]
    print(json.dumps(dict(date=time.strftime('%Y-%m-%d'), host=platform.node(),
                          cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                          python=platform.python_version(), torch=torch.__version__,
                          tokenizers=tokenizers.__version__, corpus='pysource', corpus_mb=mb,
                          shard_bytes=ms['train']['bytes'], docs=ms['train']['docs'], vocab_size=tk.vocab_size,
                          shard_seconds=round(shard_s, 1), bpe_seconds_20mb=round(bpe_s, 1),
                          tokenize=runs, serial=serial_part(work/'shards', work/'tok'))))

if __name__ == '__main__':
    with tempfile.TemporaryDirectory() as d:
        main(sys.argv[1] if len(sys.argv) > 1 else d, *(float(a) for a in sys.argv[2:3]), *sys.argv[3:4])
