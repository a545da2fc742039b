"""The pod's supervisor (lmbook.pods.supervise) in one process, against the REST v2 fake: the paths the
money matrix (test_pod_matrix) does not cross. A pod kept up after a failure still stops at its spend cap; a
refused key or a pod stopped from outside is no reason to retry; `runpodctl` comes first; `MAX_DOLLARS` is
priced by the API; a start after an end the API took is a person's and boots; boot stops before training on a
stop in its data stage; a full volume does not keep the pod up. Every supervisor's clock runs 600 times faster
than the wall's."""
import ast, json, os, re, signal, subprocess, sys, time
from pathlib import Path
import pytest
from lmbook.core import ENV
from lmbook.dev.fake_runpod import FakeRunPodV2, serve
from lmbook.pods import supervise
from lmbook.pods.supervise import Supervisor, outcome_path, write_json

KEY, POD, FAST = 'rpa_PODSCOPEDkey42', 'pod1234abc', 600


@pytest.fixture
def api():
    f = FakeRunPodV2(KEY)
    f.add_pod(POD, name='pod-1')
    t0 = time.monotonic()
    f.clock = lambda: t0 + (time.monotonic() - t0)*FAST
    srv, f.url = serve(f)
    yield f
    srv.shutdown()


def supervisor(api, tmp_path, **env) -> Supervisor:
    ws = tmp_path/'ws'
    (ws/'logs').mkdir(parents=True, exist_ok=True)
    env = dict(PATH=os.environ['PATH'], LMBOOK_WORKSPACE=str(ws), RUN_EXPERIMENT='sv', RUNPOD_POD_ID=POD,
               RUNPOD_API_KEY=KEY, RUNPOD_API_BASE_URL=api.url, LMBOOK_TIME_SCALE=str(FAST)) | env
    return Supervisor(env, ws/'logs'/'boot-sv.log')


def log_of(s:Supervisor) -> str: return s.log_path.read_text()


def report(s:Supervisor, **d):
    "The command that stands in for `lmbook boot`: it writes its report, then exits 1."
    path = outcome_path(Path(s.env['LMBOOK_WORKSPACE']), 'sv')
    code = f"open({str(path)!r}, 'w').write({json.dumps(json.dumps(d))}); exit(1)"
    return [sys.executable, '-c', code]


def test_a_pod_kept_after_a_failure_still_stops_at_its_spend_cap(api, tmp_path):
    "ON_FAILURE=keep keeps a failed pod up, billing, until its cap: twelve pod minutes, 1.2 s of the wall's."
    s = supervisor(api, tmp_path, ON_FAILURE='keep', MAX_HOURS='0.2', LMBOOK_GUARD_POLL='30')
    t = time.monotonic()
    rc = s.run(['true'], report(s, outcome='failed', why='the trainer ended (exit code 1)'))
    log = log_of(s)
    assert ('the pod stays up, as asked (--keep, --on-failure keep), and bills until `lmbook pod stop '
            'pod1234abc` ends it') in log
    assert re.search(r'the spend cap: the pod has billed 0\.2\d h, over --max-hours 0\.2', log), log
    assert 'RunPod took the stop' in log
    assert api.pods[POD]['status'] == 'EXITED' and time.monotonic() - t < 10 and rc == 1


@pytest.mark.parametrize('answer', [401, 409])
def test_a_refused_key_and_a_pod_stopped_from_outside_are_not_retried(api, tmp_path, answer):
    if answer == 401: api.key = 'rpa_ANOTHERkey'  # the pod's key does not work: the container ends at once
    else: api.pods[POD]['status'] = 'EXITED'  # stopped meanwhile from outside: a stop is answered 409
    s = supervisor(api, tmp_path)
    rc = s.end('stop', 'the run finished')
    log = log_of(s)
    said = ("RunPod refused the stop with the pod's key (HTTP 401)" if answer == 401
            else 'RunPod says pod pod1234abc is not running already: nothing to stop')
    assert said in log and 'no stop yet' not in log and len(api.calls('POST')) == 1, log
    assert rc == 1 and json.loads(s.marker.read_text())['api'] == ('never' if answer == 401 else 'taken')


@pytest.mark.parametrize('works', [True, False])
def test_runpodctl_first_then_the_api(api, tmp_path, works):
    "RunPod's images carry runpodctl with the pod's key: it is tried first, the REST API when it fails."
    bin_ = tmp_path/'bin'
    bin_.mkdir()
    (bin_/'runpodctl').write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\nexit {0 if works else 1}\n')
    (bin_/'runpodctl').chmod(0o755)
    s = supervisor(api, tmp_path, PATH=f"{bin_}:{os.environ['PATH']}")
    assert s.end('terminate', 'the run finished') == 1  # no container stop came: it ends itself
    assert (tmp_path/'calls').read_text() == f'remove pod {POD}\n'
    assert api.calls('POST') == ([] if works else [('POST', f'/v2/pods/{POD}/action',
                                                     dict(action='terminate'))])


def test_max_dollars_is_priced_by_the_api_and_a_taken_end_lets_the_next_start_boot(api, tmp_path):
    s = supervisor(api, tmp_path, MAX_DOLLARS='5', PRICE_PER_HOUR='1')
    write_json(s.marker, dict(action='stop', why='the run finished (step_00000030 complete)', api='taken'))
    s.run(['true'], report(s, outcome='failed', why='the trainer ended (exit code 1)'))
    log = log_of(s)
    assert 'started again after its run ended (the run finished (step_00000030 complete)): booting' in log
    assert 'the spend cap stops the run at 1.86 billed hours' in log, log  # $5 at the API's $2.69/h, not $1/h


def test_a_full_volume_still_stops_the_pod(api, tmp_path, capfd):
    """A full volume takes neither the boot log's lines nor the end's marker: the run's end still stops the
    pod through the API, the lines go to the container's output (RunPod's logs), the bill's watch goes on."""
    s = supervisor(api, tmp_path, LMBOOK_GUARD_POLL='30')
    s.log_path = Path('/dev/full')  # every write: "No space left on device"
    (tmp_path/'ws'/'logs'/'full').write_text('')
    s.marker = tmp_path/'ws'/'logs'/'full'/'ended.json'  # its folder cannot be made: the write is refused
    rc = s.run(['true'], report(s, outcome='failed', why='the trainer ended (exit code 1)'))
    out = capfd.readouterr().err
    assert api.pods[POD]['status'] == 'EXITED' and rc == 1, out
    assert 'pod: the trainer ended (exit code 1): stopping pod pod1234abc' in out
    assert f'pod: {s.marker} cannot be written' in out and 'pod: RunPod took the stop' in out
    assert 'pod: billed' in out  # the watch's lines: its thread did not die on the first one
    assert not list((tmp_path/'ws'/'logs').glob('.*.tmp'))


def test_the_supervisor_reads_only_variables_lmbook_documents():
    "It runs before lmbook is installed, so it reads its environment itself: only names `core.ENV` lists."
    tree = ast.parse(Path(supervise.__file__).read_text())
    read = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
            and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
            and getattr(n.func, 'attr', getattr(n.func, 'id', '')) in ('get', 'num')
            and n.args[0].value.isupper()}
    assert read and not read - set(ENV), read - set(ENV)


def test_a_stop_during_the_data_stage_ends_boot_before_training(tmp_path):
    "Boot stops in its data stage at once (the data resumes on the next boot) and reports it stopped."
    ws = tmp_path/'ws'
    corpus = tmp_path/'big.txt'
    corpus.write_text('\n\n'.join(f"document {i}: " + ' '.join(f"w{(i*7 + j) % 997}" for j in range(60))
                                  for i in range(30000)))
    env = dict(os.environ, LMBOOK_WORKSPACE=str(ws), RUN_CONFIG='smoke', RUN_EXPERIMENT='sd', RUN_SHARD='1',
               RUN_INPUT=str(corpus), HF_HUB_OFFLINE='1')
    p = subprocess.Popen([str(Path(sys.executable).parent/'lmbook'), 'boot', '--no-install',
                          '--no-tensorboard'], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = ws/'logs'/'boot-sd.log'
    t = time.time()
    while not (log.is_file() and 'stage 2/4 layout' in log.read_text()) and time.time() - t < 60:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(60)
    said, r = log.read_text(), json.loads((ws/'logs'/'outcome-sd.json').read_text())
    assert rc == 143 and 'stage 4/4' not in said, said
    assert 'stage 3/4 data: ' not in said.split('stage 2/4 layout')[1], said  # the data is not done
    assert r['outcome'] == 'stopped' and r['why'].startswith('boot stopped by SIGTERM before training'), r


def test_a_sigkill_is_a_failure_that_claims_no_checkpoint():
    "The kernel's out-of-memory killer ends a trainer with SIGKILL (137): nothing was saved by it."
    from lmbook.train.launch import describe_exit
    assert describe_exit(137) == describe_exit(-9) == 'killed by SIGKILL (no checkpoint of its own)'
    assert describe_exit(143) == 'stopped by SIGTERM after writing its checkpoint'


@pytest.mark.parametrize('autokill, ends', [('', 'stop'), ('terminate', 'terminate')])
def test_a_prepare_pod_stops_every_time_it_has_prepared(api, tmp_path, autokill, ends):
    """Prepared data is the whole job of a CPU pod: it stops (terminates with AUTOKILL=terminate); started
    again, it prepares what is missing and stops again. A failure never terminates."""
    prepared = ('prepared', 'the data is prepared', ends)
    for outcome, why, action in (prepared, prepared, ('failed', 'error: no validation text', 'stop')):
        if POD not in api.pods: api.add_pod(POD, name='pod-1')
        api.pods[POD]['status'] = 'RUNNING'
        s = supervisor(api, tmp_path, AUTOKILL=autokill, RUN_PREPARE='1')
        s.run(['true'], report(s, outcome=outcome, why=why))
        assert f"pod: {why}: {dict(stop='stopping', terminate='terminating')[action]} pod {POD}" in log_of(s)
        assert api.calls('POST')[-1][2] == dict(action=action)


def test_keep_keeps_a_finished_pod_up_as_asked(api, tmp_path):
    "`pod create --keep` (KEEP_POD=1): a finished run leaves the pod up, to fetch from; the cap still holds."
    s = supervisor(api, tmp_path, KEEP_POD='1', MAX_HOURS='0.2')
    s.run(['true'], report(s, outcome='finished', why='the run finished (step_00000030 complete)'))
    log = log_of(s)
    assert 'the run finished (step_00000030 complete); the pod stays up, as asked' in log
    assert re.search(r'the spend cap: the pod has billed 0\.2\d h', log)
    assert api.pods[POD]['status'] == 'EXITED'


def test_boot_stops_a_trainer_that_hangs_after_its_first_step(tmp_path, monkeypatch):
    """STALL_MINUTES counts from the first metrics line (the data, the fit and compiling come before it): a
    trainer quiet for 2 s before its first step is left alone; hung after it, deaf to SIGTERM, it is stopped,
    then killed."""
    from types import SimpleNamespace
    from lmbook.pods.boot import _follow
    from lmbook.pods.guard import StopSignals
    from lmbook.pods.stages import BootLog
    monkeypatch.setenv('STALL_MINUTES', '0.01')  # 0.6 s
    run = tmp_path/'run'
    run.mkdir()
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(2); "
            "open('metrics.jsonl', 'w').write('{\"step\": 1}\\n'); time.sleep(60)")
    stop, log, t0 = StopSignals(), BootLog(tmp_path/'boot.log'), time.monotonic()
    rc = _follow([sys.executable, '-c', code], SimpleNamespace(run=run), log, stop, cwd=run)
    took, said = time.monotonic() - t0, (tmp_path/'boot.log').read_text()
    assert rc == -signal.SIGKILL and stop.stalled and 2.5 < took < 10, (rc, took, said)
    assert 'logged nothing for 0.01 min (STALL_MINUTES)' in said and 'killing it (SIGKILL)' in said
