"""Data preparation under faults: one preparation of an experiment at a time, whichever command starts it;
Ctrl-C is one line."""
import errno, json, os, signal, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import lmbook_cmd
from lmbook.core import paths_for
from lmbook.data.prepare import read_manifest
from lmbook.runlock import data_lock, DATA_LOCK

EXE = str(Path(sys.executable).parent/'lmbook')
SMALL = ['--set', 'take=1500']


def lmbook_popen(*args, env=None):
    # Ctrl-C as a terminal gives it: a test run started in the background inherits SIGINT ignored
    return subprocess.Popen([EXE, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, 'HF_HUB_OFFLINE': '1', **(env or {})},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def data_files(ws, exp):
    """Every data file of an experiment with its bytes (its name in paths made EXP): shards, manifests,
    tokenizer, token files."""
    p = paths_for(exp, root=ws)
    return {str(f.relative_to(d)): f.read_bytes().replace(f'/{exp}'.encode(), b'/EXP')
            for d in (p.train, p.val, p.tokenizer, p.cache) if d.is_dir()
            for f in sorted(d.rglob('*')) if f.is_file() and not f.name.startswith('.')
            and f.name != 'meta.json'}


@pytest.mark.parametrize('cmd',
                         [['prepare', '-p', 'smoke', *SMALL],
                          ['train', '--prepare-only', '-p', 'smoke', *SMALL],
                                 ['shard', '--dataset', 'builtin', '--take', '1500']])
def test_a_second_preparation_waits(workspace, cmd):
    """While another process prepares an experiment's data, `prepare`, `train` and each stage wait for it,
    saying so once."""
    p = paths_for('held', root=workspace)
    with data_lock(p.cache):
        proc = lmbook_popen(*cmd, '-e', 'held', '--root', workspace)
        line = next((l for l in proc.stdout if 'waiting' in l or 'error' in l), '')
        assert ('is in use by another data preparation' in line and f'pid {os.getpid()}' in line
                and 'waiting for it to finish' in line), line
        time.sleep(1.0)
        assert proc.poll() is None and read_manifest(p.train) is None  # nothing written while it waits
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert read_manifest(p.train)['complete'] and not (p.cache/DATA_LOCK).exists()


def test_two_prepares_at_once(workspace):
    """Two `lmbook prepare` of one experiment at once: both succeed, and the data is what one prepare alone
    makes."""
    a, b = (lmbook_popen('prepare', '-p', 'smoke', '-e', 'twice', '--root', workspace, '-q', *SMALL)
            for _ in range(2))
    for proc in (a, b):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    r = lmbook_cmd('prepare', '-p', 'smoke', '-e', 'once', '--root', workspace, '-q', *SMALL)
    assert r.returncode == 0, r.stderr
    assert data_files(workspace, 'twice') == data_files(workspace, 'once')


def test_boot_data_stage_takes_the_lock(workspace):
    "The boot pipeline's data stage waits for another preparation of the same experiment too."
    from lmbook.pods.boot import stage_data, BootOptions
    p = paths_for('booted', root=workspace)
    holder = subprocess.Popen([sys.executable, '-c',
                               'import sys, time; from lmbook.runlock import data_lock\n'
                               'with data_lock(sys.argv[1]): print("held", flush=True); time.sleep(2)',
                               str(p.cache)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == 'held'
    said, t0 = [], time.time()
    stage_data(BootOptions(profile='smoke', experiment='booted', overrides=dict(take=1500), shard=True), p,
               said.append, env={})
    assert time.time() - t0 > 1.0 and any('waiting for it to finish' in s for s in said), said
    assert holder.wait() == 0 and read_manifest(p.train)['complete']


@pytest.mark.parametrize('stage', ['shards', 'tokens'])
def test_ctrl_c_during_prepare_is_one_line(workspace, stage):
    """Ctrl-C while sharding or tokenizing: exit 130 and one line saying where it stopped; the rerun finishes
    the same data."""
    p = paths_for('intr', root=workspace)
    proc = lmbook_popen('prepare', '-p', 'smoke', '-e', 'intr', '--root', workspace, '-q',
                        env=dict(SHARD_LINES='50'))
    target = p.train if stage == 'shards' else p.cache/'tokens'/'train'
    t0 = time.time()
    while time.time() - t0 < 120 and proc.poll() is None:
        if (target/'manifest.json').is_file(): break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert (len(lines) == 1 and lines[0].startswith('interrupted ')
            and 'rerun the same command' in lines[0]), err
    if stage == 'shards':
        assert 'while sharding' in lines[0] or 'while making the tokenizer' in lines[0], lines
    r = lmbook_cmd('prepare', '-p', 'smoke', '-e', 'intr', '--root', workspace, '-q',
                   env=dict(SHARD_LINES='50'))
    assert r.returncode == 0, r.stderr
    assert read_manifest(p.cache/'tokens'/'train')['complete']


class FullDisk:
    "`open` whose files written under `folder` find the disk full once `budget` bytes are written in all."
    def __init__(self, folder:Path, budget:int): self.folder, self.left = str(folder), budget

    def open(self, path, mode='r', *a, **k):
        f = open(path, mode, *a, **k)
        return f if 'r' in mode or not str(path).startswith(self.folder) else _Filling(f, self)

class _Filling:
    "A file that raises ENOSPC, as the kernel does, once its disk has no bytes left."
    def __init__(self, f, disk:FullDisk): self.f, self.disk = f, disk
    def write(self, b):
        self.disk.left -= len(b)
        if self.disk.left < 0: raise OSError(errno.ENOSPC, 'No space left on device')
        return self.f.write(b)
    def close(self):  # what was buffered finds no room either
        self.f.close()
        if self.disk.left < 0: raise OSError(errno.ENOSPC, 'No space left on device')
    def __getattr__(self, k): return getattr(self.f, k)
    def __enter__(self): return self
    def __exit__(self, *exc): self.close()


def test_disk_full_during_prepare_is_one_line(workspace, monkeypatch, capsys):
    """A disk that fills while sharding, then (on the rerun) while tokenizing: each time exit 2 and one line
    saying where it stopped, no temporary file left; each rerun keeps the whole files written before."""
    import lmbook.data.prepare as prepare_mod, lmbook.data.tokenizer as tokenizer_mod
    from lmbook.cli import main
    p = paths_for('full', root=workspace)
    args = ['prepare', '-p', 'smoke', '-e', 'full', '--root', str(workspace), '-q', '--set', 'take=600',
            'vocab_size=320']
    kept = {}
    for mod, folder, files, budget, where in [
            (prepare_mod, p.train.parent, '*.txt', 400_000, 'while sharding ('),
            (tokenizer_mod, p.cache/'tokens', '*.bin', 20_000, 'while tokenizing the train split')]:
        monkeypatch.setenv('SHARD_LINES', '50')
        monkeypatch.setattr(mod, 'open', FullDisk(folder, budget).open, raising=False)
        assert main(args) == 2
        out, err = capsys.readouterr()
        lines = [l for l in err.splitlines() if l.strip()]
        assert (len(lines) == 1 and lines[0].startswith(f'error: no space left on device {where}')
                and 'rerun the same command to continue' in lines[0]), err
        assert not [f for f in workspace.rglob('*') if f.name.endswith('.tmp') or '.tmp-' in f.name]
        assert all(f.stat().st_ino == ino for f, ino in kept.items())  # the rerun continued
        kept.update({f: f.stat().st_ino for f in folder.rglob(files)})
        assert kept, lines
        monkeypatch.undo()
    monkeypatch.setenv('SHARD_LINES', '50')
    assert main(args) == 0
    assert all(f.stat().st_ino == ino for f, ino in kept.items())
    assert read_manifest(p.cache/'tokens'/'train')['complete']


def test_a_manifest_that_finds_the_disk_full_leaves_the_old_one(tmp_path, monkeypatch):
    "A manifest written half before the disk filled: the old one stays, and no temporary file."
    from lmbook.data.prepare import write_manifest
    write_manifest(tmp_path, dict(shards=[1]))
    real = Path.write_text
    def half(self, text, *a, **k):
        real(self, text[:5], *a, **k)
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(Path, 'write_text', half)
    with pytest.raises(OSError): write_manifest(tmp_path, dict(shards=[1, 2]))
    monkeypatch.undo()
    assert read_manifest(tmp_path) == dict(shards=[1])
    assert [f.name for f in tmp_path.iterdir()] == ['manifest.json']
