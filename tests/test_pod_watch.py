"""The laptop's side of a pod's spend cap (`lmbook pod watch`, `pod create --watch`) and a graceful
`pod stop` without SSH, through the pod's network volume (moto's S3 server on 127.0.0.1), against the REST
v2 fake."""
import socket, threading, time
import pytest
from lmbook.dev.fake_runpod import FakeRunPodV2, serve
from test_runpod import run, one_line_error, KEY
from lmbook.pods.api import RunPodAPI, RunPodError
from lmbook.pods.watch import Watcher, watch_pod

POD, VOL = 'pod1234abc', 'volwatch42'  # moto's buckets outlive a server: a name of its own
ON_VOLUME = dict(network=[dict(volumeId=VOL, mountPath='/workspace')])


@pytest.fixture
def fake(monkeypatch):
    f = FakeRunPodV2(KEY)
    srv, url = serve(f)
    monkeypatch.setenv('RUNPOD_API_BASE_URL', url)
    monkeypatch.setenv('RUNPOD_API_KEY', KEY)
    for k in ('LMBOOK_RUNPOD_API', 'RUNPOD_S3_ACCESS_KEY', 'RUNPOD_S3_SECRET_KEY'):
        monkeypatch.delenv(k, raising=False)
    yield f
    srv.shutdown()


def status(fake): return fake.pods[POD]['status']


def test_watch_stops_a_pod_at_the_cap_it_was_created_with(fake, capsys, tmp_path):
    "Eight billed hours at $2.69/h (the pod's log says so) are over its --max-dollars 20."
    fake.add_pod(POD, env=dict(LMBOOK_T0=f'{time.time() - 8*3600:.0f}', MAX_DOLLARS='20'))
    (tmp_path/'container.log').write_text('[boot 12:00:00] pod: billed 8.000 h so far\n')
    fake.logs[POD] = str(tmp_path/'container.log')
    rc, out, err = run(capsys, 'pod', 'watch', POD, '--watch-poll', '0')
    assert rc == 0 and status(fake) == 'EXITED', err
    assert 'over --max-dollars 20' in err and 'stop sent' in out
    fake.add_pod('pod2', env=dict(LMBOOK_T0=f'{time.time():.0f}'))
    one_line_error(*run(capsys, 'pod', 'watch', 'pod2'), 'no spend cap to watch', '--stall-minutes')


def test_watch_stops_a_stalled_pod_at_once_and_lets_a_moving_one_run(fake, tmp_path):
    "A log whose newest step stays for 30 minutes: the pod is stopped without asking its stuck trainer."
    fake.add_pod(POD, env=dict(LMBOOK_T0=f'{time.time():.0f}', RUN_EXPERIMENT='fw-2b'))
    log = tmp_path/'container.log'
    log.write_text('boot: training\nstep   10/3000 | loss 6.10\n')
    fake.logs[POD] = str(log)
    now = [time.time()]
    def sleep(s):
        now[0] += 600  # ten minutes a look
        if len(log.read_text().splitlines()) < 5:  # it moves on for three looks, then hangs
            log.write_text(log.read_text() + f'step {10*len(log.read_text().splitlines())}/3000\n')
    lines = Out()
    watch_pod(RunPodAPI(), POD, Watcher(stall_min=30), poll_s=0, out=lines, clock=lambda: now[0],
              sleep=sleep)
    said = ''.join(lines)
    assert status(fake) == 'EXITED' and 'no progress for 30 min (last: step 40/3000)' in said, said
    assert not fake.calls('GET', '/v2/account/ssh-keys')  # a stall is not asked to save
    fake.add_pod('pod2', env=dict(LMBOOK_T0=f'{time.time():.0f}'))
    def ends(s): fake.pods['pod2']['status'] = 'EXITED'  # the run finished and autokill stopped it
    watch_pod(RunPodAPI(), 'pod2', Watcher(max_dollars=100), poll_s=0, out=lines, sleep=ends)
    assert 'pod2: EXITED: not billing' in ''.join(lines) and not fake.calls('POST', '/v2/pods/pod2/action')


class Out(list):
    def write(self, s): self.append(s)
    def flush(self): pass


def test_a_save_that_cannot_be_asked_for_still_stops_the_pod(fake, capsys):
    "Over the cap, with no SSH key and no volume: the watch stops the pod anyway, money first."
    fake.ssh_keys = []
    fake.add_pod(POD, env=dict(LMBOOK_T0=f'{time.time() - 3600:.0f}', MAX_HOURS='0.5', RUN_EXPERIMENT='x'))
    rc, out, err = run(capsys, 'pod', 'watch', POD, '--watch-poll', '0')
    assert rc == 0 and status(fake) == 'EXITED' and 'no SSH public key is registered' in err, err


def test_stop_without_ssh_keys_says_every_way_out_and_leaves_the_pod(fake, capsys):
    fake.ssh_keys = []
    fake.add_pod(POD, env=dict(RUN_EXPERIMENT='fw-2b'), mounts=ON_VOLUME)
    one_line_error(*run(capsys, 'pod', 'stop', POD), 'SSH Public Keys', 'RUNPOD_S3_ACCESS_KEY', '--now')
    assert status(fake) == 'RUNNING'
    assert run(capsys, 'pod', 'stop', POD, '--now')[0] == 0 and status(fake) == 'EXITED'


def test_stop_without_ssh_asks_the_trainer_through_the_volume(fake, capsys, monkeypatch):
    """No SSH key, but the pod trains on a network volume and the S3 keys are set: the stop request goes
    onto the volume, and the pod is stopped once the trainer's stop checkpoint is complete there."""
    moto = pytest.importorskip('moto.server')
    import boto3
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    srv = moto.ThreadedMotoServer(ip_address='127.0.0.1', port=port, verbose=False)
    srv.start()
    try:
        for k, v in dict(LMBOOK_S3_ENDPOINT=f'http://127.0.0.1:{port}', RUNPOD_S3_ACCESS_KEY='user_TEST',
                         RUNPOD_S3_SECRET_KEY='rps_TEST').items(): monkeypatch.setenv(k, v)
        s3 = boto3.client('s3', endpoint_url=f'http://127.0.0.1:{port}', region_name='EU-RO-1',
                          aws_access_key_id='user_TEST', aws_secret_access_key='rps_TEST')
        s3.create_bucket(Bucket=VOL, CreateBucketConfiguration={'LocationConstraint': 'EU-RO-1'})
        run_key = 'runs/fw-2b/'
        s3.put_object(Bucket=VOL, Key=run_key + '.lock', Body=b'{}')
        s3.put_object(Bucket=VOL, Key=run_key + 'checkpoints/step_00000100/COMPLETE', Body=b'{}')
        fake.ssh_keys = []
        fake.add_pod(POD, env=dict(RUN_EXPERIMENT='fw-2b'), mounts=ON_VOLUME)
        seen = []
        def trainer():  # takes the request at its next step, writes its checkpoint, lets go of the folder
            for _ in range(200):
                keys = [o['Key'] for o in s3.list_objects_v2(Bucket=VOL, Prefix=run_key).get('Contents', [])]
                if run_key + 'STOP' in keys:
                    seen.append('asked')
                    s3.delete_object(Bucket=VOL, Key=run_key + 'STOP')
                    s3.put_object(Bucket=VOL, Key=run_key + 'checkpoints/step_00000120/COMPLETE', Body=b'{}')
                    s3.delete_object(Bucket=VOL, Key=run_key + '.lock')
                    return
                time.sleep(0.05)
        t = threading.Thread(target=trainer)
        t.start()
        rc, out, err = run(capsys, 'pod', 'stop', POD, '--poll', '0.05')
        t.join()
    finally: srv.stop()
    assert rc == 0 and seen == ['asked'] and status(fake) == 'EXITED', err
    assert 'the trainer stopped with step_00000120 complete on the volume' in out


@pytest.fixture
def slow(fake, monkeypatch):
    "The fake's clock, moved only by the pauses lmbook takes between its tries (and the watch's looks)."
    import functools
    import lmbook.pods.watch as watch
    t = [0.0]
    fake.clock = lambda: t[0]
    def pause(s): t[0] += s
    monkeypatch.setattr(watch, 'RunPodAPI', functools.partial(RunPodAPI, sleep=pause))
    return t, pause


def test_stop_outlasts_a_40_s_outage_and_says_when_the_pod_still_bills(fake, slow, capsys):
    fake.add_pod(POD)
    fake.down(40, from_next_call=True)
    rc, out, err = run(capsys, 'pod', 'stop', POD, '--now')
    assert rc == 0 and status(fake) == 'EXITED' and 'stop sent' in out, err
    fake.add_pod('pod2')
    fake.down(10**9, on='POST .*')  # gone for good at the stop: ten minutes of tries, then one line
    one_line_error(*run(capsys, 'pod', 'stop', 'pod2', '--now'), "RunPod's API did not answer for 10 min",
                   'pod pod2 may still be RUNNING at $2.69/h', '`lmbook pod stop pod2 --now` ends it')
    assert 600 <= slow[0][0] < 800


def test_stop_on_a_stopped_pod_says_so(fake, capsys):
    fake.add_pod(POD, status='EXITED')
    rc, out, err = run(capsys, 'pod', 'stop', POD)
    assert rc == 0 and f'pod {POD} is stopped already (EXITED): nothing to do' in out, err
    assert not fake.calls('POST')


def test_watch_outlasts_an_api_outage_and_counts_billed_time(fake, slow, tmp_path):
    """Three minutes without the API: the watch goes on. It counts the time the pod billed (the pod's own
    ledger, which its log reports), not the time since `pod create`: a pod created eight hours ago that billed
    one hour is not over --max-hours 2."""
    t, pause = slow
    fake.add_pod(POD, env=dict(LMBOOK_T0=f'{time.time() - 8*3600:.0f}', MAX_HOURS='2'))
    log = tmp_path/'container.log'
    log.write_text('[boot 10:00:00] pod: billed 1.000 h so far\nstep 10/3000\n')
    fake.logs[POD] = str(log)
    fake.down(180, from_next_call=True)
    looks = Out()
    def sleep(s):
        pause(s)
        if t[0] > 900: log.write_text(log.read_text() + '[boot 11:00:00] pod: billed 2.010 h so far\n')
    watch_pod(RunPodAPI(sleep=pause), POD, Watcher(max_hours=2), poll_s=60, out=looks, clock=lambda: t[0],
              sleep=sleep)
    said = ''.join(looks)
    assert "RunPod's API does not answer" in said and status(fake) == 'EXITED', said
    assert 'it has billed 2.01 h, over --max-hours 2' in said and t[0] > 900


def test_a_log_that_cannot_be_read_does_not_run_the_stall_clock(fake, monkeypatch):
    "Forty minutes without a readable log are forty minutes without evidence: no stall is counted."
    fake.add_pod(POD, env=dict(RUN_EXPERIMENT='fw-2b'))
    api, now, looks = RunPodAPI(sleep=lambda s: None), [0.0], iter(range(100))
    def logs(pod_id, tail=100, follow=False, out=None):
        n = next(looks)
        if 1 <= n <= 4: raise RunPodError('RunPod answered 503 (upstream unavailable)')
        if n == 6: fake.pods[POD]['status'] = 'EXITED'  # the run ends on its own
        return ['step 10/3000']
    monkeypatch.setattr(api, 'logs', logs)
    def sleep(s): now[0] += 600
    out = Out()
    watch_pod(api, POD, Watcher(stall_min=30), poll_s=0, out=out, clock=lambda: now[0], sleep=sleep)
    assert 'no progress' not in ''.join(out) and not fake.calls('POST'), ''.join(out)
