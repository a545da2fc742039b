"""The pod's exact start command, run by bash as a container's PID 1 would be: a stop signal reaches the
trainer, which checkpoints; a failed install stops the pod through the (fake REST v2) API and says why in the
volume's log; an endpoint pod serves. Every way a run ends, under every state of the API: test_pod_matrix."""
import json, os, shlex, signal, subprocess, sys, sysconfig, time
from pathlib import Path
import pytest
from lmbook.dev.fake_runpod import FakeRunPodV2, serve
from lmbook.pods.runpod import start_command
from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint, ckpt_step

ROOT = Path(__file__).resolve().parents[1]
KEY = 'rpa_PODSCOPEDkey42'
HEAD = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()
TINY = ('max_steps=500,batch_size=2,block_size=32,n_layer=1,n_embd=32,n_head=2,vocab_size=300,'
        'eval_every=1000,eval_steps=1,ckpt_every=1000,log_every=1,warmup_steps=1,tensorboard=false')


def volume_venv(path):
    """A virtualenv standing in for the volume's (/workspace/venvs/lmbook): it sees this environment's
    packages, and lmbook is at HEAD. Made once: a second call finds it."""
    if (path/'bin'/'lmbook').exists(): return path
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(path)], check=True)
    site = next(path.glob('lib/python*/site-packages'))
    (site/'lmbook-dev.pth').write_text(sysconfig.get_paths()['purelib'] + '\n' + str(ROOT) + '\n')
    (path/'bin'/'lmbook').write_text(f"#!{path}/bin/python\nimport sys\nfrom lmbook.cli import "
                                     "main\nsys.exit(main())\n")
    (path/'bin'/'lmbook').chmod(0o755)
    (path/'lmbook-commit').write_text(HEAD + '\n')
    return path


def container(tmp_path, url, **env):
    "The environment a pod's container has, with a stand-in for the image's /start.sh."
    # this checkout itself as the pod's: no commit to check out, or a commit made meanwhile would move it
    here = env.get('LMBOOK_SRC') == str(ROOT) and 'LMBOOK_COMMIT' not in env
    start = tmp_path/'start.sh'
    start.write_text('#!/bin/bash\nexec sleep 600\n'); start.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k in ('PATH', 'LANG', 'TMPDIR')}
    (tmp_path/'tmp').mkdir(exist_ok=True)  # the container's /tmp, where the start command writes its script
    return base | dict(HOME=str(tmp_path/'home'), TMPDIR=str(tmp_path/'tmp'),
                       LMBOOK_WORKSPACE=str(tmp_path/'workspace'),
                       RUN_EXPERIMENT='pod', RUN_CONFIG='smoke',
                       RUNPOD_POD_ID='pod1234abc', RUNPOD_API_KEY=KEY, RUNPOD_API_BASE_URL=url,
                       LMBOOK_START=str(start), LMBOOK_COMMIT='' if here else HEAD,
                       HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', PYTHONUNBUFFERED='1',
                       TENSORBOARD_PORT='0') | env


@pytest.fixture
def api():
    f = FakeRunPodV2(KEY)
    f.add_pod('pod1234abc', name='pod-1')
    srv, url = serve(f)
    f.url = url
    yield f
    srv.shutdown()


def pid1(env):
    "The start command as a container runs it: PID 1 of its own session and process group."
    return subprocess.Popen(shlex.split(start_command()), env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def end_container(workspace:Path):
    "SIGKILL every process of a container, as its end would: they carry its workspace in their environment."
    mark = f"LMBOOK_WORKSPACE={workspace}".encode()
    for d in Path('/proc').iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid(): continue
        try:
            if mark in (d/'environ').read_bytes().split(b'\0'): os.kill(int(d.name), signal.SIGKILL)
        except (OSError, ProcessLookupError): pass


def wait_for(cond, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (v := cond()): return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def stops(api): return [b for m, p, b in api.calls('POST', '/v2/pods/pod1234abc/action')]


@pytest.mark.parametrize('how', ['clone', 'pip'])
def test_a_failed_stage_before_boot_stops_the_pod_and_says_why(api, tmp_path, how):
    if how == 'clone': repo = f'file://{tmp_path}/no-such-repo.git'
    else:  # a repository that clones, but is no Python project: pip install fails
        src = tmp_path/'src'; src.mkdir()
        subprocess.run(f'git init -q {src} && git -C {src} -c user.email=a@b.c -c user.name=a commit -q '
                       '--allow-empty -m x', shell=True, check=True)
        repo = f'file://{src}'
    env = container(tmp_path, api.url, LMBOOK_REPO=repo, LMBOOK_COMMIT='')
    p = pid1(env)
    try:
        log_file = tmp_path/'workspace'/'logs'/'boot-pod.log'
        wait_for(lambda: log_file.is_file() and 'pod: RunPod took the stop' in log_file.read_text(), 120,
                 'the supervisor to stop the pod')
        log = log_file.read_text()
        want = 'git clone' if how == 'clone' else 'pip install -e'
        assert (f'install: {want}' in log and f'pod: the install failed ({want}' in log
                and 'stopping pod pod1234abc' in log), log
        assert stops(api) == [dict(action='stop')] and api.pods['pod1234abc']['status'] == 'EXITED'
        # PID 1 stays until RunPod's stop ends the container (the image's start script keeps SSH up)
        assert p.poll() is None
        assert KEY not in log
    finally:
        os.killpg(p.pid, signal.SIGKILL); p.wait()


def test_a_container_stop_reaches_the_trainer_which_checkpoints(api, tmp_path):
    """SIGTERM to PID 1 alone, as `docker stop` sends it: the real trainer, under papermill, writes its stop
    checkpoint (the money matrix sends it to PID 1's process group too, with a stand-in trainer)."""
    corpus = tmp_path/'corpus.txt'
    corpus.write_text('\n\n'.join(f"document {i}: the quick brown fox jumps over the lazy dog number {i % 11}"
                                  for i in range(300)))
    env = container(tmp_path, api.url, LMBOOK_REPO=f'file://{ROOT}', LMBOOK_SRC=str(ROOT),
                    LMBOOK_VENV=str(volume_venv(tmp_path/'venv')),
                    RUN_SHARD='1', RUN_INPUT=str(corpus), RUN_OVERRIDES=TINY, AUTOKILL='stop')
    run = tmp_path/'workspace'/'runs'/'pod'
    p = pid1(env)
    try:
        wait_for(lambda: (run/'metrics.jsonl').is_file()
                 and '"step": 3,' in (run/'metrics.jsonl').read_text(), 240, 'step 3')
        os.kill(p.pid, signal.SIGTERM)
        rc = p.wait(120)
    # the container goes: whatever is left of its process group (the start script's stand-in) goes with it
    finally:
        try: os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError: pass
        p.wait()
    log = (tmp_path/'workspace'/'logs'/'boot-pod.log').read_text()
    assert rc == 143, log
    cks = list_checkpoints(run/'checkpoints')
    assert cks and verify_checkpoint(cks[0]), log  # ckpt_every=1000: only the stop wrote one
    step = ckpt_step(cks[0])
    assert f'stopped by SIGTERM at step {step}/500' in (run/'train.log').read_text()
    assert ('pod: the container got SIGTERM: passing it on' in log
            and 'passing the SIGTERM boot got on to the trainer' in log)
    # the container is being stopped: RunPod ends the pod, nobody calls its API
    assert 'the container exits and RunPod ends the pod' in log and stops(api) == []
    # nothing of the run is left behind
    assert not subprocess.run(['pgrep', '-f', str(run)], capture_output=True).stdout.strip()


def test_an_endpoint_pod_serves_the_model(api, tmp_path):
    """RUN_SERVE (pod create --serve): the start command runs `lmbook serve` on SERVE_PORT instead of the
    training boot."""
    import socket, urllib.request
    sys.path.insert(0, str(ROOT/'nbs'/'benchmarks'))
    from tiny_llama import tiny_llama
    model = tiny_llama(tmp_path/'workspace'/'exports'/'tiny')
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    env = container(tmp_path, api.url, LMBOOK_REPO=f'file://{ROOT}', LMBOOK_SRC=str(ROOT),
                    LMBOOK_VENV=str(volume_venv(tmp_path/'venv')),
                    RUN_SERVE=str(model), SERVE_PORT=str(port), RUN_EXPERIMENT='serve-tiny',
                    LMBOOK_API_KEY='sk-pod-key')
    p = pid1(env)
    try:
        def answer():
            req = urllib.request.Request(f'http://127.0.0.1:{port}/v1/completions',
                                         b'{"prompt": "What", "max_tokens": 3}',
                                         {'Content-Type': 'application/json',
                                          'Authorization': 'Bearer sk-pod-key'})
            try: return json.loads(urllib.request.urlopen(req, timeout=5).read())
            except OSError: return None
        r = wait_for(answer, 120, 'the endpoint to answer')
        assert r['object'] == 'text_completion' and r['model'] == 'tiny'
        assert not (tmp_path/'workspace'/'runs').exists()  # nothing trained
    finally:
        os.killpg(p.pid, signal.SIGKILL); p.wait()
        end_container(tmp_path/'workspace')  # the supervisor starts the server in a session of its own


def test_an_endpoint_pod_with_vllm(api, tmp_path):
    """SERVE_ENGINE=vllm: the start command runs vLLM's OpenAI server on the export, its key as VLLM_API_KEY
    only."""
    fake = tmp_path/'fake'/'vllm'/'entrypoints'/'openai'
    fake.mkdir(parents=True)
    for d in (fake, fake.parent, fake.parent.parent): (d/'__init__.py').write_text('')
    (fake/'api_server.py').write_text("import json, os, sys\nopen(os.environ['LMBOOK_WORKSPACE'] + "
                                      "'/vllm.json', 'w')"
                                      ".write(json.dumps(dict(argv=sys.argv[1:], "
                                      "key=os.environ.get('VLLM_API_KEY'))))\n")
    venv = volume_venv(tmp_path/'venv')
    (next(venv.glob('lib/python*/site-packages'))/'fake-vllm.pth').write_text(str(tmp_path/'fake') + '\n')
    env = container(tmp_path, api.url, LMBOOK_REPO=f'file://{ROOT}', LMBOOK_SRC=str(ROOT),
                    LMBOOK_VENV=str(venv),
                    RUN_SERVE='/workspace/exports/chat-7b', SERVE_PORT='8000', SERVE_ENGINE='vllm',
                    RUN_EXPERIMENT='serve-chat', LMBOOK_API_KEY='sk-pod-key')
    p = pid1(env)
    try:
        got = json.loads(wait_for(lambda: (tmp_path/'workspace'/'vllm.json').is_file()
                                  and (tmp_path/'workspace'/'vllm.json').read_text(),
                                   60, "vLLM's server to start"))
    finally: os.killpg(p.pid, signal.SIGKILL); p.wait()
    assert got == dict(argv=['--model', '/workspace/exports/chat-7b', '--served-model-name', 'chat-7b',
                             '--host', '0.0.0.0', '--port', '8000'], key='sk-pod-key')


@pytest.mark.parametrize('torch_version, want', [('2.9.1', '0.15.0'), ('2.4.1', None)])
def test_a_gpu_pod_gets_the_torchao_built_for_its_torch(tmp_path, monkeypatch, torch_version, want):
    """The install stage on a GPU (nvidia-smi there, no torchao): the torchao release built for the image's
    torch (fp8='auto' needs it), or one line saying the runs train in bf16."""
    import importlib.metadata, importlib.util
    from lmbook.pods import stages
    bin_ = tmp_path/'bin'; bin_.mkdir()
    (bin_/'nvidia-smi').write_text('#!/bin/sh\n'); (bin_/'nvidia-smi').chmod(0o755)
    monkeypatch.setenv('PATH', f"{bin_}:{os.environ['PATH']}")
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
    monkeypatch.setattr(importlib.metadata, 'version', lambda name: torch_version)
    ran = []
    monkeypatch.setattr(stages.subprocess, 'run',
                        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    said = []
    class Log(list):
        f = None
        def __call__(self, m): said.append(m)
    stages.install_float8(Log())
    if want:
        assert ran == [[sys.executable, '-m', 'pip', 'install', '-q', f'torchao=={want}']]
        assert said == [f'stage 1/4 install: torchao {want} for torch {torch_version} (float8)']
    else: assert not ran and "fp8='auto' trains in bf16" in said[0]
