"Where a training step's GPU time goes, by kernel kind and top kernels: python3 nbs/benchmarks/kernel_profile.py PROFILE NAME=VALUE ..."
import sys, torch
from torch.profiler import profile, ProfilerActivity
from lmbook.profiles import get_config
from lmbook.train.bench import make_step, synthetic_batches

prof_name, sets = sys.argv[1], dict(a.split('=', 1) for a in sys.argv[2:])
cfg = get_config(prof_name, sets)
model, step, _ = make_step(cfg, 'cuda')
b = synthetic_batches(cfg.model.vocab_size, cfg.train.batch_size, cfg.model.block_size, 'cuda')
for _ in range(2): step(b).item()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(2): step(b).item()
    torch.cuda.synchronize()
ev = [e for e in p.key_averages() if e.device_time_total > 0]
tot = sum(e.device_time_total for e in ev)
cats = {}
for e in ev:
    n = e.key.lower()
    c = ('attention' if any(s in n for s in ('flash', 'fmha', 'cudnn', 'attention', 'sdpa')) else
         'gemm' if any(s in n for s in ('gemm', 'sm90', 'cutlass', 'nvjet', 'matmul', 'xmma')) else
         'optimizer' if any(s in n for s in ('adam', 'multi_tensor', 'foreach')) else
         'triton' if 'triton' in n else 'other')
    cats[c] = cats.get(c, 0) + e.device_time_total
print(f"GPU time per step {tot/2/1000:.1f} ms; by kind:", {k: f"{100*v/tot:.1f}%" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])})
for e in sorted(ev, key=lambda e: -e.device_time_total)[:14]:
    print(f"{100*e.device_time_total/tot:5.1f}% {e.device_time_total/2/1000:7.2f} ms x{e.count//2:<4} {e.key[:110]}")
