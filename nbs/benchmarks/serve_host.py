"""The host's time a token of `lmbook serve`, on the CPU: the real server (uvicorn, Starlette, the answers' path) and
the real engine, whose decode step is a stand-in that returns fixed logits at once (the model is a small random
Llama for the prefill). With --gpu-ms the stand-in first sleeps that long with the GIL free, as the host waits
on a GPU's step. Clients run in another process (raw sockets: their CPU is not the server's). For each path
(plain; stop strings; logprobs with top_logprobs 5; half with both, as serve_load.py's mix 0.5) one row: CPU
microseconds a token of the event loop's thread, of the engine's thread and of the whole server process,
and wall milliseconds a step.
--text-share is the share of sampled tokens that are text: the random 7B of serve_load.sh samples from 32,000 ids
of which its tokenizer has 1,672 (0.05); a trained model's tokens are all text (1).
usage: python nbs/benchmarks/serve_host.py [--clients 64] [--requests 2] [--max-tokens 128] [--repeat 1] [--paths plain,stop,logprobs,mix]
                                           [--text-share 0.05] [--gpu-ms 0] [--loop asyncio] [--profile DIR] [--out FILE]"""
import argparse, asyncio, json, math, re, statistics, subprocess, sys, threading, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
KEY = 'sk-host'
PROMPTS = ['What does abs do in Python?', 'Explain what a list is.', 'How do I open a file?', 'What is a dictionary?']
STOPS = ['\n\n\n\n', '</answer>']  # as serve_load.py's requests with extras
WIDTH = 768  # logits a step: the tokenizer's ids, then ids that are no text (a tokenizer smaller than the model)


def body(path:str, k:int, i:int, clients:int, max_tokens:int) -> dict:
    "Request `i` of client `k` on `path`."
    b = dict(model='tiny', messages=[dict(role='user', content=PROMPTS[(k + i) % len(PROMPTS)])],
             max_tokens=max_tokens, temperature=0.8, seed=k*1000 + i, stream=True,
             stream_options=dict(include_usage=True))
    j = k + i*clients
    extra = dict(plain=False, stop=True, logprobs=True, mix=int((j + 1)*0.5) > int(j*0.5))[path]
    if extra and path in ('stop', 'mix'): b['stop'] = STOPS
    if extra and path in ('logprobs', 'mix'): b.update(logprobs=True, top_logprobs=5)
    return b


async def one_client(port:int, k:int, a) -> int:
    "Client `k`: its requests one after another on one connection; the completion tokens they got."
    r, w = await asyncio.open_connection('127.0.0.1', port)
    got = 0
    for i in range(a.requests):
        data = json.dumps(body(a.path, k, i, a.clients, a.max_tokens)).encode()
        w.write(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                b'Authorization: Bearer ' + KEY.encode() + b'\r\nContent-Length: %d\r\n\r\n' % len(data) + data)
        buf = b''
        while not buf.endswith(b'\r\n0\r\n\r\n'):
            part = await r.read(1 << 16)
            if not part: raise SystemExit(f"client {k}: the server closed the connection")
            buf = buf[-4096:] + part
        if b'data: [DONE]' not in buf: raise SystemExit(f"client {k}: no [DONE]: {buf[-300:]!r}")
        got += int(re.findall(rb'"completion_tokens": (\d+)', buf)[-1])
    w.close()
    return got


def clients_main(a):
    "The clients' process: print the tokens all clients got, and the seconds from the first request to the last."
    async def run(): return sum(await asyncio.gather(*[one_client(a.port, k, a) for k in range(a.clients)]))
    t0 = time.perf_counter()
    tokens = asyncio.run(run())
    print(tokens, time.perf_counter() - t0, flush=True)


def stand_in(engine, text_share:float, gpu_ms:float):
    "Replace the engine's decode step by fixed logits over `WIDTH` ids (a share `text_share` of draws text)."
    import torch
    import lmbook.serve.engine as em
    real, n_text = engine.step, engine.s.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(engine.slots), WIDTH, generator=g)*0.5
    if text_share >= 1: logits[:, n_text:] = -float('inf')
    else: logits[:, n_text:] += math.log(n_text/(WIDTH - n_text)*(1 - text_share)/text_share)
    from lmbook.model.generate import stop_ids
    logits[:, stop_ids(engine.s.tokenizer, True)] = -float('inf')  # no answer ends before its max_tokens

    due, back = [0.0], [None]  # when the emulated device finishes the step launched last; when its sync returned
    engine.gaps = []  # ms from a sync's return to the next launch: the host's time between two device steps

    class Late(torch.Tensor):
        "The step's sampled tokens: reading them on the host waits for the device, with the GIL free."
        def tolist(self):
            if (wait := due[0] - time.perf_counter()) > 0: time.sleep(wait)
            with torch._C.DisableTorchFunctionSubclass(): out = super().tolist()  # a plain tensor's cost
            back[0] = time.perf_counter()
            return out

    class Step:
        graphs, dev, sizes, tensor = False, real.dev, real.sizes, real.tensor
        def __call__(self, tok, pos, keys):
            now = time.perf_counter()
            if back[0] is not None and len(tok) == len(engine.slots): engine.gaps.append((now - back[0])*1e3)
            back[0], due[0] = None, now + gpu_ms/1000  # launched: the device is busy until then
            return logits[:len(tok)]
    engine.step = Step()
    sample = em.sample_rows
    em.sample_rows = lambda *a, **k: sample(*a, **k).as_subclass(Late)  # every host sync reads these
    return logits


def thread_cpu(t:threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def sampling_ms(logits, scored:bool) -> float:
    "CPU milliseconds of one step's sampling (and scores) over `logits` alone: a GPU's work, not the host's."
    import torch
    from lmbook.serve.decoding import sample_rows, token_logprobs
    B = len(logits)
    t, p, s, at = torch.full((B,), .8), torch.ones(B), torch.zeros(B, 2, dtype=torch.long), torch.arange(B)
    def f():
        nxt = sample_rows(logits, t, p, s, at, False)
        if scored: token_logprobs(logits, nxt, 5)
    f()
    t0 = time.thread_time()
    for _ in range(20): f()
    return (time.thread_time() - t0)/20*1e3


def run_path(port, a, path, threads, engine) -> dict:
    "One path's row: the clients in their own process, the server's threads' CPU time measured around it."
    cpu0, proc0, steps0 = {n: thread_cpu(t) for n, t in threads.items()}, time.process_time(), engine.steps
    engine.gaps.clear()
    cmd = [sys.executable, __file__, '--client', '--port', str(port), '--path', path, '--clients', str(a.clients),
           '--requests', str(a.requests), '--max-tokens', str(a.max_tokens)]
    tokens, wall = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-2:]
    tokens, wall, steps = int(tokens), float(wall), engine.steps - steps0
    cpu = {n: thread_cpu(t) - cpu0[n] for n, t in threads.items()}
    us = lambda x: round(x/tokens*1e6, 1)
    return dict(path=path, clients=a.clients, requests=a.clients*a.requests, tokens=tokens, steps=steps,
                wall_s=round(wall, 2), loop_us_per_token=us(cpu['loop']), engine_us_per_token=us(cpu['engine']),
                process_us_per_token=us(time.process_time() - proc0), engine_ms_per_step=round(cpu['engine']/steps*1e3, 3),
                wall_ms_per_step=round(wall/steps*1e3, 3), full_steps=len(g := sorted(engine.gaps)),
                gap_ms_mean=round(statistics.mean(g), 3) if g else None,
                gap_ms_p50=round(g[len(g)//2], 3) if g else None, gap_ms_p90=round(g[len(g)*9//10], 3) if g else None)


def server_main(a):
    if a.root: sys.path.insert(0, str(a.root))  # another tree's lmbook: a before against an after
    import cProfile, pstats, torch
    from lmbook.dev.fixtures import tiny_llama
    from lmbook.serve.engine import Engine, load_served
    from lmbook.serve.server import bind, http_server, make_app
    sys.path.insert(0, str(HERE))
    from scratch import scratch
    folder = tiny_llama(scratch('serve-host-')/'tiny', vocab=512, layers=1, width=64, context=1024)
    s = load_served(str(folder), 'cpu')
    engine = Engine(s, max_batch=a.clients, context=1024, graphs=False, start=False)
    logits = stand_in(engine, a.text_share, a.gpu_ms)
    prof = {n: cProfile.Profile(time.thread_time) for n in ('loop', 'engine')} if a.profile else {}
    if prof: engine.thread = threading.Thread(target=prof['engine'].runcall, args=(engine._loop,), daemon=True)
    engine.thread.start()
    sock, server = bind('127.0.0.1', 0), http_server(make_app(engine, KEY))
    server.config.loop = a.loop
    run = (lambda: prof['loop'].runcall(server.run, sockets=[sock])) if prof else (lambda: server.run(sockets=[sock]))
    loop = threading.Thread(target=run, daemon=True)
    loop.start()
    port, threads = sock.getsockname()[1], dict(loop=loop, engine=engine.thread)
    while not server.started: time.sleep(0.05)
    run_path(port, argparse.Namespace(**{**vars(a), 'requests': 1}), 'mix', threads, engine)  # warm-up
    rows = []
    for rep, path in [(k, p) for k in range(a.repeat) for p in a.paths]:  # the paths interleaved
        r = dict(run_path(port, a, path, threads, engine), rep=rep)
        r['sampling_cpu_ms_per_step'] = round(sampling_ms(logits, path != 'plain' and path != 'stop'), 3)
        r.update(code=str(a.root or 'this tree'), text_share=a.text_share, gpu_ms=a.gpu_ms, loop=a.loop, max_tokens=a.max_tokens, device='cpu',
                 torch=torch.__version__, python=sys.version.split()[0], date=time.strftime('%Y-%m-%d'))
        rows.append(r)
        print(json.dumps(r), flush=True)
        if a.out:
            with open(a.out, 'a') as f: f.write(json.dumps(r) + '\n')
    keys = ('loop_us_per_token', 'engine_us_per_token', 'process_us_per_token', 'wall_ms_per_step', 'gap_ms_mean',
            'gap_ms_p50')
    print('medians of', a.repeat, '|', 'path', *keys, file=sys.stderr)
    for path in a.paths:
        print(path, *[statistics.median(r[k] for r in rows if r['path'] == path) for k in keys], file=sys.stderr)
    server.should_exit = True
    loop.join(30)
    engine.stop(wait=True)
    if prof:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        for n, p in prof.items():
            with open(Path(a.profile)/f'{n}.txt', 'w') as f:
                pstats.Stats(p, stream=f).sort_stats('tottime').print_stats(30)
    return rows


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--clients', type=int, default=64); ap.add_argument('--requests', type=int, default=2)
    ap.add_argument('--max-tokens', type=int, default=128)
    ap.add_argument('--repeat', type=int, default=1, help='rows per path, the paths interleaved')
    ap.add_argument('--paths', type=lambda s: s.split(','), default=['plain', 'stop', 'logprobs', 'mix'])
    ap.add_argument('--text-share', type=float, default=0.05); ap.add_argument('--gpu-ms', type=float, default=0)
    ap.add_argument('--loop', default='asyncio', help="uvicorn's event loop: asyncio (as serve_load.sh's GPU machine), uvloop")
    ap.add_argument('--profile', default=None, help='write each thread\'s cProfile top 30 into this folder')
    ap.add_argument('--out', type=Path)
    ap.add_argument('--root', type=Path, help='measure the lmbook package under this folder (default: this tree)')
    ap.add_argument('--client', action='store_true', help=argparse.SUPPRESS)
    ap.add_argument('--port', type=int, help=argparse.SUPPRESS); ap.add_argument('--path', help=argparse.SUPPRESS)
    a = ap.parse_args()
    clients_main(a) if a.client else server_main(a)
