import os, sys, subprocess
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
os.environ.setdefault('MPLBACKEND', 'Agg')


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    "An empty workspace for one test, given to lmbook (and its subprocesses) through LMBOOK_WORKSPACE."
    ws = tmp_path/'ws'
    ws.mkdir()
    monkeypatch.setenv('LMBOOK_WORKSPACE', str(ws))
    return ws


def lmbook_cmd(*args, env=None, timeout=600, cwd=ROOT):
    "Run the `lmbook` console script of this interpreter's environment."
    exe = Path(sys.executable).parent/'lmbook'
    return subprocess.run([str(exe), *map(str, args)], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
