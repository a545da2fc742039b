"""Checkpoints under stress: kill -9 and resume bit-identically, SIGTERM, a corrupt newest checkpoint, a
pickle payload."""
import json, os, random, signal, subprocess, time
from pathlib import Path
import pytest, torch
from lmbook.profiles import get_config
from conftest import rows
from lmbook.train.trainer import train
from lmbook.train.launch import worker_cmd
from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint, ckpt_step
from lmbook.core import sha256_file

TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2,
            log_every=1,
            max_steps=30, warmup_steps=3, ckpt_every=4, keep_ckpts=3, tensorboard=False, deterministic=True)
def quiet(lines): return lambda *a, **k: lines.append(' '.join(map(str, a)))

def start(ws, exp, **kw):
    cmd = worker_cmd('smoke', exp, {**TINY, **kw}, root=ws)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

def wait_for_step(proc, step, out):
    "Read lines until one reports `step`; return the time it arrived."
    for line in proc.stdout:
        out.append(line)
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= step: return time.time()
    raise AssertionError(''.join(out))

@pytest.fixture(scope='module')
def reference(ws):
    "An uninterrupted deterministic run (subprocess, like the interrupted ones)."
    p = start(ws, 'ref')
    out = p.stdout.read(); assert p.wait() == 0, out
    return rows(Path(ws)/'runs'/'ref')

def test_kill9_resume_is_bit_identical(ws, reference):
    # From step 9 on, step 4's checkpoint is complete: the save at step 8 waits for the write before it.
    # (Earlier, a kill may leave no checkpoint at all; the resume then has nothing to compare.)
    k = random.Random().randint(9, 20)
    p = start(ws, 'killed'); out = []
    wait_for_step(p, k, out)
    p.kill(); p.wait()
    last = list_checkpoints(Path(ws)/'runs'/'killed'/'checkpoints')[0]
    assert ckpt_step(last) < 30
    p = start(ws, 'killed')
    out2 = p.stdout.read(); assert p.wait() == 0, out2
    assert f'resumed at step {int(last.name[5:])}' in out2
    got, ref = rows(Path(ws)/'runs'/'killed'), reference
    assert [r['step'] for r in got] == [r['step'] for r in ref]
    for a, b in zip(got, ref):  # exact equality of every loss, before and after the kill
        assert ((a.get('loss'), a.get('val_loss'), a.get('grad_norm'), a['tokens'])
                == (b.get('loss'), b.get('val_loss'), b.get('grad_norm'), b['tokens'])), (a, b)

@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGINT'])
def test_signal_checkpoints_and_exits_fast(ws, sig):
    p = start(ws, sig, max_steps=500, ckpt_every=100); out = []
    wait_for_step(p, 3, out)
    t0 = time.time(); p.send_signal(getattr(signal, sig))
    rest = p.stdout.read(); rc = p.wait(); dt = time.time() - t0
    assert rc == 128 + getattr(signal, sig) and dt < 5, (rc, dt, rest)  # 143 for SIGTERM, 130 for SIGINT
    msg = [l for l in rest.splitlines() if l.startswith(f'stopped by {sig}')]
    assert msg, rest
    step = int(msg[0].split('at step ')[1].split('/')[0])
    newest = list_checkpoints(Path(ws)/'runs'/sig/'checkpoints')[0]
    assert newest.name == f'step_{step:08d}' and verify_checkpoint(newest)

def test_corrupt_newest_falls_back(ws):
    train(get_config('smoke', {**TINY, 'max_steps': 12}), 'corrupt', root=ws, log=quiet([]))
    ck = Path(ws)/'runs'/'corrupt'/'checkpoints'
    p = ck/'step_00000012'/'model.safetensors'
    b = bytearray(p.read_bytes()); b[len(b)//2] ^= 0xFF; p.write_bytes(bytes(b))
    log = []
    train(get_config('smoke', {**TINY, 'max_steps': 14}), 'corrupt', root=ws, log=quiet(log))
    assert any(l.startswith('warning: skipping checkpoint step_00000012') and 'sha256' in l for l in log), log
    assert any('resumed at step 8' in l for l in log)

class Payload:
    def __reduce__(self): return (os.system, (f'touch {PWNED}',))
PWNED = '/tmp/lmbook_test_pwned'

def test_pickle_payload_refused(ws):
    if os.path.exists(PWNED): os.remove(PWNED)
    train(get_config('smoke', {**TINY, 'max_steps': 8}), 'pickle', root=ws, log=quiet([]))
    d = Path(ws)/'runs'/'pickle'/'checkpoints'/'step_00000008'
    man = json.loads((d/'COMPLETE').read_text())  # the attacker also fixes the manifest
    for f in d.glob('optim-*.safetensors'):  # as written before: the optimizer state in optim.pt
        f.unlink()
        del man['files'][f.name]
    torch.save({'state': Payload()}, d/'optim.pt')
    man['files']['optim.pt'] = dict(size=(d/'optim.pt').stat().st_size, sha256=sha256_file(d/'optim.pt'))
    (d/'COMPLETE').write_text(json.dumps(man))
    log = []
    train(get_config('smoke', {**TINY, 'max_steps': 10}), 'pickle', root=ws, log=quiet(log))
    assert any('skipping checkpoint step_00000008' in l and 'UnpicklingError' in l for l in log), log
    assert any('resumed at step 4' in l for l in log)
    assert not os.path.exists(PWNED)


def test_a_new_checkpoint_is_not_read_back(tmp_path, monkeypatch):
    "`write_checkpoint` hashed its files as it wrote them: pruning reads back only the older ones it keeps."
    import lmbook.runs.checkpoint.writer as wr
    from lmbook.runs.checkpoint.formats import rng_state
    read, real = [], wr.verify_checkpoint
    spy = lambda p, *a, **k: read.append(Path(p).name) or real(p, *a, **k)
    monkeypatch.setattr(wr, 'verify_checkpoint', spy)
    snap = dict(model={'w': torch.ones(4)}, optim=None, ranks=[dict(rng=rng_state(), loader=dict(pos=0))])
    for step in (1, 2): wr.write_checkpoint(tmp_path, step, snap, dict(tokens=0), keep=2)  # no `good` set
    assert read == ['step_00000001']  # the older one, once; neither right after its own write
    assert [p.name for p in list_checkpoints(tmp_path)] == ['step_00000002', 'step_00000001']
