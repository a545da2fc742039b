"""`lmbook serve` over real HTTP on 127.0.0.1: the `openai` package gets completions and chat answers, streamed
and whole; concurrent clients are decoded together; bad requests get OpenAI's error shape; the RunPod worker
answers a job in the SDK's local test mode; the load test script reports its figures."""
import json, subprocess, sys, threading, urllib.error, urllib.request
import pytest
from conftest import ROOT, lmbook_cmd

sys.path.insert(0, str(ROOT/'nbs'/'benchmarks'))


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    "A small random Llama in a transformers folder, as `lmbook export` or a download leaves one."
    from tiny_llama import tiny_llama
    return tiny_llama(tmp_path_factory.mktemp('hf')/'tiny')


@pytest.fixture(scope='module')
def server(folder):
    from lmbook.serve.server import load_served, make_server
    srv = make_server(load_served(str(folder), 'cpu'), port=0, max_batch=8)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown(); srv.server_close()


def post(srv, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{srv.server_port}{path}", json.dumps(body).encode(),
                                 {'Content-Type': 'application/json'})
    try: return 200, json.loads(urllib.request.urlopen(req, timeout=60).read())
    except urllib.error.HTTPError as e: return e.code, json.loads(e.read())


def test_openai_client(server):
    openai = pytest.importorskip('openai')
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key='none', max_retries=0)
    assert [m.id for m in c.models.list().data] == ['tiny']
    r = c.completions.create(model='tiny', prompt='What does', max_tokens=5, temperature=0)
    assert r.object == 'text_completion' and r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ('length', 'stop')
    r = c.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'What does abs do?'}], max_tokens=6,
                                  temperature=0)
    whole = r.choices[0].message.content
    assert r.choices[0].message.role == 'assistant' and r.usage.completion_tokens <= 6
    parts = list(c.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'What does abs do?'}],
                                           max_tokens=6, temperature=0, stream=True))
    assert ''.join(p.choices[0].delta.content or '' for p in parts) == whole  # streamed and whole answers agree
    assert parts[-1].choices[0].finish_reason in ('length', 'stop')
    text = ''.join(p.choices[0].text for p in c.completions.create(model='tiny', prompt='What does', max_tokens=5,
                                                                    temperature=0, stream=True))
    assert text == c.completions.create(model='tiny', prompt='What does', max_tokens=5, temperature=0).choices[0].text


def test_concurrent_requests_share_waves(server):
    "Eight clients at once: every one answered, in fewer waves than requests, each as it would be alone."
    engine = server.RequestHandlerClass.engine
    body = lambda k: dict(model='m', prompt='the ' * (k + 1), max_tokens=8, temperature=0)
    alone = [post(server, '/v1/completions', body(k))[1]['choices'][0]['text'] for k in range(8)]
    out, w0 = {}, engine.waves
    th = [threading.Thread(target=lambda k=k: out.__setitem__(k, post(server, '/v1/completions', body(k)))) for k in range(8)]
    for t in th: t.start()
    for t in th: t.join()
    assert [out[k][1]['choices'][0]['text'] for k in range(8)] == alone
    assert engine.waves - w0 < 8


@pytest.mark.parametrize('body, says', [(dict(prompt='x', temperature=5), 'temperature'), (dict(prompt=3), 'prompt'),
                                        (dict(prompt='x', max_tokens=-1), 'max_tokens'), (dict(prompt='x', n=2), 'n must be 1')])
def test_bad_requests(server, body, says):
    code, r = post(server, '/v1/completions', body)
    assert code == 400 and says in r['error']['message'] and r['error']['type'] == 'invalid_request_error'
    assert post(server, '/v1/nothing', {})[0] == 404


def test_runpod_worker_local_test_mode(folder):
    job = json.dumps(dict(input=dict(messages=[dict(role='user', content='hi')], max_tokens=3, temperature=0)))
    r = lmbook_cmd('serve', folder, '--runpod', '--device', 'cpu', '--test-input', job, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and 'completed successfully' in out and "'object': 'chat.completion'" in out, out[-2000:]


def test_load_script(folder, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT/'nbs/benchmarks/serve_load.py'), str(folder), '--clients', '4', '--requests', '8',
                        '--max-tokens', '8', '--device', 'cpu', '--out', tmp_path/'r.json'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path/'r.json').read_text())
    assert res['requests'] == 8 and res['p95_s'] >= res['p50_s'] > 0 and res['tok_per_s'] > 0 and res['waves'] <= 8
