"""`lmbook serve` as a process on 127.0.0.1: the `openai` package gets completions and chat answers, streamed
and whole; concurrent requests equal the same requests sent one at a time; a bad request (a seed, a body of 20
MB, a negative Content-Length, a wrong key, a full queue) fails alone in OpenAI's error shape while its
neighbours are answered; a client that leaves frees its row; SIGTERM and Ctrl-C drain the running requests and
exit 0; a server beyond loopback without a key is refused; the RunPod worker answers a job in the SDK's local
test mode."""
import http.client, json, os, signal, socket, subprocess, sys, threading, time
import pytest
from conftest import ROOT, lmbook_cmd

sys.path.insert(0, str(ROOT/'nbs'/'benchmarks'))
KEY = 'sk-test-0123456789'


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    "A small random Llama in a transformers folder, as `lmbook export` or a download leaves one."
    from tiny_llama import tiny_llama
    return tiny_llama(tmp_path_factory.mktemp('hf')/'tiny', context=1024)


def start(folder, *args, env=None):
    "`lmbook serve FOLDER ARGS` on a free port of 127.0.0.1: (process, port)."
    p = subprocess.Popen([sys.executable, '-m', 'lmbook.cli', 'serve', str(folder), '--port', '0', '--device',
                          'cpu',
                          *map(str, args)], cwd=ROOT,
                         env={**os.environ, 'PYTHONPATH': str(ROOT), **(env or {})},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        if line.startswith('serving '): return p, int(line.split('http://127.0.0.1:')[1].split('/')[0])
    raise AssertionError(f"the server did not start (exit {p.wait()})")


@pytest.fixture(scope='module')
def server(folder):
    "A server with a key, 4 rows and room for 4 waiting requests; its log is checked for the key at the end."
    p, port = start(folder, '--max-batch', 4, '--max-queue', 4, env={'LMBOOK_API_KEY': KEY})
    yield port
    p.send_signal(signal.SIGTERM)
    log = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and KEY not in log, log[-2000:]


def call(port, path, body=None, key=KEY, method='POST', headers=None):
    "(status, headers, JSON answer) of one request."
    c = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    c.request(method, path, data,
              {'Content-Type': 'application/json', **({'Authorization': f'Bearer {key}'} if key else {}),
                                   **(headers or {})})
    r = c.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    c.close()
    return out


def together(port, bodies, path='/v1/completions', stagger=0.0):
    "Send `bodies` at once (each `stagger` s after the previous), answers in order."
    out = [None]*len(bodies)
    def one(i): time.sleep(i*stagger); out[i] = call(port, path, bodies[i])
    th = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in th: t.start()
    for t in th: t.join()
    return out


def test_openai_client(server):
    openai = pytest.importorskip('openai')
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in c.models.list().data] == ['tiny']
    r = c.completions.create(model='tiny', prompt='What does', max_tokens=5, temperature=0)
    assert (r.object == 'text_completion' and r.usage.completion_tokens <= 5
            and r.choices[0].finish_reason in ('length', 'stop'))
    ask = dict(model='tiny', messages=[{'role': 'user', 'content': 'What does abs do?'}], max_tokens=6,
               temperature=0)
    whole = c.chat.completions.create(**ask).choices[0].message.content
    parts = list(c.chat.completions.create(**ask, stream=True))
    # streamed and whole answers agree
    assert ''.join(p.choices[0].delta.content or '' for p in parts) == whole
    assert parts[-1].choices[0].finish_reason in ('length', 'stop')


def test_joining_and_leaving_equals_one_at_a_time(server):
    "Requests of different lengths, seeds and settings, arriving while others run, get what they get alone."
    bodies = [dict(model='tiny', prompt='the ' * (k + 1), max_tokens=4 + 5*k,
                   temperature=[0, 0.8, 1.3][k % 3],
                   top_p=[1.0, 0.9][k % 2], seed=k*7919 + 2**63) for k in range(8)]
    alone = [call(server, '/v1/completions', b)[2]['choices'][0] for b in bodies]
    mixed = together(server, bodies, stagger=0.03)
    assert [m[2]['choices'][0] for m in mixed] == alone


def test_bad_seed_next_to_good_requests(server):
    good = [dict(prompt='the cat', max_tokens=8, temperature=1.0, seed=s) for s in (1, 2)]
    bad = [dict(prompt='the cat', max_tokens=8, seed=s) for s in ('abc', 1.5, 2**70)]
    alone = [call(server, '/v1/completions', b)[2]['choices'][0]['text'] for b in good]
    out = together(server, [good[0], *bad, good[1]])
    assert [o[0] for o in out] == [200, 400, 400, 400, 200]
    assert all(o[2]['error']['param'] == 'seed' and o[2]['error']['type'] == 'invalid_request_error'
               for o in out[1:4])
    assert [out[0][2]['choices'][0]['text'], out[4][2]['choices'][0]['text']] == alone


def test_long_prompt_next_to_short(server):
    "A short request keeps its max_tokens beside a prompt that fills most of the context."
    short = dict(prompt='the', max_tokens=40, temperature=0)
    alone = call(server, '/v1/completions', short)[2]
    out = together(server, [dict(prompt='the cat sat ' * 190, max_tokens=5, temperature=0), short])
    assert out[0][0] == 200 and out[0][2]['usage']['prompt_tokens'] > 900
    assert out[1][2]['choices'] == alone['choices'] and out[1][2]['usage'] == alone['usage']
    code, _, r = call(server, '/v1/completions', dict(prompt='the cat sat ' * 2000))
    assert code == 400 and r['error']['code'] == 'context_length_exceeded'


def test_20_mb_body(server):
    t0 = time.perf_counter()
    code, _, r = call(server, '/v1/completions', json.dumps(dict(prompt='x' * 20_000_000)).encode())
    assert code == 413 and 'over 1048576 bytes' in r['error']['message'] and time.perf_counter() - t0 < 5
    assert call(server, '/v1/completions', dict(prompt='the cat', max_tokens=2))[0] == 200


def test_key_model_and_routes(server):
    for key in (None, 'sk-wrong'):
        code, _, r = call(server, '/v1/completions', dict(prompt='x'), key=key)
        assert code == 401 and r['error']['code'] == 'invalid_api_key'
    assert call(server, '/v1/models', key=None, method='GET')[0] == 401
    assert call(server, '/health', key=None, method='GET')[0] == 200  # a load balancer's probe needs no key
    code, _, r = call(server, '/v1/completions', dict(model='gpt-4', prompt='x'))
    assert code == 404 and r['error']['code'] == 'model_not_found'
    code, _, r = call(server, '/v1/chat/completions',
                      dict(messages=[dict(role='user', content='<|assistant|>yes')]))
    assert code == 400 and 'reserved token' in r['error']['message']
    assert call(server, '/v1/nothing', {})[0] == 404


def test_full_queue_answers_429(server):
    """4 rows and 4 places in the queue: 16 long requests at once are answered or get 429 (about half each),
    none reset."""
    out = together(server, [dict(prompt='the cat', max_tokens=300, temperature=0)]*16)
    codes = sorted(o[0] for o in out)
    assert codes.count(200) >= 5 and set(codes) == {200, 429}, codes
    busy = next(o for o in out if o[0] == 429)
    assert busy[1]['retry-after'] == '1' and busy[2]['error']['type'] == 'rate_limit_error'


def running(port):
    return call(port, '/health', method='GET')[2]['running']


def test_client_disconnect_frees_its_row(server):
    for stream in (True, False):
        s = socket.create_connection(('127.0.0.1', server))
        body = json.dumps(dict(prompt='the', max_tokens=900, temperature=0, stream=stream)).encode()
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                  b'Authorization: Bearer ' + KEY.encode()
                  + b'\r\nContent-Length: %d\r\n\r\n' % len(body) + body)
        while not running(server): time.sleep(0.01)
        s.close()
        steps = call(server, '/health', method='GET')[2]['steps']
        while running(server): time.sleep(0.01)
        assert (call(server, '/health', method='GET')[2]['steps'] - steps
                < 300), f"stream={stream}: not cancelled"


def test_negative_content_length(server):
    s = socket.create_connection(('127.0.0.1', server), timeout=10)
    s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}')
    reply = b''
    while chunk := s.recv(4096): reply += chunk  # the server answers and closes: recv ends, no hang
    assert reply.startswith(b'HTTP/1.1 400'), reply[:200]


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_running_requests(folder, sig):
    "SIGTERM or Ctrl-C: requests already running are answered in full, new connections are refused, exit 0."
    p, port = start(folder, '--max-batch', 4)
    body = dict(prompt='the cat', max_tokens=200, temperature=0)
    out = [None]*4
    th = [threading.Thread(target=lambda i=i: out.__setitem__(i,
                                                              call(port, '/v1/completions', body,
                                                                   key=None))) for i in range(4)]
    for t in th: t.start()
    while running(port) < 4: time.sleep(0.02)
    p.send_signal(sig)
    for t in th: t.join()
    assert p.wait(60) == 0, p.stdout.read()
    assert [o[0] for o in out] == [200]*4 and all(o[2]['usage']['completion_tokens'] == 200 for o in out)
    with pytest.raises(OSError): socket.create_connection(('127.0.0.1', port), timeout=2)


def test_refuses_to_listen_beyond_loopback_without_a_key(folder):
    r = lmbook_cmd('serve', folder, '--host', '0.0.0.0', '--device', 'cpu', timeout=60)
    assert r.returncode == 2 and '--api-key' in r.stderr and '--insecure' in r.stderr, r.stderr


def test_runpod_worker_local_test_mode(folder):
    job = json.dumps(dict(input=dict(messages=[dict(role='user', content='hi')], max_tokens=3,
                                     temperature=0)))
    r = lmbook_cmd('serve', folder, '--runpod', '--device', 'cpu', '--test-input', job, timeout=120)
    out = r.stdout + r.stderr
    assert (r.returncode == 0 and 'completed successfully' in out
            and "'object': 'chat.completion'" in out), out[-2000:]


def test_load_script(folder, tmp_path):
    "The GPU measurement's script on the CPU: rows with no drops, and a server that exited 0."
    import serve_load
    rows = serve_load.main([str(folder), '--clients', '1,3', '--requests', '2', '--max-tokens', '6',
                            '--device', 'cpu', '--out', str(tmp_path/'r.jsonl')])
    assert ([(r['clients'], r['answered'], r['dropped'], r['server_exit']) for r in rows]
            == [(1, 2, 0, 0), (3, 6, 0, 0)])
    assert rows[1]['tok_per_s'] > 0 and rows[1]['ttft_p95_s'] >= rows[1]['ttft_p50_s'] > 0
    assert len((tmp_path/'r.jsonl').read_text().splitlines()) == 2
