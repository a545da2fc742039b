"""Alerts for unattended runs, against a webhook on 127.0.0.1: each event arrives once, in the form its
address asks for, from the trainer, `lmbook train`, boot and the pod's start script; a dead webhook costs one
warning and no time; the address is in no file of the run, no log line and no manifest."""
import http.server, json, os, signal, socket, threading, time
from pathlib import Path
import pytest
from lmbook.dev.fake_runpod import FakeRunPodV2, serve
from lmbook.profiles import get_config
from lmbook.runs.alert import Alerts, alert_shape
from lmbook.train import trainer
from lmbook.train.launch import alert_failure, alerting, launch, spawn, TrainingExit
from test_pod_start import KEY, container, pid1, volume_venv, wait_for
from test_runpod import create, fake, one_line_error, run

SECRET = 'T0SECRET/B0SECRET/hookTOKENvalue42'  # the part of a webhook's address that must never be written
TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2,
            log_every=1, max_steps=6, warmup_steps=2, ckpt_every=4, keep_ckpts=2, tensorboard=False)
def cfg(**kw): return get_config('smoke', {**TINY, **kw})
def quiet(lines): return lambda *a, **k: lines.append(' '.join(map(str, a)))
def train(c, exp, ws, said, **kw): return trainer.train(c, exp, root=ws, log=quiet(said), **kw)


class Hook:
    "A webhook on 127.0.0.1 that keeps what it is sent: (path, headers, body)."
    def __init__(self, status=200):
        got = self.got = []
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers['Content-Length']))
                got.append((self.path, dict(self.headers), body))
                self.send_response(status)
                self.end_headers()
            def log_message(self, *a): pass
        self.srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f'http://127.0.0.1:{self.srv.server_address[1]}/hooks/{SECRET}'

    def sent(self) -> list[dict]: return [json.loads(b) for _, _, b in self.got]
    def events(self) -> list[str]: return [d['event'] for d in self.sent()]
    def one(self, event:str) -> dict:
        (d,) = [d for d in self.sent() if d['event'] == event]
        return d


@pytest.fixture
def hook(monkeypatch):
    h = Hook()
    monkeypatch.setenv('LMBOOK_ALERT_URL', h.url)
    monkeypatch.delenv('LMBOOK_ALERT_PARENT', raising=False)
    yield h
    h.srv.shutdown()


def no_url_in(folder, *texts):
    for p in Path(folder).rglob('*'):
        if p.is_file(): assert SECRET.encode() not in p.read_bytes(), p
    for t in texts: assert SECRET not in t


def test_each_webhook_gets_its_own_form(hook):
    urls = ('https://hooks.slack.com/services/T0/B0/x', 'https://discord.com/api/webhooks/1/x',
            'https://ntfy.sh/runs', 'https://push.ntfy.example.org/runs', 'https://discord.com/other',
            'https://example.org/lmbook')
    assert [alert_shape(u) for u in urls] == ['slack', 'discord', 'ntfy', 'ntfy', 'json', 'json']
    for shape in ('slack', 'discord', 'ntfy', 'json'):
        al = Alerts('fw-2b', 'runpod_2b', url=hook.url, shape=shape)
        assert al.send('finished', 'val_loss 3.2104', wait=True, step=4000) and al.delivered == {'finished'}
    (_, _, slack), (_, _, discord), (_, nh, ntfy), (_, jh, generic) = hook.got
    assert json.loads(slack) == {'text': '*lmbook: fw-2b finished*\nval_loss 3.2104'}
    assert json.loads(discord) == {'content': '**lmbook: fw-2b finished**\nval_loss 3.2104'}
    assert ntfy == b'val_loss 3.2104' and (nh['Title'], nh['Tags'], nh['Priority']) == (
        'lmbook: fw-2b finished', 'white_check_mark', 'default')
    d = json.loads(generic)
    assert jh['Content-Type'] == 'application/json' and jh['User-Agent'].startswith('lmbook/')
    assert {k: d[k] for k in ('event', 'title', 'text', 'experiment', 'profile', 'step')} == dict(
        event='finished', title='lmbook: fw-2b finished', text='val_loss 3.2104', experiment='fw-2b',
        profile='runpod_2b', step=4000)
    assert 'Alerts' in repr(al) and SECRET not in repr(al)


@pytest.mark.parametrize('how', ['refused', 'silent', 'http 500', 'not a URL'])
def test_a_webhook_that_fails_is_one_warning_and_holds_nothing_up(how):
    listener = socket.socket()
    listener.bind(('127.0.0.1', 0))
    if how == 'silent': listener.listen()  # takes the connection, never answers
    bad = Hook(status=500) if how == 'http 500' else None
    url = (bad.url if bad else f'http://127.0.0.1:{listener.getsockname()[1]}/hooks/{SECRET}'
           if how != 'not a URL' else f'hooks.slack.com/services/{SECRET}')
    said = []
    t0 = time.monotonic()
    al = Alerts('fw-2b', log=said.append, url=url, timeout_s=0.5)
    for e in ('started', 'stalled', 'finished'): al.send(e, 'text')  # each returns at once
    assert time.monotonic() - t0 < 0.3
    al.close()
    assert time.monotonic() - t0 < 3 and al.delivered == set()
    assert len(said) == 1 and said[0].startswith('warning:') and SECRET not in said[0], said
    assert {'refused': 'refused', 'silent': 'no answer in 0.5 s', 'http 500': 'HTTP 500',
            'not a URL': 'not an http(s) URL'}[how] in said[0], said
    listener.close()
    if bad: bad.srv.shutdown()


def test_a_run_sends_started_and_finished_once_and_writes_the_url_nowhere(hook, ws):
    said = []
    res = train(cfg(), 'alerted', ws, said, profile='smoke')
    assert hook.events() == ['started', 'finished']
    started, finished = hook.one('started'), hook.one('finished')
    assert started['text'].startswith('profile smoke: 6 steps of 256 tokens (1.54k tokens) on 1 x cpu')
    assert (started['total_steps'], started['step'], started['world_size']) == (6, 0, 1)
    best = Path(res['run_dir'])/'checkpoints'/'best'
    assert finished['best'] == str(best) and best.is_dir() and str(best) in finished['text']
    assert finished['val_loss'] == pytest.approx(res['val_loss']) and finished['step'] == 6
    assert all(h['Content-Type'] == 'application/json' for _, h, _ in hook.got)
    train(cfg(), 'alerted', ws, said, profile='smoke')  # already finished: nothing starts, nothing to say
    assert hook.events() == ['started', 'finished']
    no_url_in(ws, *said)



def test_divergence_is_sent_once_and_is_no_failure(hook, ws):
    c = cfg(max_steps=20, max_nonfinite=3)
    c.train.optim.lr = 1e4  # absurd (get_config refuses lr >= 1, so set it directly)
    assert launch(c, 'smoke', 'diverged', {}, root=ws, checked=True) == 3
    assert hook.events() == ['started', 'diverged']
    assert 'non-finite for 3 steps in a row' in hook.one('diverged')['text']


def test_a_stall_is_sent_once_while_the_run_goes_on(hook, ws, monkeypatch):
    step, calls = trainer.train_step, []
    def slow_third(*a, **k):
        calls.append(1)
        if len(calls) == 3: time.sleep(2.5)  # a hung step, 4 times the stall limit
        return step(*a, **k)
    monkeypatch.setattr(trainer, 'train_step', slow_third)
    res = train(cfg(alert_stall_minutes=0.01), 'stalls', ws, [])  # 0.6 s, looked at every 0.15 s
    assert res['step'] == 6 and hook.events().count('stalled') == 1
    assert hook.events()[0] == 'started' and hook.events()[-1] == 'finished'
    s = hook.one('stalled')
    assert s['minutes'] == 0.01 and s['total_steps'] == 6 and 'no step has finished for 0.01 min' in s['text']


def test_a_crash_in_lmbook_train_is_sent_as_failed_with_the_last_log_line(hook, ws, monkeypatch):
    calls = []
    def crash(*a, **k):
        calls.append(1)
        if len(calls) == 3: raise RuntimeError('boom at the third step')
        return step(*a, **k)
    step = trainer.train_step
    monkeypatch.setattr(trainer, 'train_step', crash)
    with pytest.raises(RuntimeError, match='boom'):
        launch(cfg(), 'smoke', 'crashes', {}, root=ws)
    assert hook.events() == ['started', 'failed']
    f = hook.one('failed')
    log = (ws/'runs'/'crashes'/'train.log').read_text().strip().splitlines()
    assert f['exit_code'] == 1 and f['detail'] == 'RuntimeError: boom at the third step'
    assert f['last_line'] == log[-1] and 'step 2/6' in f['last_line'] and 'exit code 1' in f['text']


def test_a_failed_subprocess_is_sent_once_by_its_launcher(hook, ws, monkeypatch):
    with pytest.raises(TrainingExit) as e:
        for _ in spawn('smoke', 'no-init', dict(TINY, init_from='no-such-run'), root=ws): pass
    assert e.value.code == 2 and hook.events() == ['failed']
    f = hook.one('failed')
    assert f['exit_code'] == 2 and f['detail'].startswith("error: init_from='no-such-run'")
    # under boot, boot sends it
    monkeypatch.setenv('LMBOOK_ALERT_PARENT', '1')
    assert not alert_failure(2, 'no-init', ws)
    assert hook.events() == ['failed']


def test_boot_sends_failures_before_the_pod_stops(hook, tmp_path, monkeypatch):
    "Boot alerts the failures it reports (the spend cap and what boot cannot see are the supervisor's)."
    from lmbook.pods import boot
    from lmbook.core import EXIT_USER_ERROR
    ws = tmp_path/'ws'
    for k, v in dict(LMBOOK_WORKSPACE=str(ws), HF_HOME=str(tmp_path/'hf'),
                     LMBOOK_SETTINGS=str(Path(__file__).parents[1]/'settings.ini')).items():
        monkeypatch.setenv(k, v)  # boot sets these for what it starts; the test gets them back
    for k in ('RUNPOD_POD_ID', 'NUM_NODES', 'NNODES', 'LMBOOK_TRAIN_CMD'):
        monkeypatch.delenv(k, raising=False)
    o = boot.BootOptions(profile='smoke', experiment='guarded', install=False, tensorboard_port=0)
    envs = []
    def follow(cmd, paths, log, stop, env, cwd):
        envs.append(env)
        return 1
    monkeypatch.setattr(boot, '_follow', follow)
    monkeypatch.setattr(boot, 'trainer_exit_code', lambda out, rc: rc)
    assert boot.run_pipeline(o, ws, stages=(2, 3, 4)) == 1
    assert hook.events() == ['failed'] and envs[0]['LMBOOK_ALERT_PARENT'] == '1'
    assert hook.one('failed')['exit_code'] == 1
    assert json.loads((ws/'logs'/'outcome-guarded.json').read_text())['alerted']
    # a stage that fails: its error goes with the code
    def no_data(*a): raise ValueError('no validation text')
    monkeypatch.setattr(boot, 'stage_data', no_data)
    assert boot.run_pipeline(o, ws, stages=(2, 3, 4)) == EXIT_USER_ERROR
    f = hook.sent()[-1]
    assert f['event'] == 'failed' and f['exit_code'] == 2 and f['detail'] == 'error: no validation text'
    assert f['last_line'].endswith('error: no validation text')  # boot's own log, before any training
    no_url_in(tmp_path)


@pytest.fixture
def api():
    f = FakeRunPodV2(KEY)
    f.add_pod('pod1234abc', name='pod-1')
    srv, f.url = serve(f)
    yield f
    srv.shutdown()


@pytest.mark.parametrize('why,lmbook', [('clone', False), ('clone', True), ('spend', False)])
def test_the_start_script_sends_its_own_stops(hook, api, tmp_path, why, lmbook):
    """A clone that fails, or the spend cap reached during the install: one alert before the pod stops, sent
    by the volume's lmbook once it runs, else by the supervisor itself (plain python3)."""
    env = container(tmp_path, api.url, LMBOOK_REPO=f'file://{tmp_path}/no-such-repo.git', LMBOOK_COMMIT='',
                    LMBOOK_ALERT_URL=hook.url)
    if lmbook: env['LMBOOK_VENV'] = str(volume_venv(tmp_path/'venv'))
    if why == 'spend':
        bin_ = tmp_path/'bin'
        bin_.mkdir()
        (bin_/'git').write_text('#!/bin/sh\nexec sleep 600\n')
        (bin_/'git').chmod(0o755)
        env.update(PATH=f"{bin_}:{env['PATH']}", MAX_HOURS='1', LMBOOK_T0=str(time.time() - 3600))
    p = pid1(env)
    try:
        wait_for(lambda: api.pods['pod1234abc']['status'] == 'EXITED', 60, 'the supervisor to stop the pod')
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    (d,) = hook.sent()
    want = 'the install failed (git clone' if why == 'clone' else 'the spend cap: the pod has billed'
    assert d['event'] == ('failed' if why == 'clone' else 'spend_limit') and want in d['text'], d
    assert d['title'] == f"lmbook: pod {d['event'].replace('_', ' ')}" and d['experiment'] == 'pod'
    assert ('lmbook' in d) == lmbook  # lmbook's own JSON names its version; the start script's does not
    no_url_in(tmp_path/'workspace')


def test_pod_create_passes_the_url_by_reference_only(fake, capsys, monkeypatch):
    url = f'https://hooks.slack.com/services/{SECRET}'
    monkeypatch.setenv('LMBOOK_ALERT_URL', url)
    rc, out, err = run(capsys, *create(fake))  # the URL set here goes to the pod: env:LMBOOK_ALERT_URL
    assert rc == 0, err
    (pod,) = fake.pods.values()
    manifest = Path('pod.yaml').read_text()
    assert pod['body']['env']['LMBOOK_ALERT_URL'] == url
    assert 'LMBOOK_ALERT_URL: env:LMBOOK_ALERT_URL' in manifest
    assert SECRET not in out + err + manifest
    rc, out, err = run(capsys, *create(fake, '--dry-run', '--alert-url', '{{ RUNPOD_SECRET_alert_url }}'))
    assert rc == 0 and '{{ RUNPOD_SECRET_alert_url }}' in out and SECRET not in out + err
    for bad in (['--env', f'LMBOOK_ALERT_URL={url}'], ['--env', f'HOOK={url}'], ['--alert-url', url]):
        rc, out, err = run(capsys, *create(fake, '--dry-run', *bad))
        assert rc == 2 and SECRET not in out + err, err
    one_line_error(*run(capsys, *create(fake, '--dry-run', '--env', f'MY={url}')), 'secret', '--alert-url')
