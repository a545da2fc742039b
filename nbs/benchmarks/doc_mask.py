"""Per-document attention for packed rows (`doc_mask`): what it costs a step, and what it does to a fine-tuned model.

Two parts, rows appended to OUT (JSON lines):

- `speed`: forward + backward + AdamW step of one model (124M-shaped, T=1024 on a GPU; the smoke shape on a CPU) on rows packed with documents of random lengths (geometric,
  mean `--doc-len`, a new layout every step), plain causal attention against the document mask as SDPA's dense
  boolean mask and, on CUDA, as a FlexAttention BlockMask; eager, and compiled on CUDA. A row reports ms per step,
  tokens/s, the ratio to plain causal in the same mode, and how many graphs torch.compile made (a mask that
  recompiled every step would show as many graphs as steps).
- `loss`: from a pretrained run (`--init-from`, else the smoke profile pretrained here on the built-in corpus),
  fine-tune on the built-in chat set once per arm (doc_mask off; on through SDPA; on through FlexAttention on CUDA),
  same seed, steps and data; report each arm's validation loss on its held-out examples scored the way a model is
  used (each example alone, which is what the mask gives), and packed without a mask, and its training tok/s.

Usage (repo root):  python3 nbs/benchmarks/doc_mask.py OUT.jsonl [--part speed|loss|all] [--tiny]
One GPU:            bash nbs/benchmarks/doc_mask.sh      (both parts at the 124M shape, about 10 minutes)
The `loss` part's runs go to --root, kept, else to a scratch folder removed when the script ends (see scratch.py).
"""
import argparse, json, math, platform, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch


def packed_batch(B, T, vocab, doc_len, eot, g, device):
    "(B, T+1) token ids: documents of geometric lengths (mean `doc_len`), each starting with `eot`."
    import torch
    x = torch.randint(1, vocab, (B, T + 1), generator=g)
    starts = torch.rand(B, T + 1, generator=g) < 1.0/doc_len
    starts[:, 0] = True
    x[starts] = eot
    return x.to(device)


def speed(a, write):
    import torch, torch._dynamo
    from lmbook.profiles import get_config
    from lmbook.model.gpt import GPT, doc_mask, create_block_mask
    cuda = torch.cuda.is_available() and not a.tiny
    dev = 'cuda' if cuda else 'cpu'
    shape = (dict(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=512) if a.tiny else
             dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=32768) if cuda else
             dict(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=4096))  # the smoke shape on a CPU
    B = 2 if a.tiny else a.batch_size
    a.doc_len = a.doc_len or shape['block_size']/4
    arms = [('causal', 'sdpa', False), ('doc-sdpa', 'sdpa', True)]
    if cuda and create_block_mask is not None: arms.append(('doc-flex', 'flex', True))
    for compiled in ([False, True] if cuda else [False]):
        base = None
        for name, backend, masked in arms:
            if name == 'doc-flex' and not compiled: continue  # uncompiled FlexAttention is a slow reference, not a kernel
            torch.manual_seed(0); torch._dynamo.reset()
            cfg = get_config('smoke', dict(shape, attn_backend=backend))
            model = GPT(cfg.model).to(dev)
            fwd = torch.compile(model) if compiled else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
            g = torch.Generator().manual_seed(0)
            ctx = torch.autocast('cuda', torch.bfloat16) if cuda else torch.autocast('cpu', enabled=False)
            def step():
                xy = packed_batch(B, shape['block_size'], shape['vocab_size'], a.doc_len, 0, g, dev)
                x, y = xy[:, :-1], xy[:, 1:]
                kw = dict(mask=doc_mask(x, 0, backend)) if masked else {}
                with ctx: loss = fwd(x, y, **kw)
                loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
                return loss
            for _ in range(a.warmup): step()
            if cuda: torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps): loss = step()
            if cuda: torch.cuda.synchronize()
            dt = (time.perf_counter() - t0)/a.steps
            graphs = torch._dynamo.utils.counters['stats']['unique_graphs'] if compiled else 0
            base = dt if name == 'causal' else base
            write(dict(part='speed', arm=name, compiled=compiled, device=dev, B=B, T=shape['block_size'],
                       n_layer=shape['n_layer'], n_embd=shape['n_embd'], doc_len=a.doc_len, ms=1000*dt,
                       tok_per_s=B*shape['block_size']/dt, vs_causal=dt/base, graphs=graphs, loss=loss.item(),
                       mem_gb=torch.cuda.max_memory_allocated()/1e9 if cuda else None))
            del model, fwd, opt
            if cuda: torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()


def val_losses(run, root, device):
    "Validation loss of a fine-tuned run's held-out examples: each example alone (masked) and packed without a mask."
    import functools, torch
    from lmbook.train.validation import bits_per_byte, token_byte_lengths
    from lmbook.model.gpt import doc_mask
    from lmbook.runs.load import load_model
    from lmbook.data.sft import sft_val_rows
    lm = load_model(run, root, device)
    x, y = sft_val_rows(lm.config, lm.tokenizer)
    batches = [(x[i:i+8], y[i:i+8]) for i in range(0, len(x), 8)]
    bl, eot = token_byte_lengths(lm.tokenizer), lm.tokenizer.eot_id
    alone = bits_per_byte(lm.model, batches, bl, lm.device, functools.partial(doc_mask, sep_id=eot))
    packed = bits_per_byte(lm.model, batches, bl, lm.device)
    return dict(val_alone=alone['val_loss'], val_packed_nomask=packed['val_loss'], val_tokens=alone['val_tokens'],
                val_rows=len(x))


def loss(a, write):
    import torch
    from lmbook.profiles import get_config
    from lmbook.runs.metrics import read_metrics
    from lmbook.data.sft import builtin_chat, write_jsonl
    from lmbook.train.finetune import finetune
    from lmbook.train.trainer import train
    cuda = torch.cuda.is_available() and not a.tiny
    dev = 'cuda' if cuda else 'cpu'
    root = Path(a.root) if a.root else scratch('doc-mask-')
    quiet = (lambda *x, **k: None) if a.quiet else print
    init = a.init_from
    if not init:
        pre = dict(device=dev, tensorboard=False, max_steps=a.pretrain_steps, ckpt_every=a.pretrain_steps)
        if a.tiny: pre.update(take=2000, vocab_size=512, block_size=128, n_embd=64, n_head=2, batch_size=4, eval_every=20,
                              eval_steps=1, warmup_steps=2)
        t0 = time.time()
        init = str(train(get_config('smoke', pre), 'pre', root=root, log=quiet)['run_dir'])
        write(dict(part='loss', arm='pretrain', seconds=time.time() - t0, steps=a.pretrain_steps, device=dev))
    data = write_jsonl(builtin_chat(), root/'chat.jsonl')
    arms = [('off', dict(doc_mask=False)), ('doc-sdpa', dict(doc_mask=True, attn_backend='sdpa'))]
    if cuda: arms.append(('doc-flex', dict(doc_mask=True, attn_backend='flex')))
    for seed in range(a.seeds):
        for name, ov in arms:
            ov = dict(ov, max_steps=a.ft_steps, device=dev, val_ratio=0.2, eval_every=max(a.ft_steps//4, 1), seed=seed,
                      ckpt_every=a.ft_steps, tensorboard=False, ckpt_async=False)
            t0 = time.time()
            res = finetune(init, data, f'ft-{name}-s{seed}', ov, root=root, log=quiet)
            secs = time.time() - t0
            recs = read_metrics(res['run_dir'])
            tps = [r['tok_per_s'] for r in recs if r.get('tok_per_s')]
            write(dict(part='loss', arm=name, seed=seed, device=dev, steps=res['step'], seconds=secs,
                       logged_val_loss=res['val_loss'], tok_per_s=sorted(tps)[len(tps)//2] if tps else None, init=init,
                       **val_losses(res['run_dir'], root, dev)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path, help='JSON-lines file rows are appended to')
    ap.add_argument('--part', choices=('speed', 'loss', 'all'), default='all')
    ap.add_argument('--tiny', action='store_true', help='toy shapes and steps on the CPU, to check the script end to end')
    ap.add_argument('--batch-size', type=int, default=16, help='speed: rows per step (GPU)')
    ap.add_argument('--doc-len', type=float, default=0, help='speed: mean document length in tokens (default: a quarter row)')
    ap.add_argument('--steps', type=int, default=20, help='speed: timed steps per arm')
    ap.add_argument('--warmup', type=int, default=5, help='speed: untimed steps first (compilation)')
    ap.add_argument('--init-from', default='', help='loss: a pretrained run to fine-tune (default: pretrain smoke here)')
    ap.add_argument('--root', default='', help='loss: workspace for the runs, kept (default: a scratch folder, removed)')
    ap.add_argument('--pretrain-steps', type=int, default=300, help='loss: steps of the smoke pretraining')
    ap.add_argument('--ft-steps', type=int, default=200, help='loss: fine-tuning steps of each arm')
    ap.add_argument('--seeds', type=int, default=2, help='loss: fine-tunes of each arm, seeds 0, 1, ... (init and order)')
    ap.add_argument('--quiet', action='store_true', help="loss: hide the trainer's lines")
    a = ap.parse_args()
    if a.tiny: a.steps, a.warmup, a.pretrain_steps, a.ft_steps, a.seeds = 2, 1, 20, 6, 1
    import torch
    head = dict(torch=torch.__version__, host=platform.node(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, time=time.time())
    def write(r):
        r = dict(head, **r)
        print(json.dumps(r), flush=True)
        with open(a.out, 'a') as f: f.write(json.dumps(r) + '\n')
    if a.part in ('speed', 'all'): speed(a, write)
    if a.part in ('loss', 'all'): loss(a, write)


if __name__ == '__main__': main()
