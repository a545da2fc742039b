"""In-process training runs on CPU: the run folder, auto-resume, new run folders, refusals, budgets,
divergence."""
import hashlib, json, tomllib
from pathlib import Path
import pytest
from lmbook.config import flat_config
from lmbook.profiles import get_config, to_toml
from lmbook.core import sha256_file
from lmbook.train.trainer import train, NonFiniteError
from lmbook.runs.checkpoint.formats import list_checkpoints
from lmbook.runs.checkpoint.resume import check_compatible
from conftest import rows

# tiny and fast: 2 layers of width 64 on 64-token windows; the data is a slice of the built-in corpus
TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2,
            log_every=1, max_steps=12, warmup_steps=3, ckpt_every=4, keep_ckpts=3, tensorboard=False)
def cfg(**kw): return get_config('smoke', {**TINY, **kw})
def quiet(lines): return lambda *a, **k: lines.append(' '.join(map(str, a)))

def test_run_folder(ws):
    res = train(cfg(tensorboard=True), 'basic', root=ws, log=quiet([]))
    run = Path(res['run_dir'])
    for f in ('training.toml', 'training.yaml', 'meta.json', 'metrics.jsonl', 'samples.md', 'samples.jsonl'):
        assert (run/f).is_file(), f
    assert list((run/'tensorboard').glob('events.out.tfevents.*'))
    assert ([p.name for p in list_checkpoints(run/'checkpoints')]
            == ['step_00000012', 'step_00000008', 'step_00000004'])
    assert res['val_loss'] < res['first_val_loss'] - 0.5
    r = rows(run)
    assert [x['step'] for x in r] == list(range(13))
    assert {'step', 'tokens', 'loss', 'lr', 'grad_norm', 'tok_per_s', 'dt_ms', 'mfu', 'mem_gb'} <= set(r[5])
    assert r[12]['tokens'] == 12*4*64 and 'val_loss' in r[12]
    meta = json.loads((run/'meta.json').read_text())
    assert meta['torch'] and meta['total_steps'] == 12

def test_resume_continues_and_extends(ws):
    train(cfg(max_steps=8), 'ext', root=ws, log=quiet([]))
    log = []
    res = train(cfg(max_steps=12), 'ext', root=ws, log=quiet(log))
    assert any('resumed at step 8' in l for l in log)
    assert [x['step'] for x in rows(res['run_dir'])] == list(range(13))  # no replayed or missing lines

def old_layout(run):
    "Rewrite run folder `run` as lmbook wrote it before `TrainConfig` had sections: train fields in [train]."
    flat = lambda d: dict(d, train=flat_config(d['train']))
    (run/'training.toml').write_text(to_toml(flat(tomllib.loads((run/'training.toml').read_text()))))
    for ck in list_checkpoints(run/'checkpoints'):
        st = json.loads((ck/'state.json').read_text())
        (ck/'state.json').write_text(json.dumps(dict(st, config=flat(st['config'])), indent=1))
        man = json.loads((ck/'COMPLETE').read_text())
        f = ck/'state.json'
        man['files'][f.name] = dict(size=f.stat().st_size, sha256=sha256_file(f))
        (ck/'COMPLETE').write_text(json.dumps(man, indent=1))

def test_resume_a_run_from_before_the_sections(ws):
    "Its saved config and checkpoints hold the flat [train]: the run resumes, and a change is still caught."
    run = Path(train(cfg(max_steps=4), 'flat', root=ws, log=quiet([]))['run_dir'])
    old_layout(run)
    st = json.loads((list_checkpoints(run/'checkpoints')[0]/'state.json').read_text())
    assert st['config']['train']['lr'] == 3e-3 and 'optim' not in st['config']['train']
    with pytest.raises(ValueError, match=r'differs.*: lr 0.003 -> 0.001;'):
        train(cfg(max_steps=8, lr=1e-3), 'flat', root=ws, log=quiet([]))
    log = []
    res = train(cfg(max_steps=8), 'flat', root=ws, log=quiet(log))
    assert any('resumed at step 4' in l for l in log) and not any('config changed' in l for l in log), log
    assert [x['step'] for x in rows(res['run_dir'])] == list(range(9))

def _digest(d):
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(d).rglob('*')) if p.is_file()}

def test_no_auto_resume_new_folder(ws):
    first = train(cfg(max_steps=4), 'fresh', root=ws, log=quiet([]))['run_dir']
    before = _digest(first)
    second = train(cfg(max_steps=4, auto_resume=False), 'fresh', root=ws, log=quiet([]))['run_dir']
    assert Path(second).name == 'fresh-2' and _digest(first) == before
    assert rows(second)[0]['step'] == 0

def test_other_shape_refused(ws):
    train(cfg(max_steps=4), 'shape', root=ws, log=quiet([]))
    with pytest.raises(ValueError, match='another model shape.*n_layer=2'):
        train(cfg(max_steps=8, n_layer=3), 'shape', root=ws, log=quiet([]))

def test_other_tokenizer_refused():
    state = dict(config=dict(model=dict(n_layer=2)), tokenizer=dict(path='a', sha256='x'))
    with pytest.raises(ValueError, match='tokenizer'):
        check_compatible(state, dict(n_layer=2), dict(path='b', sha256='y'))

def test_token_budget_and_epochs(ws):
    assert train(cfg(token_budget=5*4*64), 'budget', root=ws, log=quiet([]))['total_steps'] == 5
    res = train(cfg(epochs=0.01, max_steps=1000), 'epochs', root=ws, log=quiet([]))
    n = json.loads((Path(res['run_dir'])/'meta.json').read_text())['n_train_tokens']
    assert res['total_steps'] == -(-int(0.01*n)//(4*64))

def test_divergent_run_stops(ws):
    c = cfg(max_steps=20, max_nonfinite=3)
    c.train.optim.lr = 1e4  # absurd (get_config refuses lr >= 1, so set it directly)
    log = []
    with pytest.raises(NonFiniteError, match='non-finite for 3 steps in a row'):
        train(c, 'diverge', root=ws, log=quiet(log))
    r = rows(Path(ws)/'runs'/'diverge')
    assert r[-1]['skipped'] == 3 and r[-1]['grad_norm'] is None
    assert any(l.startswith('error: training diverged') for l in log)

def test_sample_from_run(ws):
    from lmbook.runs.sample import sample_run
    train(cfg(max_steps=4), 'sampled', root=ws, log=quiet([]))
    out = sample_run('sampled', ['Return the'], max_new_tokens=8, root=ws, device='cpu')
    assert out[0]['prompt'] == 'Return the' and isinstance(out[0]['text'], str) and out[0]['text']
    assert out == sample_run('sampled', ['Return the'], max_new_tokens=8, root=ws, device='cpu')  # seeded


def test_checkpoints_on_time(ws, monkeypatch):
    """With `ckpt_minutes`, a checkpoint is due once that much wall time has passed, whatever `ckpt_every`
    says; the start warns when a write is measured slower than the interval."""
    from lmbook.runs.checkpoint import checkpointer
    monkeypatch.setattr(checkpointer, 'write_seconds', lambda folder, nbytes: 120.0)  # a slow volume
    log = []
    res = train(cfg(max_steps=3, ckpt_every=100, ckpt_minutes=1e-9, keep_ckpts=5), 'on-time', root=ws,
                log=quiet(log))
    assert ([p.name for p in list_checkpoints(Path(res['run_dir'])/'checkpoints')]
            == ['step_00000003', 'step_00000002', 'step_00000001'])
    assert sum('about 120 s to write' in l and 'ckpt_minutes=1e-09' in l for l in log) == 1
    # smoke: ckpt_minutes=0
    off = train(cfg(max_steps=3, ckpt_every=100), 'on-steps', root=ws, log=quiet(log))
    assert [p.name for p in list_checkpoints(Path(off['run_dir'])/'checkpoints')] == ['step_00000003']


def test_the_clock_goes_on_across_a_stop(ws, monkeypatch):
    """A run stopped between two metrics rows resumes its training clock from the stop's checkpoint: the
    steps after the last row it kept are counted, not lost (the rows alone would miss them)."""
    import time
    from lmbook.train import trainer
    from lmbook.runlock import request_stop
    step, calls, pause = trainer.train_step, [], 0.3
    def slow(t, *a):
        calls.append(time.sleep(pause))  # a step of `pause` seconds at least; the 5th asks to stop
        if len(calls) == 5: request_stop(Path(ws)/'runs'/'clock')
        return step(t, *a)
    monkeypatch.setattr(trainer, 'train_step', slow)
    c = cfg(max_steps=8, log_every=100, eval_every=100, ckpt_every=100)
    assert train(c, 'clock', root=ws, log=quiet([]))['step'] == 5
    run = Path(ws)/'runs'/'clock'
    assert [x['step'] for x in rows(run)] == [0]  # no row after step 0: the stop fell between rows
    state = json.loads((list_checkpoints(run/'checkpoints')[0]/'state.json').read_text())
    assert state['elapsed_s'] >= 5*pause
    assert train(c, 'clock', root=ws, log=quiet([]))['step'] == 8
    last = rows(run)[-1]
    assert last['step'] == 8 and last['elapsed_s'] >= 8*pause, last
