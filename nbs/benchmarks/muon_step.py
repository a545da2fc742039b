"""The optimizer step alone at a profile's shapes (default runpod_1b): Muon as lmbook runs it now (momentum for all
matrices at once, same-shape matrices orthogonalised together in bf16, each process a share, then gathered), Muon
as it ran before (a matrix's momentum at a time, stacks of 8 orthogonalised on every process), and fused AdamW,
in one process and under torchrun, on the same gradients.

Each process holds the whole model (as DDP does: the same gradients on every rank, here random and the same
seed everywhere) and times `optimizer.step()` over --steps steps after --warmup, synchronised; the row is rank 0's
median milliseconds a step. With several processes the new Muon splits the orthogonalisation between them; the
old one and AdamW do all of it on every process.

GPU, from the repo root: one GPU (about 1 minute), then four of one host:
    PYTHONPATH=$PWD python3 nbs/benchmarks/muon_step.py --out $OUT/muon_step_1.json
    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD torchrun --standalone --nproc_per_node 4 nbs/benchmarks/muon_step.py \\
        --out $OUT/muon_step_4.json
CPU, to check the script itself: PYTHONPATH=$PWD python3 nbs/benchmarks/muon_step.py --profile smoke --steps 2
"""
import argparse, json, os, statistics, time
import torch
import torch.distributed as dist
from lmbook.profiles import get_config
from lmbook.model.gpt import GPT
from lmbook.train.optim import Muon, make_optimizer, muon_groups, orthogonalize


class MuonBefore(Muon):
    "Muon's step as it was before: each matrix's momentum on its own, same-shape stacks of 8, every process all."
    def _muon(self, ps, g, lr, stack:int=8):
        by_shape = {}
        for p in ps:
            st = self.state[p]
            if not st: st['momentum_buffer'] = torch.zeros_like(p)
            buf = st['momentum_buffer']
            buf.lerp_(p.grad, 1 - g['momentum'])
            upd = p.grad.lerp(buf, g['momentum']) if g['nesterov'] else buf
            by_shape.setdefault(tuple(upd.shape), []).append((p, upd))
        for (rows, cols), items in by_shape.items():
            for i in range(0, len(items), stack):
                chunk = items[i:i + stack]
                O = orthogonalize(torch.stack([f for _, f in chunk]), g['ns_steps'])*max(1.0, rows/cols)**0.5
                for (p, _), o in zip(chunk, O): p.add_(o.to(p.dtype), alpha=-lr)


def time_step(opt, params, steps:int, warmup:int, dev) -> float:
    "Median milliseconds of `opt.step()` over `steps` steps after `warmup`."
    out = []
    for i in range(warmup + steps):
        for p in params: p.grad = torch.randn_like(p) if i == 0 else p.grad
        sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= warmup: out.append(1000*(time.perf_counter() - t0))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_1b')
    ap.add_argument('--steps', type=int, default=10)
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--optimizers', default='muon-now,muon-before,adamw-fused,muon-now')
    ap.add_argument('--out')
    a = ap.parse_args()
    if 'RANK' in os.environ:
        dist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo')
        torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) if torch.cuda.is_available() else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dev = torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else torch.device('cpu')
    cfg = get_config(a.profile, dict(optimizer='muon'))
    rows = []
    for name in a.optimizers.split(','):
        torch.manual_seed(0)
        with dev: model = GPT(cfg.model)
        params = [p for p in model.parameters() if p.requires_grad]
        if name == 'adamw-fused': opt = make_optimizer(model, get_config(a.profile).train.optim, dev.type)
        else:
            oc = cfg.train.optim
            opt = (Muon if name == 'muon-now' else MuonBefore)(muon_groups(model, oc), lr=oc.lr,
                                                                betas=(oc.beta1, oc.beta2), momentum=oc.muon_momentum)
        ms = time_step(opt, params, a.steps, a.warmup, dev)
        rows.append(dict(optimizer=name, ms_per_step=round(ms, 1)))
        del model, opt, params
        if dev.type == 'cuda': torch.cuda.empty_cache()
    res = dict(profile=a.profile, processes=world, rows=rows, torch=torch.__version__,
               card=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu', date=time.strftime('%Y-%m-%d'))
    if rank == 0:
        print(json.dumps(res, indent=1))
        if a.out: open(a.out, 'w').write(json.dumps(res, indent=1) + '\n')
    if dist.is_initialized(): dist.destroy_process_group()


if __name__ == '__main__': main()
