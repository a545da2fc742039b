"""Names: an empty or blank name is a one-line error, and a run with no experiment given never lands in
another run's folder."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from conftest import ROOT
from lmbook.cli import main


def written(ws): return sorted(str(p.relative_to(ws)) for p in Path(ws).rglob('*'))


@pytest.mark.parametrize('argv,what', [
    (['train', '--experiment', ''], 'experiment is empty'),
    (['train', '-e', '   '], 'experiment is empty'),
    (['train', '--profile', ''], 'profile is empty'),
    (['prepare', '-e', ''], 'experiment is empty'),
    (['prepare', '-p', ' '], 'profile is empty'),
    (['prepare', '--tokenizer-json', ''], 'tokenizer-json is empty'),
    (['shard', '--experiment', ''], 'experiment is empty'),
    (['shard', '--dataset', ''], 'dataset is empty'),
    (['shard', '--input', ' '], 'input is empty'),
    (['shard', '--text-field', ''], 'text-field is empty'),
    (['tokenizer', '--experiment', ''], 'experiment is empty'),
    (['tokenize', '--experiment', '\t'], 'experiment is empty'),
])
def test_blank_names_are_one_line_errors(workspace, capsys, argv, what):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('error:') and what in err and len(err.splitlines()) == 1, err
    assert written(workspace) == []


def test_default_experiment_follows_the_profile(workspace, monkeypatch):
    from lmbook.train.launch import train_args, resolve_args
    import argparse
    monkeypatch.delenv('RUN_EXPERIMENT', raising=False)
    monkeypatch.delenv('RUN_CONFIG', raising=False)
    ap = train_args(argparse.ArgumentParser())
    exp = lambda *a: resolve_args(ap.parse_args(list(a)))[2]
    assert exp() == exp('--profile', 'smoke') == 'smoke-demo'     # the settings' own pairing
    assert exp('--profile', 'runpod_2b') == 'runpod_2b'
    assert exp('--profile', 'runpod_2b', '-e', 'fw-2b') == 'fw-2b'
    monkeypatch.setenv('RUN_CONFIG', 'm3_medium')                  # a pod's default profile
    assert exp() == 'm3_medium'
    monkeypatch.setenv('RUN_EXPERIMENT', 'pod-run')
    assert exp('--profile', 'runpod_2b') == 'pod-run'


def papermill(out, *params):
    args = [str(Path(sys.executable).parent/'papermill'), str(ROOT/'nbs'/'train.ipynb'), str(out), '--cwd',
            str(ROOT)]
    for k, v in params: args += ['-p', k, v]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env=os.environ)


def test_train_notebook_names(workspace, monkeypatch):
    """`-p experiment ''` stops before any work; `-p profile runpod_2b` on a CPU is refused before any work,
    in one line naming the card and `lmbook pod plan`; forced, it never writes into runs/smoke-demo."""
    monkeypatch.delenv('RUN_EXPERIMENT', raising=False)
    r = papermill(workspace/'blank.ipynb', ('experiment', ''))
    assert r.returncode != 0 and 'experiment is empty' in r.stderr + (workspace/'blank.ipynb').read_text()
    assert written(workspace) == ['blank.ipynb']
    r = papermill(workspace/'big.ipynb', ('profile', 'runpod_2b'), ('overrides', 'device=cpu'))
    said = [o['traceback'] for c in json.loads((workspace/'big.ipynb').read_text())['cells']
            for o in c.get('outputs', []) if o['output_type'] == 'error']
    assert r.returncode != 0 and len(said) == 1 and len(said[0]) == 1, said  # one line
    assert 'NVIDIA H100' in said[0][0] and 'lmbook pod plan --profile runpod_2b' in said[0][0], said
    from test_notebooks import first_said
    assert first_said(r.stderr) == said[0][0], r.stderr  # the first thing read, above papermill's trace
    assert written(workspace) == ['big.ipynb', 'blank.ipynb']
    # forced, it goes on: runpod_2b reads FineWeb, which is unreachable offline, so the run stops at data
    # preparation, in its own folder
    r = papermill(workspace/'big.ipynb', ('profile', 'runpod_2b'), ('overrides', 'device=cpu'),
                  ('force', 'True'))
    assert r.returncode != 0
    assert (workspace/'datasets'/'train'/'runpod_2b').is_dir()
    assert not [p for p in written(workspace) if 'smoke-demo' in p]
