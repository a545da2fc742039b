"""The boot pipeline end to end on this machine: orchestrate, boot, resume, autokill through a fake
`runpodctl`."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from conftest import lmbook_cmd

TINY = ('max_steps=4,batch_size=2,block_size=32,n_layer=1,n_embd=32,n_head=2,vocab_size=300,eval_every=2,'
        'eval_steps=1,ckpt_every=2,log_every=2,warmup_steps=1')
SECRETS = dict(HF_TOKEN='hf_BOOTsecretTOKEN42', JUPYTER_PASSWORD='jp_BOOTsecretPASS42',
               RUNPOD_API_KEY='rpa_PODSCOPEDkey42')
RUNPODCTL = '''#!/bin/sh
{ echo "ARGS $*"
  for d in "$WS"/runs/"$EXP"/checkpoints/step_*; do
    [ -f "$d/COMPLETE" ] && echo "complete $(basename "$d")"
  done
  grep -q "autokill: $AUTOKILL pod" "$WS/logs/boot-$EXP.log" && echo "logged"
} >> "$WS/runpodctl-calls"
exit 0
'''


def corpus(path, n, start=0):
    path.write_text('\n\n'.join(f"document {i}: the quick brown fox jumps over the lazy dog number {i % 11}"
                                for i in range(start, start + n)))
    return path


@pytest.fixture
def pod(tmp_path, monkeypatch):
    "A workspace, a fake `runpodctl` on PATH, and the environment a pod would have."
    ws = tmp_path/'ws'; ws.mkdir()
    # the volume's checkout, as the start command leaves it: not a package to import from the cwd
    (ws/'lmbook'/'nbs').mkdir(parents=True)
    bin_ = tmp_path/'bin'; bin_.mkdir()
    (bin_/'runpodctl').write_text(RUNPODCTL); (bin_/'runpodctl').chmod(0o755)
    env = dict(SECRETS, PATH=f"{bin_}:{os.environ['PATH']}", WS=str(ws), LMBOOK_WORKSPACE=str(ws),
               RUNPOD_POD_ID='pod1234abc', HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1')
    return ws, env


def calls(ws):
    f = ws/'runpodctl-calls'
    return f.read_text().split('ARGS ')[1:] if f.is_file() else []


def no_secret_in(ws, *texts):
    for p in ws.rglob('*'):
        if p.is_file():
            data = p.read_bytes()
            for s in SECRETS.values(): assert s.encode() not in data, f"{s} in {p}"
    for t in texts:
        for s in SECRETS.values(): assert s not in t


def test_orchestrate_then_boot_resumes_and_autokills_once_after_the_final_checkpoint(pod, tmp_path):
    ws, env = pod
    exp = 'bt'
    train, val = corpus(tmp_path/'train.txt', 400), corpus(tmp_path/'val.txt', 40, start=1000)
    r = lmbook_cmd('orchestrate', '--mode', 'local', '--input', train, '--validation', val, '--experiment',
                   exp, '--train-shard-lines', 100,
                   '--profile', 'smoke', '--set', *TINY.split(','), env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (ws/'logs'/f'boot-{exp}.log').read_text()
    for s in ('stage 2/4 layout', 'stage 3/4 data', 'stage 4/4 train: finished'): assert s in log
    assert 'stage 1/4' not in log
    shards = sorted(p.name for p in (ws/'datasets'/'train'/exp).iterdir() if p.name.startswith('shard'))
    assert len(shards) == 4, shards  # 400 documents, 100 lines a shard
    assert len(list((ws/'datasets'/'val'/exp).glob('shard*'))) == 1
    assert (ws/'settings.ini').is_file() and list((ws/'runs'/exp).glob('train-*.ipynb'))
    assert (ws/'runs'/exp/'checkpoints'/'step_00000004'/'COMPLETE').is_file() and calls(ws) == []

    # a new pod over the same volume: the finished run is not trained again; autokill fires once, after it
    benv = dict(env, RUN_CONFIG='smoke', RUN_EXPERIMENT=exp, RUN_SHARD='1', RUN_INPUT=str(train),
                RUN_OVERRIDES=TINY, AUTOKILL='terminate', EXP=exp)
    nbs = set((ws/'runs'/exp).glob('train-*.ipynb'))
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard', env=benv, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (ws/'logs'/f'boot-{exp}.log').read_text()
    assert 'stage 1/4 install: skipped' in log and 'already finished (step_00000004): nothing to train' in log
    assert set((ws/'runs'/exp).glob('train-*.ipynb')) == nbs
    (c,) = calls(ws)
    assert (c.splitlines()
            == ['remove pod pod1234abc', 'complete step_00000002', 'complete step_00000004', 'logged'])

    # more steps asked: the next boot resumes from step 4 through papermill, then stops the pod once
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard',
                   env=dict(benv, RUN_OVERRIDES=TINY.replace('max_steps=4', 'max_steps=6'), AUTOKILL='stop'),
                   timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (ws/'logs'/f'boot-{exp}.log').read_text()
    assert 'resumed at step 4' in log and 'stage 4/4 train: finished' in log
    c1, c2 = calls(ws)
    assert c2.splitlines()[0] == 'stop pod pod1234abc' and 'complete step_00000006' in c2 and 'logged' in c2
    assert json.loads((ws/'runs'/exp/'autokill.json').read_text())['action'] == 'stop'
    no_secret_in(ws, r.stdout, r.stderr)

    # the stopped pod resumed by hand (to fetch the results): the same pod, the same final checkpoint, it
    # stays up
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard',
                   env=dict(benv, RUN_OVERRIDES=TINY.replace('max_steps=4', 'max_steps=6'), AUTOKILL='stop'),
                   timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(calls(ws)) == 2 and 'autokill: not firing again' in (ws/'logs'/f'boot-{exp}.log').read_text()


def test_a_failed_run_stops_the_pod_unless_asked_to_keep_it(pod, tmp_path):
    ws, env = pod
    # no validation document: data preparation refuses it (exit code 2)
    one_doc = corpus(tmp_path/'tiny.txt', 1)
    benv = dict(env, RUN_CONFIG='smoke', RUN_EXPERIMENT='bad', RUN_SHARD='1', RUN_INPUT=str(one_doc),
                RUN_OVERRIDES=TINY, AUTOKILL='terminate', EXP='bad')
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard', '--on-failure', 'keep', env=benv, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert ('autokill: not firing, the run failed (exit code 2); the pod stays up (ON_FAILURE=keep)'
            in (ws/'logs'/'boot-bad.log').read_text())
    assert calls(ws) == []
    # the default: stop, never terminate, after a failure
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard', env=benv, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    log = (ws/'logs'/'boot-bad.log').read_text()
    assert ('autokill: stop pod pod1234abc: the run failed (exit code 2); the volume keeps the run and this '
            'log' in log)
    (c,) = calls(ws)
    assert c.splitlines()[0] == 'stop pod pod1234abc' 


def autokill_bench(tmp_path, experiment:str):
    """(run paths, the lines logged, a boot Log class, an env whose `runpodctl` records its calls in
    tmp_path/calls) for calling `boot.autokill` directly."""
    from lmbook.core import paths_for
    paths = paths_for(experiment, root=tmp_path)
    paths.run.mkdir(parents=True)
    lines = []
    class Log:
        f = open(tmp_path/'log', 'a')
        def __call__(self, m): lines.append(m)
        def sync(self): pass
    bin_ = tmp_path/'bin'; bin_.mkdir()
    (bin_/'runpodctl').write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\n')
    (bin_/'runpodctl').chmod(0o755)
    return paths, lines, Log, dict(PATH=f"{bin_}:{os.environ['PATH']}", RUNPOD_POD_ID='pod1234abc')


def test_autokill_only_fires_on_success_or_when_asked(tmp_path, monkeypatch):
    from lmbook.pods.boot import BootOptions, autokill
    paths, lines, Log, env = autokill_bench(tmp_path, 'ak')
    o = BootOptions(experiment='ak', autokill='stop', on_failure='keep')
    # diverged, and asked to keep the pod: it stays
    assert not autokill(o, paths, 3, Log(), env)
    assert not autokill(o, paths, 0, Log(), env)                  # "finished" but no final checkpoint
    # stopped by a signal: the pod is being stopped
    assert not autokill(BootOptions(experiment='ak'), paths, 143, Log(), env)
    assert not autokill(BootOptions(experiment='ak'), paths, 3, Log(), dict(env, RUNPOD_POD_ID=''))
    assert not (tmp_path/'calls').exists()
    # a failure stops; it never terminates
    assert autokill(BootOptions(experiment='ak', autokill='terminate'), paths, 3, Log(), env)
    assert (tmp_path/'calls').read_text() == 'stop pod pod1234abc\n'
    assert any('the run failed (exit code 3)' in l for l in lines)


def test_boot_options_come_from_the_pod_environment():
    from lmbook.pods.boot import BootOptions
    o = BootOptions.from_env(dict(RUN_CONFIG='runpod_2b', RUN_SHARD='1', SHARD_LINES='5000', RUN_NPROC='8',
                                  AUTOKILL='terminate'))
    assert ((o.experiment, o.shard, o.shard_lines, o.nproc, o.autokill)
            == ('runpod_2b', True, 5000, 8, 'terminate'))
    with pytest.raises(ValueError, match='AUTOKILL'): BootOptions.from_env(dict(AUTOKILL='yes'))
    assert (BootOptions.from_env({}).on_failure == 'stop'
            and BootOptions.from_env(dict(ON_FAILURE='keep')).on_failure == 'keep')
    with pytest.raises(ValueError, match='ON_FAILURE'): BootOptions.from_env(dict(ON_FAILURE='terminate'))
    with pytest.raises(ValueError, match='name=value'): BootOptions.from_env(dict(RUN_OVERRIDES='lr'))


FAKES = dict(  # each records its call in $REC; python3 only makes venvs, whose pip "installs" a fake lmbook
    git='#!/bin/sh\necho "git $*" >> "$REC"\nfor last; do :; done\n[ "$1" = clone ] && mkdir -p '
        '"$last/.git"\n[ "$3" = rev-parse ] && echo 0123456789abcdef\nexit 0\n',
    python3='#!/bin/sh\necho "python3 $*" >> "$REC"\n[ "$2" = venv ] || exit 1\nfor last; do :; done\nmkdir '
            '-p "$last/bin"\n'
            'cp "$FAKES/python" "$FAKES/pip" "$last/bin/"\n',
    python='#!/bin/sh\nexit 0\n',
    pip='#!/bin/sh\necho "pip $*" >> "$REC"\ncp "$FAKES/lmbook" "$(dirname "$0")/"\n',
    lmbook='#!/bin/sh\necho "lmbook $*" >> "$REC"\n')


def test_start_command_installs_on_the_volume_once_and_reuses_it(tmp_path):
    """Stage 1 of the pod's start command with fake git/python3: clone, venv, install on the first pod; a
    later pod only boots."""
    import shlex, signal, time
    from lmbook.pods.runpod import start_command
    ws, bin_, rec = tmp_path/'ws', tmp_path/'bin', tmp_path/'rec'
    bin_.mkdir()
    fakes = tmp_path/'fakes'; fakes.mkdir()
    for name, body in FAKES.items(): (fakes/name).write_text(body); (fakes/name).chmod(0o755)
    for name in ('git', 'python3'): (bin_/name).symlink_to(fakes/name)
    env = dict(PATH=f"{bin_}:/usr/bin:/bin", REC=str(rec), FAKES=str(fakes), LMBOOK_WORKSPACE=str(ws),
               RUN_EXPERIMENT='fw', LMBOOK_START='true',
               LMBOOK_REPO='https://example.org/lmbook.git', LMBOOK_COMMIT='0123456789abcdef')
    def boot():
        n = rec.read_text().count('lmbook boot\n') if rec.exists() else 0
        p = subprocess.Popen(shlex.split(start_command()), env=env, start_new_session=True)
        try:
            for _ in range(300):
                if rec.exists() and rec.read_text().count('lmbook boot\n') > n: return
                time.sleep(0.05)
            raise AssertionError((ws/'logs'/'boot-fw.log').read_text())
        finally: os.killpg(p.pid, signal.SIGKILL); p.wait()
    boot()
    s, v = ws/'lmbook', ws/'venvs'/'lmbook'
    assert rec.read_text().splitlines() == [f'git clone -q https://example.org/lmbook.git {s}',
                                            f'git -C {s} rev-parse HEAD',
                                            f'python3 -m venv --system-site-packages {v}',
                                            f'pip install -q -e {s}', f'git -C {s} rev-parse HEAD',
                                            'lmbook boot --help', 'lmbook boot']
    assert (v/'lmbook-commit').read_text().strip() == '0123456789abcdef'
    assert ('stage 1/4 install: lmbook 0123456789abcdef from https://example.org/lmbook.git'
            in (ws/'logs'/'boot-fw.log').read_text())
    boot()
    assert (rec.read_text().splitlines()[7:]
            == [f'git -C {s} rev-parse HEAD', 'lmbook boot --help', 'lmbook boot'])


def test_two_nodes_meet_through_torchrun_rendezvous(pod, tmp_path):
    """Two boots as two cluster nodes (1 CPU process each) on one shared workspace: node 0 prepares, node 1
    waits, both train."""
    import socket
    ws, env = pod
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    train = corpus(tmp_path/'train.txt', 400)
    base = dict(env, RUN_CONFIG='smoke', RUN_EXPERIMENT='mn', RUN_INPUT=str(train), RUN_OVERRIDES=TINY,
                RUN_NPROC='1',
                NUM_NODES='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), LMBOOK_DATA_WAIT='240')
    exe = Path(sys.executable).parent/'lmbook'
    procs = [subprocess.Popen([str(exe), 'boot', '--no-install', '--no-tensorboard'],
                              env=dict(base, NODE_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (1, 0)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    log0, log1 = (ws/'logs'/'boot-mn.log').read_text(), (ws/'logs'/'boot-mn-node1.log').read_text()
    assert 'torchrun --nnodes=2 --node_rank=0 --master_addr=127.0.0.1' in log0 and '--node_rank=1' in log1
    assert 'stage 3/4 data: waiting for node 0' in log1 and 'validation tokens' in log0
    meta = json.loads((ws/'runs'/'mn'/'meta.json').read_text())
    assert meta['world_size'] == 2 and (ws/'runs'/'mn'/'checkpoints'/'step_00000004'/'COMPLETE').is_file()


def test_install_stage_reinstalls_only_when_the_checkout_moved(tmp_path, monkeypatch):
    """Stage 1 inside the volume's venv: the same commit only registers the kernel; a new commit reinstalls
    first."""
    import lmbook.pods.boot as boot
    from lmbook.core import git_commit, package_dir
    venv = tmp_path/'venv'; venv.mkdir()
    monkeypatch.setattr(sys, 'prefix', str(venv))
    calls, lines = [], []
    real = subprocess.run
    monkeypatch.setattr(subprocess, 'run', lambda cmd, **kw: real(cmd, **kw) if cmd[0] == 'git'
                        else calls.append(cmd[2:5]))
    log = type('Log', (), dict(f=None, __call__=lambda self, m: lines.append(m)))()
    commit = git_commit(package_dir().parent)
    (venv/'lmbook-commit').write_text(f'{commit}\n')
    assert boot.stage_install(boot.BootOptions(), log) == 'lmbook'
    assert calls == [['ipykernel', 'install', '--user']] and 'from the image' in lines[-1]
    (venv/'lmbook-commit').write_text('an older commit\n')
    calls.clear()
    boot.stage_install(boot.BootOptions(), log)
    assert calls == [['pip', 'install', '-q'], ['ipykernel', 'install', '--user']]
    assert (venv/'lmbook-commit').read_text().strip() == commit
    monkeypatch.setattr(sys, 'prefix', sys.base_prefix)
    with pytest.raises(ValueError, match='virtualenv'): boot.stage_install(boot.BootOptions(), log)


@pytest.mark.parametrize('runpodctl', ['missing', 'failing'])
def test_autokill_through_the_api_when_runpodctl_is_missing_or_fails(tmp_path, monkeypatch, runpodctl):
    """Without a working `runpodctl` autokill uses the pod-scoped RUNPOD_API_KEY (REST v2); an API failure is
    logged on the volume, never raised."""
    from lmbook.dev.fake_runpod import FakeRunPodV2, serve
    from lmbook.pods.boot import BootOptions, autokill
    from lmbook.core import paths_for
    f = FakeRunPodV2('rpa_PODSCOPEDkey42')
    f.add_pod('pod1234abc', name='ak-1')
    srv, url = serve(f)
    monkeypatch.setenv('RUNPOD_API_BASE_URL', url)
    monkeypatch.setattr('lmbook.pods.api.time.sleep', lambda s: None)
    paths = paths_for('ak', root=tmp_path); paths.run.mkdir(parents=True)
    bin_ = tmp_path/'bin'; bin_.mkdir()
    if runpodctl == 'failing': (bin_/'runpodctl').write_text('#!/bin/sh\necho "runpodctl: unauthorized"; '
                                                             'exit 1\n'); (bin_/'runpodctl').chmod(0o755)
    lines = []
    log = type('Log', (), dict(f=None, __call__=lambda self, m: lines.append(m), sync=lambda self: None))()
    env = dict(PATH=str(bin_), RUNPOD_POD_ID='pod1234abc', RUNPOD_API_KEY='rpa_WRONGkey')
    o = BootOptions(experiment='ak')
    assert not autokill(o, paths, 3, log, env)
    assert (f.pods['pod1234abc']['status'] == 'RUNNING' and 'stop the pod by hand' in lines[-1]
            and 'rpa_WRONGkey' not in ' '.join(lines))
    assert autokill(o, paths, 3, log, dict(env, RUNPOD_API_KEY='rpa_PODSCOPEDkey42'))
    assert (f.pods['pod1234abc']['status'] == 'EXITED'
            and f.calls('POST', '/v2/pods/pod1234abc/action')[-1][2] == dict(action='stop'))
    assert ('runpodctl failed' in ' '.join(lines)) == (runpodctl == 'failing')
    srv.shutdown()


def test_the_spend_guard_stops_the_run_after_a_checkpoint_then_the_pod(pod, tmp_path, monkeypatch):
    """--max-dollars on the pod: priced from the API, the run stops mid-way with a checkpoint, then the pod
    stops (its volume kept)."""
    import time
    from lmbook.dev.fake_runpod import FakeRunPodV2, serve
    from lmbook.runs.checkpoint import list_checkpoints, verify_checkpoint, ckpt_step
    ws, env = pod
    f = FakeRunPodV2('rpa_PODSCOPEDkey42')
    f.add_pod('pod1234abc', name='sg-1')  # an H100 at $2.69/h
    srv, url = serve(f)
    train = corpus(tmp_path/'train.txt', 400)
    env = dict(env, PATH=os.environ['PATH'], RUNPOD_API_BASE_URL=url, RUN_CONFIG='smoke', RUN_EXPERIMENT='sg',
               RUN_SHARD='1', RUN_INPUT=str(train),
               RUN_OVERRIDES=TINY.replace('max_steps=4', 'max_steps=100000').replace('ckpt_every=2',
                                                                                     'ckpt_every=100000'),
               # 30 s at the API's price
               MAX_DOLLARS=f'{2.69*30/3600:.6f}', PRICE_PER_HOUR='9.99', LMBOOK_T0=str(time.time()))
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard', env=env, timeout=300)
    srv.shutdown()
    log = (ws/'logs'/'boot-sg.log').read_text()
    assert r.returncode == 143, log
    assert ('over --max-dollars' in log and 'at $2.69/h' in log
            and 'passing the spend limit on to the trainer' in log)
    (ck,) = list_checkpoints(ws/'runs'/'sg'/'checkpoints')
    assert verify_checkpoint(ck) and 0 < ckpt_step(ck) < 100000
    assert f.pods['pod1234abc']['status'] == 'EXITED' and 'autokill: stop pod pod1234abc: spend guard' in log
    ledger = json.loads((ws/'logs'/'spend-pod1234abc.json').read_text())
    assert 29 < ledger['seconds'] < 120 and ledger['price'] == 2.69


def test_tensorboard_starts_beside_training_and_is_not_started_twice(tmp_path):
    """TensorBoard serves the workspace's runs on its port (all interfaces, for RunPod's proxy); a second boot
    leaves it be."""
    import signal, socket, time, urllib.request
    from lmbook.pods.boot import start_tensorboard
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    lines = []
    p = start_tensorboard(tmp_path, port, lines.append)
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f'http://127.0.0.1:{port}/data/logdir',
                                            timeout=1) as r: logdir = json.loads(r.read())['logdir']; break
            except OSError: assert p.poll() is None, 'tensorboard exited'; time.sleep(0.1)
        else: raise AssertionError('tensorboard never answered')
        assert logdir == str(tmp_path) and f'on port {port}' in lines[0] and '--bind_all' in p.args
        assert start_tensorboard(tmp_path, port, lines.append) is None and 'already serves' in lines[-1]
        assert start_tensorboard(tmp_path, 0, lines.append) is None
    finally:
        os.killpg(p.pid, signal.SIGTERM); p.wait(10)
