"""The best checkpoint, val_bpb and HellaSwag during training, the prompts a run samples: tiny CPU runs on
five documents."""
import contextlib, errno, hashlib, json, os, shutil, subprocess
from pathlib import Path
import pytest
from lmbook.cli import main
from lmbook.profiles import get_config
from lmbook.train.trainer import train
from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint
from lmbook.runs.checkpoint.space import disk_plan, saved_bytes
from lmbook.runs.checkpoint.writer import prune_checkpoints
from lmbook.train.runstart import build_trainable
from lmbook.train.inputs import Init
from lmbook.runs.load import load_model
from conftest import lmbook_cmd, rows

# five documents and 200 steps at a constant, high lr: validation loss bottoms out early, then rises
OVF = dict(take=5, val_ratio=0.2, batch_size=8, block_size=32, n_layer=2, n_embd=64, n_head=2, vocab_size=384,
           eval_every=10,
           eval_steps=2, max_steps=200, warmup_steps=2, lr=1e-2, min_lr_ratio=1.0, ckpt_every=50,
           keep_ckpts=1, log_every=10, tensorboard=False, device='cpu')
EX = dict(ind=1, activity_label='Python', ctx_a='Return the value', ctx_b='of', source_id='t', split='val',
          split_type='indomain')

def cfg(**kw): return get_config('smoke', {**OVF, **kw})
def quiet(lines=None):
    return lambda *a, **k: (lines if lines is not None else []).append(' '.join(map(str, a)))
def digest(d): return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).iterdir())}
def vals(run_dir): return {r['step']: r for r in rows(run_dir) if 'val_loss' in r}

@pytest.fixture(scope='module')
def run(ws):
    return train(cfg(), 'ovf', root=ws, log=quiet())

@pytest.fixture
def hs(tmp_path):
    "A HellaSwag file in the official JSONL format."
    ends = [['the function.', 'a banana boat.', 'purple rain falls.', 'zebra zebra.'],
            ['if it is None.', 'xyzzy.', 'qq qq.', 'ha ha ha.']]
    lines = [json.dumps(dict(EX, ctx=f'Return the value {i}', endings=ends[i % 2], label=i % 4))
             for i in range(7)]
    (tmp_path/'hs.jsonl').write_text('\n'.join(lines) + '\n')
    return tmp_path/'hs.jsonl'

def copy_run(run, name):
    src = Path(run['run_dir']); d = src.parent/name
    shutil.copytree(src, d)
    return d

def test_best_is_the_lowest_validation(run):
    d = Path(run['run_dir']); v = vals(d)
    low = min(v, key=lambda s: v[s]['val_loss'])
    best = d/'checkpoints'/'best'
    st = json.loads((best/'state.json').read_text())
    assert 0 < st['step'] == low == run['best_step'] < 200, (st['step'], low)
    assert st['val_loss'] == v[low]['val_loss'] == run['best_val_loss']
    assert v[200]['val_loss'] > v[low]['val_loss'] + 0.05  # the run did overfit
    verify_checkpoint(best)
    assert not (best/'optim.pt').exists()  # weights only: a resume uses the step checkpoints
    # best/ is not one of the keep_ckpts=1
    assert [p.name for p in list_checkpoints(d/'checkpoints')] == ['step_00000200']

def test_resume_keeps_a_better_best(ws, run):
    d = copy_run(run, 'ovf-resumed'); best = d/'checkpoints'/'best'
    before, lines = digest(best), []
    res = train(cfg(max_steps=240), 'ovf-resumed', root=ws, log=quiet(lines))
    assert any('resumed at step 200' in l for l in lines)  # from the newest step checkpoint, not from best/
    v = vals(d)
    # every new validation is worse
    assert all(v[s]['val_loss'] > v[run['best_step']]['val_loss'] for s in (210, 220, 230, 240))
    assert digest(best) == before and res['best_step'] == run['best_step']

def test_damaged_best_is_moved_aside(ws, run):
    d = copy_run(run, 'ovf-damaged'); best = d/'checkpoints'/'best'
    with open(best/'model.safetensors', 'r+b') as f: f.truncate(1000)
    r = lmbook_cmd('sample', 'ovf-damaged:best', 'Return the', '--root', ws, '--device', 'cpu')
    assert r.returncode == 2 and 'cannot be used' in r.stderr and 'Traceback' not in r.stderr, r.stderr
    lines = []
    res = train(cfg(max_steps=210), 'ovf-damaged', root=ws, log=quiet(lines))
    assert any('moved damaged checkpoint best to checkpoints/damaged/best' in l for l in lines), lines
    # the next validation is the best now
    assert json.loads((best/'state.json').read_text())['step'] == 210 == res['best_step']
    verify_checkpoint(best)

def test_val_bpb_matches_eval(ws, run):
    v = vals(run['run_dir'])
    assert all(0 < r['val_bpb'] < r['val_loss'] for r in v.values())
    for src, step in (('ovf', 200), ('ovf:best', run['best_step'])):
        r = lmbook_cmd('eval', src, '--root', ws, '--device', 'cpu', '--json', '--no-hellaswag')
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert (res['step'] == step and abs(res['val_bpb'] - v[step]['val_bpb']) < 1e-5
                and abs(res['val_loss'] - v[step]['val_loss']) < 1e-5)

def test_sample_and_export_the_best(ws, run, tmp_path):
    lm = load_model('ovf:best', root=ws)
    assert (lm.path.name, lm.step, lm.experiment) == ('best', run['best_step'], 'ovf')
    assert load_model(Path(run['run_dir'])/'checkpoints'/'best').step == run['best_step']
    r = lmbook_cmd('sample', 'ovf:best', 'Return the', '--max-new-tokens', 4, '--device', 'cpu', '--json',
                   '--root', ws)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])['prompt'] == 'Return the', r.stderr
    r = lmbook_cmd('export', 'ovf:best', tmp_path/'hf', '--format', 'hf', '--root', ws)
    assert r.returncode == 0 and (tmp_path/'hf'/'config.json').is_file(), r.stderr
    r = lmbook_cmd('eval', 'no-such-run:best', '--root', ws, '--no-hellaswag')
    assert (r.returncode == 2 and "no run 'no-such-run'" in r.stderr
            and 'runs with checkpoints there: ovf' in r.stderr), r.stderr

def test_hellaswag_every_n_steps(ws, hs, tmp_path, monkeypatch):
    res = train(cfg(max_steps=10, eval_every=5, ckpt_every=10, hellaswag_every=4, hellaswag_file=str(hs),
                    hellaswag_limit=5), 'hs',
                root=ws, log=quiet())
    got = [r for r in rows(res['run_dir']) if 'hellaswag' in r]
    assert [r['step'] for r in got] == [0, 4, 8, 10]  # every 4 steps, the start and the end
    assert all(0 <= r['hellaswag'] <= 1 and 0 <= r['hellaswag_acc'] <= 1 for r in got)
    e = lmbook_cmd('eval', 'hs', '--root', ws, '--device', 'cpu', '--json', '--hellaswag-file', hs, '--limit',
                   5)
    assert e.returncode == 0, e.stderr
    out = json.loads(e.stdout)
    assert ((out['hellaswag'], out['hellaswag_acc'], out['hellaswag_n'])
            == (got[-1]['hellaswag'], got[-1]['hellaswag_acc'], 5))
    from test_notebooks import papermill_run
    monkeypatch.setenv('LMBOOK_WORKSPACE', str(ws))  # the analysis notebook reads runs from the workspace
    pm = papermill_run('analysis.ipynb', tmp_path/'a.ipynb', ('experiments', 'hs'))
    assert pm.returncode == 0, pm.stderr[-3000:]
    for f in ('val_bpb.png', 'hellaswag.png'): assert (Path(res['run_dir'])/'plots'/f).stat().st_size > 1000
    assert '| val_bpb | hellaswag |' in (tmp_path/'a.ipynb').read_text()

def test_missing_hellaswag_file_stops_at_startup(ws, tmp_path):
    sets = [f'--set={k}={v}' for k, v in {**OVF, 'hellaswag_every': 5}.items()]
    for extra, msg in (([], 'downloads are off (HF_HUB_OFFLINE=1)'),
                       ([f'--set=hellaswag_file={tmp_path}/nope.jsonl'], 'does not exist')):
        r = lmbook_cmd('train', '-p', 'smoke', '-e', 'hs-missing', '--root', ws, *sets, *extra)
        err = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith('error:') and msg in err[0], r.stderr
        assert not (Path(ws)/'runs'/'hs-missing'/'metrics.jsonl').exists()

def test_end_of_run_samples_use_the_config_prompts(ws):
    res = train(cfg(max_steps=2, eval_every=2, sample_prompts='Hello there|Goodbye'), 'prompts', root=ws,
                log=quiet())
    got = [json.loads(l)['prompt'] for l in (Path(res['run_dir'])/'samples.jsonl').read_text().splitlines()]
    assert got == ['Hello there', 'Goodbye']

def test_hellaswag_shared_by_two_fsdp_ranks(ws, hs):
    "Under torchrun each rank scores its share of the examples; the numbers are those of all of them."
    sets = [f'--set={k}={v}' for k,
            v in {**OVF, 'max_steps': 4, 'eval_every': 2, 'ckpt_every': 4, 'hellaswag_every': 2,
                                           'hellaswag_file': hs, 'parallel': 'fsdp'}.items()]
    r = lmbook_cmd('train', '-p', 'smoke', '-e', 'hs-two', '--nproc', 2, '--root', ws, *sets)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [x for x in rows(Path(ws)/'runs'/'hs-two') if 'hellaswag' in x]
    assert [x['step'] for x in got] == [0, 2, 4] and all('val_bpb' in x for x in got)
    e = lmbook_cmd('eval', 'hs-two', '--root', ws, '--device', 'cpu', '--json', '--hellaswag-file', hs)
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)['hellaswag'] == got[-1]['hellaswag']


# four steps, validated every other one: step 4 is both a step checkpoint and (the loss still falling) a new
# best;
# wider than OVF, so that a checkpoint's megabytes outweigh the space check's margin of one
FOUR = dict(OVF, n_embd=128, max_steps=4, eval_every=2, ckpt_every=4, keep_ckpts=2, log_every=1)
def four_cfg(**kw): return get_config('smoke', {**FOUR, **kw})
def folder_bytes(d): return sum(f.stat().st_size for f in Path(d).iterdir() if f.is_file())
def ino(p): return p.stat().st_ino

@pytest.fixture(scope='module')
def four(ws):
    lines = []
    res = train(four_cfg(), 'four', root=ws, log=quiet(lines))
    ck = Path(res['run_dir'])/'checkpoints'
    return dict(res, step_bytes=folder_bytes(ck/'step_00000004'), best_bytes=folder_bytes(ck/'best'),
                lines=lines)

def test_disk_plan_is_what_a_run_writes(four):
    """The sizes a run logs at its start, counted from its model and optimizer, are those of the checkpoints
    it writes."""
    t = build_trainable(four_cfg(), Init())
    plan = disk_plan(*saved_bytes(t.raw, t.optimizer), keep=2)
    assert (plan.step == pytest.approx(four['step_bytes'], rel=0.03)
            and plan.best == pytest.approx(four['best_bytes'], rel=0.03))
    said = [l for l in four['lines'] if l.startswith('disk: ')]
    assert (len(said) == 1
            and said[0].startswith(f'disk: a checkpoint {plan.step/1e6:.1f} MB, '
                                   f'best/ {plan.best/1e6:.1f} MB;')), said
    assert f'keep_ckpts=2 peaks at {plan.peak/1e6:.1f} MB' in said[0] and 'free' in said[0], said

def test_best_links_the_step_checkpoint(ws, four):
    """A best at a step with a checkpoint due shares its weights and rank files (hard links) and outlives its
    pruning."""
    ck = Path(four['run_dir'])/'checkpoints'; best, step = ck/'best', ck/'step_00000004'
    assert four['best_step'] == 4
    assert all(ino(best/f) == ino(step/f) for f in ('model.safetensors', 'rank0.pt'))
    man, step_man = verify_checkpoint(best), verify_checkpoint(step)
    assert sorted(man['files']) == ['model.safetensors', 'rank0.pt', 'state.json'] and man['step'] == 4
    assert man['files']['model.safetensors'] == step_man['files']['model.safetensors']
    assert json.loads((best/'state.json').read_text())['val_loss'] == four['best_val_loss']
    prune_checkpoints(ck, 0)  # as keep_ckpts does once later checkpoints are written
    assert not step.exists() and (best/'model.safetensors').stat().st_nlink == 1
    verify_checkpoint(best)
    assert load_model('four:best', root=ws).step == 4
    r = lmbook_cmd('sample', 'four:best', 'Return the', '--max-new-tokens', 4, '--device', 'cpu', '--json',
                   '--root', ws)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])['prompt'] == 'Return the', r.stderr

def test_best_written_in_full_where_links_fail(ws, monkeypatch):
    "A filesystem without hard links: best/ is written in full, the same weights in a file of its own."
    def refuse(*a, **k): raise OSError(errno.EPERM, 'Operation not permitted')
    monkeypatch.setattr(os, 'link', refuse)
    res = train(four_cfg(), 'four-nolink', root=ws, log=quiet())
    ck = Path(res['run_dir'])/'checkpoints'; best, step = ck/'best', ck/'step_00000004'
    assert res['best_step'] == 4 and ino(best/'model.safetensors') != ino(step/'model.safetensors')
    assert (verify_checkpoint(best)['files']['model.safetensors']
            == verify_checkpoint(step)['files']['model.safetensors'])
    assert not (best/'optim.pt').exists()

@contextlib.contextmanager
def small_disk(path, size):
    """A tmpfs of `size` bytes mounted at `path` while inside (as root; skipped where mounting is not
    permitted)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size//1024}k', 'tmpfs', str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f'a small disk needs `mount -t tmpfs`, which is not permitted here: {r.stderr.strip()}')
    try: yield path
    finally: subprocess.run(['umount', str(path)], check=True)

def test_best_fits_where_a_step_checkpoint_does_not(ws, four, capsys):
    """On a disk with room for two step checkpoints (keep_ckpts=2 needs three and best/), each best/ asks for
    its own bytes, a third of a step checkpoint's: the bests after step 4's checkpoint are written, and the
    run stops, in one line, only at the step checkpoint that does not fit."""
    ck = Path(ws)/'runs'/'small-disk'/'checkpoints'
    sets = [f'--set={k}={v}' for k, v in {**FOUR, 'max_steps': 12}.items()]
    with small_disk(ck, 2*four['step_bytes']):
        code = main(['train', '-p', 'smoke', '-e', 'small-disk', '--root', str(ws), *sets])
        out, err = capsys.readouterr()
        err = [l for l in err.splitlines() if l.strip()]
        assert (code == 2 and len(err) == 1
                and err[0].startswith('error: no space for checkpoint step_00000008')), err
        assert 'rerun the same command' in err[0] and 'warning: best/' not in out, out
        # said at the start
        assert [l for l in out.splitlines() if l.startswith('warning:') and 'is under the peak of' in l], out
        v = vals(ck.parent)
        # step 6 was a best with no checkpoint due
        assert v[6]['val_loss'] < min(v[s]['val_loss'] for s in (0, 2, 4))
        assert json.loads((ck/'best'/'state.json').read_text())['step'] == 6
        verify_checkpoint(ck/'best')
        assert [p.name for p in list_checkpoints(ck)] == ['step_00000004'] and not list(ck.glob('.tmp-*'))
        verify_checkpoint(ck/'step_00000004')
