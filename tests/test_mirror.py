"""Checkpoints mirrored off the volume while training goes on: a fine-tuning run with mirror=s3://... puts
every checkpoint into a bucket of a local S3 stand-in (moto's server on 127.0.0.1, through boto3);
mirror=hf://... goes through huggingface_hub to the local Hub stand-in; a failing mirror is a warning and the
run finishes."""
import json, os, subprocess, sys
import pytest
from pathlib import Path
from conftest import ROOT, lmbook_cmd
from lmbook.rundir import RunDir

sys.path.insert(0, str(ROOT/'nbs'/'benchmarks'))
S3_ENV = dict(AWS_ACCESS_KEY_ID='testing', AWS_SECRET_ACCESS_KEY='testing', AWS_DEFAULT_REGION='us-east-1')


@pytest.fixture(scope='module')
def model_and_data(tmp_path_factory):
    from tiny_llama import tiny_llama
    from lmbook.data.sft import builtin_chat, write_jsonl
    d = tmp_path_factory.mktemp('m')
    return tiny_llama(d/'tiny'), write_jsonl(builtin_chat()[:20], d/'chat.jsonl')


def finetune(model, data, exp, mirror, env):
    return lmbook_cmd('finetune', '--init-from', f'hf:{model}', '--data', data, '-e', exp, '--lora-rank', 2,
                      '--max-steps', 4,
                      '--set', 'block_size=128', 'batch_size=2', 'ckpt_every=2', 'eval_every=2', 'device=cpu',
                      f'mirror={mirror}', env=env)


def test_s3_mirror(workspace, model_and_data):
    moto = pytest.importorskip('moto.server')
    import boto3
    srv = moto.ThreadedMotoServer(ip_address='127.0.0.1', port=0); srv.start()
    try:
        url = f"http://127.0.0.1:{srv._server.server_port}"
        s3 = boto3.client('s3', endpoint_url=url,
                          **{k.lower(): v for k, v in S3_ENV.items() if k != 'AWS_DEFAULT_REGION'},
                          region_name='us-east-1')
        s3.create_bucket(Bucket='ckpts')
        r = finetune(*model_and_data, 'mir', 's3://ckpts/runs', dict(S3_ENV, AWS_ENDPOINT_URL=url))
        assert r.returncode == 0, r.stdout + r.stderr
        keys = {o['Key'] for o in s3.list_objects_v2(Bucket='ckpts')['Contents']}
        ck = workspace/'runs'/'mir'/'checkpoints'/'step_00000004'
        assert {f"runs/mir/step_00000004/{f.name}" for f in ck.iterdir() if f.is_file()} <= keys
        body = s3.get_object(Bucket='ckpts', Key='runs/mir/step_00000004/model.safetensors')['Body'].read()
        assert body == (ck/'model.safetensors').read_bytes()
        assert 'mirror: step_00000004 copied to s3://ckpts/runs/mir/step_00000004' in r.stdout
        assert not (workspace/'runs'/'mir'/'.mirror').exists()
    finally: srv.stop()


def test_failing_mirror_is_a_warning(workspace, model_and_data):
    r = finetune(*model_and_data, 'nomir', 's3://ckpts/runs',
                 dict(S3_ENV, AWS_ENDPOINT_URL='http://127.0.0.1:9'))
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'warning: mirror: step_00000004 was not copied' in r.stdout and 'done: 4 steps' in r.stdout


def test_hf_mirror(tmp_path):
    from fake_hub import FakeHub
    ck = tmp_path/'step_00000002'
    ck.mkdir(); (ck/'model.safetensors').write_bytes(b'w'*64); (ck/'COMPLETE').write_text('ok')
    hub = FakeHub()
    code = ("from lmbook.runs.mirror import Mirror; import sys; from pathlib import Path\n"
            f"m = Mirror('hf://me/ckpts', 'exp', Path({str(tmp_path)!r})/'.mirror'); "
            f"m.submit(Path({str(ck)!r})); m.close()\n"
            "sys.exit(0 if m.done == ['step_00000002'] else 1)")
    try:
        r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, 'HF_ENDPOINT': hub.url, 'HF_TOKEN': 'hf_' + 'x'*20,
                                'HF_HUB_OFFLINE': '0', 'HF_HOME': str(tmp_path/'hfhome')})
    finally: hub.close()
    assert r.returncode == 0, r.stdout + r.stderr
    assert hub.files[('me/ckpts', 'exp/step_00000002/model.safetensors')] == b'w'*64


class Silent:
    "A local endpoint that accepts connections and never answers."
    def __init__(self):
        import socket, threading
        self.sock = socket.socket(); self.sock.bind(('127.0.0.1', 0)); self.sock.listen(16)
        self.url, self.held = f"http://127.0.0.1:{self.sock.getsockname()[1]}", []
        threading.Thread(target=self._hold, daemon=True).start()
    def _hold(self):
        while True:
            try:self.held.append(self.sock.accept()[0])
            except OSError: return
    def close(self):
        for c in self.held: c.close()
        self.sock.close()


TINY = [
    '--set',
    'take=1500',
    'batch_size=4',
    'block_size=64',
    'n_embd=64',
    'n_head=2',
    'eval_every=4',
    'eval_steps=1',
    'max_steps=4',
    'warmup_steps=1',
    'ckpt_every=4',
    'tensorboard=False',
    'mirror=s3://ckpts/runs',
]

def train_popen(ws, exp, wait_s, url, *extra):
    exe = Path(sys.executable).parent/'lmbook'
    return subprocess.Popen(
        [str(exe), 'train', '-p', 'smoke', '-e', exp, '--root', str(ws), *extra, *TINY,
         f'mirror_wait_s={wait_s}'],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **S3_ENV, 'AWS_ENDPOINT_URL': url, 'HF_HUB_OFFLINE': '1'},
    )


def test_mirror_that_never_answers_waits_at_most_mirror_wait_s(workspace):
    """An endpoint that accepts and never answers: the finished run says once what it waits for, gives up
    after mirror_wait_s, lists the checkpoint it could not copy with the retry command, and leaves no lock
    and no staging folder."""
    srv = Silent()
    try:
        p = train_popen(workspace, 'silent', 1, srv.url)
        out = p.communicate(timeout=120)[0]
    finally:
        srv.close()
    assert p.returncode == 0, out
    run = workspace/'runs'/'silent'
    assert out.count('mirror: waiting up to 1 s for step_00000004') == 1, out
    left = json.loads(RunDir(run).mirror_left.read_text())
    assert left['checkpoints'] == ['step_00000004'] and left['retry'] == f"lmbook mirror {run}", left
    assert 'Traceback' not in out and not (run/'.lock').exists() and not (run/'.mirror').exists(), out
    moto = pytest.importorskip('moto.server')  # the endpoint answers again: the retry command copies the list
    import boto3
    srv = moto.ThreadedMotoServer(ip_address='127.0.0.1', port=0); srv.start()
    try:
        url = f"http://127.0.0.1:{srv._server.server_port}"
        boto3.client('s3', endpoint_url=url, region_name='us-east-1', aws_access_key_id='testing',
                     aws_secret_access_key='testing').create_bucket(Bucket='ckpts')
        r = lmbook_cmd('mirror', run, env=dict(S3_ENV, AWS_ENDPOINT_URL=url))
    finally:
        srv.stop()
    assert r.returncode == 0 and 'mirror: step_00000004 copied to s3://ckpts/runs/silent' in r.stdout, (
        r.stdout + r.stderr
    )
    assert not RunDir(run).mirror_left.exists()


@pytest.mark.parametrize('nproc', [1, 2])
def test_a_signal_ends_the_mirror_wait_at_once(workspace, nproc):
    """SIGTERM while a finished run waits for its mirror, one process or under torchrun: it ends in seconds,
    lock released, list written."""
    import signal, time
    srv = Silent()
    try:
        p = train_popen(workspace, 'silent-term', 300, srv.url, '--nproc', str(nproc))
        seen = []
        for line in p.stdout:
            seen.append(line)
            if line.startswith('mirror: waiting up to 300 s'): break
        assert seen and seen[-1].startswith('mirror: waiting'), ''.join(seen)[-3000:]  # else what it said
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=60)[0]
        took = time.monotonic() - t0
    finally: srv.close()
    run = workspace/'runs'/'silent-term'
    assert took < 10 and not (run/'.lock').exists() and not (run/'.mirror').exists(), (took, out)
    assert 'Traceback' not in out and RunDir(run).mirror_left.is_file(), out
