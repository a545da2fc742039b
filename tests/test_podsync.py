"""`lmbook pod push`, `pod fetch` and `pod logs` against a real sshd on 127.0.0.1 (Debian's openssh-server),
and `lmbook pod volume upload` against a local S3-compatible server (moto's, from the `moto[server]`
package)."""
import json, os, shutil, socket, subprocess, time
from pathlib import Path
import pytest
from lmbook.dev.fake_runpod import FakeRunPodV2, serve
from test_runpod import run, one_line_error, KEY

FAKE = {}  # the fake API of the running `pod` fixture
SSHD = shutil.which('sshd') or next((p for p in ('/usr/sbin/sshd', '/usr/bin/sshd') if os.path.exists(p)),
                                    None)


def free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


@pytest.fixture
def sshd(tmp_path):
    """A real sshd on 127.0.0.1 that lets this machine's root in with a fresh key: a pod's SSH, seen from the
    laptop."""
    if not SSHD: pytest.skip("no sshd on this machine (Debian: apt-get install openssh-server)")
    if os.geteuid() != 0: pytest.skip("a pod is entered as root: the sshd test runs as root")
    d = tmp_path/'sshd'; d.mkdir()
    for k in ('host', 'client'):
        subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', str(d/k)], check=True)
    (d/'authorized_keys').write_text((d/'client.pub').read_text())
    port = free_port()
    (d/'sshd_config').write_text(f"Port {port}\nListenAddress "
                                 f"127.0.0.1\nHostKey {d}/host\nAuthorizedKeysFile {d}/authorized_keys\n"
                                 f"PidFile {d}/sshd.pid\nPasswordAuthentication "
                                 "no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                                 "StrictModes no\nUsePAM no\nSubsystem sftp internal-sftp\n")
    Path('/run/sshd').mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([SSHD, '-D', '-e', '-f', str(d/'sshd_config')], stdout=subprocess.DEVNULL,
                         stderr=open(d/'sshd.log', 'w'))
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(('127.0.0.1', port)) == 0: break
        assert p.poll() is None, (d/'sshd.log').read_text()
        time.sleep(0.05)
    yield port, f"-i {d}/client -o UserKnownHostsFile={d}/known_hosts -o IdentitiesOnly=yes"
    p.terminate(); p.wait(10)


@pytest.fixture
def pod(sshd, tmp_path, monkeypatch):
    "A running pod in the fake API whose SSH is the local sshd and whose volume is a folder."
    port, opts = sshd
    f = FakeRunPodV2(KEY)
    f.ssh = ('127.0.0.1', port)
    f.add_pod('podSSH', name='fw-2b-1', env=dict(RUN_EXPERIMENT='fw-2b'))
    srv, url = serve(f)
    FAKE['api'] = f
    vol = tmp_path/'volume'
    run_dir = vol/'runs'/'fw-2b'
    (run_dir/'checkpoints'/'step_00000010').mkdir(parents=True)
    (run_dir/'checkpoints'/'step_00000010'/'model.safetensors').write_bytes(b'\0'*1000)
    (run_dir/'metrics.jsonl').write_text('{"step": 10, "loss": 3.2}\n')
    (vol/'logs').mkdir()
    (vol/'logs'/'boot-fw-2b.log').write_text(''.join(f'[boot] line {i}\n' for i in range(20)))
    f.logs['podSSH'] = vol/'logs'/'boot-fw-2b.log'  # the start script copies it to the container's stdout
    for k, v in dict(RUNPOD_API_BASE_URL=url, RUNPOD_API_KEY=KEY, LMBOOK_SSH_OPTS=opts,
                     LMBOOK_POD_WORKSPACE=str(vol),
                     LMBOOK_WORKSPACE=str(tmp_path/'laptop')).items(): monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    yield vol
    srv.shutdown()


@pytest.mark.parametrize('copy', ['rsync', 'tar'])
def test_push_and_fetch_over_ssh(pod, tmp_path, capsys, monkeypatch, copy):
    if copy == 'rsync' and not shutil.which('rsync'):
        pytest.skip('no rsync on this machine (Debian: apt-get install rsync)')
    monkeypatch.setenv('LMBOOK_COPY', copy)
    data = tmp_path/'corpus'; (data/'sub').mkdir(parents=True)
    (data/'a.txt').write_text('first document\n'); (data/'sub'/'b.jsonl').write_text('{"text": "second"}\n')
    rc, out, err = run(capsys, 'pod', 'push', data, 'podSSH')
    assert rc == 0, err
    assert ((pod/'uploads'/'corpus'/'a.txt').read_text() == 'first document\n'
            and (pod/'uploads'/'corpus'/'sub'/'b.jsonl').is_file())
    rc, out, err = run(capsys, 'pod', 'push', data/'a.txt', 'podSSH', '--dest', f'{pod}/data/one.txt')
    assert rc == 0 and (pod/'data'/'one.txt').read_text() == 'first document\n', err
    one_line_error(*run(capsys, 'pod', 'push', data/'a.txt', 'podSSH', '--dest', '/etc/passwd'),
                   'push onto the volume')
    rc, out, err = run(capsys, 'pod', 'fetch', 'podSSH')
    local = tmp_path/'laptop'/'runs'/'fw-2b'
    assert (rc == 0 and (local/'metrics.jsonl').read_text() == '{"step": 10, "loss": 3.2}\n'
            and not (local/'checkpoints').exists()), err
    rc, out, err = run(capsys, 'pod', 'fetch', 'podSSH', '--checkpoints', '--dest', tmp_path/'all')
    ck = tmp_path/'all'/'checkpoints'/'step_00000010'/'model.safetensors'
    assert rc == 0 and ck.stat().st_size == 1000, err


def test_logs_come_from_the_logs_endpoint_and_ssh_needs_a_registered_key(pod, tmp_path, capsys):
    rc, out, err = run(capsys, 'pod', 'logs', 'podSSH', '-n', '3')
    assert rc == 0 and out.splitlines() == ['[boot] line 17', '[boot] line 18', '[boot] line 19'], err
    # RunPod's startSsh does nothing without a key: say so before ssh fails with 255
    FAKE['api'].ssh_keys = []
    for cmd in (['push', pod/'logs', 'podSSH'], ['fetch', 'podSSH'], ['stop', 'podSSH']):
        one_line_error(*run(capsys, 'pod', *cmd), 'no SSH public key is registered', 'SSH Public Keys')
    assert FAKE['api'].pods['podSSH']['status'] == 'RUNNING'


def test_pod_stop_waits_for_the_stop_checkpoint_then_stops_the_pod(pod, ws, capsys):
    """A trainer on the pod's volume gets the stop request over SSH, writes its checkpoint, and only then is
    the pod stopped."""
    from test_pod_signals import train
    from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint, ckpt_step
    FAKE['api'].add_pod('podGS', name='gs-1', env=dict(RUN_EXPERIMENT='gs'))
    os.environ['LMBOOK_POD_WORKSPACE'] = str(ws)  # restored by the fixture's monkeypatch
    p = train(ws, 'gs')
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= 3: break
    else: raise AssertionError(''.join(out))
    rc, o, err = run(capsys, 'pod', 'stop', 'podGS', '--poll', '0.2')
    rest = p.stdout.read()
    assert rc == 0 and p.wait(30) == 143, err + rest
    (msg,) = [l for l in rest.splitlines() if l.startswith('stopped by SIGTERM')]
    newest = list_checkpoints(Path(ws)/'runs'/'gs'/'checkpoints')[0]
    assert (f'at step {ckpt_step(newest)}/' in msg and verify_checkpoint(newest)
            and f'with {newest.name} complete' in o)
    assert FAKE['api'].pods['podGS']['status'] == 'EXITED' and 'waiting for the stop checkpoint' in err
    assert not (Path(ws)/'runs'/'gs'/'STOP').exists()


def test_upload_to_a_network_volume_without_a_pod(tmp_path, capsys, monkeypatch):
    """Through the S3-compatible API (endpoint and region from the volume's data center, the volume id as the
    bucket)."""
    try: from moto.server import ThreadedMotoServer
    except ImportError: pytest.skip("no local S3 server: pip install 'moto[server]'")
    import boto3
    port = free_port()
    s3srv = ThreadedMotoServer(ip_address='127.0.0.1', port=port, verbose=False); s3srv.start()
    f = FakeRunPodV2(KEY)
    srv, url = serve(f)
    try:
        for k, v in dict(RUNPOD_API_BASE_URL=url, RUNPOD_API_KEY=KEY,
                         LMBOOK_S3_ENDPOINT=f'http://127.0.0.1:{port}',
                         RUNPOD_S3_ACCESS_KEY='user_TEST',
                         RUNPOD_S3_SECRET_KEY='rps_TEST').items(): monkeypatch.setenv(k, v)
        s3 = boto3.client('s3', endpoint_url=f'http://127.0.0.1:{port}', region_name='EU-RO-1',
                          aws_access_key_id='user_TEST', aws_secret_access_key='rps_TEST')
        # RunPod's volume is the bucket
        s3.create_bucket(Bucket='vol123abc', CreateBucketConfiguration={'LocationConstraint': 'EU-RO-1'})
        data = tmp_path/'corpus'; (data/'sub').mkdir(parents=True)
        (data/'a.txt').write_text('first\n'); (data/'sub'/'b.txt').write_text('second\n')
        rc, out, err = run(capsys, 'pod', 'volume', 'upload', data, '--volume', 'vol123abc')
        assert (rc == 0 and '2 file(s) uploaded to volume vol123abc (EU-RO-1)' in out
                and '/workspace/uploads/corpus' in out), err
        keys = sorted(o['Key'] for o in s3.list_objects_v2(Bucket='vol123abc')['Contents'])
        assert keys == ['uploads/corpus/a.txt', 'uploads/corpus/sub/b.txt']
        assert s3.get_object(Bucket='vol123abc', Key='uploads/corpus/sub/b.txt')['Body'].read() == b'second\n'
        assert run(capsys, 'pod', 'volume', 'upload', data/'a.txt', '--volume', 'vol123abc', '--dest',
                   'data/one.txt')[0] == 0
        assert s3.get_object(Bucket='vol123abc', Key='data/one.txt')['Body'].read() == b'first\n'
        one_line_error(*run(capsys, 'pod', 'volume', 'upload', data, '--volume', 'volnothere'),
                       'volnothere does not exist')
        one_line_error(*run(capsys, 'pod', 'volume', 'upload', data, '--volume', 'vol123abc', '--dest',
                            '../x'), 'inside the volume')
    finally:
        s3srv.stop(); srv.shutdown()


def test_the_s3_endpoint_is_the_data_centers(monkeypatch):
    from lmbook.pods.sync import s3_endpoint
    monkeypatch.delenv('LMBOOK_S3_ENDPOINT', raising=False)
    assert s3_endpoint('EU-RO-1') == 'https://s3api-eu-ro-1.runpod.io/'
