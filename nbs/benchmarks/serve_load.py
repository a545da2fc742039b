"""Load test of `lmbook serve`: N concurrent clients, each sending requests one after another over real HTTP to a
server on 127.0.0.1; prints and writes p50/p95 latency, tokens/s and how many waves decoded them.
usage: python nbs/benchmarks/serve_load.py SOURCE [--clients 8] [--requests 32] [--max-tokens 64] [--max-batch 8]
                                            [--device auto] [--out FILE.json]
       python nbs/benchmarks/serve_load.py --tiny ...   (a small random Llama made on the spot: the CPU check)
With --tiny the model's folder is a scratch folder, removed when the script ends (see scratch.py)."""
import argparse, json, statistics, sys, threading, time, urllib.request
from pathlib import Path
import torch
from lmbook.serve.server import load_served, make_server

PROMPTS = ['What does abs do in Python?', 'Explain what a list is.', 'How do I open a file?', 'What is a dictionary?']


def client(port:int, n:int, max_tokens:int, out:list, k:int):
    "Send `n` chat requests one after another; append (latency s, completion tokens) of each to `out`."
    for i in range(n):
        body = dict(model='m', messages=[dict(role='user', content=PROMPTS[(k + i) % len(PROMPTS)])], max_tokens=max_tokens,
                    temperature=0.8, seed=k*1000 + i)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {'Content-Type': 'application/json'})
        t0 = time.perf_counter()
        r = json.loads(urllib.request.urlopen(req, timeout=600).read())
        out.append((time.perf_counter() - t0, r['usage']['completion_tokens']))


def load_test(source:str, clients:int=8, requests:int=32, max_tokens:int=64, max_batch:int=8, device:str='auto') -> dict:
    "Serve `source`, run the clients, return the figures."
    s = load_served(source, device)
    srv = make_server(s, port=0, max_batch=max_batch)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    res, per = [], max(1, requests//clients)
    try:
        client(srv.server_port, 1, 4, [], 0)  # warm-up
        waves0, t0 = srv.RequestHandlerClass.engine.waves, time.perf_counter()
        th = [threading.Thread(target=client, args=(srv.server_port, per, max_tokens, res, k)) for k in range(clients)]
        for t in th: t.start()
        for t in th: t.join()
        wall, waves = time.perf_counter() - t0, srv.RequestHandlerClass.engine.waves - waves0
    finally: srv.shutdown(); srv.server_close()
    lat = sorted(r[0] for r in res)
    toks = sum(r[1] for r in res)
    q = statistics.quantiles(lat, n=20) if len(lat) > 1 else lat*19
    dev = torch.cuda.get_device_name() if s.device.startswith('cuda') else 'cpu'
    return dict(source=str(source), device=dev, clients=clients, requests=len(res), max_tokens=max_tokens, max_batch=max_batch,
                p50_s=round(statistics.median(lat), 3), p95_s=round(q[18], 3), tokens=toks, wall_s=round(wall, 2),
                tok_per_s=round(toks/wall, 1), waves=waves, torch=torch.__version__, date=time.strftime('%Y-%m-%d'))


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('source', nargs='?'); ap.add_argument('--tiny', action='store_true')
    ap.add_argument('--clients', type=int, default=8); ap.add_argument('--requests', type=int, default=32)
    ap.add_argument('--max-tokens', type=int, default=64); ap.add_argument('--max-batch', type=int, default=8)
    ap.add_argument('--device', default='auto'); ap.add_argument('--out', type=Path)
    a = ap.parse_args()
    if a.tiny:
        sys.path.insert(0, str(Path(__file__).parent))
        from tiny_llama import tiny_llama
        from scratch import scratch
        a.source = str(tiny_llama(scratch('serve-load-')/'tiny', width=128, layers=4, context=512))
    if not a.source: ap.error('give SOURCE or --tiny')
    r = load_test(a.source, a.clients, a.requests, a.max_tokens, a.max_batch, a.device)
    if a.tiny: r['source'] = 'tiny random Llama (4 layers x 128)'
    print(json.dumps(r))
    if a.out: a.out.write_text(json.dumps(r, indent=1) + '\n')
