"""Stops that land with nobody watching: RunPod's API (the REST v2 fake) is down for three minutes while
autokill, the spend guard or the start script's guard stops the pod; each ends with the pod stopped, or with
the container gone when the API never comes back. The fake's clock runs 60 times faster than the wall's and
the retry pauses are scaled down (`LMBOOK_STOP_PAUSE`), so three minutes of outage take three seconds."""
import json, os, shlex, signal, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import lmbook_cmd
from lmbook.dev.fake_runpod import FakeRunPodV2, serve
from test_pod_start import container, pid1, wait_for, KEY
from lmbook.rundir import RunDir

FAST = 60  # fake seconds a wall second
POD = 'pod1234abc'


@pytest.fixture
def api():
    f = FakeRunPodV2(KEY)
    f.add_pod(POD, name='pod-1')
    t0 = time.monotonic()
    f.clock = lambda: t0 + (time.monotonic() - t0)*FAST
    srv, f.url = serve(f)
    yield f
    srv.shutdown()


# ten fake minutes
def retries(env): return dict(env, LMBOOK_STOP_PAUSE='0.2', LMBOOK_STOP_DEADLINE=str(600//FAST))


class Log(list):
    f = None
    def __call__(self, m): self.append(m)
    def sync(self): pass


def finished_run(tmp_path):
    "A run folder whose final checkpoint (step 4 of 4) is complete."
    from lmbook.core import paths_for
    paths = paths_for('ak', root=tmp_path)
    (RunDir(paths.run).checkpoints/'step_00000004').mkdir(parents=True)
    (RunDir(paths.run).checkpoints/'step_00000004'/'COMPLETE').write_text(json.dumps(dict(step=4, files={})))
    (paths.run/'meta.json').write_text(json.dumps(dict(total_steps=4)))
    return paths


def test_autokill_stops_the_pod_after_three_minutes_without_an_api(api, tmp_path, monkeypatch):
    from lmbook.pods.boot import BootOptions, autokill
    monkeypatch.setenv('RUNPOD_API_BASE_URL', api.url)
    paths, log = finished_run(tmp_path), Log()
    api.down(180)
    t = time.monotonic()
    assert autokill(BootOptions(experiment='ak', autokill='stop'), paths, 0, log,
                    retries(dict(PATH='', RUNPOD_POD_ID=POD, RUNPOD_API_KEY=KEY)))
    assert api.pods[POD]['status'] == 'EXITED' and api.unanswered >= 3 and time.monotonic() - t < 8
    assert (any('trying again' in l for l in log)
            and json.loads((paths.run/'autokill.json').read_text())['action'] == 'stop')


def test_autokill_ends_the_container_when_the_api_never_answers(api, tmp_path, monkeypatch):
    """Ten minutes without an answer: the start script (a stand-in here) is asked to exit, which ends the
    container and its bill."""
    from lmbook.pods.boot import BootOptions, autokill
    monkeypatch.setenv('RUNPOD_API_BASE_URL', api.url)
    paths, log = finished_run(tmp_path), Log()
    api.down(10**9)
    start = subprocess.Popen(['sleep', '60'])
    env = dict(PATH='', RUNPOD_POD_ID=POD, RUNPOD_API_KEY=KEY, LMBOOK_START_PID=str(start.pid),
               LMBOOK_STOP_PAUSE='0.2', LMBOOK_STOP_DEADLINE='2')
    assert not autokill(BootOptions(experiment='ak', autokill='stop'), paths, 0, log, env)
    assert start.wait(5) == -signal.SIGTERM and 'ending the container' in log[-1]
    assert not (paths.run/'autokill.json').exists()  # a later boot of this pod tries again


@pytest.mark.parametrize('down', [0, 180])
def test_max_dollars_stops_the_pod_during_data_preparation(api, tmp_path, down):
    """--max-dollars with --shard: the guard counts from the pod's create time and stops boot in its data
    stage, then the pod."""
    ws = tmp_path/'ws'; ws.mkdir()
    corpus = tmp_path/'big.txt'
    words = ('alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma '
             'tau').split()
    corpus.write_text('\n\n'.join(' '.join(words[(i*7 + j) % len(words)] + str(i % 997)
                                           for j in range(60)) for i in range(60000)))
    env = retries(dict(PATH=os.environ['PATH'], LMBOOK_WORKSPACE=str(ws), RUNPOD_POD_ID=POD,
                       RUNPOD_API_KEY=KEY, RUNPOD_API_BASE_URL=api.url,
                       RUN_CONFIG='smoke', RUN_EXPERIMENT='sd', RUN_SHARD='1', RUN_INPUT=str(corpus),
                       HF_HUB_OFFLINE='1',
                       MAX_DOLLARS='1', PRICE_PER_HOUR='2.69', LMBOOK_T0=str(time.time() - 1337),
                       LMBOOK_GUARD_POLL='1'))
    # 1337 s at $2.69/h is $1.00 spent when the guard first looks, one second into the data stage
    p = subprocess.Popen([str(Path(sys.executable).parent/'lmbook'), 'boot', '--no-install',
                          '--no-tensorboard'], env={**os.environ, **env},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = ws/'logs'/'boot-sd.log'
    wait_for(lambda: log.is_file() and 'spend guard: the pod stops' in log.read_text(), 60, 'the spend guard')
    api.down(down, from_next_call=True)  # the price was asked: the next call is the stop
    rc = p.wait(120)
    log = log.read_text()
    assert 'stage 3/4 data: skipped' not in log and 'over --max-dollars 1' in log, log
    assert ('before training' in log
            and 'stage 3/4 data:' not in log.split('spend guard: the pod has run')[1]), log  # data unfinished
    assert 'stage 4/4' not in log and 'autokill: stop pod pod1234abc: spend guard' in log, log
    assert api.pods[POD]['status'] == 'EXITED' and rc != 0
    assert ('trying again' in log) == bool(down)


def test_a_failed_stage_before_boot_stops_the_pod_after_three_minutes_without_an_api(api, tmp_path):
    api.down(180)
    p = pid1(retries(container(tmp_path, api.url, LMBOOK_REPO=f'file://{tmp_path}/no-such-repo.git',
                               LMBOOK_COMMIT='')))
    try:
        wait_for(lambda: api.pods[POD]['status'] == 'EXITED', 30, 'the guard to stop the pod')
        log = (tmp_path/'workspace'/'logs'/'boot-pod.log').read_text()
        assert ('guard: git clone' in log and 'trying again' in log
                and 'guard: pod stopped (REST API)' in log), log
        assert p.poll() is None and api.unanswered >= 3
    finally:
        os.killpg(p.pid, signal.SIGKILL); p.wait()


def test_the_container_exits_when_the_api_never_answers(api, tmp_path):
    api.down(10**9)
    env = container(tmp_path, api.url, LMBOOK_REPO=f'file://{tmp_path}/no-such-repo.git', LMBOOK_COMMIT='',
                    LMBOOK_STOP_PAUSE='0.2', LMBOOK_STOP_DEADLINE='2')
    p = pid1(env)
    try: p.wait(30)
    finally:
        try: os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError: pass
    log = (tmp_path/'workspace'/'logs'/'boot-pod.log').read_text()
    assert 'ending the container instead' in log and api.pods[POD]['status'] == 'RUNNING', log


def test_the_spend_guard_counts_the_install_and_stops_the_pod(api, tmp_path):
    """A clone that never ends, on a pod created an hour ago with --max-hours 1: the start script's guard
    stops it."""
    bin_ = tmp_path/'bin'; bin_.mkdir()
    (bin_/'git').write_text('#!/bin/sh\nexec sleep 600\n'); (bin_/'git').chmod(0o755)
    env = container(tmp_path, api.url, LMBOOK_REPO='https://github.com/lmbook/lmbook.git', MAX_HOURS='1',
                    LMBOOK_T0=str(time.time() - 3600))
    p = pid1(dict(env, PATH=f"{bin_}:{env['PATH']}"))
    try:
        wait_for(lambda: api.pods[POD]['status'] == 'EXITED', 30, 'the spend guard to stop the pod')
        log = (tmp_path/'workspace'/'logs'/'boot-pod.log').read_text()
        assert 'spend guard: the pod reached MAX_HOURS/MAX_DOLLARS before lmbook boot ran' in log, log
    finally:
        os.killpg(p.pid, signal.SIGKILL); p.wait()
