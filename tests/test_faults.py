"""Faults a user on a pod meets: a closed console, a second trainer, damaged checkpoints, a torn metrics line,
a changed config, a full disk, --prepare-only."""
import errno, json, os, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest
import torch
from conftest import rows, lmbook_cmd
from lmbook.profiles import get_config
from lmbook.train.trainer import train
from lmbook.train.launch import worker_cmd
from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint, ckpt_step
from lmbook.runs.checkpoint.formats import CheckpointSpaceError
import lmbook.runs.checkpoint.writer as ckpt_mod

TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2,
            log_every=1, max_steps=12, warmup_steps=3, ckpt_every=4, keep_ckpts=2, tensorboard=False)
def cfg(**kw): return get_config('smoke', {**TINY, **kw})
def quiet(lines): return lambda *a, **k: lines.append(' '.join(map(str, a)))
def sets(**kw): return [f'--set={k}={v}' for k, v in {**TINY, **kw}.items()]

def test_closed_stdout_keeps_training(ws):
    "`lmbook train … | head -3`: the reader goes away, the run finishes, its lines reach train.log."
    exe = Path(sys.executable).parent/'lmbook'
    p = subprocess.Popen([str(exe), 'train', '-p', 'smoke', '-e', 'pipe', '--root', str(ws),
                          *sets(max_steps=10)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for _ in range(3): p.stdout.readline()
    p.stdout.close()  # what `head -3` does
    assert p.wait(timeout=300) == 0
    log = (Path(ws)/'runs'/'pipe'/'train.log').read_text()
    assert 'done: 10 steps' in log and log.count(' step ') >= 10, log
    assert ckpt_step(list_checkpoints(Path(ws)/'runs'/'pipe'/'checkpoints')[0]) == 10

def test_second_trainer_refused(ws):
    "Two trainers on one experiment: the second is refused in one line naming the first; the first goes on."
    a = subprocess.Popen(worker_cmd('smoke', 'locked', {**TINY, 'max_steps': 500, 'ckpt_every': 100},
                                    root=ws),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in a.stdout:
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= 2: break
    b = lmbook_cmd('train', '-p', 'smoke', '-e', 'locked', '--root', ws, *sets(max_steps=500, ckpt_every=100),
                   timeout=120)
    a.send_signal(signal.SIGTERM); rest = a.stdout.read()
    assert a.wait() == 143, rest
    assert b.returncode == 2, b.stdout + b.stderr
    err = b.stderr.strip().splitlines()
    assert (len(err) == 1 and 'in use by another trainer' in err[0] and f'pid {a.pid}' in err[0]
            and socket.gethostname() in err[0]), err
    assert 'stale after 120 s' in err[0]
    assert ([r['step'] for r in rows(Path(ws)/'runs'/'locked')]
            == sorted({r['step'] for r in rows(Path(ws)/'runs'/'locked')}))
    assert not (Path(ws)/'runs'/'locked'/'.lock').exists()

def test_stale_lock_taken_over(ws, monkeypatch):
    "A lock whose heartbeat stopped (another host) is taken over after LMBOOK_LOCK_STALE_S."
    run = Path(ws)/'runs'/'stale'; run.mkdir(parents=True)
    (run/'.lock').write_text(json.dumps(dict(host='gone-host', pid=1, started=time.time() - 60,
                                             heartbeat=time.time() - 10)))
    with pytest.raises(ValueError, match='host gone-host pid 1'):
        train(cfg(max_steps=2), 'stale', root=ws, log=quiet([]))
    monkeypatch.setenv('LMBOOK_LOCK_STALE_S', '5')
    log = []
    assert train(cfg(max_steps=2), 'stale', root=ws, log=quiet(log))['step'] == 2
    assert any('taking over the stale lock' in l and 'no heartbeat for' in l for l in log), log

def _truncate(p):
    p.write_bytes(p.read_bytes()[:p.stat().st_size//2])

def test_damaged_checkpoints_moved_aside(ws):
    """The two newest checkpoints truncated: restart at 0, keep the old metrics aside, never prune the new
    checkpoints."""
    train(cfg(max_steps=12), 'damaged', root=ws, log=quiet([]))
    run = Path(ws)/'runs'/'damaged'
    for p in list_checkpoints(run/'checkpoints'): _truncate(p/'model.safetensors')
    log = []
    res = train(cfg(max_steps=6), 'damaged', root=ws, log=quiet(log))
    assert res['step'] == 6 and not any('resumed' in l for l in log)
    assert [p.name for p in list_checkpoints(run/'checkpoints')] == ['step_00000006', 'step_00000004']
    for p in list_checkpoints(run/'checkpoints'): verify_checkpoint(p)
    # best/ (step 12) shares step 12's weights file (a hard link), so truncating one damaged both: both moved
    # aside
    assert (sorted(p.name for p in (run/'checkpoints'/'damaged').iterdir())
            == ['best', 'step_00000008', 'step_00000012'])
    assert [r['step'] for r in rows(run)] == list(range(7))
    assert ([json.loads(l)['step'] for l in (run/'metrics.after-step-0.jsonl').read_text().splitlines()]
            == list(range(13)))
    assert any('moved damaged checkpoint step_00000012' in l for l in log), log

def test_torn_metrics_line(ws):
    """A crash mid-append leaves a torn last line of metrics.jsonl: dropped with a warning naming the file,
    and the run resumes."""
    train(cfg(max_steps=8), 'torn', root=ws, log=quiet([]))
    m = Path(ws)/'runs'/'torn'/'metrics.jsonl'
    with open(m, 'a') as f: f.write('{"step": 9, "lo')
    log = []
    train(cfg(max_steps=10), 'torn', root=ws, log=quiet(log))
    assert any(l.startswith('warning:') and str(m) in l and 'not a whole record' in l for l in log), log
    assert [r['step'] for r in rows(m.parent)] == list(range(11))

def test_config_change_needs_permission(ws):
    """A changed lr is shown and refused; allowed with allow_config_change and recorded; batch_size is refused
    anyway."""
    train(cfg(max_steps=8), 'cfgchange', root=ws, log=quiet([]))
    run = Path(ws)/'runs'/'cfgchange'
    first = (run/'training.toml').read_text()
    old_lr = cfg().train.optim.lr
    with pytest.raises(ValueError, match=f"lr {old_lr!r} -> 0.001.*--allow-config-change"):
        train(cfg(max_steps=10, lr=1e-3), 'cfgchange', root=ws, log=quiet([]))
    with pytest.raises(ValueError, match="batch_size 4 -> 8: the loader's exact position"):
        train(cfg(max_steps=10, batch_size=8, allow_config_change=True), 'cfgchange', root=ws, log=quiet([]))
    assert ckpt_step(list_checkpoints(run/'checkpoints')[0]) == 8
    log = []
    train(cfg(max_steps=10, lr=1e-3, allow_config_change=True), 'cfgchange', root=ws, log=quiet(log))
    assert any(l.startswith('config changed at step 8: lr') for l in log), log
    assert (run/'training.toml').read_text() == first
    assert 'lr = 0.001' in (run/'configs'/'start-step-8.toml').read_text()
    assert rows(run)[-1]['lr'] < 1e-3 + 1e-12

def test_disk_full_is_one_line(ws, monkeypatch):
    """Too little space before a checkpoint, or ENOSPC during it: one line naming the folder and keep_ckpts;
    older checkpoints intact."""
    train(cfg(max_steps=8), 'full', root=ws, log=quiet([]))
    ck = Path(ws)/'runs'/'full'/'checkpoints'
    Usage = ckpt_mod.shutil.disk_usage(ck).__class__
    monkeypatch.setattr(ckpt_mod.shutil, 'disk_usage', lambda p: Usage(10**12, 10**12 - 10**4, 10**4))
    with pytest.raises(CheckpointSpaceError) as e: train(cfg(max_steps=12), 'full', root=ws, log=quiet([]))
    msg = str(e.value)
    assert '\n' not in msg and str(ck) in msg and 'keep_ckpts=2 needs about' in msg and 'GB' in msg, msg
    monkeypatch.undo()
    def enospc(*a, **k): raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(ckpt_mod.os, 'pwrite', enospc)  # the checkpoint's writers (`runs.tensorfile`) hit it
    with pytest.raises(CheckpointSpaceError, match='no space for checkpoint step_00000012'):
        train(cfg(max_steps=12), 'full', root=ws, log=quiet([]))
    assert ([p.name for p in list_checkpoints(ck)] == ['step_00000008', 'step_00000004']
            and not list(ck.glob('.tmp-*')))
    for p in list_checkpoints(ck): verify_checkpoint(p)

def test_prepare_only_does_not_train(ws):
    r = lmbook_cmd('train', '--prepare-only', '-p', 'smoke', '-e', 'prep', '--root', ws, *sets(), timeout=300)
    assert r.returncode == 0 and 'data ready' in r.stdout, r.stdout + r.stderr
    assert (not (Path(ws)/'runs'/'prep'/'checkpoints').exists()
            and not (Path(ws)/'runs'/'prep'/'metrics.jsonl').exists())

def test_background_checkpoints_do_not_stall(ws, monkeypatch):
    """With ckpt_async a slow write runs beside training; the stall is the snapshot; a stop still waits for
    the write."""
    from lmbook.runs.checkpoint import checkpointer  # where a background save calls the writer
    real = checkpointer.write_checkpoint
    def slow(*a, **k): time.sleep(1.0); return real(*a, **k)
    monkeypatch.setattr(checkpointer, 'write_checkpoint', slow)
    res = train(cfg(max_steps=12, ckpt_async=True), 'async', root=ws, log=quiet([]))
    t = res['checkpoints']
    assert [c['step'] for c in t] == [4, 8, 12]
    assert t[0]['stall_s'] < 0.5 and t[0]['write_s'] >= 1.0, t
    ck = Path(ws)/'runs'/'async'/'checkpoints'
    assert [p.name for p in list_checkpoints(ck)] == ['step_00000012', 'step_00000008']
    res = train(cfg(max_steps=12, ckpt_async=False), 'sync', root=ws, log=quiet([]))
    assert res['checkpoints'][0]['stall_s'] >= 1.0

def torchrun_at_step_3(ws, exp:str) -> subprocess.Popen:
    "`lmbook train --nproc 2` of a long smoke run, its output read up to step 3."
    exe = Path(sys.executable).parent/'lmbook'
    p = subprocess.Popen([str(exe), 'train', '-p', 'smoke', '-e', exp, '--nproc', '2', '--root',
                          str(ws), *sets(max_steps=500, ckpt_every=100)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= 3: break
    return p

def test_torchrun_stop_exit_code(ws):
    """`lmbook train --nproc 2` passes SIGTERM on to torchrun, waits for the checkpoint, and exits 143 like
    one process."""
    p = torchrun_at_step_3(ws, 'tr-stop')
    p.send_signal(signal.SIGTERM)
    rest = p.stdout.read()
    assert p.wait(timeout=120) == 143, rest
    stop = [l for l in rest.splitlines() if l.startswith('stopped by SIGTERM at step')]
    assert stop, rest
    assert (
        'Traceback' not in rest and 'SignalException' not in rest
    ), rest  # torchrun's own report of the stop
    step = int(stop[0].split('at step ')[1].split('/')[0])
    assert ckpt_step(list_checkpoints(Path(ws)/'runs'/'tr-stop'/'checkpoints')[0]) == step

def _rank_pid(parent:int, rank:int) -> int:
    "The pid of the torchrun worker with RANK=`rank` among the descendants of `parent`."
    kids = lambda pid: [int(c) for c in Path(f'/proc/{pid}/task/{pid}/children').read_text().split()]
    todo = kids(parent)
    while todo:
        pid = todo.pop()
        try: env = Path(f'/proc/{pid}/environ').read_bytes().split(b'\0')
        except OSError: continue
        if f'RANK={rank}'.encode() in env and b'LOCAL_RANK' in b' '.join(env): return pid
        todo += kids(pid)
    raise AssertionError(f'no rank {rank} under {parent}')

def test_a_killed_worker_is_one_line(ws):
    """kill -9 of one torchrun worker: one line naming the rank and the signal, exit 137, no traceback on the
    console; torchrun's report is kept in train.log."""
    p = torchrun_at_step_3(ws, 'tr-kill')
    os.kill(_rank_pid(p.pid, 1), signal.SIGKILL)
    rest = p.stdout.read()
    assert p.wait(timeout=120) == 137, rest
    errors = [l for l in rest.splitlines() if l.startswith('error:')]
    assert len(errors) == 1 and 'rank 1 was killed by SIGKILL' in errors[0], rest
    assert 'Traceback' not in rest and 'ChildFailedError' not in rest, rest
    log = (Path(ws)/'runs'/'tr-kill'/'train.log').read_text()
    assert 'Root Cause' in log and 'SIGKILL' in log

def test_resume_refuses_new_biases_and_adapters(ws):
    """Turning on `bias` or changing `lora_rank` on resume is a one-line refusal, even with
    --allow-config-change, not a state-dict error."""
    train(cfg(arch='gpt2', max_steps=4), 'shapechange', root=ws, log=quiet([]))
    with pytest.raises(ValueError,
                       match=r"another model shape: bias=False \(checkpoint\) vs True \(config\)"):
        train(cfg(arch='gpt2', bias=True, max_steps=6, allow_config_change=True), 'shapechange', root=ws,
              log=quiet([]))
    with pytest.raises(ValueError, match="lora_rank 0 -> 4: the checkpoint's adapters have the old rank"):
        train(cfg(arch='gpt2', lora_rank=4, max_steps=6, allow_config_change=True), 'shapechange', root=ws,
              log=quiet([]))
    assert ckpt_step(list_checkpoints(Path(ws)/'runs'/'shapechange'/'checkpoints')[0]) == 4


OOM = {
    'cuda': lambda: torch.cuda.OutOfMemoryError(
        'CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB'
    ),
    'cpu': lambda: RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 96000000000 bytes. Error code 12 (Cannot allocate memory)"
    ),
}

@pytest.mark.parametrize('where', OOM)
def test_out_of_memory_is_one_line(ws, monkeypatch, capsys, where):
    "Out of memory in a step, on the GPU or the CPU: one line naming the fixes, exit 2, the lock released."
    import lmbook.train.trainer as trainer_mod
    from lmbook.cli import main
    def oom(*a, **k): raise OOM[where]()
    monkeypatch.setattr(trainer_mod, 'train_step', oom)
    assert main(['train', '-p', 'smoke', '-e', f'oom-{where}', '--root', str(ws), *sets(max_steps=4)]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith(
        'error: out of memory on the ' + ('GPU' if where == 'cuda' else 'CPU')
    ), err
    assert 'lower batch_size' in err[0] and 'act_ckpt' in err[0] and 'more memory' in err[0], err
    assert not (Path(ws)/'runs'/f'oom-{where}'/'.lock').exists()
