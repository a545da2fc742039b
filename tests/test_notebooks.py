"The run notebooks, executed headless through papermill as a user would, on the smoke profile."
import json, os, re, subprocess, sys
from pathlib import Path
import pytest
from conftest import ROOT
from lmbook.train.runnb import TRAIN_PARAMS, ANALYSIS_PARAMS
from lmbook.runs.metrics import read_metrics
from lmbook.runs.analysis import summarize

PM = str(Path(sys.executable).parent/'papermill')


def papermill_run(nb, out, *params, timeout=600, extra=()):
    args = [PM, str(ROOT/'nbs'/nb), str(out), '--cwd', str(ROOT), *extra]
    for k, v in params: args += ['-p', k, str(v)]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=os.environ)


@pytest.mark.parametrize('nb,declared', [('train.ipynb', TRAIN_PARAMS), ('analysis.ipynb', ANALYSIS_PARAMS)])
def test_parameters_cell_matches_declared(nb, declared):
    import papermill  # imported where used: every test worker imports this module to collect it
    found = papermill.inspect_notebook(str(ROOT/'nbs'/nb))
    assert list(found) == list(declared)
    for k, v in declared.items(): assert found[k]['default'] == repr(v), k


# The README's main job is the smoke profile's 300 steps; here the same notebooks and profile run 60 of them
# (`-p max_steps 60`, a fifth of the time): the same lines every 10 steps, validations at 0, 50 and the end
# (the README's two kinds of step line), checkpoints, samples and plots.
SMOKE_STEPS = 60


def test_smoke_run_then_plots(workspace):
    "The README's main job: the smoke profile trains, the loss falls, the analysis notebook plots it."
    run = workspace/'runs'/'smoke-demo'
    run.mkdir(parents=True)
    r = papermill_run('train.ipynb', run/'train.ipynb', ('profile', 'smoke'), ('experiment', 'smoke-demo'),
                      ('max_steps', SMOKE_STEPS))
    assert r.returncode == 0, r.stderr[-3000:]
    # the terminal shows the progress as it happens: step, loss, tok/s and the time left
    shown = [l for l in r.stderr.splitlines() if re.match(rf'step +\d+/{SMOKE_STEPS} ', l)]
    assert (len(shown) == SMOKE_STEPS//10 + 1
            and re.search(rf'^step +10/{SMOKE_STEPS} \| loss [\d.]+ \| .* tok/s \| .* \| eta \d',
                          shown[1])), r.stderr[-3000:]
    # and the executed notebook holds each step's line once
    streams = ''.join(''.join(o.get('text', '')) for c in json.loads((run/'train.ipynb').read_text())['cells']
                      for o in c.get('outputs', []) if o.get('output_type') == 'stream')
    assert [l for l in streams.splitlines() if re.search(rf'step +\d+/{SMOKE_STEPS} ', l)] == shown
    # the README shows these lines as they are: the same fields in the same order, line for line (a README
    # step past this run's end is matched by a line of the same fields, step 250's by step 50's; the step is
    # padded to the width of the run's length)
    labels = lambda l: tuple(re.sub(r'[\d.,]+', '#', re.sub(r'\b\d+[hms](\d+[ms])?\b', 'T',
                                                            ' '.join(f.split()))) for f in l.split('|'))
    readme = (ROOT/'README.md').read_text().split('```text\n', 1)[1].split('```', 1)[0].splitlines()
    at = lambda l: int(re.match(r'step +(\d+)', l).group(1))
    ours = {at(l): labels(l) for l in shown}
    steps = [l for l in readme if l.startswith('step')]
    assert (len({labels(l) for l in steps}) >= 3
            and all(labels(l) == ours[at(l)] if at(l) in ours else labels(l) in ours.values()
                    for l in steps)), steps
    for f in ('training.toml', 'training.yaml', 'meta.json', 'metrics.jsonl', 'samples.md', 'train.ipynb'):
        assert (run/f).is_file(), f
    assert any((run/'checkpoints').iterdir())
    s = summarize(read_metrics(run))
    assert s['last_val_loss'] < s['first_val_loss'] - 1.0, s   # clearly learned
    r = papermill_run('analysis.ipynb', run/'analysis.ipynb', ('experiments', 'smoke-demo'), ('smooth', 0.9))
    assert r.returncode == 0, r.stderr[-3000:]
    for f in ('loss.png', 'grad_norm.png', 'lr.png', 'loss_tokens.png', 'loss_time.png'):
        assert (run/'plots'/f).stat().st_size > 1000
    assert not (run/'plots'/'loss_cost.png').exists()  # a CPU off RunPod has no price
    assert all(r['elapsed_s'] > 0 for r in read_metrics(run) if r['step'] > 0)
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
    # the notebook's part of it is the one line the CLI prints, in the notebook and after papermill's own
    # lines
    errs = error_outputs(out)
    assert (len(errs) == 1 and len(errs[0].splitlines()) <= 3 and errs[0].startswith('error: ')
            and msg in errs[0]), errs
    assert errs[0] in r.stderr and 'Traceback' not in r.stderr.split('Exception encountered')[-1]
    assert first_said(r.stderr) == errs[0], r.stderr  # the reason first, not below papermill's traceback
    if msg == 'unknown profile':  # a bad profile reads the same in the notebook and the CLI
        cli = subprocess.run([str(Path(sys.executable).parent/'lmbook'), 'train', '--profile', 'smok'],
                             capture_output=True, text=True)
        assert cli.returncode == 2 and errs == [cli.stderr.strip()], (errs, cli.stderr)


# what papermill itself (and its kernel's log) writes before a cell's output: its banner and progress bar
PAPERMILL_OWN = ('Input Notebook:', 'Output Notebook:', 'Working directory:', 'Executing', '[IPKernelApp]',
                 'Black is not installed', 'Passed unknown parameter')

def first_said(stderr:str) -> str|None:
    "The first line of a papermill run's terminal that is not papermill's banner, bar or kernel start-up."
    # the kernel's own start-up (a port another test's kernel took) prints above this banner
    started = stderr.split('Executing notebook with kernel')
    said = started[-1].split('\n', 1)[-1] if len(started) > 1 else stderr
    lines = [l for l in re.split(r'[\r\n]', said) if l.strip() and not l.startswith(PAPERMILL_OWN)]
    return lines[0] if lines else None


def test_first_said_skips_the_kernels_start_up():
    noise = ('Input Notebook:  nbs/train.ipynb\nExecuting:   0%|  | 0/11\nException in thread Heartbeat:\n'
             'Traceback (most recent call last):\nzmq.error.ZMQError: Address already in use\n')
    said = "Executing notebook with kernel: python3\nExecuting:   9%|\nerror: unknown config key 'n_layers'\n"
    assert first_said(noise + said) == "error: unknown config key 'n_layers'"
    assert first_said('Executing:   9%|\nerror: x\n') == 'error: x'  # no banner: every line counts


def error_outputs(nb_path) -> list[str]:
    "The text of each error output of an executed notebook, ANSI colours removed."
    nb = json.loads(Path(nb_path).read_text())
    return [re.sub(r'\x1b\[[0-9;]*m', '', '\n'.join(o['traceback'])) for c in nb['cells']
            for o in c.get('outputs', [])
            if o.get('output_type') == 'error']


def test_analysis_names_the_runs_that_exist(workspace):
    (workspace/'runs'/'real-run').mkdir(parents=True)
    (workspace/'runs'/'real-run'/'metrics.jsonl').write_text('{"step": 0, "val_loss": 8.0}\n')
    out = workspace/'out.ipynb'
    r = papermill_run('analysis.ipynb', out, ('experiments', 'real-rum'), timeout=300)
    assert r.returncode != 0 and "runs there: real-run" in r.stderr + out.read_text()


def test_finetune_published_journey(tmp_path):
    """nbs/finetune_published.ipynb with its defaults: a tiny random Llama imported, QLoRA-tuned, sampled,
    exported, served."""
    from lmbook.train.finetune import PUBLISHED_PARAMS
    import papermill
    found = papermill.inspect_notebook(str(ROOT/'nbs'/'finetune_published.ipynb'))
    assert (list(found) == list(PUBLISHED_PARAMS)
            and all(found[k]['default'] == repr(v) for k, v in PUBLISHED_PARAMS.items()))
    out = tmp_path/'out.ipynb'
    r = papermill_run('finetune_published.ipynb', out, ('root', tmp_path/'ws'))
    assert r.returncode == 0, r.stderr[-3000:]
    text = json.dumps(json.loads(out.read_text())['cells'])
    assert 'done: 30 steps' in text and "'bfloat16'" in text and 'completion_tokens' in text
    run = tmp_path/'ws'/'runs'/'tiny-llama-qlora'
    vals = [r['val_loss'] for r in map(json.loads, (run/'metrics.jsonl').read_text().splitlines())
            if 'val_loss' in r]
    assert vals[-1] < vals[0] - 0.1, vals  # it learned
    assert (tmp_path/'ws'/'exports'/'tiny-llama-qlora'/'model.safetensors').is_file()
