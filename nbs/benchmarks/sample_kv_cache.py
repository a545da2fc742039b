"""Generation speed with and without the KV cache (`lmbook.model.generate.generate`), one JSON line per row.

Randomly initialised models of the profiles' shapes, greedy decoding from a one-token prompt, so both
paths produce the same tokens (checked). On a GPU:

    python nbs/benchmarks/sample_kv_cache.py --profiles m3_medium gpt2_124m runpod_2b --out nbs/benchmarks/kv_cache.jsonl

On a CPU, something small: `--profiles smoke --lengths 32 127 --dtype float32 --threads 1`.
"""
import argparse, json, time
import torch
from lmbook.profiles import get_config
from lmbook.model.gpt import GPT
from lmbook.model.generate import generate
from lmbook.runs.load import inference_device

def timed(model, n, cache, device, batch):
    x = torch.zeros(batch, 1, dtype=torch.long, device=device)
    if device.startswith('cuda'): torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = generate(model, x, n, temperature=0, cache=cache)
    if device.startswith('cuda'): torch.cuda.synchronize()
    return time.perf_counter() - t0, y

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profiles', nargs='+', default=['m3_medium', 'gpt2_124m'])
    ap.add_argument('--lengths', nargs='+', type=int, default=[128, 512, 1023], help='new tokens (at most block_size-1)')
    ap.add_argument('--batch', type=int, default=1, help='sequences generated together')
    ap.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
    ap.add_argument('--device', default='auto')
    ap.add_argument('--threads', type=int, default=0, help='CPU threads (0: torch default)')
    ap.add_argument('--out', default=None, help='append the rows to this .jsonl file')
    a = ap.parse_args()
    if a.threads: torch.set_num_threads(a.threads)
    device, dtype = inference_device(a.device), getattr(torch, a.dtype)
    card = torch.cuda.get_device_name(device) if device.startswith('cuda') else device
    for prof in a.profiles:
        cfg = get_config(prof)
        torch.manual_seed(0)
        model = GPT(cfg.model).to(device=device, dtype=dtype).eval()
        timed(model, 8, True, device, a.batch); timed(model, 8, False, device, a.batch)  # warm up
        for n in [n for n in a.lengths if n < cfg.model.block_size]:
            (t_no, y_no), (t_kv, y_kv) = timed(model, n, False, device, a.batch), timed(model, n, True, device, a.batch)
            row = dict(profile=prof, arch=cfg.model.arch, n_layer=cfg.model.n_layer, n_embd=cfg.model.n_embd, block_size=cfg.model.block_size,
                       batch=a.batch, new_tokens=n, dtype=a.dtype, card=card, torch=torch.__version__, no_cache_s=round(t_no, 4),
                       cache_s=round(t_kv, 4), cache_tok_per_s=round(a.batch*n/t_kv, 1), speedup=round(t_no/t_kv, 2),
                       same_tokens=bool(torch.equal(y_no, y_kv)), date=time.strftime('%Y-%m-%d'))
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, 'a') as f: f.write(json.dumps(row) + '\n')

if __name__ == '__main__': main()
