"""A closed SSH session (SIGHUP) stops `lmbook train` with a checkpoint, and `lmbook train --detach` outlives
the terminal."""
import json, os, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest
from lmbook.runs.checkpoint.formats import list_checkpoints, verify_checkpoint, ckpt_step

EXE = str(Path(sys.executable).parent/'lmbook')
TINY = ['take=2000', 'batch_size=4', 'block_size=64', 'n_embd=64', 'n_head=2', 'eval_every=50',
        'eval_steps=1', 'log_every=1', 'warmup_steps=2', 'ckpt_every=100', 'tensorboard=false']


def train(ws, exp, *extra, steps=500, **kw):
    return subprocess.Popen([EXE, 'train', '--profile', 'smoke', '--experiment', exp, '--root', str(ws),
                             '--set', f'max_steps={steps}', *TINY, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            stdin=subprocess.DEVNULL, **kw)


def test_sighup_stops_training_with_a_checkpoint(ws):
    p = train(ws, 'hup')
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= 3: break
    else: raise AssertionError(''.join(out))
    p.send_signal(signal.SIGHUP)
    rest = p.stdout.read(); rc = p.wait(30)
    assert rc == 129, (rc, rest)  # 128 + SIGHUP, like 143 for SIGTERM: a checkpoint was written first
    (msg,) = [l for l in rest.splitlines() if l.startswith('stopped by SIGHUP')]
    step = int(msg.split('at step ')[1].split('/')[0])
    newest = list_checkpoints(Path(ws)/'runs'/'hup'/'checkpoints')[0]
    assert ckpt_step(newest) == step and verify_checkpoint(newest)


def test_detach_starts_a_run_that_outlives_the_terminal(ws):
    t0 = time.time()
    # the "terminal": a session of its own, hung up below
    p = train(ws, 'det', '--detach', steps=6, start_new_session=True)
    out = p.stdout.read(); rc = p.wait(60)
    assert rc == 0 and time.time() - t0 < 30, out
    pid = int(out.split('pid ')[1].split()[0].rstrip(',);'))
    assert os.getsid(pid) not in (os.getsid(0), p.pid) and 'tail -f' in out and 'train.log' in out
    try: os.killpg(p.pid, signal.SIGHUP)  # the terminal closes: its session's processes get SIGHUP
    except ProcessLookupError: pass
    run = Path(ws)/'runs'/'det'
    for _ in range(600):
        if (not Path(f'/proc/{pid}').exists()
                or Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] == 'Z'):
            break
        time.sleep(0.2)
    else: raise AssertionError('the detached run did not finish')
    assert (run/'checkpoints'/'step_00000006'/'COMPLETE').is_file(), \
        (run/'train.log').read_text() if (run/'train.log').exists() else out


def hold_lock(run:Path, pid:int):
    "A run folder locked by the live process `pid` of this host: a trainer that trains."
    from lmbook.runlock import LOCK
    run.mkdir(parents=True, exist_ok=True)
    (run/LOCK).write_text(json.dumps(dict(host=socket.gethostname(), pid=pid, started=time.time(),
                                          heartbeat=time.time(), token='first-trainer')))


def test_a_second_detach_is_refused_while_the_first_trains(ws, capsys, monkeypatch):
    """`train --detach` on a locked run folder says the lock's refusal in one line and exits 2, before it
    starts anything; a trainer that meets the lock after the check (two commands at once) is reported too."""
    from lmbook.cli import main
    from lmbook.runlock import RunLock
    run = Path(ws)/'runs'/'busy'
    first = subprocess.Popen(['sleep', '120'])
    try:
        hold_lock(run, first.pid)
        args = ['train', '-p', 'smoke', '-e', 'busy', '--root', str(ws), '--detach', '--set', *TINY]
        assert main(args) == 2
        out, err = capsys.readouterr()
        err = [l for l in err.splitlines() if l.strip()]
        assert 'in the background' not in out and not (run/'train.out').exists(), out
        assert (len(err) == 1 and err[0].startswith(f'error: {run} is in use by another trainer: host ')
                and f'pid {first.pid}' in err[0]), err
        # the lock taken between the check and the trainer's start: the trainer's own refusal, and its code
        monkeypatch.setattr(RunLock, 'check', lambda self: None)
        assert main(args) == 2
        out, err = capsys.readouterr()
        err = [l for l in err.splitlines() if l.strip()]
        assert 'in the background' not in out and len(err) == 1, out + '\n'.join(err)
        assert err[0].startswith(f'error: {run} is in use by another trainer'), err
    finally: first.kill()
