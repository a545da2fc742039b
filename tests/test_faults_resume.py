"""Resuming under faults: what each allowed config change does to the saved state, a disk that fills during a
background write, read-only run folders, bad settings and lock files, and a `best/` that outlives its run."""
import errno, json, os, shutil, subprocess, sys, time
from pathlib import Path
import pytest
import torch
from conftest import rows, lmbook_cmd
from lmbook.cli import main
from lmbook.config import field_index
from lmbook.profiles import get_config
from lmbook.train.trainer import train
from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint, ckpt_step
from lmbook.runs.checkpoint.resume import FREE_KEYS, FIXED_KEYS, SHAPE_KEYS, RESET_KEYS, read_checkpoint
import lmbook.runs.checkpoint.writer as ckpt_mod

TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2,
            log_every=1, max_steps=4, warmup_steps=2, ckpt_every=4, keep_ckpts=2, tensorboard=False)
def cfg(**kw): return get_config('smoke', {**TINY, **kw})
def quiet(lines): return lambda *a, **k: lines.append(' '.join(map(str, a)))
def sets(**kw): return [f'--set={k}={v}' for k, v in {**TINY, **kw}.items()]
def copy_run(ws, src, dst):
    shutil.copytree(Path(ws)/'runs'/src, Path(ws)/'runs'/dst)
    return Path(ws)/'runs'/dst

# The fields --allow-config-change lets change on resume, each with a new value. A field added to the config
# later
# must be sorted into FREE_KEYS, FIXED_KEYS, SHAPE_KEYS or here (test_every_allowed_field_is_listed says so).
NEW = dict(rope_theta=5000.0, norm_eps=1e-6, dropout=0.1, grad_accum=2, lr=1e-3, min_lr_ratio=0.2,
           warmup_steps=1,
           schedule='wsd', weight_decay=0.05, beta1=0.8, beta2=0.99, grad_clip=0.5, dtype='bfloat16',
           decay_frac=0.3, fp8='tensorwise',
           optimizer='muon', muon_lr=0.03, muon_momentum=0.9, init_from='chg-base', lora_alpha=8.0,
           doc_mask=True, rope_scaling='linear:2.0')
# The loss kernel and the sampled prompts touch no saved state: free on resume (they needed
# --allow-config-change before).
FREE_NOW = dict(fused_ce=True, sample_prompts='The|A')
HYPER = dict(beta1=lambda g: g['betas'][0], beta2=lambda g: g['betas'][1],
             weight_decay=lambda g: g['weight_decay'],
             muon_momentum=lambda g: g['momentum'], muon_lr=lambda g: g['lr_scale']*1e-3 if g.get('muon')
             else None)

def test_every_allowed_field_is_listed():
    allowed = {k for k in field_index() if k not in FREE_KEYS | set(FIXED_KEYS) | set(SHAPE_KEYS)}
    assert allowed == set(NEW), (allowed - set(NEW), set(NEW) - allowed)

@pytest.fixture(scope='module')
def base(ws):
    train(cfg(), 'chg-base', root=ws, log=quiet([]))
    return 'chg-base'

@pytest.mark.parametrize('key', sorted(NEW))
def test_allowed_change_on_resume(ws, base, key):
    """Each allowed change resumes (no crash), says what it means in one line and in configs/, and the saved
    state follows it."""
    exp = f'chg-{key}'
    run = copy_run(ws, base, exp)
    extra = dict(muon_lr=dict(optimizer='muon', lr=1e-3), muon_momentum=dict(optimizer='muon')).get(key, {})
    if extra:  # Muon's own fields matter under Muon: change them in a Muon run
        train(cfg(max_steps=5, allow_config_change=True, **extra), exp, root=ws, log=quiet([]))
    log = []
    res = train(cfg(max_steps=6 if extra else 5, allow_config_change=True, **extra, **{key: NEW[key]}), exp,
                root=ws, log=quiet(log))
    at = 5 if extra else 4
    assert res['step'] == res['total_steps'] and res['exit_code'] == 0, log
    said = [l for l in log if l.startswith(f'config changed at step {at}:')]
    assert len(said) == 1 and f'{key} ' in said[0], log
    head = (run/'configs'/f'start-step-{at}.toml').read_text().splitlines()[0]
    assert head.startswith(f'# resumed at step {at} with allow_config_change:') and f'{key} ' in head, head
    osd = read_checkpoint(list_checkpoints(run/'checkpoints')[0])['optim']
    if key in RESET_KEYS:  # a fresh optimizer state: the AdamW part of Muon counts its steps from the resume
        assert 'a fresh optimizer state' in said[0]
        assert {float(s['step']) for s in osd['state'].values() if 'step' in s} == {float(res['step'] - at)}
    if key in HYPER:  # the optimizer uses the new value, not the checkpoint's
        vals = {HYPER[key](g) for g in osd['param_groups']} - {None, 0.0}
        assert len(vals) == 1 and vals.pop() == pytest.approx(NEW[key]), (key, vals)

@pytest.mark.parametrize('key', sorted(FREE_NOW))
def test_free_change_on_resume(ws, base, key):
    """fused_ce and sample_prompts change on resume without --allow-config-change and without a config-change
    line."""
    assert key in FREE_KEYS
    exp = f'free-{key}'
    copy_run(ws, base, exp)
    log = []
    res = train(cfg(max_steps=5, **{key: FREE_NOW[key]}), exp, root=ws, log=quiet(log))
    assert res['step'] == res['total_steps'] and res['exit_code'] == 0, log
    assert not [l for l in log if l.startswith('config changed')], log

def test_disk_fills_during_background_write(ws, monkeypatch, capsys):
    """A background write that fills the disk (torch says RuntimeError): one line naming the write, exit 2, no
    temporary folder left. A best/ that fills it is one warning and training goes on, until the next step
    checkpoint finds no room."""
    for which in ('step_', 'best'):
        exp = f'bgfull-{which}'
        train(cfg(eval_every=2), exp, root=ws, log=quiet([]))
        ck = Path(ws)/'runs'/exp/'checkpoints'
        real_save, real_du, full = ckpt_mod._torch_save, ckpt_mod.shutil.disk_usage, []
        def filling(obj, path):  # another process fills the disk while this write runs
            if f'.tmp-{which}' in str(path):
                full.append(path); Path(path).write_bytes(b'\0'*4096)
                raise RuntimeError('[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed '
                                   'writing file data/0: file write failed')
            real_save(obj, path)
        monkeypatch.setattr(ckpt_mod, '_torch_save', filling)
        monkeypatch.setattr(ckpt_mod.shutil, 'disk_usage', lambda p: real_du(p)._replace(free=4096)
                            if full else real_du(p))
        assert main(['train', '-p', 'smoke', '-e', exp, '--root', str(ws),
                     *sets(max_steps=12, eval_every=2)]) == 2
        out, err = capsys.readouterr()
        err = [l for l in err.splitlines() if l.strip()]
        warned = [l for l in out.splitlines() if l.startswith('warning: best/ not written at step')]
        assert (len(warned) == (which == 'best')
                and all('no space for checkpoint best' in l for l in warned)), out
        assert (len(err) == 1 and err[0].startswith('error: no space for checkpoint step_0000000')
                and 'rerun the same command' in err[0]), err
        assert not list(ck.glob('.tmp-*')) and full
        for p in list_checkpoints(ck): verify_checkpoint(p)
        monkeypatch.undo()
        # space again: the rerun resumes
        assert train(cfg(max_steps=12, eval_every=2), exp, root=ws, log=quiet([]))['step'] == 12

def test_lowered_keep_ckpts_frees_space_on_resume(ws):
    """The advice of a full disk works on a rerun: a resume with a lower keep_ckpts prunes down to it before
    its first save."""
    train(cfg(max_steps=8, keep_ckpts=3), 'keep3', root=ws, log=quiet([]))
    ck = Path(ws)/'runs'/'keep3'/'checkpoints'
    assert len(list_checkpoints(ck)) == 2
    log = []
    # already finished: no save at all
    train(cfg(max_steps=8, keep_ckpts=1), 'keep3', root=ws, log=quiet(log))
    assert [p.name for p in list_checkpoints(ck)] == ['step_00000008'], log


def readonly_cmd(*args):
    "An `lmbook` command run without root's power to write where the permissions forbid it."
    cmd = [str(Path(sys.executable).parent/'lmbook'), *map(str, args)]
    if os.geteuid() == 0:
        if not shutil.which('setpriv'):
            pytest.skip('root needs setpriv to drop its override of file permissions')
        cmd = ['setpriv', '--bounding-set=-dac_override,-dac_read_search,-fowner', *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, 'HF_HUB_OFFLINE': '1'})

@pytest.fixture
def ro_run(ws):
    "A trained run whose folder (or a part of it) is made read-only, and writable again afterwards."
    train(cfg(), 'ro', root=ws, log=quiet([])) if not (Path(ws)/'runs'/'ro').exists() else None
    run, made = Path(ws)/'runs'/'ro', []
    def readonly(p): p.chmod(0o555); made.append(p)
    yield run, readonly
    for p in made: p.chmod(0o755)

@pytest.mark.parametrize('part', ['.', 'checkpoints'])
def test_readonly_run_folder_train(ws, ro_run, part):
    run, readonly = ro_run
    readonly(run/part)
    before = sorted(str(p) for p in run.rglob('*'))
    r = readonly_cmd('train', '-p', 'smoke', '-e', 'ro', '--root', ws, *sets(max_steps=8))
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert (r.returncode == 2 and len(err) == 1 and f"{(run/part).resolve()} is read-only" in err[0]
            and 'Traceback' not in r.stderr), r.stderr
    assert sorted(str(p) for p in run.rglob('*')) == before

def test_readonly_run_folder_eval_and_plot(ws, ro_run):
    run, readonly = ro_run
    readonly(run)
    r = readonly_cmd('eval', 'ro', '--no-hellaswag', '--device', 'cpu', '--root', ws, '--json')
    assert r.returncode == 0 and json.loads(r.stdout)['step'] == 4, r.stderr
    assert ('is read-only' in r.stderr and 'not added to its eval.jsonl' in r.stderr
            and 'Traceback' not in r.stderr), r.stderr
    r = readonly_cmd('plot', 'ro', '--root', ws)
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert (r.returncode == 2 and len(err) == 1 and 'is read-only' in err[0]
            and 'plot a copy' in err[0]), r.stderr


def test_bad_lock_setting_stops_before_step_0(ws, monkeypatch):
    """LMBOOK_LOCK_STALE_S=abc: one line before any work, no lock or metrics left (not a dying heartbeat
    thread mid-run)."""
    monkeypatch.setenv('LMBOOK_LOCK_STALE_S', 'abc')
    r = lmbook_cmd('train', '-p', 'smoke', '-e', 'badenv', '--root', ws, *sets())
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert (r.returncode == 2 and len(err) == 1
            and "LMBOOK_LOCK_STALE_S='abc' must be a number" in err[0]), r.stderr + r.stdout
    run = Path(ws)/'runs'/'badenv'
    assert not (run/'.lock').exists() and not (run/'metrics.jsonl').exists()

def test_heartbeat_failure_is_said(tmp_path):
    "A heartbeat that fails in an unforeseen way says so once and keeps beating, instead of dying silently."
    import time
    from lmbook.runlock import RunLock
    said = []
    lock = RunLock(tmp_path, said.append, heartbeat_s=0.05).acquire()
    real = lock._write
    lock._write = lambda exclusive: (_ for _ in ()).throw(RuntimeError('clock went backwards'))
    time.sleep(0.3)
    assert (lock.thread.is_alive() and len(said) == 1 and 'heartbeat' in said[0]
            and 'clock went backwards' in said[0]), said
    lock._write = real; lock.release()

def test_lock_that_is_a_folder(ws):
    (Path(ws)/'runs'/'lockdir'/'.lock').mkdir(parents=True)
    r = lmbook_cmd('train', '-p', 'smoke', '-e', 'lockdir', '--root', ws, *sets())
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(err) == 1 and 'is a folder, not a lock file' in err[0], r.stderr


def test_best_after_restart_from_step_0(ws):
    """Every step checkpoint gone: the run starts over at step 0, and the old run's best/ is moved aside, not
    kept as this run's."""
    train(cfg(max_steps=8, eval_every=2), 'lineage0', root=ws, log=quiet([]))
    ck = Path(ws)/'runs'/'lineage0'/'checkpoints'
    old = json.loads((ck/'best'/'state.json').read_text())
    for p in list_checkpoints(ck): shutil.rmtree(p)
    log = []
    res = train(cfg(max_steps=2, eval_every=2), 'lineage0', root=ws, log=quiet(log))
    assert any('is not from the run that goes on afresh from step 0' in l for l in log), log
    assert (ck/'discarded'/f"best-step_{old['step']:08d}").is_dir()
    new = json.loads((ck/'best'/'state.json').read_text())
    assert new['step'] == 2 and new['lineage'] != old['lineage'] and res['best_step'] == 2

def test_best_after_config_change_on_an_older_checkpoint(ws):
    """best/ from steps a resume discards (the process died after best/ at 6, before the checkpoint at 8): not
    kept."""
    train(cfg(max_steps=8, eval_every=2), 'lineage1', root=ws, log=quiet([]))
    ck = Path(ws)/'runs'/'lineage1'/'checkpoints'
    # as if killed between the best/ write at step 8 and the step checkpoint
    shutil.rmtree(ck/'step_00000008')
    assert json.loads((ck/'best'/'state.json').read_text())['step'] == 8
    log = []
    res = train(cfg(max_steps=8, eval_every=2, lr=1e-3, allow_config_change=True), 'lineage1', root=ws,
                log=quiet(log))
    assert any('is not from the run that goes on at step 4' in l for l in log), log
    best = json.loads((ck/'best'/'state.json').read_text())
    assert best['config']['train']['optim']['lr'] == 1e-3
    assert best['step'] > 4 and res['best_step'] == best['step']
    r = lmbook_cmd('sample', 'lineage1:best', 'Return the', '--max-new-tokens', 2, '--device', 'cpu',
                   '--json', '--root', ws)
    assert r.returncode == 0, r.stderr

def test_best_kept_when_the_run_goes_on_from_it(ws):
    train(cfg(max_steps=8, eval_every=4), 'lineage2', root=ws, log=quiet([]))
    ck = Path(ws)/'runs'/'lineage2'/'checkpoints'
    before = json.loads((ck/'best'/'state.json').read_text())
    log = []
    train(cfg(max_steps=10, eval_every=4), 'lineage2', root=ws, log=quiet(log))
    assert not (ck/'discarded').exists() and not any('not from the run' in l for l in log), log
    assert json.loads((ck/'best'/'state.json').read_text())['lineage'] == before['lineage']


def _full_after(n):
    "A write that fills the disk from its n-th call on."
    calls = []
    def write(*a, **k):
        calls.append(1)
        if len(calls) >= n: raise OSError(errno.ENOSPC, 'No space left on device')
        return REAL[0](*a, **k)
    return write

REAL = [None]

def _fill(monkeypatch, which):
    "Make the writer `which` of a run find its disk full after a few writes."
    import lmbook.runs.metrics as metrics_mod, lmbook.runs.sample as sample_mod
    from tensorboard.summary.writer import record_writer
    if which == 'tensorboard':
        REAL[0] = record_writer.RecordWriter.write
        monkeypatch.setattr(record_writer.RecordWriter, 'write', _full_after(8))
        return
    mod, name = (metrics_mod, 'metrics.jsonl') if which == 'metrics' else (sample_mod, 'samples.jsonl')
    real, n = open, [0]
    def fake_open(path, *a, **k):
        if str(path).endswith(name) and a[:1] == ('a',):
            n[0] += 1
            if n[0] >= 6: raise OSError(errno.ENOSPC, 'No space left on device', str(path))
        return real(path, *a, **k)
    monkeypatch.setattr(mod, 'open', fake_open, raising=False)

@pytest.mark.parametrize('which', ['tensorboard', 'metrics', 'samples'])
def test_full_disk_in_a_writer_is_one_line(ws, monkeypatch, capsys, which):
    "TensorBoard, metrics.jsonl or samples.jsonl finding the disk full: one line, exit 2; a rerun resumes."
    exp = f'wfull-{which}'
    _fill(monkeypatch, which)
    args = ['train', '-p', 'smoke', '-e', exp, '--root', str(ws)]
    args += sets(max_steps=12, tensorboard=True, sample_every=2)
    assert main(args) == 2
    out, err = capsys.readouterr()
    err = [l for l in err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith('error: no space left'), err
    assert 'rerun the same command' in err[0], err
    assert 'Traceback' not in out, out
    monkeypatch.undo()
    ck = Path(ws)/'runs'/exp/'checkpoints'
    for p in list_checkpoints(ck): verify_checkpoint(p)
    assert main(args) == 0  # space again: the rerun resumes and finishes


def test_a_background_write_that_fails_stops_the_run_at_once(ws, monkeypatch, capsys):
    """A step checkpoint written in the background that runs out of disk stops the run at the next step, not
    at the next checkpoint (the steps between could not be saved): one line, exit 2, nothing half-written."""
    import lmbook.train.trainer as trainer_mod
    real_write, real_step = ckpt_mod.write_files, trainer_mod.train_step
    def enospc(files, *a, **k):  # the checkpoint's writers
        for path in files:
            if '.tmp-step_00000004' in str(path):
                raise OSError(errno.ENOSPC, 'No space left on device', str(path))
        return real_write(files, *a, **k)
    def step(*a, **k):  # steps long enough for the write to fail during the next one
        res = real_step(*a, **k)
        time.sleep(0.1)
        return res
    monkeypatch.setattr(ckpt_mod, 'write_files', enospc)
    monkeypatch.setattr(trainer_mod, 'train_step', step)
    assert main(['train', '-p', 'smoke', '-e', 'bgstop', '--root', str(ws),
                 *sets(max_steps=12, eval_every=50, ckpt_async=True)]) == 2
    out, err = capsys.readouterr()
    err = [l for l in err.splitlines() if l.strip()]
    assert (len(err) == 1 and err[0].startswith('error: no space for checkpoint step_00000004')
            and 'rerun the same command' in err[0]), err
    run = Path(ws)/'runs'/'bgstop'
    assert max(r["step"] for r in rows(run)) <= 6, out  # the next save, at step 8, is not reached
    assert not list((run/'checkpoints').glob('.tmp-*')) and not list_checkpoints(run/'checkpoints')
