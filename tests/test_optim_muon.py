"""Muon (optimizer=muon) through the trainer on the CPU: exact resume from a checkpoint, and DDP / FSDP2 under
torchrun matching one process."""
from pathlib import Path
import pytest
from lmbook.config import get_config
from lmbook.train.trainer import train
from lmbook.train.launch import launch
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
    out = ''.join(launch('smoke', f'muon-{parallel}', {**TINY, 'parallel': parallel, 'deterministic': False},
                         nproc=2, root=ws))
    assert '2 process(es)' in out, out[-2000:]
    got = losses(Path(ws)/'runs'/f'muon-{parallel}')
    assert sorted(got) == sorted(single) == list(range(1, 13))
    for s in got: assert abs(got[s] - single[s]) < 1e-4*abs(single[s]), (s, got[s], single[s])
