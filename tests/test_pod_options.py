"""`pod create --template/--min-vcpu/--min-memory`, the catalog's GPU availability in the volume's data center
before a create, and `pod create --serve`: each sent only where RunPod's API takes it, checked by the fakes
(REST v2 against the contract written from RunPod's OpenAPI document; GraphQL against the SDK's mutation)."""
import pytest
from lmbook.pods.api import RunPodAPI, RunPodError
from test_runpod import fake, run, create, one_line_error, posts, HEAD
from test_runpod_graphql import gql
from lmbook.dev.fake_runpod import violations

H100 = 'NVIDIA H100 80GB HBM3'


def test_template_replaces_the_image(fake, capsys):
    rc, out, err = run(capsys, *create(fake, '--template', 'tmpl42abc'))
    assert rc == 0, err
    (pod,) = fake.pods.values()
    assert pod['body']['templateId'] == 'tmpl42abc' and 'image' not in pod['body']
    assert violations({'$ref': 'CreatePodRequest'}, pod['body']) == []
    run(capsys, *create(fake, '--template', 'tmpl42abc', '--image', 'me/img:1', '--experiment', 'fw-img'))
    assert posts(fake)[-1][2]['image'] == 'me/img:1'


def test_machine_minimums_are_refused_over_rest(fake, capsys):
    one_line_error(*run(capsys, *create(fake, '--min-vcpu', 16)),
                   'REST API v2 takes no vCPU or memory minimum', 'graphql')
    one_line_error(*run(capsys, *create(fake, '--min-memory', 64, '--dry-run')), 'no vCPU or memory minimum')
    assert not posts(fake)


def test_machine_minimums_and_template_over_graphql(gql, capsys):
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'runpod_2b', '--experiment', 'fw-2b', '--gpu',
                       'H100', '--volume',
                       'vol123abc', '--retry-wait', '0', '--repo', gql.repo, '--min-vcpu', 16, '--min-memory',
                       64, '--template', 'tp1')
    assert rc == 0, err
    (pod,) = gql.pods.values()
    assert ((pod['input']['minVcpuCount'], pod['input']['minMemoryInGb'], pod['input']['templateId'])
            == (16, 64, 'tp1'))


def test_no_gpu_free_in_the_volumes_data_center(fake, capsys):
    fake.stock[(H100, 'EU-RO-1')] = 'NONE'
    rc, out, err = run(capsys, *create(fake))
    one_line_error(rc, out, err, 'no 2 x NVIDIA H100 80GB HBM3 free in EU-RO-1', 'US-KS-2 (HIGH)')
    assert 'CA-MTL-1' not in err and not posts(fake)  # it has no network volumes: no place for this one
    fake.stock[(H100, 'EU-RO-1')] = 'LOW'
    rc, out, err = run(capsys, *create(fake))
    assert (rc == 0 and 'few 2 x NVIDIA H100 80GB HBM3 are free in EU-RO-1 (LOW)' in out
            and len(posts(fake)) == 1), err


def test_availability_query_follows_the_contract(fake):
    "The fake refuses what the OpenAPI document refuses, so the query lmbook sends is one RunPod takes."
    api = RunPodAPI()
    assert api.availability(H100, 2, 'SECURE')['data_centers']['EU-RO-1'] == 'HIGH'
    with pytest.raises(RunPodError, match='valid only with include'):
        api.b.call('GET', '/catalog/gpus/NVIDIA%20B200?count=2')
    with pytest.raises(RunPodError, match='requires product'):
        api.b.call('GET', '/catalog/gpus/NVIDIA%20B200?include=AVAILABILITY')


def test_serve_pod(fake, capsys):
    rc, out, err = run(capsys, 'pod', 'create', '--serve', '/workspace/exports/chat-7b', '--gpu', 'H100',
                       '--volume', 'vol123abc', '--retry-wait', '0', '--repo', fake.repo)
    assert rc == 0, err
    (pod,) = fake.pods.values()
    body = pod['body']
    assert violations({'$ref': 'CreatePodRequest'}, body) == []
    assert body['env']['RUN_SERVE'] == '/workspace/exports/chat-7b' and body['env']['LMBOOK_COMMIT'] == HEAD
    assert ('8000/http' in body['ports'] and 'RUN_CONFIG' not in body['env']
            and pod['name'].startswith('serve-chat-7b-'))
    assert f"https://{pod['id']}-8000.proxy.runpod.net/v1 (lmbook)" in out
    assert (body['env']['SERVE_ENGINE'] == 'lmbook'
            and body['env']['LMBOOK_API_KEY'] == '{{ RUNPOD_SECRET_lmbook_api_key }}')
    assert 'key: the RunPod secret lmbook_api_key' in out and "Authorization: Bearer <the key>" in out


def test_serve_pod_with_vllm_and_your_key(fake, capsys, monkeypatch):
    """--engine vllm: the same pod with SERVE_ENGINE=vllm; --serve-key env:NAME sends your key, masked in the
    output."""
    monkeypatch.setenv('MY_SERVE_KEY', 'sk-mine-0123456789')
    rc, out, err = run(capsys, 'pod', 'create', '--serve', '/workspace/exports/chat-7b', '--gpu', 'H100',
                       '--volume', 'vol123abc',
                       '--retry-wait', '0', '--repo', fake.repo, '--engine', 'vllm', '--serve-key',
                       'env:MY_SERVE_KEY')
    assert rc == 0, err
    (pod,) = fake.pods.values()
    body = pod['body']
    assert violations({'$ref': 'CreatePodRequest'}, body) == []
    assert body['env']['SERVE_ENGINE'] == 'vllm' and body['env']['LMBOOK_API_KEY'] == 'sk-mine-0123456789'
    assert '(vllm); key: your $MY_SERVE_KEY' in out and 'sk-mine' not in out + err
    one_line_error(*run(capsys, 'pod', 'create', '--serve', 'exports/x', '--gpu', 'H100', '--repo',
                        fake.repo), '/workspace/exports/NAME')


def test_a_resume_without_free_gpus_points_to_a_new_pod_on_the_volume(fake, capsys):
    fake.add_pod('podOLD', status='EXITED', env=dict(RUN_EXPERIMENT='fw-2b'),
                 mounts=dict(network=[dict(volumeId='vol123abc', path='/workspace')]))
    fake.no_free_gpus = True
    one_line_error(*run(capsys, 'pod', 'resume', 'podOLD'), 'not enough free GPUs', 'lmbook pod create',
                   '--volume vol123abc', '--experiment fw-2b')
    fake.no_free_gpus = False
    # then RUNNING
    assert run(capsys, 'pod', 'resume', 'podOLD')[0] == 0 and fake.pods['podOLD']['status'] == 'STARTING'


def test_the_fake_keeps_the_contracts_cross_field_rules_and_lmbook_never_breaks_them(fake, capsys):
    from lmbook.dev.fake_runpod import Problem
    gpu = dict(id=H100, count=1)
    for body, words in ((dict(gpu=dict(gpu, minCudaVersion='12.8', allowedCudaVersions=['12.8'])),
                         'mutually exclusive'),
                        (dict(cpu=dict(id='cpu3c'), mounts=dict(persistent=dict(size=20, path='/workspace'))),
                         'CPU pod'),
                        (dict(gpu=gpu, env={f'V{i}': 'x' for i in range(51)}), 'at most 50'),
                        (dict(gpu=gpu, ports=['8888/http', '5000/udp']), 'UDP'),
                        (dict(gpu=dict(id=H100, count=9)), 'at most 8')):
        with pytest.raises(Problem, match=words): fake.contract_rules(body)
    for args, words in ((['--env', *[f'V{i}=x' for i in range(45)]], 'at most 50'),
                        (['--gpus', '9'], '1 to 8')):
        one_line_error(*run(capsys, *create(fake), *args), words)
    fake.balance = 0
    one_line_error(*run(capsys, *create(fake)), 'insufficient balance', 'add credit')
    assert not fake.pods
