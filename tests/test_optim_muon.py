"""Muon (optimizer=muon) through the trainer on the CPU: exact resume from a checkpoint, and DDP / FSDP2 under
torchrun matching one process."""
from pathlib import Path
import pytest
from lmbook.profiles import get_config
from lmbook.train.trainer import train
from lmbook.train.launch import spawn
from lmbook.distributed import check_parallel
from conftest import rows

def _fsdp_cpu_ok():
    try: check_parallel('fsdp', 'cpu'); return True
    except ValueError: return False
FSDP_CPU = pytest.mark.skipif(not _fsdp_cpu_ok(), reason='FSDP2 on the CPU needs torch >= 2.6')

# global batch 8 sequences: 1 process x batch 4 x grad_accum 2, or 2 processes x batch 4.
# 'wsd' without decay keeps lr constant after warmup, so a longer rerun continues the same schedule.
TINY = dict(take=2000, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2, log_every=1,
            max_steps=12,
            warmup_steps=3, ckpt_every=4, keep_ckpts=3, tensorboard=False, batch_size=4, optimizer='muon',
            muon_lr=0.02, schedule='wsd', decay_frac=0.0, deterministic=True)
def losses(run): return {r['step']: r['loss'] for r in rows(run) if r.get('loss') is not None}
def quiet(*a): pass

@pytest.fixture(scope='module')
def single(ws):
    train(get_config('smoke', {**TINY, 'grad_accum': 2}), 'one', root=ws, log=quiet)
    return losses(Path(ws)/'runs'/'one')

def test_muon_trains_and_resumes_exactly(ws, single):
    assert single[12] < single[1] - 0.5  # it learns
    train(get_config('smoke', {**TINY, 'grad_accum': 2, 'max_steps': 8}), 'resumed', root=ws, log=quiet)
    log = []
    train(get_config('smoke', {**TINY, 'grad_accum': 2}), 'resumed', root=ws,
          log=lambda *a: log.append(' '.join(map(str, a))))
    assert any('resumed at step 8' in l for l in log)
    # optimizer state (momentum, Adam moments) restored bit for bit
    assert losses(Path(ws)/'runs'/'resumed') == single

@pytest.mark.parametrize('parallel', ['ddp', pytest.param('fsdp', marks=FSDP_CPU)])
def test_muon_two_processes_match_one(ws, single, parallel):
    out = ''.join(spawn('smoke', f'muon-{parallel}', {**TINY, 'parallel': parallel, 'deterministic': False},
                         nproc=2, root=ws))
    assert '2 process(es)' in out, out[-2000:]
    got = losses(Path(ws)/'runs'/f'muon-{parallel}')
    assert sorted(got) == sorted(single) == list(range(1, 13))
    for s in got: assert abs(got[s] - single[s]) < 1e-4*abs(single[s]), (s, got[s], single[s])


@pytest.mark.parametrize('batch', [1 << 27, 200])  # all of a shape in one batch; at most one or two a batch
def test_batched_step_equals_matrix_by_matrix(batch, monkeypatch):
    "Muon's step (momentum for all at once, same-shape matrices orthogonalised in batches) is the plain one."
    import torch
    import lmbook.train.optim as optim
    monkeypatch.setattr(optim, 'MUON_BATCH', batch)
    torch.manual_seed(0)
    shapes = [(16, 8)]*5 + [(8, 16)]*3 + [(12, 12)]*2
    ps = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    ref, bufs = [p.detach().clone() for p in ps], [torch.zeros(s) for s in shapes]
    opt = optim.Muon([dict(params=ps, muon=True, lr_scale=1.0, weight_decay=0.0)], lr=0.02, momentum=0.95)
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, gr in zip(ps, grads): p.grad = gr.clone()
        opt.step()
        for r, b, gr in zip(ref, bufs, grads):  # one matrix at a time, as Muon is written down
            b.lerp_(gr, 1 - 0.95)
            r.add_(optim.orthogonalize(gr.lerp(b, 0.95))*max(1, r.shape[0]/r.shape[1])**0.5, alpha=-0.02)
    for p, r in zip(ps, ref): torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
