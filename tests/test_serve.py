"""`lmbook serve` as a process on 127.0.0.1, driven by the official `openai` package as a client drives it:
completions and chat, streamed and whole, stop strings (across tokens, in a stream, per request in a batch),
log-probabilities, n, best_of, echo, and every other field of both endpoints honoured or refused by name
(`FIELDS`); its errors (401, 400, 404, 429, 503) read as the client's own exception types; concurrent requests
equal the same requests sent one at a time; a bad request fails alone in OpenAI's error shape while its
neighbours are answered; a client that leaves frees its row; SIGTERM and Ctrl-C drain the running requests and
exit 0, and a grace that runs out ends every unfinished request with its error in its own format; the chat
page answers in a real browser; a server beyond loopback without a key is refused; the RunPod worker answers a
job in the SDK's local test mode."""
import http.client, json, os, shutil, signal, socket, subprocess, sys, threading, time
import pytest
from conftest import ROOT, lmbook_cmd
from lmbook.serve.contract import FIELDS, fields_of

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


@pytest.fixture(scope='module')
def client(server):
    "The official client, against the server, trying each request once."
    openai = pytest.importorskip('openai')
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_client(client):
    c = client
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


# ---------------------------------------------------------------- the OpenAI contract, field by field

def create(c, chat=False, **fields):
    "One request through the official client: a short greedy answer to 'the cat', with `fields` on top."
    base = dict(messages=[dict(role='user', content='the cat')]) if chat else dict(prompt='the cat')
    most = {} if 'max_completion_tokens' in fields else {'max_tokens': 8}
    body = {**base, **most, 'temperature': 0, **fields}
    first = body.pop('messages' if chat else 'prompt')
    kw = dict(stream=True) if body.pop('stream', False) else {}
    make = c.chat.completions.create if chat else c.completions.create
    what = {'messages' if chat else 'prompt': first}
    return make(model=body.pop('model', 'tiny'), **what, **kw, extra_body=body)


def text(r, i=0):
    "A choice's text, of either endpoint."
    ch = r.choices[i]
    return ch.message.content if hasattr(ch, 'message') else ch.text


def error(c, chat=False, **fields):
    "The client's error for a request with `fields`."
    import openai
    with pytest.raises(openai.APIStatusError) as e: create(c, chat, **fields)
    return e.value


def refused(c, chat, field, value, status=400):
    "The client's error for a request with `field` set to `value`: its status, and `param` naming the field."
    e = error(c, chat, **{field: value})
    assert e.status_code == status and e.param == field, (field, e)
    return e


@pytest.fixture(scope='module')
def letter(folder):
    "The id of the token 'a' in the served tokenizer."
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder/'tokenizer.json')).token_to_id('a')


SAME = dict(seed=5, temperature=1.0)  # a seeded sampled answer: what a label must leave as it is
PROBES = {  # (field, chat): what shows the field is honoured, or refused by name
    ('model', 0): lambda c, _: refused(c, 0, 'model', 'gpt-4', 404),
    ('model', 1): lambda c, _: refused(c, 1, 'model', 'gpt-4', 404),
    ('prompt', 0): lambda c, _: len(create(c, prompt=['the cat', [5, 6, 7]], n=2).choices) == 4,
    ('messages', 1): lambda c, _: (create(c, 1, messages=[dict(role='developer', content='be brief'), dict(
        role='user', content=[dict(type='text', text='the cat')])]).choices[0].finish_reason
        and error(c, 1, messages=[dict(role='user', content='x', name='bob')]).param == 'messages[0].name'),
    ('max_tokens', 0): lambda c, _: create(c, max_tokens=3).usage.completion_tokens == 3,
    ('max_tokens', 1): lambda c, _: create(c, 1, max_tokens=3).usage.completion_tokens == 3,
    ('max_completion_tokens', 1): lambda c, _: (create(c, 1, max_completion_tokens=3).usage.completion_tokens
                                                == 3 and error(c, 1, max_tokens=3, max_completion_tokens=3)
                                                .param == 'max_tokens'),
    ('temperature', 0): lambda c, _: (text(create(c, seed=1)) == text(create(c, seed=2))
                                      != text(create(c, seed=1, temperature=2))),
    ('temperature', 1): lambda c, _: text(create(c, 1, seed=1)) == text(create(c, 1, seed=2)),
    ('top_p', 0): lambda c, _: text(create(c, **SAME, top_p=1e-9)) == text(create(c)) != text(create(c,
                                                                                                  **SAME)),
    ('top_p', 1): lambda c, _: text(create(c, 1, **SAME, top_p=1e-9)) == text(create(c, 1)),
    ('n', 0): lambda c, _: len({text(create(c, **SAME, n=3), i) for i in range(3)}) == 3,
    ('n', 1): lambda c, _: len({text(create(c, 1, **SAME, n=3), i) for i in range(3)}) == 3,
    ('stop', 0): lambda c, _: stops_at(c, 0),
    ('stop', 1): lambda c, _: stops_at(c, 1),
    ('seed', 0): lambda c, _: text(create(c, **SAME)) == text(create(c, **SAME)) != text(
        create(c, seed=6, temperature=1.0)),
    ('seed', 1): lambda c, _: text(create(c, 1, **SAME)) == text(create(c, 1, **SAME)),
    ('presence_penalty', 0): lambda c, _: text(create(c, max_tokens=24, presence_penalty=2)) != text(
        create(c, max_tokens=24)),
    ('presence_penalty', 1): lambda c, _: text(create(c, 1, max_tokens=24, presence_penalty=2)) != text(
        create(c, 1, max_tokens=24)),
    ('frequency_penalty', 0): lambda c, _: text(create(c, max_tokens=24, frequency_penalty=2)) != text(
        create(c, max_tokens=24)),
    ('frequency_penalty', 1): lambda c, _: text(create(c, 1, max_tokens=24, frequency_penalty=2)) != text(
        create(c, 1, max_tokens=24)),
    ('logit_bias', 0): lambda c, a: text(create(c, **SAME, logit_bias={str(a): 100})) == 'a'*8,
    ('logit_bias', 1): lambda c, a: text(create(c, 1, **SAME, logit_bias={str(a): 100})) == 'a'*8,
    ('logprobs', 0): lambda c, _: len(create(c, logprobs=2).choices[0].logprobs.top_logprobs) == 8,
    ('logprobs', 1): lambda c, _: len(create(c, 1, logprobs=True).choices[0].logprobs.content) == 8,
    ('top_logprobs', 1): lambda c, _: {len(e.top_logprobs) for e in create(
        c, 1, logprobs=True, top_logprobs=3).choices[0].logprobs.content} == {3},
    ('echo', 0): lambda c, _: text(create(c, echo=True)) == 'the cat' + text(create(c)),
    ('best_of', 0): lambda c, _: best_of_picks_the_likeliest(c),
    ('stream', 0): lambda c, _: ''.join(p.choices[0].text for p in create(c, stream=True)) == text(create(c)),
    ('stream', 1): lambda c, _: ''.join(p.choices[0].delta.content or '' for p in create(c, 1, stream=True)
                                        if p.choices) == text(create(c, 1)),
    ('stream_options', 0): lambda c, _: list(create(c, stream=True, stream_options=dict(
        include_usage=True)))[-1].usage.completion_tokens == 8,
    ('stream_options', 1): lambda c, _: list(create(c, 1, stream=True, stream_options=dict(
        include_usage=True)))[-1].usage.completion_tokens == 8,
    ('user', 0): lambda c, _: text(create(c, **SAME, user='ann')) == text(create(c, **SAME)),
    ('user', 1): lambda c, _: text(create(c, 1, **SAME, user='ann')) == text(create(c, 1, **SAME)),
    ('safety_identifier', 1): lambda c, _: text(create(c, 1, **SAME, safety_identifier='x')) == text(
        create(c, 1, **SAME)),
    ('prompt_cache_key', 1): lambda c, _: text(create(c, 1, **SAME, prompt_cache_key='x')) == text(
        create(c, 1, **SAME)),
}
REFUSE = dict(suffix='!', tools=[dict(type='function', function=dict(name='f'))], tool_choice='auto',
              parallel_tool_calls=True, functions=[dict(name='f')], function_call='auto',
              response_format=dict(type='json_object'), modalities=['text', 'audio'], audio=dict(voice='x'),
              prediction=dict(type='content', content='x'), reasoning_effort='low', verbosity='low',
              web_search_options={}, store=True, metadata=dict(a='b'), service_tier='flex',
              moderation=dict(model='x'), prompt_cache_options=dict(ttl='1h'), prompt_cache_retention='24h')


def stops_at(c, chat):
    "A stop string across two tokens ends the answer before it: streamed or whole, finish_reason stop."
    whole = create(c, chat, max_tokens=24, logprobs=True if chat else 0)
    lp = whole.choices[0].logprobs
    toks = [e.token for e in lp.content] if chat else lp.tokens
    k = next(k for k in range(1, len(toks) - 1)
             if toks[k - 1] and toks[k] and 'bytes:' not in toks[k - 1] + toks[k])
    stop = toks[k - 1][-1] + toks[k][0]
    want = text(whole)[:text(whole).index(stop)]
    got = create(c, chat, max_tokens=24, stop=[stop, 'never-there'])
    parts = list(create(c, chat, max_tokens=24, stop=stop, stream=True))
    streamed = ''.join((p.choices[0].delta.content or '') if chat else p.choices[0].text for p in parts)
    return (text(got), got.choices[0].finish_reason, streamed, parts[-1].choices[0].finish_reason) == (
        want, 'stop', want, 'stop')


def best_of_picks_the_likeliest(c):
    "best_of=3 returns the candidate of n=3 (same seeds) with the highest log-probability per token."
    cands = create(c, **SAME, n=3, logprobs=0).choices
    mean = lambda ch: sum(ch.logprobs.token_logprobs)/len(ch.logprobs.token_logprobs)
    best = create(c, **SAME, best_of=3, logprobs=0)
    return (len(best.choices), text(best), best.usage.completion_tokens) == (1, max(cands, key=mean).text, 24)


def test_the_table_is_the_clients_api(client):
    "FIELDS holds every parameter the official client's create() takes, for each endpoint, and no other."
    import inspect
    for chat, make in ((0, client.completions.create), (1, client.chat.completions.create)):
        params = set(inspect.signature(make).parameters) - {'self', 'extra_headers', 'extra_query',
                                                            'extra_body', 'timeout'}
        assert params == set(fields_of(chat)), (chat, params ^ set(fields_of(chat)))



@pytest.mark.parametrize('field,chat', [(f, c) for c in (0, 1) for f in fields_of(c)])
def test_every_field_honoured_or_refused(client, letter, field, chat):
    "Each field of each endpoint, sent through the client: its effect shows, or a 400 names it."
    kind = FIELDS[field][1]
    if kind == 'refused':
        e = refused(client, chat, field, REFUSE[field])
        assert 'not supported' in e.message and create(client, chat, **{field: FIELDS[field][3][-1]})
        return
    assert PROBES[field, chat](client, letter), (field, chat)


def test_unknown_field_and_client_errors(client):
    "An unknown field is a 400 naming it; a wrong key the client's AuthenticationError; a bad value its 400."
    import openai
    assert refused(client, 0, 'top_k', 5).code == 'unknown_field'
    assert refused(client, 1, 'logprobs', 'yes').status_code == 400
    bad = openai.OpenAI(base_url=client.base_url, api_key='sk-wrong', max_retries=0)
    with pytest.raises(openai.AuthenticationError): bad.completions.create(model='tiny', prompt='x')
    with pytest.raises(openai.BadRequestError, match='top_logprobs needs logprobs'):
        create(client, 1, top_logprobs=2)


def test_stop_strings_each_their_own_in_a_batch(server, client):
    "Requests with different stop strings, decoded together, each end at their own."
    whole = text(create(client, max_tokens=40))
    stops = [whole[i:i + 2] for i in (3, 9, 15)]
    want = [whole[:whole.index(st)] for st in stops] + [whole]
    out = together(server, [dict(prompt='the cat', max_tokens=40, temperature=0, stop=st) for st in stops]
                   + [dict(prompt='the cat', max_tokens=40, temperature=0)])
    assert [o[2]['choices'][0]['text'] for o in out] == want
    assert [o[2]['choices'][0]['finish_reason'] for o in out] == ['stop']*3 + ['length']


def test_logprobs_come_from_the_same_forward(client):
    """A greedy token is the likeliest of its alternatives; a prompt's last token scored by its prefill (echo)
    has the log-probability the decode step gives it when a bias forces it (log-probabilities are the model's,
    before any bias)."""
    r = create(client, 1, logprobs=True, top_logprobs=4).choices[0].logprobs.content
    assert all(e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob for e in r)
    assert all(bytes(e.bytes).decode(errors='replace') == e.token or e.token.startswith('bytes:') for e in r)
    ids = [5, 6, 7, 8]
    echo = create(client, prompt=ids, echo=True, logprobs=1, max_tokens=0).choices[0].logprobs
    forced = create(client, prompt=ids[:-1], logprobs=1, max_tokens=1, logit_bias={str(ids[-1]): 100})
    assert len(echo.token_logprobs) == 4 and forced.choices[0].logprobs.tokens == echo.tokens[-1:]
    assert abs(forced.choices[0].logprobs.token_logprobs[0] - echo.token_logprobs[-1]) < 1e-3
    assert echo.text_offset == sorted(echo.text_offset) and echo.text_offset[0] == 0


def test_n_shares_the_prefill_and_keeps_the_seed(client):
    "The first of n choices is the answer n=1 gives with the same seed; the others differ; usage counts all."
    one, three = create(client, **SAME, max_tokens=12), create(client, **SAME, max_tokens=12, n=3)
    assert text(three, 0) == text(one) and len({text(three, i) for i in range(3)}) == 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens and three.usage.completion_tokens == 36


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


def test_full_queue_answers_429(client):
    """4 rows and 4 places in the queue: 16 long requests at once are answered or refused with the client's
    RateLimitError (about half each), none reset."""
    import openai
    out = [None]*16
    def one(i):
        try: out[i] = client.completions.create(model='tiny', prompt='the cat', max_tokens=300, temperature=0)
        except openai.RateLimitError as e: out[i] = e
    th = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in th: t.start()
    for t in th: t.join()
    busy = [o for o in out if isinstance(o, openai.RateLimitError)]
    assert busy and len(busy) <= 11 and all(o is not None for o in out), out
    assert busy[0].response.headers['retry-after'] == '1' and busy[0].body['type'] == 'rate_limit_error'


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


def test_a_grace_that_runs_out_ends_every_request_well(folder):
    """SIGTERM under load with --grace 0.5: every request still running or waiting gets its error in its own
    format (a 503 the client raises as InternalServerError; a stream's last event, which it raises as
    APIError), and the server exits 0 with no traceback and no abort in its log."""
    import openai
    p, port = start(folder, '--max-batch', 2, '--grace', 0.5)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key='none', max_retries=0, timeout=60)
    out = [None]*6
    def one(i):
        ask = dict(model='tiny', max_tokens=1000, temperature=0)
        try:
            if i % 2: out[i] = c.completions.create(prompt='the cat', **ask)
            else: out[i] = list(c.chat.completions.create(messages=[dict(role='user', content='hi')],
                                                          stream=True, **ask))
        except openai.APIError as e: out[i] = e
    th = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in th: t.start()
    while call(port, '/health', method='GET')[2]['waiting'] < 4: time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    for t in th: t.join()
    log = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and not any(w in log for w in ('Traceback', 'terminate called', 'ERROR')), log
    assert '6 answers unfinished when the grace ran out' in log, log
    assert all(isinstance(o, openai.InternalServerError) and (o.status_code, o.code)
               == (503, 'server_stopped') for o in out[1::2]), out
    assert all(type(o) is openai.APIError and 'server stopped' in o.message for o in out[::2]), out


def until(f, timeout=30):
    "Wait for `f()` to be true; its value."
    end = time.time() + timeout
    while not (v := f()):
        assert time.time() < end, 'timed out'
        time.sleep(0.05)
    return v


@pytest.mark.skipif(not any(map(shutil.which, ('chromium', 'chromium-browser', 'google-chrome'))),
                    reason='no Chromium installed (Debian: apt-get install chromium)')
def test_chat_page_in_a_browser(server, tmp_path):
    "The page at / asks for the key once, then streams an answer to a typed message; reset clears it."
    from test_docs import Chromium, Tab, chromium  # the docs test's driver of a headless Chromium
    b, base = Chromium(chromium(), tmp_path/'profile'), f'http://127.0.0.1:{server}/'
    try:
        tab = Tab(b)
        assert tab.open(base) == [f'401 {base}v1/models']  # no key yet: the page asks for it
        until(lambda: tab.js("!document.getElementById('key-form').hidden"))
        tab.js("document.getElementById('key').focus()")
        b.send('Input.insertText', tab.s, text=KEY)
        tab.js("document.getElementById('key-form').requestSubmit()")
        until(lambda: tab.js("document.getElementById('model').textContent") == 'tiny')
        for _ in range(3):  # the page samples at temperature 1 from a random model: it may stop at once
            tab.js("document.getElementById('reset').click()")
            tab.js("document.getElementById('input').focus()")
            b.send('Input.insertText', tab.s, text='What does abs do?')
            b.send('Input.dispatchKeyEvent', tab.s, type='keyDown', key='Enter', code='Enter',
                   windowsVirtualKeyCode=13)
            done = "(document.querySelector('.assistant') || {dataset: {}}).dataset.done === '1'"
            until(lambda: tab.js(done))
            got = tab.js("(a => ({text: a.textContent, chunks: +a.dataset.chunks, cls: a.className, "
                         "finish: a.dataset.finish || ''}))(document.querySelector('.assistant'))")
            # an empty answer only where the model ended it at once (its end token first), never silently
            assert 'error' not in got['cls'] and (got['text'] or got['finish'] == 'stop'), got
            if got['chunks'] > 1: break
        assert got['chunks'] > 1 and got['finish'] in ('stop', 'length'), got  # streamed, in pieces, ended
        assert tab.js("document.querySelector('.user').textContent") == 'What does abs do?'
        tab.js("document.getElementById('reset').click()")
        assert tab.js("document.querySelectorAll('.msg').length") == 0
        assert tab.open(base) == [] and tab.js("sessionStorage.getItem('lmbook-key')") == KEY  # asked once
        until(lambda: tab.js("$('key-form').hidden && !$('ask').hidden"))
    finally:
        b.close()


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
    rows = serve_load.main([str(folder), '--clients', '1,3', '--requests', '2', '--max-tokens', '6', '--mix',
                            '0,0.5', '--device', 'cpu', '--out', str(tmp_path/'r.jsonl')])
    assert ([(r['clients'], r['mix'], r['answered'], r['with_extras'], r['dropped'], r['server_exit'])
             for r in rows] == [(1, 0, 2, 0, 0, 0), (3, 0, 6, 0, 0, 0), (1, 0.5, 2, 1, 0, 0),
                                (3, 0.5, 6, 3, 0, 0)])
    assert rows[3]['logprob_entries'] >= 3*5 and rows[1]['logprob_entries'] == 0  # 6 tokens (or 5 and a stop)
    assert rows[1]['tok_per_s'] > 0 and rows[1]['ttft_p95_s'] >= rows[1]['ttft_p50_s'] > 0
    assert len((tmp_path/'r.jsonl').read_text().splitlines()) == 4
