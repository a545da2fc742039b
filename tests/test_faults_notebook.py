"""The train notebook under papermill loses nothing when papermill is stopped or its kernel is killed: the
trainer checkpoints and stops."""
import os, signal, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import ROOT, SHARED
from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint, ckpt_step

PM = str(Path(sys.executable).parent/'papermill')
OVERRIDES = ('take=2000,batch_size=4,block_size=64,n_embd=64,n_head=2,eval_every=4,eval_steps=2,log_every=1,'
             'warmup_steps=3,ckpt_every=100,tensorboard=false')

def children(pid):
    "Pids whose parent is `pid`."
    out = []
    for d in Path('/proc').iterdir():
        if d.name.isdigit():
            try: ppid = int((d/'stat').read_text().rsplit(')', 1)[1].split()[1])
            except (OSError, IndexError, ValueError): continue
            if ppid == pid: out.append(int(d.name))
    return out

def cmdline(pid):
    try: return (Path('/proc')/str(pid)/'cmdline').read_bytes().replace(b'\0', b' ').decode()
    except OSError: return ''

def wait_for(cond, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v: return v
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")

@pytest.fixture
def nbws(tmp_path_factory, monkeypatch):
    ws = tmp_path_factory.mktemp('nbws')
    for k, v in SHARED.items(): monkeypatch.setenv(k, v)
    monkeypatch.setenv('LMBOOK_WORKSPACE', str(ws))
    return ws

@pytest.mark.parametrize('how', ['sigterm-papermill', 'kill-kernel'])
def test_notebook_run_stops_with_checkpoint(nbws, how):
    exp = f'nb-{how}'
    run = nbws/'runs'/exp
    pm = subprocess.Popen([PM, str(ROOT/'nbs'/'train.ipynb'), str(nbws/f'{exp}.ipynb'), '--cwd', str(ROOT),
                           '-p', 'profile', 'smoke',
                           '-p', 'experiment', exp, '-p', 'max_steps', '500', '-p', 'overrides', OVERRIDES],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=os.environ)
    try:
        metrics = run/'metrics.jsonl'
        wait_for(lambda: metrics.is_file() and '"step": 3,' in metrics.read_text(), 240,
                 'step 3 in metrics.jsonl')
        kernel = [c for c in children(pm.pid) if 'ipykernel' in cmdline(c)]
        assert len(kernel) == 1
        trainer = [c for c in children(kernel[0]) if 'lmbook.train.launch' in cmdline(c)]
        assert len(trainer) == 1
        if how == 'sigterm-papermill': pm.send_signal(signal.SIGTERM)
        else: os.kill(kernel[0], signal.SIGKILL)
        wait_for(lambda: not Path(f'/proc/{trainer[0]}').exists()
                 or 'Z' == (Path(f'/proc/{trainer[0]}/stat').read_text().rsplit(')', 1)[1].split()[0]),
                 60, 'the trainer to stop')
        cks = list_checkpoints(run/'checkpoints')
        # ckpt_every=100: only a stop writes one
        assert cks, 'no checkpoint: the run died without its stop checkpoint'
        step = ckpt_step(cks[0])
        assert step >= 3 and verify_checkpoint(cks[0])
        assert f'stopped by SIGTERM at step {step}/500' in (run/'train.log').read_text()
    finally:
        if pm.poll() is None: pm.kill()
        pm.wait()
