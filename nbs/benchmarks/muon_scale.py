"""Muon against a tuned AdamW at a profile's own shape: time to the better AdamW's validation loss, one arm a GPU.

Arms, each a SPEC (one process each, `--arm SPEC`; muon_scale.sh runs them side by side, one a GPU):
  adamw@LR            AdamW at peak lr LR for STEPS steps;
  muon@F@LR           optimizer=muon for F x STEPS steps (its schedule ends there): Muon for the blocks' matrices
                      at --muon-lr, AdamW at LR for embeddings, head and gains;
  muon@F@LR@fp8       the same with fp8=tensorwise.
Every arm trains the profile's model (`runpod_1b` by default) at micro-batch B x its block, accumulation 1 (or
--grad-accum; the profile ships with 16 x 8), warmup over a tenth of its steps then a cosine decay to 10%, on the
same real tokens in the same order (tokens.py), with the same seed (--seed) and the same validation batches. Rows as in time_to_loss.py: one every EVAL_EVERY steps (run,
step, tokens, train_s without compilation and evaluation, val_loss), and a last one per arm.

Verdict (`--verdict`): the target is the lowest final validation loss of the AdamW arms (the tuned AdamW); for
every arm, the training time at which it first reached the target, against the whole training time of the AdamW
arm that set it. The goal for Muon at 1B: at most 0.8x. An arm stopped before its end (muon_scale.sh's
ARMS_LIMIT_S) still gives the step at which it reached the target.

Usage (repo root): python3 nbs/benchmarks/muon_scale.py OUT.jsonl --prepare --workspace WS
                   python3 nbs/benchmarks/muon_scale.py OUT.jsonl --arm SPEC --workspace WS [--steps 1600]
                   python3 nbs/benchmarks/muon_scale.py OUT.jsonl --verdict
"""
import argparse, json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))


def arm_settings(spec:str, steps:int) -> tuple[int, dict]:
    "The steps and config values of the arm `spec` (see the module's docstring)."
    kind, *rest = spec.split('@')
    if kind == 'adamw' and len(rest) == 1: return steps, dict(optimizer='adamw', lr=float(rest[0]))
    if kind == 'muon' and len(rest) in (2, 3) and rest[2:] in ([], ['fp8']):
        return (max(1, round(float(rest[0])*steps)),
                dict(optimizer='muon', lr=float(rest[1]), fp8='tensorwise' if rest[2:] else 'off'))
    raise SystemExit(f"arm {spec!r}: write adamw@LR, muon@FRACTION@LR or muon@FRACTION@LR@fp8")


def verdict(out:Path) -> str:
    """Each arm's time to the tuned AdamW's final validation loss, against that AdamW's whole time. Where no AdamW
    arm finished, the target is the best last validation loss of those stopped early, at their time then."""
    rows = [json.loads(l) for l in open(out) if l.strip()]
    ends = {r['run']: r for r in rows if r.get('summary')}
    mine = {n: [r for r in rows if r['run'] == n and not r.get('summary')]
            for n in dict.fromkeys(r['run'] for r in rows)}
    adamw = {n: (e['final_val_loss'], e['train_s'], f"the final val_loss of {n} ({e['max_steps']} steps, "
                 f"{e['train_s']:.1f}s)") for n, e in ends.items() if n.startswith('adamw')}
    if not adamw:  # no AdamW arm finished: those stopped early give their last row
        adamw = {n: (rs[-1]['val_loss'], rs[-1]['train_s'], f"the last val_loss of {n}, stopped at step "
                     f"{rs[-1]['step']} ({rs[-1]['train_s']:.1f}s)") for n, rs in mine.items()
                 if n.startswith('adamw') and rs and rs[-1]['step'] > 0}
    if not adamw: return 'no AdamW arm has a validation row after step 0: no target'
    target, base, what = min(adamw.values())
    lines = [f"target: {target}, {what}"]
    for n, rs in mine.items():  # every arm in the order it ran, stopped early or not
        hit = next((r for r in rs if r['val_loss'] <= target), None)
        when = (f"reached it at step {hit['step']}, {hit['train_s']:.1f}s: {hit['train_s']/base:.2f}x"
                if hit else 'did not reach it')
        e = ends.get(n)
        end = (f"{e['max_steps']} steps, {e['train_s']:.1f}s, final val_loss {e['final_val_loss']}; {e['card']}"
               if e else f"stopped before its end, last row step {rs[-1]['step'] if rs else '-'}")
        lines.append(f"{n}: {end}; {when}")
    return '\n'.join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    import tokens
    tokens.add_arm_options(ap, 'runpod_1b', 1600, 16, 120)
    ap.add_argument('--arm', help='the arm this process trains (a SPEC)')
    ap.add_argument('--muon-lr', type=float, default=0.02, help="Muon's peak learning rate (matrices)")
    ap.add_argument('--seed', type=int, default=1337, help="the model's initial weights (the batches keep their order)")
    a = ap.parse_args()
    if a.verdict: return print(verdict(a.out))
    if not a.prepare and not a.arm: ap.error('--arm is needed (or --prepare / --verdict)')
    steps, sets = arm_settings(a.arm, a.steps) if a.arm else (0, {})
    train, val = tokens.arm_tokens(ap, a, 'muon')
    if a.prepare: return
    from lmbook.train.step import cuda_allocator_defaults
    cuda_allocator_defaults()
    from lmbook.profiles import get_config
    from time_to_loss import run
    tiny = dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=2, block_size=64, device='cpu', compile='false',
                **({'fp8': 'off'} if sets.get('fp8') else {})) if a.tiny else {}
    cfg = get_config(a.profile, {**sets, 'batch_size': a.batch_size, 'grad_accum': a.grad_accum, 'max_steps': steps,
                                 'warmup_steps': max(1, steps//10), 'schedule': 'cosine', 'min_lr_ratio': 0.1,
                                 'muon_lr': a.muon_lr, 'seed': a.seed, **tiny})
    _, e = run(a.arm, cfg, train, val, a.eval_every, a.eval_batches, a.out)
    print(f"{a.arm}: {steps} steps, {e['train_s']:.1f}s, val_loss {e['final_val_loss']}", flush=True)


if __name__ == '__main__': main()
