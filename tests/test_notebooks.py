"The run notebooks, executed headless through papermill as a user would, on the smoke profile."
import json, os, subprocess, sys
from pathlib import Path
import papermill
import pytest
from conftest import ROOT
from lmbook.runnb import TRAIN_PARAMS, ANALYSIS_PARAMS
from lmbook.metrics import read_metrics
from lmbook.analysis import summarize

PM = str(Path(sys.executable).parent/'papermill')


def papermill_run(nb, out, *params, timeout=600):
    args = [PM, str(ROOT/'nbs'/nb), str(out), '--cwd', str(ROOT)]
    for k, v in params: args += ['-p', k, str(v)]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=os.environ)


@pytest.mark.parametrize('nb,declared', [('train.ipynb', TRAIN_PARAMS), ('analysis.ipynb', ANALYSIS_PARAMS)])
def test_parameters_cell_matches_declared(nb, declared):
    found = papermill.inspect_notebook(str(ROOT/'nbs'/nb))
    assert list(found) == list(declared)
    for k, v in declared.items(): assert found[k]['default'] == repr(v), k


def test_smoke_run_then_plots(workspace):
    "The README's main job: the smoke profile trains, the loss falls, the analysis notebook plots it."
    run = workspace/'runs'/'smoke-demo'
    run.mkdir(parents=True)
    r = papermill_run('train.ipynb', run/'train.ipynb', ('profile', 'smoke'), ('experiment', 'smoke-demo'))
    assert r.returncode == 0, r.stderr[-3000:]
    for f in ('training.toml', 'training.yaml', 'meta.json', 'metrics.jsonl', 'samples.md', 'train.ipynb'):
        assert (run/f).is_file(), f
    assert any((run/'checkpoints').iterdir())
    s = summarize(read_metrics(run))
    assert s['last_val_loss'] < s['first_val_loss'] - 1.0, s   # clearly learned
    r = papermill_run('analysis.ipynb', run/'analysis.ipynb', ('experiments', 'smoke-demo'))
    assert r.returncode == 0, r.stderr[-3000:]
    for f in ('loss.png', 'grad_norm.png', 'lr.png'): assert (run/'plots'/f).stat().st_size > 1000
    nb = json.loads((run/'analysis.ipynb').read_text())
    assert any('image/png' in o.get('data', {}) for c in nb['cells'] for o in c.get('outputs', []))


@pytest.mark.parametrize('params,msg', [
    ((('profle', 'smoke'),), 'unknown parameter(s) profle'),
    ((('profile', 'smok'),), 'unknown profile'),
    ((('overrides', 'n_layers=2'),), 'unknown config key'),
    ((('max_steps', 'many'),), 'not a valid int'),
    ((('nproc', 'two'),), 'should be a int'),
])
def test_bad_parameters_fail_before_work(workspace, params, msg):
    out = workspace/'out.ipynb'
    r = papermill_run('train.ipynb', out, ('experiment', 'bad-input'), *params, timeout=300)
    assert r.returncode != 0
    assert msg in r.stderr + out.read_text()
    assert not (workspace/'runs'/'bad-input').exists()
    assert not (workspace/'datasets').exists()


def test_analysis_names_the_runs_that_exist(workspace):
    (workspace/'runs'/'real-run').mkdir(parents=True)
    (workspace/'runs'/'real-run'/'metrics.jsonl').write_text('{"step": 0, "val_loss": 8.0}\n')
    out = workspace/'out.ipynb'
    r = papermill_run('analysis.ipynb', out, ('experiments', 'real-rum'), timeout=300)
    assert r.returncode != 0 and "runs there: real-run" in r.stderr + out.read_text()
