"""Where one stream's time goes in `lmbook serve`'s engine: each phase of a request timed on its own.

The engine is driven by hand, one request at a time, with a device sync after each phase: tokenizing the chat
prompt, queueing it, seating it in a row, the prefill forward, the first decode step, and the rest of its decode
steps (a mean per token). Eight short chat prompts (6 to 12 tokens) of four distinct lengths, each length twice,
show what a new prompt length costs against one seen before. Then the captured decode step alone: the mean GPU
time of one replay at a few sizes (`replay_ms`, rows x keys; empty where the step is eager). `--profile` adds one
more prefill under `torch.profiler`: CPU time against GPU time and the kernels it launches.

GPU (a random model of Llama-2-7B's shape in bf16, made on the spot, about 30 s), from the repo root:
    python3 nbs/benchmarks/serve_phases.py --out X.json [--profile]
CPU, to check that the script works (a 2-layer model): python3 nbs/benchmarks/serve_phases.py --tiny --out X.json
The model's folder is a scratch folder, removed when the script ends (see scratch.py). --out gets one JSON object:
the setup seconds and one row per request.
"""
import argparse, json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

PROMPTS = ['What does abs do in Python?', 'Explain what a list is.', 'How do I open a file?', 'What is a dictionary?']


def timed_request(engine, tokenizer, text:str, ctx:int, seed:int, sync) -> dict:
    "One chat request through the engine's phases, each timed after a sync."
    from lmbook.serve.engine import Job
    from lmbook.serve.contract import prompt_ids
    tt = time.perf_counter()
    ids = prompt_ids(tokenizer, text, ctx); t0 = time.perf_counter()
    engine.submit(Job(ids, max_tokens=128, temperature=0.8, seed=seed)); t1 = time.perf_counter()
    engine._admit(); t2 = time.perf_counter()
    engine._prefill(); sync(); t3 = time.perf_counter()
    engine._decode(); sync(); t4 = time.perf_counter()
    n = 1
    while any(engine.slots):
        engine._decode()
        n += 1
    sync(); t5 = time.perf_counter()
    ms = lambda a, b: round((b - a)*1e3, 2)
    return dict(prompt=len(ids), tok_ms=ms(tt, t0), submit_ms=ms(t0, t1), admit_ms=ms(t1, t2), prefill_ms=ms(t2, t3),
                first_decode_ms=ms(t3, t4), rest_ms_per_tok=round((t5 - t4)*1e3/max(n - 1, 1), 2), tokens=n)


def replay_ms(engine, sizes=((1, 128), (1, 256), (8, 256), (32, 256), (64, 256)), n:int=50) -> dict:
    "Mean GPU milliseconds of one replay of the captured decode step, by 'rows x keys' ({} where eager)."
    import torch
    out = {}
    for key in sizes:
        g = engine.step.captured.get(key) if engine.step.graphs else None
        if g is None: continue
        for _ in range(5): g.graph.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record()
        for _ in range(n): g.graph.replay()
        b.record(); b.synchronize()
        out[f'{key[0]}x{key[1]}'] = round(a.elapsed_time(b)/n, 3)
    return out


def profiled_prefill(engine, tokenizer, sync) -> str:
    "One prefill under torch.profiler: its table, heaviest CPU time first."
    from torch.profiler import profile, ProfilerActivity
    from lmbook.serve.engine import Job
    from lmbook.serve.contract import prompt_ids
    engine.submit(Job(prompt_ids(tokenizer, PROMPTS[-1], 1024), max_tokens=2, seed=1))
    engine._admit()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        engine._prefill()
        sync()
    return p.key_averages().table(sort_by='cpu_time_total', row_limit=18)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--tiny', action='store_true', help='a 2-layer model on the CPU: a check of the script')
    ap.add_argument('--profile', action='store_true', help='print one prefill under torch.profiler')
    ap.add_argument('--out', type=Path, help='write the JSON result here')
    a = ap.parse_args(argv)
    import torch
    from qlora_7b import make_model, SHAPE_7B, SHAPE_TINY
    from lmbook.serve.engine import load_served, Engine
    dev = 'cpu' if a.tiny or not torch.cuda.is_available() else 'cuda'
    sync = torch.cuda.synchronize if dev == 'cuda' else (lambda: None)
    t = time.time(); folder = make_model(scratch('serve-phases-')/'m', SHAPE_TINY if a.tiny else SHAPE_7B, dev)
    res = dict(make_s=round(time.time() - t, 1))
    t = time.time(); served = load_served(str(folder), dev); res['load_s'] = round(time.time() - t, 1)
    ctx = 256 if a.tiny else 1024
    t = time.time(); engine = Engine(served, max_batch=64, context=ctx, start=False)
    res['engine_ready_s'] = round(time.time() - t, 1)
    res['requests'] = [timed_request(engine, served.tokenizer, text, ctx, k, sync) for k, text in enumerate(PROMPTS*2)]
    res['replay_ms'] = replay_ms(engine)  # the decode step alone, on the GPU
    res.update(device=torch.cuda.get_device_name() if dev == 'cuda' else 'cpu', torch=torch.__version__,
               date=time.strftime('%Y-%m-%d'))
    print(json.dumps(res, indent=1), flush=True)
    if a.profile: print(profiled_prefill(engine, served.tokenizer, sync))
    if a.out: a.out.write_text(json.dumps(res) + '\n')
    return res


if __name__ == '__main__':
    main()
