"The benchmark scripts leave nothing in $TMPDIR: GPU machines run them one after another on one 64 GB disk."
import json, os, signal, subprocess, sys, time
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT/'nbs'/'benchmarks'


def _env(tmp_path):
    "A fresh empty TMPDIR; torch's compile cache (shared by every run on a machine) kept out of it."
    (tmp_path/'tmp').mkdir()
    return {**os.environ, 'TMPDIR': str(tmp_path/'tmp'), 'TORCHINDUCTOR_CACHE_DIR': str(tmp_path/'inductor'),
            'HF_HUB_OFFLINE': '1', 'PYTHONPATH': f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


# the smoke profile on a few documents at a small batch: a run starts, checkpoints and stops in seconds
SMALL = 'take=1000,vocab_size=512,batch_size=4,eval_steps=2'
MINUTES = 0.05  # graceful_stop.py's time-based checkpoints: every 3 s
SCRIPTS = {  # script and arguments, tiny on the CPU; the result goes to {out}
    'serve_load': ['serve_load.py', '--tiny', '--clients', '2', '--requests', '2', '--max-tokens', '4',
                   '--device', 'cpu', '--out', '{out}'],
    'qlora_7b': ['qlora_7b.py', '{out}', '--tiny', '--steps', '2', '--rows', 'lmbook-qlora-ckpt-none'],
    'serve_phases': ['serve_phases.py', '--tiny', '--out', '{out}'],
    'end_to_end': ['end_to_end.py', '--profile', 'smoke', '--dataset', 'builtin', '--steps', '4',
                   '--eval-every', '2', '--set', SMALL + ',log_every=1', '--out', '{out}.d'],
    'graceful_stop': ['graceful_stop.py', '--profile', 'smoke', '--minutes', str(MINUTES), '--set', SMALL,
                      '--out', '{out}'],
    # the scripts of the time-to-a-model rows, each as its docstring checks it on a CPU
    'warm_start': ['warm_start.py', '--profile', 'smoke', '--mb', '4', '--steps', '2', '--out', '{out}',
                   '--set', 'device=cpu', 'take=3000'],
    'ckpt_speed': ['ckpt_speed.py', '--profile', 'smoke', '--disk-gb', '0.2', '--out', '{out}'],
    'muon_step': ['muon_step.py', '--profile', 'smoke', '--steps', '2', '--out', '{out}'],
}


E2E = {'profile', 'steps', 'prepare_s', 'on', 'off', 'target', 'together', 'complete', 'calls', 'arms',
       'validations', 'logs', 'off_seconds_to_target', 'on_seconds_to_target', 'on_over_off', 'card',
       'gpus_per_arm', 'torch', 'date', 'val_rows', 'losses'}  # end_to_end.py's JSON, after any call


@pytest.mark.parametrize('name', [n for n in SCRIPTS if n != 'end_to_end'])  # its own test below
def test_script_leaves_tmpdir_empty(name, tmp_path):
    out = tmp_path/'out.json'
    script, *args = SCRIPTS[name]
    cmd = [sys.executable, str(BENCH/script), *[a.format(out=out) for a in args]]
    p = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res
    assert not list((tmp_path/'tmp').iterdir())
    if name == 'graceful_stop':  # the stop request loses no step; the hard kill at most the interval
        assert res['stop_steps_lost'] == 0 and res['stop_exit_code'] == 143, res
        assert res['kill_seconds_lost'] <= MINUTES*60 + 5, res


def _end_to_end(tmp_path) -> tuple[list, dict]:
    "end_to_end.py's command at toy size, its result in tmp_path/out.d, and its environment."
    script, *args = SCRIPTS['end_to_end']
    return [sys.executable, str(BENCH/script), *[a.format(out=tmp_path/'out') for a in args]], _env(tmp_path)


def test_end_to_end_goes_on_across_calls_an_arm_a_call(tmp_path):
    """A misspelled arm stops before anything is prepared. On one GPU each arm has calls of its own: a call
    of the off arm alone that asks it to stop at once (the kill only 240 s later: a loaded CI machine may take
    a minute to the first step) stops it at its first step, after a checkpoint; the next call resumes it, and
    a third runs the on arm: the JSON of one long call, the off arm's clock counting its start-up once, the
    same losses as the on arm's uninterrupted run (on the CPU the levers change nothing)."""
    cmd, env = _end_to_end(tmp_path)
    bad = subprocess.run([*cmd, '--arms', 'of'], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and '--arms of: name off, on or off,on' in bad.stderr
    assert not (tmp_path/'out.d').exists() and not list((tmp_path/'tmp').iterdir())
    def call(*args) -> dict:
        p = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        res = json.loads((tmp_path/'out.d'/'end_to_end.json').read_text())
        assert set(res) == E2E, set(res) ^ E2E
        return res
    res = call('--arms', 'off', '--budget-s', '240', '--stop-s', '240')
    assert not res['complete'] and res['arms']['off']['exits'] == [143], res['arms']
    assert res['arms']['on']['starts'] == 0 and list(tmp_path.glob('tmp/lmbook-end-to-end-*/ws/runs/e2e-off'))
    res = call('--arms', 'off')
    off = res['arms']['off']
    assert not res['complete'] and off['done'] and off['exits'] == [143, 0] and len(off['restart_s']) == 1
    res = call('--arms', 'on')
    off, on = res['arms']['off'], res['arms']['on']
    assert res['complete'] and len(res['calls']) == 3, res['calls']
    assert on['exits'] == [0] and off['starts'] == 2, res['arms']
    assert res['on_over_off'] is not None and res['prepare_s'] > 0
    assert res['val_rows'] == {'off': 2*4, 'on': 2*4}  # both validated on eval_steps x batch_size of SMALL
    v = res['validations']
    assert [r[:2] for r in v['off']] == [r[:2] for r in v['on']] and [r[0] for r in v['off']] == [0, 2, 4]
    losses = res['losses']  # the training loss, one row a step here, the resumed arm's rows counted once
    assert [r[0] for r in losses['off']] == [1, 2, 3, 4] and losses['off'] == losses['on'], losses
    # the step-0 validation: its start-up, then the validation's own seconds (under a second here)
    clock = [r[2] for r in v['off']]
    assert 0 <= clock[0] - off['startup_s'] < 1 and clock == sorted(clock)
    # the off arm's final loss is the target, which it reached last
    assert res['target'] == v['off'][-1][1] and res['off_seconds_to_target'] == v['off'][-1][2] > 0
    assert not list((tmp_path/'tmp').iterdir())  # the work folder goes once the comparison is complete


def test_sigterm_mid_row_leaves_tmpdir_empty(tmp_path):
    "SIGTERM to qlora_7b.py mid-row: the row's process is stopped, then the model folder and workspace go."
    tmp, err = tmp_path/'tmp', tmp_path/'stderr.txt'
    cmd = [sys.executable, str(BENCH/'qlora_7b.py'), str(tmp_path/'out.json'), '--tiny']
    with open(err, 'w') as f:
        p = subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=f)
    t0 = time.time()
    while not list(tmp.glob('**/lmbook-ws-*')) and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.1)
    assert p.poll() is None, err.read_text()[-2000:]  # a row's workspace exists: its process is running
    p.send_signal(signal.SIGTERM)
    rc = p.wait(60)
    assert not list(tmp.iterdir())
    # SystemExit: Python's default would end it at once, skipping the removal
    assert rc == 128 + signal.SIGTERM
