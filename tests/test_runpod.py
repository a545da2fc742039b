"`lmbook pod` with the real `runpod` SDK against a fake RunPod GraphQL server on 127.0.0.1."
import json, os, re, stat, sys
from pathlib import Path
import pytest
from fake_runpod import FakeRunPod, serve, CAPACITY
from lmbook.cli import main

KEY, HF = 'rpa_TESTKEY123', 'hf_SECRETtokenVALUE987'


@pytest.fixture
def fake(monkeypatch, tmp_path):
    import runpod
    f = FakeRunPod(KEY)
    srv, url = serve(f)
    monkeypatch.setenv('RUNPOD_API_BASE_URL', url)
    monkeypatch.setenv('RUNPOD_API_KEY', KEY)
    monkeypatch.setenv('HF_TOKEN', HF)
    monkeypatch.delenv('JUPYTER_PASSWORD', raising=False)
    monkeypatch.setattr(runpod, 'api_key', None)
    monkeypatch.setenv('LMBOOK_WORKSPACE', str(tmp_path/'ws'))
    monkeypatch.chdir(tmp_path)
    yield f
    srv.shutdown()


def run(capsys, *args):
    "(exit code, stdout, stderr) of `lmbook ARGS` run in this process."
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(rc, out, err, *words):
    assert rc == 2 and err.startswith('error: ') and len(err.strip().splitlines()) == 1, err
    for w in words: assert w in err, err


CREATE = ['pod', 'create', '--profile', 'runpod_2b', '--experiment', 'fw-2b', '--gpu', 'H100', '--gpus', '2', '--volume', 'vol123abc',
          '--hf-token', 'env:HF_TOKEN', '--autokill', '--retry-wait', '0', '--save', 'pod.yaml']


def test_create_sends_the_whole_spec_and_no_secret_anywhere_else(fake, capsys):
    rc, out, err = run(capsys, *CREATE)
    assert rc == 0, err
    (pod,) = fake.pods.values()
    inp = pod['input']
    assert (inp['gpuTypeId'], inp['gpuCount'], inp['networkVolumeId'], inp['volumeMountPath']) == ('NVIDIA H100 80GB HBM3', 2, 'vol123abc', '/workspace')
    assert inp['ports'] == '8888/http,6006/http,22/tcp' and inp['imageName'].startswith('runpod/pytorch:') and inp['cloudType'] == 'SECURE'
    env = {e['key']: e['value'] for e in inp['env']}
    assert (env['RUN_CONFIG'], env['RUN_EXPERIMENT'], env['AUTOKILL'], env['HF_TOKEN']) == ('runpod_2b', 'fw-2b', 'terminate', HF)
    assert len(env['JUPYTER_PASSWORD']) >= 20 and 'RUNPOD_API_KEY' not in env
    assert 'lmbook boot' in inp['dockerArgs'] and inp['dockerArgs'].endswith("exec ${LMBOOK_START:-/start.sh}'") and '$W/logs/boot-$RUN_EXPERIMENT.log' in inp['dockerArgs']
    assert env['LMBOOK_WORKSPACE'] == '/workspace'
    assert pod['name'].startswith('fw-2b-') and pod['id'] in out and f"https://{pod['id']}-8888.proxy.runpod.net" in out
    # the API key travels only in the Authorization header; secret values only in the create request's env
    secrets = [KEY, HF, env['JUPYTER_PASSWORD']]
    for headers, q in fake.requests:
        assert headers['Authorization'] == f'Bearer {KEY}' and KEY not in q
        if 'podFindAndDeployOnDemand' not in q: assert HF not in q and env['JUPYTER_PASSWORD'] not in q
    manifest = Path('pod.yaml').read_text()
    for s in secrets: assert s not in out + err + manifest
    assert 'env:HF_TOKEN' in manifest and 'generate' in manifest


def test_dry_run_prints_spec_and_request_and_sends_nothing(fake, capsys):
    rc, out, err = run(capsys, *CREATE, '--dry-run')
    assert rc == 0, err
    assert fake.requests == [] and not fake.pods
    assert 'podFindAndDeployOnDemand' in out and 'volumeMountPath: "/workspace"' in out and 'gpuCount: 2' in out and 'kind: lmbook-pod' in out
    assert HF not in out and KEY not in out and 'chars hidden' in out
    assert 'HF_TOKEN' in out and 'JUPYTER_PASSWORD' in out


def test_manifest_round_trip_creates_the_same_pod(fake, capsys):
    assert run(capsys, *CREATE, '--dry-run')[0] == 0
    rc, out, err = run(capsys, 'pod', 'create', '--manifest', 'pod.yaml', '--retry-wait', '0')
    assert rc == 0, err
    (pod,) = fake.pods.values()
    assert pod['input']['gpuCount'] == 2 and pod['name'].startswith('fw-2b-')
    assert run(capsys, 'pod', 'create', '--manifest', 'pod.yaml')[0] == 0
    assert len(fake.pods) == 1 and len(fake.ops('podFindAndDeployOnDemand')) == 1  # the same manifest twice: one pod
    Path('bad.yaml').write_text(Path('pod.yaml').read_text().replace("experiment: fw-2b", 'experiment: fw"2b'))
    one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'bad.yaml'), 'not allowed')


def test_capacity_is_retried_after_a_lookup_then_a_clear_error(fake, capsys):
    fake.capacity_failures = 2
    rc, out, err = run(capsys, *CREATE)
    assert rc == 0, err
    assert len(fake.pods) == 1 and len(fake.ops('podFindAndDeployOnDemand')) == 3
    assert len(fake.ops('pods {')) == 3  # a lookup by name before each try
    assert 'retrying' in out
    fake.capacity_failures = 99
    rc, out, err = run(capsys, *CREATE, '--tries', '3')
    one_line_error(rc, out, err, 'no longer any instances', 'gave up after 3 tries', '--gpu')
    assert len(fake.pods) == 1


def test_half_failed_create_is_found_by_name_and_not_billed_twice(fake, capsys):
    fake.lose_next_answer = True
    rc, out, err = run(capsys, *CREATE)
    assert rc == 0, err
    assert len(fake.pods) == 1 and len(fake.ops('podFindAndDeployOnDemand')) == 1
    assert 'not creating another' in out


def test_missing_and_wrong_key_and_api_errors_are_one_line(fake, capsys, monkeypatch):
    monkeypatch.delenv('RUNPOD_API_KEY')
    one_line_error(*run(capsys, 'pod', 'list'), 'no RunPod API key', 'RUNPOD_API_KEY')
    monkeypatch.setenv('RUNPOD_API_KEY', 'rpa_WRONG')
    one_line_error(*run(capsys, 'pod', 'list'), 'rejected the API key')
    monkeypatch.setenv('RUNPOD_API_KEY', KEY)
    rc, out, err = run(capsys, *[a if a != 'vol123abc' else 'volnothere' for a in CREATE])
    one_line_error(rc, out, err, 'RunPod API error: Network volume not found')
    assert HF not in err and KEY not in err
    monkeypatch.setenv('RUNPOD_API_BASE_URL', 'http://127.0.0.1:9')
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
])
def test_malicious_or_bad_values_are_refused_before_any_request(fake, capsys, args, words):
    base = ['pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100']
    rc, out, err = run(capsys, *base, *args)
    one_line_error(rc, out, err, *words)
    assert 'hf_plainvalue' not in err  # a token given where its source belongs is not echoed back
    assert fake.requests == []
    one_line_error(*run(capsys, 'pod', 'stop', 'abc"}) { id }'), 'pod id')


def test_status_wait_lifecycle_and_volumes(fake, capsys):
    fake.polls_until_running = 2
    assert run(capsys, *CREATE, '--wait', '--timeout', '60', '--poll', '0')[0] == 0
    pid = next(iter(fake.pods))
    rc, out, err = run(capsys, 'pod', 'status', pid)
    assert rc == 0 and 'RUNNING' in out and '$5.38/h' in out and '97% busy' in out and 'ssh root@203.0.113.7 -p 40022' in out
    assert HF not in out and 'JUPYTER_PASSWORD' not in out
    assert pid in run(capsys, 'pod', 'list')[1]
    assert run(capsys, 'pod', 'stop', pid)[0] == 0 and fake.pods[pid]['desiredStatus'] == 'EXITED'
    one_line_error(*run(capsys, 'pod', 'wait', pid, '--timeout', '1', '--poll', '0'), 'EXITED')
    assert run(capsys, 'pod', 'resume', pid)[0] == 0 and fake.pods[pid]['desiredStatus'] == 'RUNNING'
    assert 'gpuCount: 2' in fake.ops('podResume')[0]
    assert run(capsys, 'pod', 'restart', pid)[0] == 0 and fake.ops('podRestart')
    assert run(capsys, 'pod', 'terminate', pid)[0] == 0 and pid not in fake.pods
    one_line_error(*run(capsys, 'pod', 'status', pid), 'does not exist')
    rc, out, err = run(capsys, 'pod', 'volume', 'create', '--name', 'fw', '--size', '500', '--data-center', 'EU-RO-1')
    assert rc == 0 and '500 GB' in out and 'EU-RO-1' in out
    assert 'fw' in run(capsys, 'pod', 'volume', 'list')[1]
    one_line_error(*run(capsys, 'pod', 'volume', 'create', '--name', 'fw', '--size', '10', '--data-center', 'EU"RO'), 'data center')


def test_wait_times_out_with_a_clear_message(fake, capsys):
    fake.polls_until_running = 10**6
    assert run(capsys, *CREATE)[0] == 0
    from lmbook.runpod import RunPodAPI, wait_running, RunPodError
    t = iter(range(0, 10**6, 100))
    with pytest.raises(RunPodError, match='not running after 300 s'):
        wait_running(RunPodAPI(), next(iter(fake.pods)), timeout_s=300, sleep=lambda s: None, clock=lambda: next(t), log=lambda m: None)


def test_logs_tail_the_boot_log_over_ssh(fake, capsys, tmp_path, monkeypatch):
    assert run(capsys, *CREATE)[0] == 0
    bin_ = tmp_path/'bin'; bin_.mkdir()
    (bin_/'ssh').write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/ssh-args\n'); (bin_/'ssh').chmod(0o755)
    monkeypatch.setenv('PATH', f"{bin_}:{os.environ['PATH']}")
    assert run(capsys, 'pod', 'logs', next(iter(fake.pods)), '-n', '20')[0] == 0
    args = (tmp_path/'ssh-args').read_text()
    assert '-p 40022 root@203.0.113.7 tail -n 20 /workspace/logs/boot-fw-2b.log' in args


def test_plan_refuses_what_does_not_fit_and_names_what_does(capsys):
    one_line_error(*run(capsys, 'pod', 'plan', '--profile', 'runpod_2b', '--gpu', '4090'), '57.2 GB', "--gpu 'NVIDIA H100")
    rc, out, err = run(capsys, 'pod', 'plan', '--profile', 'runpod_2b', '--gpu', 'A100')
    assert rc == 0 and 'never measured on NVIDIA A100' in out and 'cost' in out
    rc, out, err = run(capsys, 'pod', 'plan', '--profile', 'runpod_2b', '--gpu', 'H100', '--json')
    p = json.loads(out)
    assert p['measured'] and 39_000 < p['tok_per_s'] < 41_000 and p['steps'] == 30_000 and 20 < p['hours'] < 35 and p['cost'] > 0


def test_fetch_copies_the_run_folder_without_checkpoints(fake, capsys, tmp_path, monkeypatch):
    assert run(capsys, *CREATE)[0] == 0
    bin_ = tmp_path/'bin'; bin_.mkdir()
    (bin_/'rsync').write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/rsync-args\n'); (bin_/'rsync').chmod(0o755)
    monkeypatch.setenv('PATH', f"{bin_}:{os.environ['PATH']}")
    assert run(capsys, 'pod', 'fetch', next(iter(fake.pods)))[0] == 0
    args = (tmp_path/'rsync-args').read_text()
    assert '--exclude checkpoints/' in args and f'root@203.0.113.7:/workspace/runs/fw-2b/ {tmp_path}/ws/runs/fw-2b/' in args and '-p 40022' in args


FAKE_HF = 'hf' + '_' + 'abcdefghijklmnopqrstuvwx'  # token-shaped, made here so no token-like literal sits in the repository

@pytest.mark.parametrize('env', [f'HF_TOKEN={FAKE_HF}', 'WANDB_API_KEY=0123abcd', 'MY_PASSWORD=hunter22', f'NOTE={FAKE_HF}yz123456'])
def test_a_secret_passed_as_plain_env_is_refused_before_anything_is_written(fake, capsys, env):
    value = env.split('=', 1)[1]
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100', '--env', env, '--save', 'p.yaml', '--dry-run')
    one_line_error(rc, out, err, 'secret', '--hf-token')
    assert value not in out + err and not Path('p.yaml').exists() and fake.requests == []
    assert run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100', '--env', 'PUBLIC_KEY=ssh-ed25519 AAAAC3', '--dry-run')[0] == 0


def test_a_manifest_is_refused_when_its_env_carries_a_secret_or_disagrees_with_it(fake, capsys):
    assert run(capsys, *CREATE, '--dry-run')[0] == 0
    txt = Path('pod.yaml').read_text()
    Path('leak.yaml').write_text(txt.replace("  PYTHONUNBUFFERED: '1'", f"  PYTHONUNBUFFERED: '1'\n  HF_TOKEN: {FAKE_HF}"))
    one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'leak.yaml', '--dry-run'), 'HF_TOKEN', 'secret')
    Path('moved.yaml').write_text(txt.replace('experiment: fw-2b', 'experiment: fw-2b-again'))
    one_line_error(*run(capsys, 'pod', 'create', '--manifest', 'moved.yaml', '--dry-run'), 'RUN_EXPERIMENT', 'fw-2b-again')
    assert fake.requests == []


def test_printed_request_shows_no_character_of_a_secret(fake, capsys):
    rc, out, err = run(capsys, *CREATE, '--dry-run')
    masks = re.findall(r'key: "(\w+)", value: "([^"]*chars hidden\))"', out)
    assert [k for k, v in masks] == ['JUPYTER_PASSWORD', 'HF_TOKEN'] and all(v.startswith('…(') for k, v in masks), masks


def test_a_create_whose_last_answer_is_lost_is_found_by_name(fake, capsys):
    fake.lose_next_answer = True
    rc, out, err = run(capsys, *CREATE, '--tries', '1')
    assert rc == 0, err
    assert len(fake.pods) == 1 and next(iter(fake.pods)) in out


def test_a_card_runpod_does_not_offer_gets_a_clear_error(fake, capsys):
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H200')
    one_line_error(rc, out, err, "'NVIDIA H200'", 'gpu_prices.yaml')
    assert 'runpod.get_gpus' not in err and not fake.pods


def test_braces_and_dollars_are_plain_string_content(fake, capsys):
    rc, out, err = run(capsys, 'pod', 'create', '--profile', 'smoke', '--experiment', 'ok', '--gpu', 'H100', '--env', 'FOO=a{b', 'BAR=${HOME}')
    assert rc == 0, err
    env = {e['key']: e['value'] for e in next(iter(fake.pods.values()))['input']['env']}
    assert (env['FOO'], env['BAR']) == ('a{b', '${HOME}')


def test_every_lmbook_command_the_pod_docs_name_exists():
    "The README's pod section and the pods page name only commands and flags that exist; whole command lines parse."
    import argparse, shlex
    from lmbook.cli import build_parser
    root = Path(__file__).resolve().parents[1]
    readme = (root/'README.md').read_text().split('## On a RunPod pod', 1)[1].split('\n## ', 1)[0]
    page = '\n'.join(''.join(c['source']) for c in json.loads((root/'nbs'/'pods.ipynb').read_text())['cells'] if c['cell_type'] == 'markdown')
    text = (readme + '\n' + page).replace('\\\n', ' ')
    lines = [m.split('  #')[0].strip() for m in re.findall(r'(?m)^(lmbook [^\n`]+)', text)]
    named = [c for c in re.findall(r'`(lmbook [^`]+)`', text)]
    assert len(lines) > 15 and len(named) > 10, (lines, named)
    ap = build_parser()
    for c in lines + named:
        args = shlex.split(c.replace('$NODE_RANK', '0').replace('$MASTER_ADDR', '10.0.0.1').replace('...', '').replace('…', ''))[1:]
        p = ap
        while args and not args[0].startswith('-'):
            sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is None: break
            assert args[0] in sub.choices, f"the docs name `{c}`: no command {args[0]!r}"
            p, args = sub.choices[args.pop(0)], args
        flags = {o for a in p._actions for o in a.option_strings}
        for a in args:
            if a.startswith('-') and ' ' not in a: assert a.split('=')[0] in flags, f"the docs name `{c}`: no option {a}"
    for c in lines:
        try: ap.parse_args(shlex.split(c.replace('$NODE_RANK', '0').replace('$MASTER_ADDR', '10.0.0.1'))[1:])
        except SystemExit: pytest.fail(f"the docs show `{c}`, which lmbook does not accept")


def test_an_api_error_that_echoes_the_request_shows_no_secret(fake, capsys):
    fake.echo_errors = True
    rc, out, err = run(capsys, *CREATE)
    one_line_error(rc, out, err, 'RunPod API error', 'chars hidden')
    (q,) = fake.ops('podFindAndDeployOnDemand')
    pw = re.search(r'key: "JUPYTER_PASSWORD", value: "([^"]+)"', q).group(1)
    for s in (HF, KEY, pw): assert s not in out + err


def test_a_config_file_for_the_pod_must_be_a_path_on_the_pod(fake, capsys):
    base = ['pod', 'create', '--experiment', 'ok', '--gpu', 'H100', '--dry-run']
    one_line_error(*run(capsys, *base, '--profile', 'configs/my.yaml'), '/workspace/')
    rc, out, err = run(capsys, *base, '--profile', '/workspace/configs/my.yaml')
    assert rc == 0 and 'RUN_CONFIG: /workspace/configs/my.yaml' in out, err
