"""The boot pipeline end to end on this machine: orchestrate, boot, resume, and the report of how the run
ended that the pod's supervisor acts on (its end: test_pod_matrix, test_pod_stops)."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from conftest import lmbook_cmd

TINY = ('max_steps=4,batch_size=2,block_size=32,n_layer=1,n_embd=32,n_head=2,vocab_size=300,eval_every=2,'
        'eval_steps=1,ckpt_every=2,log_every=2,warmup_steps=1')
SECRETS = dict(HF_TOKEN='hf_BOOTsecretTOKEN42', JUPYTER_PASSWORD='jp_BOOTsecretPASS42',
               RUNPOD_API_KEY='rpa_PODSCOPEDkey42')
def corpus(path, n, start=0):
    path.write_text('\n\n'.join(f"document {i}: the quick brown fox jumps over the lazy dog number {i % 11}"
                                for i in range(start, start + n)))
    return path


@pytest.fixture
def pod(tmp_path, monkeypatch):
    "A workspace and the environment a pod would have."
    ws = tmp_path/'ws'; ws.mkdir()
    # the volume's checkout, as the start command leaves it: not a package to import from the cwd
    (ws/'lmbook'/'nbs').mkdir(parents=True)
    env = dict(SECRETS, LMBOOK_WORKSPACE=str(ws), RUNPOD_POD_ID='pod1234abc', HF_HUB_OFFLINE='1',
               HF_DATASETS_OFFLINE='1')
    return ws, env


def outcome(ws, exp): return json.loads((ws/'logs'/f'outcome-{exp}.json').read_text())


def no_secret_in(ws, *texts):
    for p in ws.rglob('*'):
        if p.is_file():
            data = p.read_bytes()
            for s in SECRETS.values(): assert s.encode() not in data, f"{s} in {p}"
    for t in texts:
        for s in SECRETS.values(): assert s not in t


def test_orchestrate_then_boot_resumes_and_reports_how_the_run_ended(pod, tmp_path):
    ws, env = pod
    exp = 'bt'
    train, val = corpus(tmp_path/'train.txt', 400), corpus(tmp_path/'val.txt', 40, start=1000)
    r = lmbook_cmd('orchestrate', '--mode', 'local', '--input', train, '--validation', val, '--experiment',
                   exp, '--train-shard-lines', 100,
                   '--profile', 'smoke', '--set', *TINY.split(','), env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (ws/'logs'/f'boot-{exp}.log').read_text()
    for s in ('stage 2/4 layout', 'stage 3/4 data', 'stage 4/4 train: the run finished'): assert s in log
    assert 'stage 1/4' not in log
    shards = sorted(p.name for p in (ws/'datasets'/'train'/exp).iterdir() if p.name.startswith('shard'))
    assert len(shards) == 4, shards  # 400 documents, 100 lines a shard
    assert len(list((ws/'datasets'/'val'/exp).glob('shard*'))) == 1
    assert (ws/'settings.ini').is_file() and list((ws/'runs'/exp).glob('train-*.ipynb'))
    assert (ws/'runs'/exp/'checkpoints'/'step_00000004'/'COMPLETE').is_file()
    assert outcome(ws, exp) | dict(lock=None, ckpt_dir=None) == dict(
        outcome='finished', why='the run finished (step_00000004 complete)', rc=0, alerted=False, total=4,
        lock=None, ckpt_dir=None)

    # a new pod over the same volume: the finished run is not trained again
    benv = dict(env, RUN_CONFIG='smoke', RUN_EXPERIMENT=exp, RUN_SHARD='1', RUN_INPUT=str(train),
                RUN_OVERRIDES=TINY)
    nbs = set((ws/'runs'/exp).glob('train-*.ipynb'))
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard', env=benv, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (ws/'logs'/f'boot-{exp}.log').read_text()
    assert 'stage 1/4 install: skipped' in log and 'already finished (step_00000004): nothing to train' in log
    assert set((ws/'runs'/exp).glob('train-*.ipynb')) == nbs and outcome(ws, exp)['outcome'] == 'finished'

    # more steps asked: the next boot resumes from step 4 through papermill
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard',
                   env=dict(benv, RUN_OVERRIDES=TINY.replace('max_steps=4', 'max_steps=6')), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (ws/'logs'/f'boot-{exp}.log').read_text()
    assert 'resumed at step 4' in log and 'stage 4/4 train: the run finished (step_00000006 complete)' in log
    no_secret_in(ws, r.stdout, r.stderr)


def test_a_failed_run_is_reported_with_its_reason(pod, tmp_path):
    ws, env = pod
    # no validation document: data preparation refuses it (exit code 2)
    one_doc = corpus(tmp_path/'tiny.txt', 1)
    benv = dict(env, RUN_CONFIG='smoke', RUN_EXPERIMENT='bad', RUN_SHARD='1', RUN_INPUT=str(one_doc),
                RUN_OVERRIDES=TINY)
    r = lmbook_cmd('boot', '--no-install', '--no-tensorboard', env=benv, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    o = outcome(ws, 'bad')
    assert o['outcome'] == 'failed' and o['rc'] == 2 and o['why'].startswith('error: '), o
    assert o['why'] in (ws/'logs'/'boot-bad.log').read_text()


def test_boot_options_come_from_the_pod_environment():
    from lmbook.pods.boot import BootOptions
    o = BootOptions.from_env(dict(RUN_CONFIG='runpod_2b', RUN_SHARD='1', SHARD_LINES='5000', RUN_NPROC='8'))
    assert (o.experiment, o.shard, o.shard_lines, o.nproc) == ('runpod_2b', True, 5000, 8)
    with pytest.raises(ValueError, match='name=value'): BootOptions.from_env(dict(RUN_OVERRIDES='lr'))


FAKES = dict(  # each records its call in $REC; python3 only makes venvs, whose pip "installs" a fake lmbook
    git='#!/bin/sh\necho "git $*" >> "$REC"\nfor last; do :; done\n[ "$1" = clone ] && mkdir -p '
        '"$last/.git"\n[ "$3" = rev-parse ] && echo 0123456789abcdef\nexit 0\n',
    python3='#!/bin/sh\n[ "$2" = venv ] || exec "$PYTHON" "$@"\n'  # the supervisor: a real python3
            'echo "python3 $*" >> "$REC"\nfor last; do :; done\nmkdir -p "$last/bin"\n'
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
               PYTHON=sys.executable, TMPDIR=str(tmp_path),
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
                                            'lmbook boot']
    assert (v/'lmbook-commit').read_text().strip() == '0123456789abcdef'
    assert ('stage 1/4 install: lmbook 0123456789abcdef from https://example.org/lmbook.git'
            in (ws/'logs'/'boot-fw.log').read_text())
    boot()
    assert rec.read_text().splitlines()[6:] == [f'git -C {s} rev-parse HEAD', 'lmbook boot']


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
    assert outcome(ws, 'mn')['outcome'] == outcome(ws, 'mn-node1')['outcome'] == 'finished'
    meta = json.loads((ws/'runs'/'mn'/'meta.json').read_text())
    assert meta['world_size'] == 2 and (ws/'runs'/'mn'/'checkpoints'/'step_00000004'/'COMPLETE').is_file()


def test_install_stage_reinstalls_only_when_the_checkout_moved(tmp_path, monkeypatch):
    "Stage 1 inside the volume's venv: the same commit installs nothing; a new commit reinstalls."
    import lmbook.pods.stages as stages
    from lmbook.core import git_commit, package_dir
    venv = tmp_path/'venv'; venv.mkdir()
    monkeypatch.setattr(sys, 'prefix', str(venv))
    monkeypatch.setattr(stages.shutil, 'which', lambda name: None)  # no nvidia-smi: no GPU, no torchao
    calls, lines = [], []
    real = subprocess.run
    monkeypatch.setattr(subprocess, 'run', lambda cmd, **kw: real(cmd, **kw) if cmd[0] == 'git'
                        else calls.append(cmd[2:5]))
    log = type('Log', (), dict(f=None, __call__=lambda self, m: lines.append(m)))()
    commit = git_commit(package_dir().parent)
    (venv/'lmbook-commit').write_text(f'{commit}\n')
    assert stages.stage_install(stages.BootOptions(), log)
    assert calls == [] and 'from the image' in lines[-1]
    (venv/'lmbook-commit').write_text('an older commit\n')
    stages.stage_install(stages.BootOptions(), log)
    assert calls == [['pip', 'install', '-q']]
    assert (venv/'lmbook-commit').read_text().strip() == commit
    monkeypatch.setattr(sys, 'prefix', sys.base_prefix)
    with pytest.raises(ValueError, match='virtualenv'): stages.stage_install(stages.BootOptions(), log)


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
