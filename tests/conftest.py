import json, os, sys, subprocess
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
os.environ.setdefault('MPLBACKEND', 'Agg')
# The suite's models are tiny: one thread each runs them faster than two, and two test workers share two cores
# (torch and its subprocesses read this at import).
os.environ.setdefault('OMP_NUM_THREADS', '1')


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


# Runs of one test module share their data folders (built once), each run keeping its own run folder.
SHARED = dict(LMBOOK_TRAIN_DIR='datasets/train/shared', LMBOOK_VAL_DIR='datasets/val/shared',
              LMBOOK_TOKENIZER_DIR='artifacts/tokenizer/shared', LMBOOK_CACHE_DIR='cache/shared',
              HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1')

@pytest.fixture(scope='module')
def ws(tmp_path_factory):
    "A module-wide workspace whose experiments all read the same prepared data."
    with pytest.MonkeyPatch.context() as mp:
        for k, v in SHARED.items(): mp.setenv(k, v)
        yield tmp_path_factory.mktemp('ws')


def rows(run):
    "The records of a run's metrics.jsonl."
    return [json.loads(l) for l in (Path(run)/'metrics.jsonl').read_text().splitlines()]


# The longest modules (their tests compile with inductor on the CPU, or run whole benchmark scripts), in the
# order they start: the two test workers take whole modules in collection order, and one of these left to the
# end (alphabetically, test_warmstart is last) kept one worker busy for minutes after the other had finished.
LONGEST_FIRST = ('test_warmstart.py', 'test_fp8_cache.py', 'test_bench_scratch.py')


def pytest_collection_modifyitems(items):
    "Start the longest modules first; every other test keeps its order."
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort
