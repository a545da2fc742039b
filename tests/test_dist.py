"""torchrun with gloo on CPU: DDP and FSDP2 match one process at the same global batch; kill -9 of torchrun
and resume."""
import json, os, signal, subprocess, time
from pathlib import Path
import pytest
from lmbook.profiles import get_config
from conftest import rows
from lmbook.distributed import check_parallel

def _fsdp_cpu_ok():
    try: check_parallel('fsdp', 'cpu'); return True
    except ValueError: return False
FSDP_CPU = pytest.mark.skipif(not _fsdp_cpu_ok(), reason='FSDP2 on the CPU needs torch >= 2.6')
from lmbook.train.trainer import train
from lmbook.train.launch import worker_cmd, spawn
from lmbook.runs.checkpoint.formats import list_checkpoints
from lmbook.runs.checkpoint.resume import latest_checkpoint

# global batch 8 sequences: 1 process x batch 4 x grad_accum 2, or 2 processes x batch 4
TINY = dict(take=2000, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2, log_every=1,
            max_steps=40, warmup_steps=3, ckpt_every=4, keep_ckpts=3, tensorboard=False, batch_size=4)
def losses(run): return {r['step']: r['loss'] for r in rows(run) if r.get('loss') is not None}

def whole(ws, exp) -> bool:
    "Whether the run has a checkpoint that verifies."
    d = Path(ws)/'runs'/exp/'checkpoints'
    return latest_checkpoint(d, hashes=False, warn=lambda m: None) is not None

def start(ws, exp, nproc=2, **kw):
    return subprocess.Popen(worker_cmd('smoke', exp, {**TINY, **kw}, nproc=nproc, root=ws),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)

def run(ws, exp, **kw):
    "Through `launch`, as the train notebook does: a plain process prepares the data, then torchrun trains."
    out = ''.join(spawn('smoke', exp, {**TINY, **kw}, nproc=2, root=ws))
    assert out.index('data ready') < out.index('2 process(es)')
    return out

@pytest.fixture(scope='module')
def single(ws):
    train(get_config('smoke', {**TINY, 'grad_accum': 2}), 'one', root=ws, log=lambda *a: None)
    return losses(Path(ws)/'runs'/'one')

@pytest.mark.parametrize('parallel', ['ddp', pytest.param('fsdp', marks=FSDP_CPU)])
def test_two_processes_match_one(ws, single, parallel):
    out = run(ws, parallel, parallel=parallel)
    assert '2 process(es)' in out
    got = losses(Path(ws)/'runs'/parallel)
    assert sorted(got) == sorted(single) == list(range(1, 41))
    for s in got: assert abs(got[s] - single[s]) < 1e-4*abs(single[s]), (s, got[s], single[s])
    meta = json.loads((Path(ws)/'runs'/parallel/'meta.json').read_text())
    assert (meta['world_size'], meta['parallel'], meta['tokens_per_step']) == (2, parallel, 8*64)
    # rank 0 alone writes: one line per step
    assert [r['step'] for r in rows(Path(ws)/'runs'/parallel)] == list(range(41))

def test_resume_with_another_world_size(ws, single):
    log = []
    train(get_config('smoke', {**TINY, 'max_steps': 42}), 'ddp', root=ws,
          log=lambda *a: log.append(' '.join(map(str, a))))
    assert (any('written by 2 process(es), this run has 1' in l for l in log)
            and any('resumed at step 40' in l for l in log))
    assert [r['step'] for r in rows(Path(ws)/'runs'/'ddp')] == list(range(43))

def _pids_running(exp, ws):
    "Processes (torchrun and workers) of experiment `exp` in workspace `ws`."
    out = subprocess.run(['ps', '-eo', 'pid,args'], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if f'--experiment {exp} ' in l + ' '
            and 'lmbook.train.launch' in l and str(ws) in l]

@pytest.mark.parametrize('parallel', ['ddp', pytest.param('fsdp', marks=FSDP_CPU)])
def test_kill9_torchrun_then_resume(ws, single, parallel):
    exp = f'{parallel}kill'
    p = start(ws, exp, max_steps=40, parallel=parallel)
    for line in p.stdout:
        # killed once a checkpoint is whole (under load one may still be in flight at step 6)
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= 6 and whole(ws, exp): break
    os.kill(p.pid, signal.SIGKILL); p.wait()
    for _ in range(50):  # workers die with their parent (PR_SET_PDEATHSIG)
        if not _pids_running(exp, ws): break
        time.sleep(0.1)
    assert not _pids_running(exp, ws)
    # the newest that verifies: one the kill cut short is skipped on resume
    ck = int(latest_checkpoint(Path(ws)/'runs'/exp/'checkpoints', warn=lambda m: None).name[5:])
    assert 4 <= ck < 40
    out = run(ws, exp, max_steps=40, parallel=parallel)
    assert f'resumed at step {ck}' in out
    got = losses(Path(ws)/'runs'/exp)
    assert sorted(got) == list(range(1, 41))
    for s in got: assert abs(got[s] - single[s]) < 1e-4*abs(single[s]), (s, got[s], single[s])

def test_sigterm_to_torchrun(ws):
    p = start(ws, 'ddpterm', max_steps=500, ckpt_every=100)
    for line in p.stdout:
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= 3: break
    t0 = time.time(); p.send_signal(signal.SIGTERM)
    rest = p.stdout.read(); p.wait(); dt = time.time() - t0
    assert dt < 5, (dt, rest)
    msg = [l for l in rest.splitlines() if l.startswith('stopped by SIGTERM')]
    assert msg, rest
    step = int(msg[0].split('at step ')[1].split('/')[0])
    assert list_checkpoints(Path(ws)/'runs'/'ddpterm'/'checkpoints')[0].name == f'step_{step:08d}'
    assert not _pids_running('ddpterm', ws)


@pytest.mark.skipif(_fsdp_cpu_ok(), reason='only torch < 2.6 refuses FSDP2 on the CPU')
def test_fsdp_on_cpu_refused_before_start_on_old_torch(ws):
    with pytest.raises(ValueError, match='FSDP2 on the CPU needs torch >= 2.6'):
        worker_cmd('smoke', 'old-torch', dict(TINY, parallel='fsdp'), nproc=2)
