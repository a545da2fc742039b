"""Time to the AdamW recipe's validation loss: the nanoGPT recipe (AdamW) against Muon, one GPU, one call.

Table "Time to loss" of nbs/benchmarks.md. GPT-2 124M, micro-batch 64 x 1024, accumulation 1, real tokens
(see tokens.py), warmup then cosine decay to 10% over each run's own length:

1. `adamw`: the nanoGPT recipe (lr 6e-4, betas 0.9/0.95, weight decay 0.1) for STEPS steps; its final
   validation loss is the target;
2. one Muon run for each F[@LR] of --muon-runs: optimizer=muon (Muon for the blocks' matrices at muon_lr,
   AdamW for embeddings, head and gains at LR, default the recipe's 6e-4) for F x STEPS steps, so its schedule
   ends there. The default tries the AdamW part at 3x the recipe's lr in the shorter run.

Every EVAL_EVERY steps a row is written: run, step, tokens, train_s (wall time of the optimizer steps,
synchronised, without compilation and evaluation), val_loss on the same EVAL_BATCHES batches. A last row per
run gives compile_s and the time at which its validation loss first reached the target.
Plot: python3 nbs/benchmarks/plot_time_to_loss.py OUT.jsonl PNG

Usage (repo root): python3 nbs/benchmarks/time_to_loss.py OUT.jsonl [--steps 600] [--muon-runs 0.55@0.0018,0.75] [--tiny]
The real tokens are prepared in --workspace, kept for a later call, else in a scratch folder removed when the script
ends, however it ends (see scratch.py).
"""
import argparse, json, math, sys, time, warnings
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

RECIPE = dict(ce_chunk=0, attn_backend='sdpa', compile='auto', fp8='off', fused_ce=False, grad_accum=1, batch_size=64,
              schedule='cosine', min_lr_ratio=0.1)

def run(name, cfg, train, val, eval_every, eval_batches, out, target=None):
    "Train `cfg` for its max_steps; write a row every `eval_every` steps; return the rows."
    import torch
    from lmbook.train.bench import make_step, file_batches, eager_val_loss, _sync
    from lmbook.core import pick_device
    from lmbook.data.loader import val_batches
    from lmbook.train.optim import schedule_for
    device = pick_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    t, step, _ = make_step(cfg, device)
    lr = schedule_for(cfg.train.sched, cfg.train.optim.lr, cfg.train.sched.max_steps)
    batches = file_batches(train, cfg.train.batch_size, cfg.model.block_size, device)
    vb = val_batches(val, cfg.train.batch_size, cfg.model.block_size, eval_batches)
    rows, train_s, compile_s, reached = [], 0.0, 0.0, None
    def record(s, loss):
        nonlocal reached
        v = eager_val_loss(t, vb)
        r = dict(run=name, optimizer=cfg.train.optim.optimizer, step=s, tokens=s*cfg.tokens_per_step, train_s=round(train_s, 3),
                 loss=loss, val_loss=round(v, 4), max_steps=cfg.train.sched.max_steps, muon_lr=cfg.train.optim.muon_lr, lr=cfg.train.optim.lr)
        if target is not None and reached is None and v <= target: reached = r
        rows.append(r)
        with open(out, 'a') as f: f.write(json.dumps(r) + '\n')
    record(0, None)
    for s in range(cfg.train.sched.max_steps):
        t0 = time.perf_counter()
        loss = step(batches, lr(s)).item()
        _sync(device)
        dt = time.perf_counter() - t0
        if s == 0: compile_s = dt  # the first step compiles: kept apart, as for both runs
        else: train_s += dt
        if (s + 1) % eval_every == 0 or s + 1 == cfg.train.sched.max_steps: record(s + 1, round(loss, 4))
    end = dict(run=name, summary=True, optimizer=cfg.train.optim.optimizer, max_steps=cfg.train.sched.max_steps, compile_s=round(compile_s, 2),
               train_s=round(train_s, 3), final_val_loss=rows[-1]['val_loss'], target=target,
               reached_step=reached and reached['step'], reached_train_s=reached and reached['train_s'],
               card=torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu', torch=torch.__version__)
    with open(out, 'a') as f: f.write(json.dumps(end) + '\n')
    del t, step
    torch._dynamo.reset()
    if device.startswith('cuda'): torch.cuda.empty_cache()
    return rows, end

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path, help='JSON-lines file rows are appended to')
    ap.add_argument('--steps', type=int, default=600, help="the AdamW recipe's optimizer steps (its fixed budget)")
    ap.add_argument('--muon-runs', default='0.55@0.0018,0.75', help="Muon runs: FRACTION of --steps [@ the AdamW part's lr]")
    ap.add_argument('--muon-lr', type=float, default=0.02, help="Muon's peak learning rate (matrices)")
    ap.add_argument('--eval-every', type=int, default=25, help='steps between validation rows')
    ap.add_argument('--eval-batches', type=int, default=10, help='validation batches of 64 x 1024 tokens')
    ap.add_argument('--dataset', default='sources', help='real tokens (see tokens.py)')
    ap.add_argument('--mb', type=float, default=80, help='megabytes of source text to tokenize')
    ap.add_argument('--workspace', type=Path, help='where tokens are prepared, kept (default: a scratch folder, removed)')
    ap.add_argument('--tiny', action='store_true', help='toy shapes for a CPU check of the script')
    a = ap.parse_args()
    from lmbook.train.step import cuda_allocator_defaults
    cuda_allocator_defaults()
    from lmbook.profiles import get_config
    import tokens
    t0 = time.time()
    train, val = tokens.prepare(a.workspace or scratch('time-to-loss-'), 'ttl', a.dataset, 1 if a.tiny else a.mb)
    print(f"tokens ready in {time.time() - t0:.0f}s: {train}", flush=True)
    tiny = dict(n_layer=2, n_embd=64, n_head=2, block_size=64, device='cpu', compile='false', batch_size=4) if a.tiny else {}
    def cfg(steps, **kw): return get_config('gpt2_124m', {**RECIPE, 'max_steps': steps, 'warmup_steps': max(1, steps//20), **kw, **tiny})
    rows, end = run('adamw', cfg(a.steps), train, val, a.eval_every, a.eval_batches, a.out)
    target = end['final_val_loss']
    print(f"adamw: {a.steps} steps, {end['train_s']:.1f}s, val_loss {target}", flush=True)
    for spec in a.muon_runs.split(','):
        f, lr = (spec.split('@') + ['0.0006'])[:2]
        n, name = max(1, round(float(f)*a.steps)), f'muon-{spec}'
        _, e = run(name, cfg(n, optimizer='muon', muon_lr=a.muon_lr, lr=float(lr)), train, val, a.eval_every, a.eval_batches, a.out, target)
        ratio = f"{e['reached_train_s']/end['train_s']:.2f}x the recipe's time" if e['reached_train_s'] else 'target not reached'
        print(f"{name}: {n} steps, {e['train_s']:.1f}s, val_loss {e['final_val_loss']} (target {target}): {ratio}", flush=True)

if __name__ == '__main__': main()
