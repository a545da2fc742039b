"""`lmbook pod` through the other backend, the `runpod` SDK's GraphQL (`api = graphql`), against a fake
GraphQL server on 127.0.0.1."""
import re
from pathlib import Path
import pytest
from lmbook.dev.fake_graphql import FakeGraphQL
from lmbook.dev.fake_runpod import serve
from test_runpod import bare_remote, remotes_in, run, one_line_error, HEAD, KEY, HF


@pytest.fixture
def gql(monkeypatch, tmp_path):
    import runpod
    f = FakeGraphQL(KEY)
    srv, url = serve(f)
    for k, v in dict(RUNPOD_API_BASE_URL=url, RUNPOD_API_KEY=KEY, HF_TOKEN=HF, LMBOOK_RUNPOD_API='graphql',
                     LMBOOK_WORKSPACE=str(tmp_path/'ws')).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv('JUPYTER_PASSWORD', raising=False)
    monkeypatch.setattr(runpod, 'api_key', None)
    remotes_in(tmp_path, monkeypatch)
    f.repo = bare_remote(tmp_path/'remote.git', HEAD)
    monkeypatch.chdir(tmp_path)
    yield f
    srv.shutdown()


def test_the_sdk_backend_creates_watches_and_stops_a_pod(gql, capsys):
    import runpod
    # the range pyproject.toml pins is the one tested here
    assert runpod.__version__.startswith('1.12.'), runpod.__version__
    args = ['pod', 'create', '--profile', 'runpod_2b', '--experiment', 'fw-2b', '--gpu', 'H100', '--volume',
            'vol123abc', '--hf-token', 'env:HF_TOKEN', '--autokill', '--retry-wait', '0', '--repo', gql.repo]
    rc, out, err = run(capsys, *args, '--dry-run')
    assert (rc == 0 and 'podFindAndDeployOnDemand' in out and 'volumeMountPath: "/workspace"' in out
            and HF not in out), err
    rc, out, err = run(capsys, *args, '--save', 'pod.yaml')
    assert rc == 0, err
    (pod,) = gql.pods.values()
    env = {e['key']: e['value'] for e in pod['input']['env']}
    assert (env['LMBOOK_COMMIT'], env['AUTOKILL'], env['HF_TOKEN']) == (HEAD, 'terminate', HF)
    assert (pod['input']['dockerArgs'].endswith("exec bash $T/lmbook-start.sh'")
            and pod['input']['networkVolumeId'] == 'vol123abc')
    rc, out, err = run(capsys, 'pod', 'create', '--manifest', 'pod.yaml')
    assert rc == 0 and 'already exists' in out and len(gql.ops('podFindAndDeployOnDemand')) == 1
    pid = pod['id']
    rc, out, err = run(capsys, 'pod', 'status', pid)
    assert rc == 0 and 'RUNNING' in out and 'ssh root@203.0.113.7 -p 40022' in out
    one_line_error(*run(capsys, 'pod', 'restart', pid), 'no restart')
    assert not gql.ops('podRestart')
    assert run(capsys, 'pod', 'stop', pid, '--now')[0] == 0 and gql.pods[pid]['desiredStatus'] == 'EXITED'
    assert run(capsys, 'pod', 'resume', pid)[0] == 0 and 'gpuCount: 1' in gql.ops('podResume')[0]
    assert run(capsys, 'pod', 'terminate', pid, '--yes')[0] == 0 and pid not in gql.pods
    assert 'vol123abc' in run(capsys, 'pod', 'volume', 'list')[1]
    for h, q in gql.requests: assert h['Authorization'] == f'Bearer {KEY}' and KEY not in q


def test_the_sdk_backend_gives_one_line_errors(gql, capsys, monkeypatch):
    gql.echo_errors = True
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100',
                       '--repo', gql.repo, '--hf-token', 'env:HF_TOKEN')
    one_line_error(rc, out, err, 'RunPod API error', 'chars hidden')
    assert HF not in err and KEY not in err
    monkeypatch.setenv('RUNPOD_API_KEY', 'rpa_WRONG')
    one_line_error(*run(capsys, 'pod', 'list'), 'rejected the API key')
