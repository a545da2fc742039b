"""Peak memory of `lmbook prepare` on one long line: a file of MB megabytes of words with no newline.

`python3 nbs/benchmarks/long_line.py WORKSPACE [MB]` (default 200) writes the file, runs `lmbook prepare` on it
in a subprocess and prints one JSON line: the file's size, the seconds and the peak RSS of the prepare.
"""
import json, random, resource, subprocess, sys, time
from pathlib import Path

def write_long_line(path:Path, size:float) -> Path:
    "A file of `size` bytes of random words separated by spaces, with no newline (written in ~0.1 s per 100 MB)."
    rnd = random.Random(0)
    words = [''.join(rnd.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rnd.randint(2, 9))) for _ in range(3000)]
    block, n = ' '.join(rnd.choice(words) for _ in range(200_000)).encode() + b' ', int(size)
    with open(path, 'wb') as f:
        while n > 0: f.write(block[:n]); n -= len(block)
    return Path(path)

def main(ws:str, mb:float=200):
    ws = Path(ws); ws.mkdir(parents=True, exist_ok=True)
    src = write_long_line(ws/f'line-{mb:g}mb.txt', mb*1e6)
    t0 = time.time()
    r = subprocess.run([sys.executable, '-m', 'lmbook.cli', 'prepare', '-p', 'smoke', '-e', f'line-{mb:g}mb', '--root',
                        str(ws), '--set', f'dataset={src}', '--quiet'], capture_output=True, text=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024
    print(json.dumps(dict(file_mb=mb, rc=r.returncode, seconds=round(time.time() - t0, 1), peak_rss_mb=round(peak))))
    if r.returncode: print(r.stderr[-2000:], file=sys.stderr)

if __name__ == '__main__': main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 200)
