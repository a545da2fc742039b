"""A warm start: the micro-batch fit's answer and the compiler's caches are found in the workspace by the next
start, and every start records where its seconds went."""
import os
import pytest
from pathlib import Path
from lmbook.overrides import apply_overrides
from lmbook.profiles import get_config
from lmbook.core import paths_for
from lmbook.distributed import DistInfo
from lmbook.rundir import RunDir
from lmbook.runs.metrics import RunLog
from lmbook.train.inputs import Init
from lmbook.train.runstart import fitted_config
from lmbook.train.trainer import train
from lmbook.train.warmstart import FIT_CACHE, fit_file, fit_key, shared_cache

TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, max_steps=4, warmup_steps=2,
            eval_every=2, eval_steps=2, log_every=1, ckpt_every=2, tensorboard=False)


def test_second_start_skips_the_fit(tmp_path):
    "A first start tries micro-batches, a second finds the answer; another card or lever tries again."
    cfg, card = get_config('smoke', dict(batch_size=2, grad_accum=8)), 'made-up card, 40960 MiB'
    cache, tried = shared_cache(paths_for('a', root=tmp_path), FIT_CACHE), []
    fits = lambda c: tried.append(c.train.batch_size) or 10 + 4*c.train.batch_size <= 40
    fit = lambda c, card=card, run='a': fitted_config(c, Init(), tmp_path/'runs'/run, DistInfo(), print,
                                                      cache=cache, fits=fits, card=card)
    first, how = fit(cfg)
    assert (first.train.batch_size, first.train.grad_accum, how) == (4, 4, 'fitted') and tried
    assert fit_file(cache, fit_key(cfg, 1, card)).is_file()
    n = len(tried)
    second, how = fit(cfg, run='b')  # another experiment of the same profile on the same card
    assert (second.train.batch_size, second.train.grad_accum, how, len(tried)) == (4, 4, 'cached', n)
    for other in (dict(card='another card, 81559 MiB'), dict(c=apply_overrides(cfg, dict(act_ckpt='full')))):
        assert fit(**{'c': cfg, **other})[1] == 'fitted' and len(tried) > n
        n = len(tried)


def test_compile_cache_in_the_workspace(tmp_path, monkeypatch):
    "A run that compiles points torch.compile's caches at the workspace before anything compiles."
    import lmbook.train.trainer as trainer
    class Stop(Exception): pass
    def stop(*a, **k): raise Stop(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))  # where the model would compile
    monkeypatch.setattr(trainer, 'build', stop)
    monkeypatch.delenv('TORCHINDUCTOR_CACHE_DIR', raising=False)
    def cache_dir(exp, **kw):
        try: train(get_config('smoke', dict(TINY, **kw)), exp, tmp_path, RunLog(lambda *a: None))
        except Stop as e: return e.args[0]
    assert cache_dir('c', compile='true') == str(tmp_path.resolve()/'cache'/'_compile')
    monkeypatch.delenv('TORCHINDUCTOR_CACHE_DIR')
    assert cache_dir('c') is None  # nothing compiles on this CPU: nothing is set
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path/'mine'))  # the user's choice stays
    assert cache_dir('d', compile='true') == str(tmp_path/'mine')


def test_start_up_is_recorded(tmp_path):
    "Each start logs where its seconds went; a resumed one loads its checkpoint and has no step-0 validation."
    said = []
    log = lambda *a, **k: said.append(' '.join(map(str, a)))
    res = train(get_config('smoke', TINY), 'e', root=tmp_path, log=log)
    first = RunDir(res['run_dir']).read_meta()['startup']
    assert {'data', 'model', 'validation', 'first step'} <= set(first['parts'])
    assert first['ended'] - first['started'] == first['total_s'] or abs(first['ended'] - first['started']
                                                                         - first['total_s']) < 0.02
    train(get_config('smoke', dict(TINY, max_steps=6)), 'e', root=tmp_path, log=log)
    again = RunDir(res['run_dir']).read_meta()['startup']
    assert 'resume' in again['parts'] and 'validation' not in again['parts']
    assert again['notes']['resume'].startswith('found and hashed ')  # where the resume's seconds went
    assert again['started'] > first['ended']
    assert sum(l.startswith('start-up:') for l in said) == 2


def start_process(code:str, exp:str, cfg:dict, tmp_path) -> str:
    """Run `code` (argv: experiment, config values, workspace) in a new process on `tmp_path/'ws'`, with its
    own TMPDIR and no compile cache variables, as a new pod has; its stdout. The run's samples at its end are
    left out: they compile graphs of their own, after everything these tests read."""
    import subprocess, sys
    code = "import lmbook.train.trainer as t; t._samples = lambda r, step: None\n" + code
    env = {k: v for k, v in os.environ.items() if k not in ('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR')}
    (tmp_path/f'tmp-{exp}').mkdir()
    p = subprocess.run([sys.executable, '-c', code, exp, repr(cfg), str(tmp_path/'ws')], capture_output=True,
                       text=True, env=dict(env, TMPDIR=str(tmp_path/f'tmp-{exp}')), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


@pytest.mark.parametrize('compile', ['true', 'blocks'])
def test_cold_start_finds_its_fits_graphs(tmp_path, compile):
    """The micro-batch fit's trial compiles the training step; the run's first step, after the step-0
    validation ran its rows in smaller chunks (as a large vocabulary makes it on a GPU), finds those graphs
    instead of compiling the step again for any batch size; the whole model or each block compiled. The GPU's
    trial runs on the CPU here. With the whole model, a second process on the same workspace (a new pod, the
    same volume) then finds the fit's answer and every graph, and its log says so."""
    # torch writes its /tmp default into TORCHINDUCTOR_CACHE_DIR when something asks first, as importing
    # torchao's float8 does on a GPU machine: the trainer must still use the workspace's cache
    code = ("from torch._inductor.runtime.cache_dir_utils import cache_dir; cache_dir()\n"
            "import sys, torch\n"
            "for f in ('empty_cache', 'reset_peak_memory_stats'): setattr(torch.cuda, f, lambda *a: None)\n"
            "torch.cuda.max_memory_reserved = lambda *a: 0\n"
            "torch.cuda.mem_get_info = lambda *a: (1 << 40, 1 << 40)\n"
            "import lmbook.train.runstart as rs, lmbook.train.validation as v\n"
            "from lmbook.profiles import get_config; from lmbook.rundir import RunDir\n"
            "from lmbook.train.trainer import train\n"
            "v.LOGITS_AT_ONCE = 64*4096  # a row of logits at a time: validation's chunks of one row\n"
            "real = rs.fitted_config\n"
            "def fitted(cfg, init, run_dir, info, log, cache=None, fits=None, card=None):\n"
            "    trial = lambda c: c.train.batch_size <= 4 and rs.fits_card(c, init, info)\n"
            "    return real(cfg, init, run_dir, info, log, cache, trial, card='cpu')\n"
            "rs.fitted_config = fitted\n"
            "res = train(get_config('smoke', eval(sys.argv[2])), sys.argv[1], root=sys.argv[3], log=print)\n"
            "print('NOTE', RunDir(res['run_dir']).read_meta()['startup']['notes'].get('first step'))")
    # one trial compiles (4: fits); 8 is refused without compiling, as a card's estimate refuses it
    tiny = dict(TINY, n_layer=2, max_steps=2, eval_steps=1, compile=compile, batch_fit=True, batch_size=4,
                grad_accum=2)
    out = start_process(code, 'a', tiny, tmp_path)
    assert 'micro-batch 4 x accumulation 2 (4 fits, 8 does not)' in out, out[-2000:]
    note = out.split('NOTE ')[-1].strip()
    assert note.startswith('compile cache: graphs 2 found'), note  # the step's forward and backward
    if compile == 'blocks': return
    out = start_process(code, 'b', tiny, tmp_path)  # another experiment: nothing tried, nothing compiled
    assert 'as fitted for this card' in out, out[-2000:]
    note = out.split('NOTE ')[-1].strip()
    line = next(l for l in out.splitlines() if l.startswith('start-up:'))
    assert 'found' in note and 'compiled' not in note and f'({note})' in line, note
