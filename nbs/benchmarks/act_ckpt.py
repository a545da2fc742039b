"""Activation checkpointing at runpod_4b and the micro-batch fit, one GPU, one process.

Table "Activation checkpointing and the micro-batch fit" of nbs/benchmarks.md. Synthetic tokens, T=1024, and
the same tokens per optimizer step in every row of a part, so rows differ only in micro-batch, accumulation and
levers:

- part `4b`: runpod_4b at 32 sequences a step: micro-batch 2 x 16 without checkpointing (its best fit without
  it), then `act_ckpt=full` at 8 x 4 and 16 x 2, `selective` at 4 x 8, and `full` with fp8 at 16 x 2;
- part `2b`: runpod_2b at 16 sequences a step: everything off (bf16, micro-batch 8 x 2) against fp8 at 16 x 1;
  then `trainer.fit_batch` as `batch_fit` runs it, for runpod_2b with fp8 and for runpod_4b with `act_ckpt=full`
  (each fit is one row: the choice, the trials and the seconds they took).

Usage (repo root): python3 nbs/benchmarks/act_ckpt.py OUT.jsonl --part 4b|2b [--steps 3] [--tiny]
"""
import argparse, json, time, warnings
from pathlib import Path

PARTS = {  # label -> (profile, overrides)
    '4b': [('4b-none-b2', 'runpod_4b', dict(batch_size=2, grad_accum=16)),
           ('4b-full-b8', 'runpod_4b', dict(batch_size=8, grad_accum=4, act_ckpt='full')),
           ('4b-full-b16', 'runpod_4b', dict(batch_size=16, grad_accum=2, act_ckpt='full')),
           ('4b-selective-b4', 'runpod_4b', dict(batch_size=4, grad_accum=8, act_ckpt='selective')),
           ('4b-full-fp8-b16', 'runpod_4b', dict(batch_size=16, grad_accum=2, act_ckpt='full', fp8='tensorwise'))],
    '2b': [('2b-off-b8', 'runpod_2b', dict(batch_size=8, grad_accum=2)),
           ('2b-fp8-b16', 'runpod_2b', dict(batch_size=16, grad_accum=1, fp8='tensorwise'))],
}
FITS = {'2b': [('fit-2b-fp8', 'runpod_2b', dict(fp8='tensorwise'))]}

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path, help='JSON-lines file rows are appended to')
    ap.add_argument('--part', choices=list(PARTS), required=True)
    ap.add_argument('--steps', type=int, default=3, help='timed optimizer steps of each row')
    ap.add_argument('--tiny', action='store_true', help='toy shapes on the CPU, to check the script end to end')
    a = ap.parse_args()
    from lmbook.train.step import cuda_allocator_defaults
    from lmbook.train.runstart import fit_batch
    from lmbook.train.inputs import Init
    cuda_allocator_defaults()
    import torch
    from lmbook.train.bench import measure, format_rows
    from lmbook.profiles import get_config
    from lmbook.distributed import DistInfo
    tiny = dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=2, block_size=64, device='cpu', compile='false') if a.tiny else {}
    def write(r):
        with open(a.out, 'a') as f: f.write(json.dumps(r) + '\n')
    rows = []
    for label, profile, ov in PARTS[a.part]:
        cfg = get_config(profile, {**ov, **tiny})
        t = time.time()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore' if a.tiny else 'default')
            r = measure(cfg, a.steps, 2)
        r = dict(profile=profile, label=label, overrides=ov, wall_s=round(time.time() - t, 1), **r)
        rows.append(r); write(r)
        print(f"{label}: {r.get('tok_per_s')} tok/s, peak {r.get('mem_gb')} GB (est {r.get('mem_est_gb')}), "
              f"reserved {r.get('mem_reserved_gb')} GB, {r['wall_s']}s", flush=True)
    print(format_rows(rows))
    base = rows[0].get('tok_per_s')
    for r in rows[1:]:
        if base and r.get('tok_per_s'): print(f"{r['label']}: {r['tok_per_s']/base:.3f}x {rows[0]['label']}")
    for label, profile, ov in FITS.get(a.part, []):
        cfg = get_config(profile, {**ov, **tiny})
        dev = 'cpu' if a.tiny else 'cuda:0'
        said, t = [], time.time()
        fake = (lambda c: c.train.batch_size <= 16) if a.tiny else None
        f = fit_batch(cfg, Init(), DistInfo(device=dev), said.append, fits=fake)
        r = dict(label=label, profile=profile, overrides=ov, batch_size=f.train.batch_size, grad_accum=f.train.grad_accum,
                 said=said, fit_s=round(time.time() - t, 1), card=torch.cuda.get_device_name() if dev != 'cpu' else 'cpu',
                 torch=torch.__version__, date=time.strftime('%Y-%m-%d'))
        write(r); print(json.dumps(r), flush=True)

if __name__ == '__main__': main()
