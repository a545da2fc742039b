"""fp8 against bf16 over a long run: loss parity at a profile's own shape on real tokens.

Table "fp8 loss parity" of nbs/benchmarks.md. One arm per process (`--arm bf16` or `--arm fp8`), so two GPUs
of one host run both arms at once; each arm trains the profile's model (`runpod_2b` by default) for STEPS
optimizer steps at micro-batch B x 1024, accumulation 1 (or --grad-accum), with the profile's lr, warmup of STEPS/10 and a
cosine decay to 10% over STEPS. The arms differ only in `fp8` (off / tensorwise): same seed, same batches in
the same order, same validation batches. Every EVAL_EVERY steps a row gives the validation loss
(see time_to_loss.py for the row format); the last row per arm gives its final validation loss.

Verdict: `python3 nbs/benchmarks/fp8_parity.py OUT.jsonl --verdict` prints the final validation losses,
their relative difference (bound: 0.5%), the largest training loss of each arm after warmup (a divergence shows
there first), and when the fp8 arm first reached bf16's final validation loss, as a share of bf16's training time.
Equal steps are one question; equal time is the other: fp8 at the micro-batch it frees (16) for the steps that
take about bf16's time at 8 (see fp8_time_to_loss.sh).

Usage (repo root): python3 nbs/benchmarks/fp8_parity.py OUT.jsonl --arm bf16|fp8 [--steps 1500] [--batch-size 8]
                   [--profile runpod_2b] [--tiny]
The real tokens are prepared in --workspace, kept (`--prepare` fills it once for both arms: fp8_parity.sh makes one
and removes it at its end), else in a scratch folder removed when the script ends, however it ends (see scratch.py).
"""
import argparse, json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = {'bf16': dict(fp8='off'), 'fp8': dict(fp8='tensorwise')}

def verdict(out:Path) -> str:
    rows = [json.loads(l) for l in open(out)]
    ends = {r['run']: r for r in rows if r.get('summary')}
    lines = []
    for arm, e in ends.items():
        losses = [r['loss'] for r in rows if r.get('run') == arm and not r.get('summary') and r.get('loss') is not None
                  and r['step'] > e['max_steps']//10]
        lines.append(f"{arm}: {e['max_steps']} steps, {e['train_s']:.0f}s, final val_loss {e['final_val_loss']}, "
                     f"max train loss after warmup {max(losses) if losses else '-'}, {e['card']}")
    if {'bf16', 'fp8'} <= set(ends):
        b, f = ends['bf16']['final_val_loss'], ends['fp8']['final_val_loss']
        d = 100*(f - b)/b
        lines.append(f"fp8 vs bf16 final val_loss: {d:+.2f}% ({'within' if abs(d) <= 0.5 else 'below' if d < 0 else 'OUTSIDE'} the 0.5% bound)")
    if 'bf16' in ends and any(r.get('run') == 'fp8' for r in rows):  # an fp8 arm stopped early still has its crossing
        lines.append(time_to_bf16(rows, ends))
    return '\n'.join(lines)

def time_to_bf16(rows:list[dict], ends:dict) -> str:
    "When the fp8 arm's validation loss first reaches the bf16 arm's final one, against bf16's whole time."
    b, target = ends['bf16'], ends['bf16']['final_val_loss']
    hit = next((r for r in rows if r.get('run') == 'fp8' and not r.get('summary') and r['val_loss'] <= target), None)
    last = max((r['step'] for r in rows if r.get('run') == 'fp8' and not r.get('summary')), default=0)
    if hit is None: return f"fp8 never reached bf16's final val_loss {target} (its last row: step {last})"
    f = ends.get('fp8')  # none when the arm was stopped before its end: its compile time is then unknown
    with_compile = (f"{(hit['train_s'] + f['compile_s'])/(b['train_s'] + b['compile_s']):.2f}x with compilation"
                    if f else f"the arm stopped at step {last} before its summary: compilation not known")
    return (f"fp8 reached bf16's final val_loss {target} at step {hit['step']}, {hit['train_s']:.1f}s of training: "
            f"{hit['train_s']/b['train_s']:.2f}x bf16's {b['train_s']:.1f}s ({with_compile})")

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    import tokens
    tokens.add_arm_options(ap, 'runpod_2b', 1500, 8, 80)
    ap.add_argument('--arm', choices=list(ARMS), help='which arm this process trains')
    ap.add_argument('--seed', type=int, default=1337, help="the model's initial weights (the batches keep their order)")
    a = ap.parse_args()
    if a.verdict: return print(verdict(a.out))
    train, val = tokens.arm_tokens(ap, a, 'fp8p')
    if a.prepare: return
    if not a.arm: ap.error('--arm is needed (or --prepare / --verdict)')
    from lmbook.train.step import cuda_allocator_defaults
    cuda_allocator_defaults()
    from lmbook.profiles import get_config
    from time_to_loss import run
    tiny = dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=2, block_size=64, device='cpu', compile='false') if a.tiny else {}
    cfg = get_config(a.profile, dict(batch_size=a.batch_size, grad_accum=a.grad_accum, max_steps=a.steps, warmup_steps=max(1, a.steps//10),
                                     schedule='cosine', min_lr_ratio=0.1, seed=a.seed,
                                     **ARMS[a.arm], **tiny))
    _, e = run(a.arm, cfg, train, val, a.eval_every, a.eval_batches, a.out)
    print(f"{a.arm}: {a.steps} steps, {e['train_s']:.1f}s, val_loss {e['final_val_loss']}", flush=True)

if __name__ == '__main__': main()
