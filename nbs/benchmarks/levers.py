"""Throughput levers alone and together against the nanoGPT-recipe row, one GPU, one process.

Table "Levers" of nbs/benchmarks.md. Every row is measured in this one call on this one card, at accumulation 1
and T=1024, so each ratio compares two rows of the same call at the same shape and micro-batch:

1. the 2B shape (GPT-2 arch, 24 x 2560, 40 heads), micro-batch 16, synthetic tokens: tok/s, MFU, peak memory;
2. GPT-2 124M, micro-batch 64, real tokens with the config's warmup and cosine decay over PARITY_STEPS steps:
   tok/s, peak memory and the validation loss at the end (loss parity against the recipe row);
3. on request (`--shapes 2bp`), the 2B shape at micro-batch 16 on the same real tokens and schedule: loss parity at 2B.

Rows: `recipe` (arch=gpt2, whole-logits loss, attn_backend=sdpa, default compile, fused AdamW: nanoGPT's
train.py), then each lever alone (`fp8` tensorwise, `fused_ce`, `attn` = attn_backend=auto: cuDNN on Hopper),
then `all` together. MFU is against the dense bf16 peak (bf16-equivalent for fp8 rows).

Usage (repo root): python3 nbs/benchmarks/levers.py OUT.jsonl [--parity-steps 120] [--shapes 2b,124m] [--tiny]
`--tiny` runs the same sequence on a CPU with toy shapes, to check the script end to end.
The real tokens are prepared in --workspace, kept for a later call, else in a scratch folder removed when the script
ends, however it ends (see scratch.py).
"""
import argparse, json, os, sys, time, warnings
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

LEVERS = {  # name -> config overrides on top of the recipe; `all` second, so a cut-short call keeps the key rows
    'recipe': {},
    'all': dict(fp8='tensorwise', fused_ce=True, attn_backend='auto'),
    'fp8': dict(fp8='tensorwise'),
    'fused_ce': dict(fused_ce=True),
    'attn': dict(attn_backend='auto'),
}
RECIPE = dict(ce_chunk=0, attn_backend='sdpa', compile='auto', optimizer='adamw', fp8='off', fused_ce=False, grad_accum=1)
G2B = dict(n_layer=24, n_embd=2560, n_head=40)

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path, help='JSON-lines file rows are appended to')
    ap.add_argument('--shapes', default='2b,124m', help="which tables: '2b' (throughput), '124m' (throughput and loss parity), '2bp' (2B loss parity on real tokens)")
    ap.add_argument('--parity-steps', type=int, default=120, help='timed optimizer steps of each 124M row (loss parity)')
    ap.add_argument('--steps-2b', type=int, default=4, help='timed optimizer steps of each 2B row')
    ap.add_argument('--levers', default=','.join(LEVERS), help='comma-separated subset of ' + ','.join(LEVERS))
    ap.add_argument('--dataset', default='sources', help='real tokens for the 124M rows (see tokens.py)')
    ap.add_argument('--mb', type=float, default=32, help='megabytes of source text to tokenize')
    ap.add_argument('--workspace', type=Path, help='where tokens are prepared, kept (default: a scratch folder, removed)')
    ap.add_argument('--tiny', action='store_true', help='toy shapes for a CPU check of the script')
    a = ap.parse_args()
    from lmbook.train.step import cuda_allocator_defaults
    cuda_allocator_defaults()
    import torch
    from lmbook.train.bench import measure, format_rows
    from lmbook.profiles import get_config
    import tokens
    t0 = time.time()
    train, val = tokens.prepare(a.workspace or scratch('levers-'), 'levers', a.dataset, 1 if a.tiny else a.mb)
    print(f"tokens ready in {time.time() - t0:.0f}s: {train}", flush=True)
    names = a.levers.split(',')
    tiny = dict(n_layer=2, n_embd=64, n_head=2, block_size=64, device='cpu', compile='false', warmup_steps=3)
    shapes = [  # (label, overrides, steps, warmup, real tokens)
        ('2b-b16', {**G2B, 'batch_size': 16}, a.steps_2b, 2, False),
        ('124m-b64', {'batch_size': 64, 'warmup_steps': max(1, a.parity_steps//10)}, a.parity_steps, 2, True),
        ('2bp-b16', {**G2B, 'batch_size': 16, 'warmup_steps': max(1, a.parity_steps//10)}, a.parity_steps, 2, True)]
    shapes = [s for s in shapes if s[0].split('-')[0] in a.shapes.split(',')]
    rows = []
    for label, shape, steps, warmup, real in shapes:
        for name in names:
            ov = {**RECIPE, **shape, **LEVERS[name], **(dict(tiny, batch_size=4) if a.tiny else {})}
            cfg = get_config('gpt2_124m', ov)
            t = time.time()
            with warnings.catch_warnings():
                warnings.simplefilter('ignore' if a.tiny else 'default')
                r = measure(cfg, steps, warmup, train if real else None, schedule=real, val_data=val if real else None,
                            eval_batches=10 if not a.tiny else 2)
            left = round(torch.cuda.memory_allocated()/1e9, 2) if torch.cuda.is_available() else None  # should be ~0: nothing leaks into the next row
            r = dict(profile='gpt2_124m', label=f'{label}-{name}', lever=name, shape=label, overrides=ov, wall_s=round(time.time() - t, 1),
                     mem_left_gb=left, **r)
            rows.append(r)
            with open(a.out, 'a') as f: f.write(json.dumps(r) + '\n')
            print(f"{r['label']}: {r.get('tok_per_s')} tok/s, mem {r.get('mem_gb')} GB (est {r.get('mem_est_gb')}), "
                  f"val_loss {r.get('val_loss')}, {r['wall_s']}s; fp8={r.get('fp8')} loss={r.get('loss_kernel')} attn={r.get('attention')}", flush=True)
    print(format_rows(rows))
    print(summary(rows))

def summary(rows):
    "Each lever's ratio to the recipe row of the same shape, memory against the estimate, and validation-loss change."
    out = ['| shape | lever | tok/s | × recipe | MFU (bf16 peak) | peak GB | est GB | val_loss | Δ val_loss |', '|' + '---|'*9]
    base = {r['shape']: r for r in rows if r['lever'] == 'recipe' and r.get('tok_per_s')}
    for r in rows:
        b = base.get(r['shape'])
        tok = r.get('tok_per_s')
        ratio = f"{tok/b['tok_per_s']:.3f}" if tok and b else '-'
        dv = f"{100*(r['val_loss'] - b['val_loss'])/b['val_loss']:+.2f}%" if r.get('val_loss') and b and b.get('val_loss') else '-'
        mfu = f"{100*r['mfu']:.1f}%" if r.get('mfu') else '-'
        out.append(f"| {r['shape']} | {r['lever']} | {tok or 'OOM'} | {ratio} | {mfu} | {r.get('mem_gb')} | {r.get('mem_est_gb')} | {r.get('val_loss', '-')} | {dv} |")
    return '\n'.join(out)

if __name__ == '__main__': main()
