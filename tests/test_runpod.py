"""`lmbook pod` against a fake of RunPod's REST API v2 on 127.0.0.1 that checks every request against the
contract."""
import json, os, re, subprocess, sys
from pathlib import Path
import pytest
from lmbook.dev.fake_runpod import FakeRunPodV2, serve, CAPACITY, violations
from lmbook.cli import main

KEY, HF = 'rpa_TESTKEY123', 'hf_SECRETtokenVALUE987'
ROOT = Path(__file__).resolve().parents[1]
HEAD = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()


# pods refuse local repositories: this host is a folder of the test (git's insteadOf)
GIT_HOST = 'https://git.lmbook.test/'


def remotes_in(folder, monkeypatch):
    "Make `GIT_HOST`'s repositories the bare repositories in `folder`."
    for k, v in dict(GIT_CONFIG_COUNT='1', GIT_CONFIG_KEY_0=f'url.file://{folder}/.insteadOf',
                     GIT_CONFIG_VALUE_0=GIT_HOST).items():
        monkeypatch.setenv(k, v)


def bare_remote(path, sha):
    """A bare repository sharing this checkout's objects whose only branch points at `sha`: a remote that has
    `sha` and its past."""
    subprocess.run(['git', 'init', '-q', '--bare', str(path)], check=True)
    common = subprocess.run(['git', 'rev-parse', '--git-common-dir'], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    (path/'objects'/'info'/'alternates').write_text(str((ROOT/common).resolve()/'objects') + '\n')
    subprocess.run(['git', 'update-ref', 'refs/heads/main', sha], cwd=path, check=True)
    return GIT_HOST + path.name


@pytest.fixture
def fake(monkeypatch, tmp_path):
    f = FakeRunPodV2(KEY)
    srv, url = serve(f)
    for k, v in dict(RUNPOD_API_BASE_URL=url, RUNPOD_API_KEY=KEY, HF_TOKEN=HF,
                     LMBOOK_WORKSPACE=str(tmp_path/'ws')).items():
        monkeypatch.setenv(k, v)
    for k in ('JUPYTER_PASSWORD', 'LMBOOK_RUNPOD_API', 'RUNPOD_GPU_TYPE', 'RUNPOD_GPU_COUNT'):
        monkeypatch.delenv(k, raising=False)
    remotes_in(tmp_path, monkeypatch)
    f.repo = bare_remote(tmp_path/'remote.git', HEAD)
    monkeypatch.chdir(tmp_path)
    yield f
    srv.shutdown()


# a plan from a checkout whose origin may be a local path (as in a CI clone) names where the pod clones
PLAN = ('pod', 'plan', '--repo', 'https://github.com/someone/lmbook.git')


def run(capsys, *args):
    "(exit code, stdout, stderr) of `lmbook ARGS` run in this process."
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(rc, out, err, *words):
    lines = [l for l in err.strip().splitlines() if not l.startswith(('warning:', 'note:'))]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith('error: '), err
    for w in words: assert w in err, err


def create(fake, *extra):
    return ['pod', 'create', '--profile', 'runpod_2b', '--experiment', 'fw-2b', '--gpu', 'H100', '--gpus',
            '2', '--volume', 'vol123abc',
            '--hf-token', 'env:HF_TOKEN', '--autokill', '--retry-wait', '0', '--save', 'pod.yaml', '--repo',
            fake.repo, *extra]


def posts(fake): return fake.calls('POST', '/v2/pods')


def test_stall_minutes_go_to_the_pod(fake, capsys):
    "`pod create --stall-minutes` also arms the pod's own stall guard, which outlives the laptop."
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'st', '--gpu', 'H100',
                       '--repo', fake.repo, '--stall-minutes', '25')
    assert rc == 0, err
    (pod,) = fake.pods.values()
    assert pod['body']['env']['STALL_MINUTES'] == '25'


def test_create_sends_the_whole_spec_and_no_secret_anywhere_else(fake, capsys):
    rc, out, err = run(capsys, *create(fake))
    assert rc == 0, err
    (pod,) = fake.pods.values()
    body = pod['body']
    assert violations({'$ref': 'CreatePodRequest'}, body) == []
    assert (body['gpu'] == dict(id='NVIDIA H100 80GB HBM3', count=2, minCudaVersion='12.8')
            and body['cloud'] == 'SECURE')
    assert (body['mounts'] == dict(network=[dict(volumeId='vol123abc', path='/workspace')])
            and body['dataCenterIds'] == ['EU-RO-1'])
    assert (body['ports'] == ['8888/http', '6006/http', '22/tcp']
            and body['image'].startswith('runpod/pytorch:') and body['startSsh'])
    env = body['env']
    assert ((env['RUN_CONFIG'], env['RUN_EXPERIMENT'], env['AUTOKILL'], env['HF_TOKEN'], env['ON_FAILURE'])
            == ('runpod_2b', 'fw-2b', 'terminate', HF, 'stop'))
    assert (env['LMBOOK_REPO'], env['LMBOOK_COMMIT']) == (fake.repo, HEAD)
    assert 'token_budget=' in env['RUN_OVERRIDES']  # two GPUs train the profile's tokens, not twice as many
    assert len(env['JUPYTER_PASSWORD']) >= 20 and 'RUNPOD_API_KEY' not in env
    assert (body['args'].startswith("bash -c 'T=${TMPDIR:-/tmp}; echo ")
            and body['args'].endswith("exec bash $T/lmbook-start.sh'"))
    assert (pod['name'].startswith('fw-2b-') and pod['id'] in out
            and f"https://{pod['id']}-8888.proxy.runpod.net" in out)
    secrets = [KEY, HF, env['JUPYTER_PASSWORD']]
    # the key travels only in the Authorization header; secret values only in the create body
    for m, p, h, b in fake.requests:
        assert h['Authorization'] == f'Bearer {KEY}' and KEY not in json.dumps(b)
        if (m, p) != ('POST', '/v2/pods'):
            assert HF not in json.dumps(b) and env['JUPYTER_PASSWORD'] not in json.dumps(b)
    manifest = Path('pod.yaml').read_text()
    for s in secrets: assert s not in out + err + manifest
    assert 'env:HF_TOKEN' in manifest and 'generate' in manifest
    assert ([p for m, p, b in fake.calls('GET')][:2]
            == ['/v2/network-volumes/vol123abc', '/v2/catalog/gpus/NVIDIA%20H100%2080GB%20HBM3'])


def test_dry_run_prints_spec_and_request_and_sends_nothing(fake, capsys, monkeypatch):
    rc, out, err = run(capsys, *create(fake, '--dry-run'))
    assert rc == 0, err
    assert all(m == 'GET' for m, p, b in fake.calls()) and not fake.pods  # only the read-only checks
    body = json.loads(out.split('POST /v2/pods\n', 1)[1])
    assert (body['mounts']['network'][0]['path'] == '/workspace' and body['gpu']['count'] == 2
            and 'kind: lmbook-pod' in out and body['dataCenterIds'] == ['EU-RO-1'])
    # the exact request: the same name each time, and the one a create then sends
    again = json.loads(run(capsys, *create(fake, '--dry-run'))[1].split('POST /v2/pods\n', 1)[1])
    assert again['name'] == body['name'] and run(capsys, *create(fake))[0] == 0
    (sent,) = [b for m, p, b in posts(fake)]
    assert sent['name'] == body['name'] and sent['dataCenterIds'] == body['dataCenterIds']
    monkeypatch.delenv('RUNPOD_API_KEY')
    rc, out, err = run(capsys, *create(fake, '--dry-run'))
    assert rc == 0 and "no RUNPOD_API_KEY, so not checked: a create adds the volume's data center" in out
    assert (HF not in out and KEY not in out and 'chars hidden' in out and 'HF_TOKEN' in out
            and 'JUPYTER_PASSWORD' in out)


def test_a_manifest_created_twice_is_one_pod_and_one_clear_answer(fake, capsys):
    assert run(capsys, *create(fake, '--dry-run'))[0] == 0
    rc, out, err = run(capsys, 'pod', 'create', '--manifest', 'pod.yaml', '--retry-wait', '0')
    assert rc == 0 and 'created' in out, err
    (pid,) = fake.pods
    assert run(capsys, 'pod', 'stop', pid, '--now')[0] == 0
    rc, out, err = run(capsys, 'pod', 'create', '--manifest', 'pod.yaml')
    assert (rc == 0 and out.count('\n') == 1 and 'already exists, status EXITED: nothing created' in out
            and f'lmbook pod resume {pid}' in out), out
    assert 'created:' not in out and len(fake.pods) == 1 and len(posts(fake)) == 1
    Path('bad.yaml').write_text(Path('pod.yaml').read_text().replace("experiment: fw-2b",
                                                                     'experiment: fw"2b'))
    one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'bad.yaml'), 'not allowed')


def test_capacity_is_retried_after_a_lookup_then_a_clear_error(fake, capsys):
    fake.capacity_failures = 2
    rc, out, err = run(capsys, *create(fake))
    assert rc == 0, err
    # a lookup by name before each try
    assert len(fake.pods) == 1 and len(posts(fake)) == 3 and len(fake.calls('GET', '/v2/pods')) == 3
    assert 'retrying' in out
    fake.capacity_failures = 99
    # another experiment: the same one would find the pod just made
    one_line_error(*run(capsys, *create(fake, '--tries', '3', '--experiment', 'fw-2c')), 'no capacity',
                   'gave up after 3 tries', '--gpu')
    assert len(fake.pods) == 1


def test_half_failed_create_is_found_by_name_and_not_billed_twice(fake, capsys):
    fake.lose_next_answer = True
    rc, out, err = run(capsys, *create(fake, '--tries', '1'))
    (pid,) = fake.pods
    assert rc == 0 and f'pod {pid} (' in out and 'created' in out and 'already exists' not in out, err
    assert 'jupyter' in out and len(fake.pods) == 1 and len(posts(fake)) == 1  # its URLs, as for any new pod
    rc, out, err = run(capsys, 'pod', 'create', '--manifest', 'pod.yaml', '--retry-wait', '0')
    assert rc == 0 and 'already exists' in out and len(posts(fake)) == 1  # a second create of the same spec


def test_busy_and_failing_api_calls_are_retried_with_backoff(fake, capsys, monkeypatch):
    import lmbook.pods.api as podapi
    waits = []
    monkeypatch.setattr(podapi.time, 'sleep', waits.append)
    fake.add_pod('podAAA', name='a')
    fake.busy, fake.broken = 1, 2  # 429, then two 503s: every call is retried, none gives up
    rc, out, err = run(capsys, 'pod', 'status', 'podAAA')
    assert rc == 0 and 'RUNNING' in out and waits == [0.0, 2, 4], (waits, err)
    fake.broken = 99
    one_line_error(*run(capsys, 'pod', 'list'), 'RunPod answered 503')


def test_missing_and_wrong_key_and_api_errors_are_one_line(fake, capsys, monkeypatch):
    monkeypatch.delenv('RUNPOD_API_KEY')
    one_line_error(*run(capsys, 'pod', 'list'), 'no RunPod API key', 'RUNPOD_API_KEY')
    monkeypatch.setenv('RUNPOD_API_KEY', 'rpa_WRONG')
    one_line_error(*run(capsys, 'pod', 'list'), 'rejected the API key')
    monkeypatch.setenv('RUNPOD_API_KEY', KEY)
    one_line_error(*run(capsys, *[a if a != 'vol123abc' else 'volnothere' for a in create(fake)]),
                   'network volume volnothere does not exist')
    fake.echo_errors = True
    rc, out, err = run(capsys, *create(fake))
    one_line_error(rc, out, err, 'RunPod API error (400)', 'chars hidden')
    for s in (HF, KEY): assert s not in out + err
    monkeypatch.setenv('RUNPOD_API_BASE_URL', 'http://127.0.0.1:9')
    monkeypatch.setattr('lmbook.pods.api.time.sleep', lambda s: None)
    one_line_error(*run(capsys, 'pod', 'status', 'pod0001xyz'), 'no usable answer from the RunPod API')


@pytest.mark.parametrize('args, words', [
    (['--experiment', 'x", gpuCount: 8, name: "y'], ['experiment name', 'not allowed']),
    (['--image', 'evil" }) { id } mutation { podTerminate'], ['image', 'not allowed']),
    (['--env', 'FOO=a"b'], ['FOO', 'unescaped']),
    (['--env', 'BAD-KEY=1'], ['not allowed']),
    (['--volume', 'v") { id }'], ['volume id', 'not allowed']),
    (['--set', 'dataset=/workspace/x"y'], ['RUN_OVERRIDES', 'unescaped']),
    (['--set', 'dataset=/workspace/a,b'], ['dataset', 'comma']),
    (['--hf-token', 'hf_plainvalue'], ['never the value itself']),
    (['--gpu', 'H1000'], ['unknown GPU']),
    # no network volume: terminate would delete the run
    (['--autokill', 'terminate'], ['--autokill stop', 'final checkpoint']),
    (['--volume', 'vol123abc', '--cloud-type', 'COMMUNITY'], ['Secure Cloud only']),
    (['--gpu', 'B200', '--image', 'runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04'], ['CUDA 12.8']),
    (['--repo', '<this repository>'], ['--repo']),
    (['--max-hours', '-1'], ['--max-hours']),
    (['--stall-minutes', '-5'], ['--stall-minutes', '0 (never)']),
])
def test_bad_values_and_risky_combinations_are_refused_before_any_request(fake, capsys, args, words):
    base = ['pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100', '--repo', fake.repo]
    rc, out, err = run(capsys, *base, *args)
    one_line_error(rc, out, err, *words)
    assert 'hf_plainvalue' not in err  # a token given where its source belongs is not echoed back
    assert fake.requests == []
    one_line_error(*run(capsys, 'pod', 'stop', 'abc"}) { id }'), 'pod id')


def test_the_pod_runs_a_commit_the_remote_has(fake, capsys, tmp_path):
    base = ['pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100', '--dry-run']
    # a remote one commit behind: HEAD was never pushed there
    old = bare_remote(tmp_path/'old.git', HEAD + '~1')
    one_line_error(*run(capsys, *base, '--repo', old), 'is not on', 'push it first')
    rc, out, err = run(capsys, *base, '--repo', old, '--commit', 'HEAD~1')
    parent = subprocess.run(['git', 'rev-parse', 'HEAD~1'], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    assert rc == 0 and f'LMBOOK_COMMIT: {parent}' in out, err
    one_line_error(*run(capsys, *base, '--repo', GIT_HOST + 'nothing.git'), 'cannot read')
    # a pod cannot clone from this machine
    for local in (f'file://{tmp_path}/remote.git', str(tmp_path/'remote.git')):
        one_line_error(*run(capsys, *base, '--repo', local), 'a pod cannot clone', 'push', '--repo')
        one_line_error(*run(capsys, 'pod', 'plan', '--profile', 'smoke', '--gpu', 'H100', '--repo', local),
                       'a pod cannot clone', '--repo')
    if not subprocess.run(['git', 'remote'], cwd=ROOT, capture_output=True, text=True).stdout.strip():
        one_line_error(*run(capsys, *base), "no remote 'origin'", '--repo')


def test_status_wait_lifecycle_and_volumes(fake, capsys, monkeypatch):
    fake.polls_until_running = 2
    assert run(capsys, *create(fake, '--wait', '--timeout', '60', '--poll', '0'))[0] == 0
    (pid,) = fake.pods
    rc, out, err = run(capsys, 'pod', 'status', pid)
    assert (rc == 0 and 'RUNNING' in out and '$5.38/h' in out and '97% busy' in out
            and 'ssh root@203.0.113.7 -p 40022' in out)
    assert 'volume       vol123abc (EU-RO-1)' in out and HF not in out and 'JUPYTER_PASSWORD' not in out
    assert pid in run(capsys, 'pod', 'list')[1]
    assert (run(capsys, 'pod', 'restart', pid)[0] == 0
            and fake.calls('POST', f'/v2/pods/{pid}/action')[-1][2] == dict(action='restart'))
    assert run(capsys, 'pod', 'stop', pid, '--now')[0] == 0 and fake.pods[pid]['status'] == 'EXITED'
    one_line_error(*run(capsys, 'pod', 'wait', pid, '--timeout', '1', '--poll', '0'), 'EXITED')
    one_line_error(*run(capsys, 'pod', 'restart', pid), '409', 'EXITED')  # RunPod restarts only a running pod
    # then RUNNING, as RunPod's
    assert run(capsys, 'pod', 'resume', pid)[0] == 0 and fake.pods[pid]['status'] == 'STARTING'
    assert run(capsys, 'pod', 'wait', pid, '--poll', '0')[0] == 0 and fake.pods[pid]['status'] == 'RUNNING'
    one_line_error(*run(capsys, 'pod', 'terminate', pid), '--yes', 'network volume vol123abc keeps the run')
    assert pid in fake.pods
    rc, out, err = run(capsys, 'pod', 'terminate', pid, '--yes')
    assert rc == 0 and 'the network volume vol123abc keeps the run' in out and pid not in fake.pods
    one_line_error(*run(capsys, 'pod', 'status', pid), 'does not exist')
    rc, out, err = run(capsys, 'pod', 'volume', 'create', '--name', 'fw', '--size', '500', '--data-center',
                       'EU-RO-1')
    assert rc == 0 and '500 GB' in out and 'EU-RO-1' in out
    assert 'fw' in run(capsys, 'pod', 'volume', 'list')[1]
    one_line_error(*run(capsys, 'pod', 'volume', 'create', '--name', 'fw', '--size', '10', '--data-center',
                        'CA-MTL-1'), 'no network volumes', 'EU-RO-1')


def test_terminate_without_a_network_volume_says_the_run_goes_with_it(fake, capsys, monkeypatch):
    fake.add_pod('podBBB', name='b')
    monkeypatch.setattr('sys.stdin.isatty', lambda: True)
    monkeypatch.setattr('builtins.input', lambda prompt: (capsys.readouterr(), 'n')[1])
    rc, out, err = run(capsys, 'pod', 'terminate', 'podBBB')
    assert rc == 1 and 'not terminated' in out and 'podBBB' in fake.pods
    asked = []
    monkeypatch.setattr('builtins.input', lambda prompt: (asked.append(prompt), 'y')[1])
    rc, out, err = run(capsys, 'pod', 'terminate', 'podBBB')
    assert rc == 0 and 'podBBB' not in fake.pods and 'keeps the run' not in out
    assert 'no network volume' in asked[0] and 'deleted with it' in asked[0]


def test_the_volume_data_center_comes_from_the_api(fake, capsys):
    one_line_error(*run(capsys, *create(fake, '--data-center', 'US-KS-2')), 'vol123abc is in EU-RO-1',
                   '--data-center')
    fake.volumes['volKS'] = dict(id='volKS', name='ks', size=50, dataCenter='US-KS-2', type='STANDARD')
    rc, out, err = run(capsys, *[a if a != 'vol123abc' else 'volKS' for a in create(fake)])
    assert rc == 0, err
    assert next(iter(fake.pods.values()))['body']['dataCenterIds'] == ['US-KS-2']


def test_the_fake_rejects_what_runpod_would(fake):
    """The contract at work: an unknown field, a volume on Community Cloud or in another data center, an
    action that does not exist."""
    from lmbook.pods.api import RestV2, RunPodError
    api = RestV2(KEY, set())
    body = dict(name='x', image='img', gpu=dict(id='NVIDIA H100 80GB HBM3', count=1),
                mounts=dict(network=[dict(volumeId='vol123abc', path='/workspace')]))
    for bad, word in [(dict(body, gpuCount=2), "additional properties 'gpuCount'"),
                      (dict(body, cloud='ALL'), 'must be one of'),
                      (dict(body, cloud='COMMUNITY'), 'Secure Cloud only'),
                      (dict(body, dataCenterIds=['US-KS-2']), 'is in EU-RO-1'),
                      (dict(body, gpu=dict(id='NVIDIA H100 80GB HBM3', count=0)), 'must be >= 1')]:
        with pytest.raises(RunPodError, match=re.escape(word)): api.call('POST', '/pods', bad)
    fake.add_pod('podCCC')
    with pytest.raises(RunPodError, match='must be one of'):
        api.call('POST', '/pods/podCCC/action', dict(action='reset'))
    with pytest.raises(RunPodError, match='additional properties'):
        api.call('POST', '/network-volumes',
                 dict(name='v', size=10, dataCenterId='EU-RO-1', dataCenter='EU-RO-1'))
    assert not fake.pods.keys() - {'podCCC'}


def test_wait_times_out_saying_the_pod_bills_and_how_to_stop_it(fake, capsys):
    fake.polls_until_running = 10**6
    assert run(capsys, *create(fake))[0] == 0
    from lmbook.pods.api import RunPodAPI, RunPodError
    from lmbook.pods.runpod import wait_running
    t = iter(range(0, 10**6, 100))
    with pytest.raises(RunPodError, match=r'not running after 300 s \(status STARTING\), and it is billing '
                                          r'\(\$5.38/h\): `lmbook pod stop pod0001xyz`'):
        wait_running(RunPodAPI(), next(iter(fake.pods)), timeout_s=300, sleep=lambda s: None,
                     clock=lambda: next(t), log=lambda m: None)


def test_the_runpod_settings_give_the_card_and_count(fake, capsys, monkeypatch):
    monkeypatch.setenv('RUNPOD_GPU_TYPE', 'NVIDIA A100 80GB PCIe')
    monkeypatch.setenv('RUNPOD_GPU_COUNT', '2')
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--repo',
                       fake.repo, '--dry-run')
    assert rc == 0 and 'gpu_type: NVIDIA A100 80GB PCIe' in out and 'gpu_count: 2' in out, err
    rc, out, err = run(capsys, *PLAN, '--profile', 'smoke')
    assert rc == 0 and 'on 2 x NVIDIA A100 80GB PCIe' in out


def test_plan_refuses_what_does_not_fit_and_names_what_does(capsys):
    # fp8='auto': the 4090 runs float8, so the need is float8's; the card named is the cheapest that holds it
    # (an A100 80GB PCIe at $1.64/h, not the H100 PCIe of as much memory at $2.39/h)
    one_line_error(*run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', '4090'), '49.4 GB',
                   "--gpu 'NVIDIA A100 80GB PCIe'")
    one_line_error(*run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', '4090', '--set', 'fp8=off'),
                   '57.2 GB', "--gpu 'NVIDIA A100 80GB PCIe'")
    rc, out, err = run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', 'A100')
    assert rc == 0 and 'never measured on NVIDIA A100' in out and 'cost' in out
    rc, out, err = run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', 'H100', '--json')
    p = json.loads(out)
    # fp8='auto' on an H100: float8 at the micro-batch it frees (16), a measured row
    assert (p['measured'] and p['batch_size'] == 16 and 52_000 < p['tok_per_s'] < 54_500
            and p['steps'] == 30_000
            and 20 < p['hours'] < 35 and p['cost'] > 0)
    rc, out, err = run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', 'H100', '--gpus', '8',
                       '--json')
    p8 = json.loads(out)
    assert (p8['tokens'] == p['tokens'] and p8['steps'] == 30_000//8 and 'DDP' not in p8['source']
            and '97.3%' in p8['source'])
    one_line_error(*run(capsys, *PLAN, '--profile', 'smoke', '--gpu', 'H100', '--cloud', 'community',
                        '--volume', 'vol1'), 'Secure Cloud only')


# token-shaped, made here so no token-like literal sits in the repository
FAKE_HF = 'hf' + '_' + 'abcdefghijklmnopqrstuvwx'

@pytest.mark.parametrize('env',
                         [f'HF_TOKEN={FAKE_HF}', 'WANDB_API_KEY=0123abcd', 'MY_PASSWORD=hunter22',
                          f'NOTE={FAKE_HF}yz123456'])
def test_a_secret_passed_as_plain_env_is_refused_before_anything_is_written(fake, capsys, env):
    value = env.split('=', 1)[1]
    base = ['pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100', '--repo', fake.repo,
            '--dry-run']
    rc, out, err = run(capsys, *base, '--env', env, '--save', 'p.yaml')
    one_line_error(rc, out, err, 'secret', '--hf-token')
    assert value not in out + err and not Path('p.yaml').exists() and fake.requests == []
    assert run(capsys, *base, '--env', 'PUBLIC_KEY=ssh-ed25519 AAAAC3')[0] == 0


def test_a_manifest_is_refused_when_its_env_carries_a_secret_or_disagrees_with_it(fake, capsys):
    assert run(capsys, *create(fake, '--dry-run'))[0] == 0
    txt = Path('pod.yaml').read_text()
    Path('leak.yaml').write_text(txt.replace("  PYTHONUNBUFFERED: '1'",
                                             f"  PYTHONUNBUFFERED: '1'\n  HF_TOKEN: {FAKE_HF}"))
    one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'leak.yaml', '--dry-run'), 'HF_TOKEN',
                   'secret')
    Path('moved.yaml').write_text(txt.replace('experiment: fw-2b', 'experiment: fw-2b-again'))
    one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'moved.yaml', '--dry-run'), 'RUN_EXPERIMENT',
                   'fw-2b-again')
    assert not fake.calls('POST')  # a dry run only reads


def test_printed_request_shows_no_character_of_a_secret(fake, capsys):
    rc, out, err = run(capsys, *create(fake, '--dry-run'))
    env = json.loads(out.split('POST /v2/pods\n', 1)[1])['env']
    assert (env['HF_TOKEN'].startswith('…(') and env['JUPYTER_PASSWORD'].startswith('…(')
            and env['HF_TOKEN'].endswith('chars hidden)'))


def test_braces_and_dollars_are_plain_string_content(fake, capsys):
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100',
                       '--repo', fake.repo, '--env', 'FOO=a{b', 'BAR=${HOME}')
    assert rc == 0, err
    env = next(iter(fake.pods.values()))['body']['env']
    assert (env['FOO'], env['BAR']) == ('a{b', '${HOME}')


def test_every_lmbook_command_the_pod_docs_name_exists():
    """The README's pod section and the pods page name only commands and flags that exist; whole command lines
    parse."""
    import argparse, shlex
    from lmbook.cli import build_parser
    readme = (ROOT/'README.md').read_text().split('## On a RunPod pod', 1)[1].split('\n## ', 1)[0]
    page = '\n'.join(''.join(c['source'])
                     for c in json.loads((ROOT/'nbs'/'on_runpod.ipynb').read_text())['cells']
                     if c['cell_type'] == 'markdown')
    text = (readme + '\n' + page).replace('\\\n', ' ')
    lines = [m.split('  #')[0].strip() for m in re.findall(r'(?m)^(lmbook [^\n`]+)', text)]
    named = [c for c in re.findall(r'`(lmbook [^`]+)`', text)]
    assert len(lines) > 15 and len(named) > 10, (lines, named)
    ap = build_parser()
    for c in lines + named:
        c = c.replace('$NODE_RANK', '0').replace('$MASTER_ADDR', '10.0.0.1')
        args = shlex.split(c.replace('...', '').replace('…', ''))[1:]
        p = ap
        while args and not args[0].startswith('-'):
            sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is None: break
            assert args[0] in sub.choices, f"the docs name `{c}`: no command {args[0]!r}"
            p, args = sub.choices[args.pop(0)], args
        flags = {o for a in p._actions for o in a.option_strings}
        for a in args:
            if a.startswith('-') and ' ' not in a:
                assert a.split('=')[0] in flags, f"the docs name `{c}`: no option {a}"
    for c in lines:
        try: ap.parse_args(shlex.split(c.replace('$NODE_RANK', '0').replace('$MASTER_ADDR', '10.0.0.1'))[1:])
        except SystemExit: pytest.fail(f"the docs show `{c}`, which lmbook does not accept")


def test_a_config_file_for_the_pod_must_be_a_path_on_the_pod(fake, capsys):
    base = ['pod', 'create', '--experiment', 'ok', '--gpu', 'H100', '--repo', fake.repo, '--dry-run']
    one_line_error(*run(capsys, *base, '--profile', 'configs/my.yaml'), '/workspace/')
    rc, out, err = run(capsys, *base, '--profile', '/workspace/configs/my.yaml')
    assert rc == 0 and 'RUN_CONFIG: /workspace/configs/my.yaml' in out, err


def test_the_readme_in_a_clone_of_a_local_mirror_stops_at_its_first_command(tmp_path):
    """The README's laptop commands, run in order in a fresh clone whose origin is a local path: the first one
    says what to do."""
    readme = (ROOT/'README.md').read_text().split('### From your laptop')[1]
    readme = readme.split('```bash\n')[1].split('```')[0]
    cmds = [l.split('  #')[0].strip() for l in readme.splitlines() if l.startswith('lmbook ')]
    clone = tmp_path/'clone'
    # origin: a path on this machine
    subprocess.run(['git', 'clone', '-q', str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith('GIT_CONFIG')}
    env |= dict(RUNPOD_API_KEY=KEY, LMBOOK_WORKSPACE=str(tmp_path/'ws'), PYTHONPATH=str(clone))
    first = subprocess.run([sys.executable, '-m', 'lmbook.cli', *cmds[0].split()[1:]], cwd=clone, env=env,
                           capture_output=True, text=True)
    assert first.returncode == 2 and first.stdout == '', first.stdout + first.stderr
    assert (first.stderr.count('\n') == 1 and 'push lmbook' in first.stderr
            and '--repo' in first.stderr), first.stderr


def test_create_watch_stops_the_pod_from_here_at_its_cap(fake, capsys):
    "`pod create --watch` waits for the pod, then stops it at its spend cap, with no SSH key to save first."
    fake.ssh_keys = []
    rc, out, err = run(capsys, *create(fake, '--watch', '--max-hours', '1e-7', '--watch-poll', '0',
                                      '--poll', '0'))
    (pid,) = fake.pods
    assert rc == 0 and fake.pods[pid]['status'] == 'EXITED', err
    assert 'over --max-hours 1e-07' in err and 'stop sent' in out


def test_a_plan_at_an_unmeasured_micro_batch_is_an_estimate(capsys):
    """runpod_4b on 4 H100s under FSDP2 was measured at micro-batch 8 and 16; its own micro-batch, 2, ran at
    two-thirds of that MFU on H200s, so the plan must not call the figure measured."""
    rc, out, err = run(capsys, *PLAN, '--profile', 'runpod_4b', '--gpu', 'H100', '--gpus', '4', '--set',
                       'parallel=fsdp', 'fp8=off', 'batch_fit=false', '--json')
    p = json.loads(out)
    assert rc == 0 and not p['measured'] and "micro-batch 2 is not measured" in p['source'], err
    rc, out, err = run(capsys, *PLAN, '--profile', 'runpod_4b', '--gpu', 'H100', '--gpus', '4', '--set',
                       'parallel=fsdp', '--set', 'batch_size=8', 'batch_fit=false', '--json')
    assert json.loads(out)['measured'], out


def test_pod_logs_asks_for_no_more_lines_than_runpod_gives(fake, capsys):
    "RunPod's logs endpoint gives 0 to 5000 lines: more is refused here, in one line that says what to do."
    fake.add_pod('podLOGS')
    one_line_error(*run(capsys, 'pod', 'logs', 'podLOGS', '-n', '10000'), 'at most 5000 lines',
                   '/workspace/logs/boot-')
    assert not fake.calls('GET', '/v2/pods/podLOGS/logs')


def fixes(err:str) -> list[list[str]]:
    "The fixes a refused plan offers: each the flags it names between backquotes."
    import shlex
    return [shlex.split(f) for f in re.findall(r'`(--[^`]+)`', err)]


@pytest.mark.parametrize('profile, gpu, gpus', [('runpod_4b', 'H100', 4), ('runpod_4b', 'H100', 8),
                                                ('runpod_2b', '4090', 1)])
def test_every_fix_a_refused_plan_offers_is_accepted_and_the_cards_are_by_price(capsys, profile, gpu, gpus):
    """Each fix, tried with the same GPU count, plans; the card named first is the cheapest that `plan` takes
    on that many GPUs, and the one it names as the fastest per dollar is."""
    from lmbook.core import gpu_table
    from lmbook.pods.plan import plan
    rc, out, err = run(capsys, *PLAN, '--profile', profile, '--gpu', gpu, '--gpus', gpus)
    assert rc == 2 and len(fixes(err)) >= 2, err
    for fix in fixes(err):
        if fix[0] == '--gpu': args = fix  # a card: the same count
        else: args = ['--gpu', gpu] + fix
        rc2, _, err2 = run(capsys, *PLAN, '--profile', profile, '--gpus', gpus, *args)
        assert rc2 == 0, (fix, err2)
    table, ok = gpu_table(), {}
    for card in gpu_table():
        try: ok[card] = plan(profile, card, gpus)
        except ValueError: pass
    cheapest = min(ok, key=lambda k: table[k]['secure'])
    per_dollar = max(ok, key=lambda k: ok[k]['tok_per_s']/ok[k]['price_per_hour'])
    assert f"the cheapest card it fits: `--gpu '{cheapest}'`" in err, err
    assert per_dollar == cheapest or f"the fastest per dollar: `--gpu '{per_dollar}'`" in err, err


def test_a_card_whose_free_hosts_run_an_older_cuda_is_refused_up_front(fake, capsys):
    """Every image lmbook picks asks for CUDA 12.8 (gpu.minCudaVersion); RunPod's catalog counts the hosts
    that run it (minCudaVersion). Where the card is free only on older hosts, create refuses at once, naming
    CUDA and --image, instead of retrying capacity errors for minutes."""
    args = ['pod', 'create', '--profile', 'smoke', '--experiment', 'a6', '--gpu', 'A6000', '--retry-wait',
            '0', '--repo', fake.repo]
    one_line_error(*run(capsys, *args), 'CUDA 12.8', 'older CUDA', '--image')
    assert posts(fake) == []
    q = [p for m, p, b in fake.calls('GET') if p.startswith('/v2/catalog/gpus/')]
    assert q, fake.requests


def interface_gaps(cls) -> list[str]:
    "What backend `cls` lacks of `Backend`: a method not implemented, or one whose parameters differ."
    import inspect
    from lmbook.pods.api import Backend
    params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
    return [f"{cls.__name__}.{m}{inspect.signature(getattr(cls, m))} vs Backend.{m}"
            f"{inspect.signature(getattr(Backend, m))}" if m not in cls.__abstractmethods__
            else f"{cls.__name__}.{m} missing" for m in sorted(Backend.__abstractmethods__)
            if m in cls.__abstractmethods__ or params(getattr(cls, m)) != params(getattr(Backend, m))]


def test_both_backends_implement_the_whole_interface():
    """Each backend implements every method of `Backend` with the interface's parameters (names, kinds,
    defaults), and is made as `RunPodAPI` makes it: `(key, hidden)`."""
    import inspect
    from lmbook.pods.api import BACKENDS, Backend
    assert len(Backend.__abstractmethods__) == 13 and set(BACKENDS) == {'rest', 'graphql'}
    for name, cls in BACKENDS.items():
        assert issubclass(cls, Backend) and cls.name == name
        assert not interface_gaps(cls), interface_gaps(cls)
        inspect.signature(cls).bind(KEY, set())
    class Wrong(Backend):  # the check sees a changed parameter and a missing method
        def pods(self, all_pods=True): return []
    gaps = interface_gaps(Wrong)
    assert gaps[0] == 'Wrong.action missing'
    assert any(g.startswith('Wrong.pods(self, all_pods=True)') for g in gaps), gaps
