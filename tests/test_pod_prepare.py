"""`lmbook pod prepare`: a CPU pod over the network volume that only prepares a run's data, then stops itself,
against the fake of RunPod's REST API v2; and the plan's line on what preparing the data costs."""
import json, os, re, signal
import pytest
from lmbook.dev.fake_runpod import violations
from lmbook.pods.plan import tokenize_rate
from test_runpod import fake, run, one_line_error, posts, PLAN
from test_pod_start import api, container, pid1, volume_venv, wait_for, stops, ROOT


def prepare(fake, *extra):
    return ['pod', 'prepare', '--profile', 'runpod_2b', '--experiment', 'fw-2b', '--volume', 'vol123abc',
            '--repo', fake.repo, '--retry-wait', '0', *extra]


def test_the_cpu_pod_keeps_the_contract_and_only_prepares(fake, capsys):
    rc, out, err = run(capsys, *prepare(fake, '--save', 'prep.yaml'))
    assert rc == 0, err
    (_, _, body), = posts(fake)
    assert violations({'$ref': 'CreatePodRequest'}, body) == []
    assert 'gpu' not in body and body['cpu'] == dict(id='cpu3c', vcpuCount=16)
    assert body['mounts'] == dict(network=[dict(volumeId='vol123abc', path='/workspace')])
    env = body['env']
    assert (env['RUN_PREPARE'], env['RUN_SHARD'], env['RUN_EXPERIMENT']) == ('1', '1', 'fw-2b')
    assert 'AUTOKILL' not in env and '6006/http' not in body['ports']  # it stops itself; no TensorBoard
    assert 'cpu3c x 16 vCPUs' in out and 'then stops itself' in out and 'note:' not in err
    pod_id = next(iter(fake.pods))
    assert fake.pods[pod_id]['cost'] == 0.48 and fake.pods[pod_id]['gpu'] is None
    rc, out, _ = run(capsys, 'pod', 'status', pod_id)
    assert 'cpu3c x 16 vCPUs  $0.48/h' in out and 'tensorboard' not in out
    # its manifest makes the same pod: nothing new
    rc, out, _ = run(capsys, 'pod', 'create', '--manifest', 'prep.yaml')
    assert rc == 0 and 'already exists' in out and len(posts(fake)) == 1
    # terminated instead of stopped, on another flavor: still the contract's
    fake.pods.clear()
    assert run(capsys, *prepare(fake, '--terminate', '--cpu', 'cpu5c', '--vcpus', '32'))[0] == 0
    body = posts(fake)[-1][2]
    assert body['cpu'] == dict(id='cpu5c', vcpuCount=32) and body['env']['AUTOKILL'] == 'terminate'
    assert body['env']['RUN_PREPARE'] == '1'  # what the run reads; --all: all of the corpus
    fake.pods.clear()
    assert run(capsys, *prepare(fake, '--all'))[0] == 0 and posts(fake)[-1][2]['env']['RUN_PREPARE'] == 'all'
    assert violations({'$ref': 'CreatePodRequest'}, body) == []
    # a training pod on the volume afterwards has another name, so it is created beside the stopped one
    assert body['name'].startswith('fw-2b-prep-')


@pytest.mark.parametrize('args, words', [
    (['--volume', ''], ['needs --volume', 'vanish with the pod']),
    (['--vcpus', '12'], ['comes with 2, 4, 8, 16, 32 vCPUs']),
    (['--cpu', 'cpu9x'], ['unknown CPU flavor', 'cpu_prices.yaml']),
    (['--max-dollars', '-1'], ['must be positive']),
])
def test_refusals_are_one_line_and_send_nothing(fake, capsys, args, words):
    one_line_error(*run(capsys, *prepare(fake, *args)), *words)
    assert posts(fake) == [] and not fake.pods


def test_what_a_cpu_pod_cannot_be(fake, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv('LMBOOK_RUNPOD_API', 'graphql')
    one_line_error(*run(capsys, *prepare(fake)), 'REST API v2 only')
    monkeypatch.delenv('LMBOOK_RUNPOD_API')
    assert run(capsys, *prepare(fake, '--save', 'prep.yaml', '--dry-run'))[0] == 0
    text = (tmp_path/'prep.yaml').read_text()
    # a manifest edited into a CPU pod without its volume, with a GPU, or that would train
    for old, new, words in (("volume_id: vol123abc", "volume_id: ''", 'vanish with the pod'),
                            ("gpu_count: 0", "gpu_count: 1", 'has vCPUs and no GPU'),
                            ("RUN_PREPARE: '1'", "RUN_PREPARE: '0'", 'only prepare')):
        (tmp_path/'bad.yaml').write_text(text.replace(old, new))
        one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'bad.yaml'), *words)
    # its manifest, over the GraphQL backend
    monkeypatch.setenv('LMBOOK_RUNPOD_API', 'graphql')
    one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'prep.yaml', '--dry-run'), 'REST API v2 only')
    assert posts(fake) == []


def test_the_plan_prices_preparing_the_data_on_both_pods(capsys):
    rc, out, _ = run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', 'H100', '--gpus', '8')
    assert rc == 0
    lines = out.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith('prepare  3.93B tokens to tokenize'))
    assert 'on this pod' in lines[at + 1] and '128 vCPUs (16 a GPU, assumed)' in lines[at + 1]
    assert 'on a CPU pod' in lines[at + 2] and 'cpu3c x 16 vCPUs at $0.48/h (an estimate)' in lines[at + 2]
    assert 'measured on another machine' in out and 'lmbook pod prepare' in out
    r = tokenize_rate()
    p = json.loads(run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', 'H100', '--gpus', '8', '--json')[1])
    d = p['prep']
    assert d['tokens'] == p['tokens'] and d['cpu_pod']['tok_per_s'] == r['serial_tok_per_s']
    assert d['gpu_pod']['hours'] == pytest.approx(p['tokens']/r['serial_tok_per_s']/3600)
    assert d['gpu_pod']['cost'] == pytest.approx(d['gpu_pod']['hours']*21.52)
    assert d['cpu_pod']['cost'] == pytest.approx(d['cpu_pod']['hours']*0.48)
    # four vCPUs: the per-core figure times four, below the one-thread cap
    p = json.loads(run(capsys, *PLAN, '--profile', 'runpod_2b', '--gpu', 'H100', '--vcpus', '4', '--json')[1])
    assert p['prep']['cpu_pod']['tok_per_s'] == 4*r['tok_per_s_per_core']
    # a run set by epochs: its tokens are not known before its data is
    rc, out, _ = run(capsys, *PLAN, '--profile', 'smoke', '--gpu', 'H100', '--set', 'epochs=1')
    assert 'prepare  unknown until the data is prepared' in out


def test_a_prepare_pod_prepares_the_data_then_stops_itself(api, tmp_path):
    """The start command with RUN_PREPARE=1, as a container's PID 1: install, layout, data, no training, then
    the pod stops itself through the (fake) API; the training pod that follows finds the data done."""
    from lmbook.profiles import get_config
    from lmbook.core import paths_for
    from lmbook.data.loader import prepare_data, data_status
    corpus = tmp_path/'corpus.txt'
    corpus.write_text('\n\n'.join(f"document {i}: the quick brown fox jumps over the lazy dog number {i % 11}"
                                  for i in range(300)))
    ov = 'vocab_size=300,block_size=32,n_layer=1,n_embd=32,n_head=2'
    env = container(tmp_path, api.url, LMBOOK_REPO=f'file://{ROOT}', LMBOOK_SRC=str(ROOT),
                    LMBOOK_VENV=str(volume_venv(tmp_path/'venv')),
                    RUN_PREPARE='1', RUN_SHARD='0', RUN_INPUT=str(corpus), RUN_OVERRIDES=ov)
    log_file = tmp_path/'workspace'/'logs'/'boot-pod.log'
    p = pid1(env)
    try:
        wait_for(lambda: stops(api), 180, 'the pod to stop itself')
        wait_for(lambda: 'boot: done' in log_file.read_text(), 30, 'boot to finish')
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    log = log_file.read_text()
    assert 'stage 3/4 data:' in log, log
    assert 'stage 4/4 train: skipped: this pod only prepares the data' in log, log
    assert 'pod: the data is prepared: stopping pod pod1234abc' in log and 'boot: done, exit code 0' in log
    assert stops(api) == [dict(action='stop')] and api.pods['pod1234abc']['status'] == 'EXITED'
    run_dir = tmp_path/'workspace'/'runs'/'pod'
    assert not (run_dir/'metrics.jsonl').exists() and not list(run_dir.glob('train-*.ipynb'))
    # the training pod's data stage: everything is there, and nothing is written again
    ws = tmp_path/'workspace'
    ovs = dict(kv.split('=') for kv in ov.split(',')) | dict(dataset=str(corpus.resolve()))
    cfg = get_config('smoke', ovs)
    paths = paths_for('pod', root=ws)
    assert data_status(cfg, paths) == 'after its last stage (the data is complete)'
    files = {f: f.stat().st_mtime_ns for f in ws.rglob('*') if f.is_file() and 'logs' not in f.parts}
    pd = prepare_data(cfg, paths)
    assert pd.n_train_tokens > 0
    assert {f: f.stat().st_mtime_ns for f in files} == files


def test_the_cpu_pod_is_checked_against_runpods_catalog_and_sized(fake, capsys, monkeypatch):
    """lmbook/cpu_prices.yaml holds estimates: `pod prepare` asks RunPod's catalog (GET /v2/catalog/cpus/{id})
    for the flavor, its vCPU counts and its price before it creates anything, and sizes the pod from the
    profile: vCPUs against the one-thread bound, memory, the volume's and the container's disk."""
    import lmbook.dev.fake_runpod as fr
    cpus = dict(fr.CPUS)
    del cpus['cpu5c']  # RunPod has no such flavor (any more)
    cpus['cpu3c'] = (0.05, (2, 4, 8, 16, 32), 2, 'Compute-Optimized')  # and prices it above the estimate
    monkeypatch.setattr(fr, 'CPUS', cpus)
    one_line_error(*run(capsys, *prepare(fake, '--cpu', 'cpu5c')),
                   "RunPod's catalog has no CPU flavor 'cpu5c'", 'cpu_prices.yaml')
    assert posts(fake) == []
    rc, out, err = run(capsys, *prepare(fake, '--max-dollars', '2', '--dry-run'))
    assert rc == 0 and "PRICE_PER_HOUR: '0.8'" in out, out  # 16 vCPUs at RunPod's $0.05, not $0.03
    assert 'vCPUs: 16: tokenizing runs at its one-thread bound' in out and 'memory: 32 GB' in out, out
    assert re.search(r'volume: ~\d+ GB for the data .* the volume has 200 GB', out), out
