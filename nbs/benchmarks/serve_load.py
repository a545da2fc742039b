"""Load test of `lmbook serve`, and transformers' `generate` on the same model for comparison.
`lmbook serve SOURCE` runs as its own process on 127.0.0.1; N clients each send streamed chat requests one after
another (a fixed number each, or for a fixed time). One JSON row per client count: tok/s over all clients, p50/p95
time to first token, time per output token, p50/p95 latency, and the requests dropped (a connection reset or
refused, a timeout), refused with 429 (then retried after Retry-After), or failed with another status.
With --mix 0,0.5 each client count is measured twice on the same server: plain requests, then with stop sequences
and log-probabilities (logprobs, top_logprobs 5) in half of them; a row counts the log-probability entries that came.
usage: python nbs/benchmarks/serve_load.py SOURCE [--clients 1,8,32] [--requests 4 | --duration 60] [--max-tokens 128]
                                           [--mix 0,0.5] [--max-batch 64] [--context 1024] [--no-graphs] [--device auto]
                                           [--out FILE]
       python nbs/benchmarks/serve_load.py SOURCE --hf-generate 1,32 [--max-tokens 128]   (transformers' generate)
       python nbs/benchmarks/serve_load.py --tiny ...   (a small random Llama made on the spot: the CPU check)
With --tiny the model's folder is a scratch folder, removed when the script ends (see scratch.py)."""
import argparse, http.client, json, os, signal, statistics, subprocess, sys, threading, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ['What does abs do in Python?', 'Explain what a list is.', 'How do I open a file?', 'What is a dictionary?']
KEY = 'sk-load-test'
STOPS = ['\n\n\n\n', '</answer>']  # stop sequences a request with extras carries: matched in every answer, rarely hit


def start_server(source:str, a) -> tuple[subprocess.Popen, int]:
    "`lmbook serve SOURCE` on a free port: (process, port)."
    args = ['--max-batch', a.max_batch, '--max-queue', a.max_queue, '--device', a.device] + (['--context', a.context] if a.context else [])
    p = subprocess.Popen([sys.executable, '-m', 'lmbook.cli', 'serve', source, '--port', '0', *map(str, args)]
                         + ['--no-graphs']*a.no_graphs, cwd=ROOT, env={**os.environ, 'LMBOOK_API_KEY': KEY},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        print(line.rstrip(), file=sys.stderr)
        if line.startswith('serving '):
            threading.Thread(target=lambda: [print(l.rstrip(), file=sys.stderr) for l in p.stdout], daemon=True).start()
            return p, int(line.split('http://127.0.0.1:')[1].split('/')[0])
    raise SystemExit(f"the server did not start (exit {p.wait()})")


def ask(port:int, body:dict) -> dict:
    "One streamed request: {'ttft', 'latency', 'tokens'}, or {'status'} when refused, or {'dropped'}."
    c = http.client.HTTPConnection('127.0.0.1', port, timeout=600)
    t0 = time.perf_counter()
    try:
        c.request('POST', '/v1/chat/completions', json.dumps(body), {'Content-Type': 'application/json',
                                                                       'Authorization': f'Bearer {KEY}'})
        r = c.getresponse()
        if r.status != 200: return dict(status=r.status, retry=float(r.getheader('Retry-After') or 0), body=r.read())
        first, tokens, entries = None, 0, 0
        for line in r:
            if not line.startswith(b'data: {'): continue
            d = json.loads(line[6:])
            if first is None and d['choices'] and d['choices'][0]['delta'].get('content'): first = time.perf_counter()
            if d['choices'] and d['choices'][0].get('logprobs'): entries += len(d['choices'][0]['logprobs']['content'])
            if d.get('usage'): tokens = d['usage']['completion_tokens']
        t1 = time.perf_counter()
        return dict(ttft=(first or t1) - t0, latency=t1 - t0, tokens=tokens, entries=entries,
                    extras='logprobs' in body)
    except (OSError, http.client.HTTPException) as e: return dict(dropped=f"{type(e).__name__}: {e}")
    finally: c.close()


def extras(j:int, mix:float) -> bool:
    "Whether request `j` of a run carries stop sequences and log-probabilities: a `mix` share, spread evenly."
    return int((j + 1)*mix) > int(j*mix)


def client(port:int, k:int, a, until:float, out:list):
    "Send requests one after another: `a.requests` of them, or until `until`; a 429 waits and tries again."
    i = 0
    while (i < a.requests) if not a.duration else time.perf_counter() < until:
        body = dict(model=a.name, messages=[dict(role='user', content=PROMPTS[(k + i) % len(PROMPTS)])],
                    max_tokens=a.max_tokens, temperature=0.8, seed=k*1000 + i, stream=True,
                    stream_options=dict(include_usage=True))
        if extras(k + i*a.clients_now, a.mix_now): body.update(stop=STOPS, logprobs=True, top_logprobs=5)
        r = ask(port, body)
        out.append(r)
        if r.get('status') == 429: time.sleep(r['retry'] or 1); continue
        i += 1


def figures(res:list, wall:float) -> dict:
    "The row's figures from every request's result."
    ok = [r for r in res if 'tokens' in r]
    q = lambda xs, p: round(statistics.quantiles(xs, n=100)[p - 1], 3) if len(xs) > 1 else round(xs[0], 3) if xs else None
    ttft, lat = [r['ttft'] for r in ok], [r['latency'] for r in ok]
    tpot = [(r['latency'] - r['ttft'])/(r['tokens'] - 1)*1000 for r in ok if r['tokens'] > 1]
    toks = sum(r['tokens'] for r in ok)
    lp = [r for r in ok if r['extras']]
    return dict(answered=len(ok), with_extras=len(lp), logprob_entries=sum(r['entries'] for r in lp),
                dropped=sum('dropped' in r for r in res), refused_429=sum(r.get('status') == 429 for r in res),
                failed=sum(r.get('status') not in (None, 429) for r in res), tokens=toks, wall_s=round(wall, 2),
                tok_per_s=round(toks/wall, 1), ttft_p50_s=q(ttft, 50), ttft_p95_s=q(ttft, 95),
                tpot_p50_ms=q(tpot, 50), latency_p50_s=q(lat, 50), latency_p95_s=q(lat, 95),
                drops=sorted({r['dropped'] for r in res if 'dropped' in r})[:3])


def run_clients(port:int, clients:int, a, mix:float=0.0) -> dict:
    "`clients` concurrent clients against the server on `port`, a `mix` share of requests with extras: the figures."
    res, t0, a.clients_now, a.mix_now = [], time.perf_counter(), clients, mix
    th = [threading.Thread(target=client, args=(port, k, a, t0 + a.duration, res)) for k in range(clients)]
    for t in th: t.start()
    for t in th: t.join()
    return figures(res, time.perf_counter() - t0)


def serve_rows(source:str, a) -> list[dict]:
    "One row per client count, all against one server (warmed up first at the largest count)."
    p, port = start_server(source, a)
    a.name = json.loads(http_get(port, '/v1/models'))['data'][0]['id']
    rows = []
    try:
        warm = argparse.Namespace(**{**vars(a), 'requests': 1, 'duration': 0})
        run_clients(port, max(a.clients), warm, max(a.mix))  # every batch size and path to come, run once
        for mix in a.mix:
            for c in a.clients:
                rows.append(dict(kind='lmbook serve', clients=c, mix=mix, **run_clients(port, c, a, mix),
                                 max_tokens=a.max_tokens, max_batch=a.max_batch, context=a.context,
                                 graphs=not a.no_graphs))
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        p.send_signal(signal.SIGTERM)
        code = p.wait(120)
    for r in rows: r['server_exit'] = code
    return rows


def http_get(port:int, path:str) -> bytes:
    c = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
    c.request('GET', path, headers={'Authorization': f'Bearer {KEY}'})
    return c.getresponse().read()


def hf_rows(source:str, a) -> list[dict]:
    "transformers' own `generate` on the same folder: greedy, `max_tokens` new tokens for each row of a batch."
    import torch
    from transformers import AutoModelForCausalLM
    dev = 'cuda' if a.device == 'auto' and torch.cuda.is_available() else 'cpu' if a.device == 'auto' else a.device
    dt = torch.bfloat16 if dev.startswith('cuda') else torch.float32
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dt).to(dev).eval()
    rows = []
    for b in a.hf_generate:
        ids = torch.randint(100, model.config.vocab_size, (b, 24), device=dev, generator=None)
        gen = lambda n: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                       do_sample=False, pad_token_id=0)
        gen(8)  # warm-up
        if dev.startswith('cuda'): torch.cuda.synchronize()
        t0 = time.perf_counter(); out = gen(a.max_tokens)
        if dev.startswith('cuda'): torch.cuda.synchronize()
        dt_s = time.perf_counter() - t0
        toks = (out.shape[1] - ids.shape[1])*b
        rows.append(dict(kind='transformers generate', batch=b, tokens=toks, wall_s=round(dt_s, 2),
                         tok_per_s=round(toks/dt_s, 1), tpot_p50_ms=round(dt_s/(out.shape[1] - ids.shape[1])*1000, 2),
                         max_tokens=a.max_tokens, transformers=__import__('transformers').__version__))
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('source', nargs='?'); ap.add_argument('--tiny', action='store_true')
    ints = lambda s: [int(x) for x in s.split(',')]
    ap.add_argument('--clients', type=ints, default=[8]); ap.add_argument('--requests', type=int, default=4, help='per client')
    ap.add_argument('--duration', type=float, default=0, help='seconds each client keeps sending (instead of --requests)')
    ap.add_argument('--max-tokens', type=int, default=64); ap.add_argument('--max-batch', type=int, default=64)
    ap.add_argument('--mix', type=lambda s: [float(x) for x in s.split(',')], default=[0.0],
                    help='shares of requests with stop sequences and log-probabilities, a row set each (e.g. 0,0.5)')
    ap.add_argument('--max-queue', type=int, default=256); ap.add_argument('--context', type=int, default=None)
    ap.add_argument('--no-graphs', action='store_true'); ap.add_argument('--device', default='auto')
    ap.add_argument('--hf-generate', type=ints, default=None, metavar='BATCHES', help="transformers' generate instead")
    ap.add_argument('--out', type=Path, help='append the rows here (JSON lines)')
    a = ap.parse_args(argv)
    if a.tiny:
        sys.path.insert(0, str(Path(__file__).parent))
        from tiny_llama import tiny_llama
        from scratch import scratch
        a.source = str(tiny_llama(scratch('serve-load-')/'tiny', width=128, layers=4, context=512))
    if not a.source: ap.error('give SOURCE or --tiny')
    rows = hf_rows(a.source, a) if a.hf_generate else serve_rows(a.source, a)
    import torch
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() and a.device != 'cpu' else 'cpu'
    for r in rows:
        if dev == 'cpu' and 'graphs' in r: r['graphs'] = False  # CUDA graphs are for CUDA only
        r.update(source='tiny random Llama (4 layers x 128)' if a.tiny else str(a.source), device=dev,
                 torch=torch.__version__, date=time.strftime('%Y-%m-%d'))
        print(json.dumps(r), flush=True)
        if a.out:
            with open(a.out, 'a') as f: f.write(json.dumps(r) + '\n')
    return rows


if __name__ == '__main__':
    main()
