"""The live view of a run: widgets where a person watches (checked on the widget tree with fake metrics and on
a real kernel's request), plain progress lines under papermill (the analysis notebook following runs to their
end)."""
import json, os, socket, threading, time
from pathlib import Path
import pytest
from lmbook.train.runnb import Dashboard, follow, interactive, run_state, watch
from test_notebooks import papermill_run

FAKE = [dict(step=0, val_loss=8.3)] + [dict(step=s, loss=8.0 - s/50, lr=3e-4, tok_per_s=9100.0, mfu=0.41)
                                       for s in range(10, 110, 10)]
TIMED = FAKE[:-1] + [dict(FAKE[-1], dt_ms=250.0)]   # the trainer's time per step gives the time left


def write_run(run: Path, recs, total: int):
    run.mkdir(parents=True, exist_ok=True)
    (run/'meta.json').write_text(json.dumps(dict(total_steps=total)))
    (run/'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in recs))
    (run/'samples.jsonl').write_text(json.dumps(dict(step=100, prompt='Once', text=' upon a time')) + '\n')


def test_widget_tree_from_fake_metrics(tmp_path):
    import ipywidgets as W
    d = Dashboard('demo', 400)
    d.update(FAKE, elapsed=30.0, sample=dict(step=100, prompt='Once', text=' upon <a> time'))
    title, row, stats, plots, sample = d.widget.children
    bar, status = row.children
    assert isinstance(bar, W.FloatProgress) and bar.value == 0.25 and bar.description == '25%'
    assert status.value == 'step 100/400 · eta 1m30s'
    assert ('loss <b>6.0000</b>' in stats.value and 'tok/s <b>9,100</b>' in stats.value
            and 'MFU <b>41.0%</b>' in stats.value)
    assert isinstance(plots, W.Image) and plots.value[:4] == b'\x89PNG'
    assert 'upon &lt;a&gt; time' in sample.value    # the sample is shown as text, never as markup
    # following a run it did not start: the trainer's time per step
    d.update(TIMED, elapsed=None)
    assert status.value == 'step 100/400 · eta 1m15s'
    d.update(FAKE + [dict(step=400, loss=1.0)], elapsed=60.0, force=True)
    assert bar.value == 1 and bar.bar_style == 'success' and 'eta' not in status.value


def test_follow_live_and_plain(tmp_path, capsys):
    run = tmp_path/'demo'
    write_run(run, FAKE, 200)
    follow(iter(['a line']), run, live=False)
    # the trainer's lines carry the progress: no second line for a step
    assert capsys.readouterr().out == 'a line\n'
    follow(iter([]), run, live=True)   # outside a notebook, display() prints the widget's repr
    assert 'VBox' in capsys.readouterr().out
    drawn = []
    assert (watch({'demo': run}, refresh=0.1, draw=lambda: drawn.append(1), live=True, max_s=0.3)
            == {'demo': 'running'})
    assert drawn == [1] and 'VBox' in capsys.readouterr().out


def test_interactive_on_a_real_kernel():
    """A request carrying a cell id (as JupyterLab sends) means a person watches; nbclient's requests carry
    none."""
    from jupyter_client.manager import start_new_kernel
    env = {k: v for k, v in os.environ.items() if k not in ('JPY_SESSION_NAME', 'LMBOOK_DASHBOARD')}
    km, kc = start_new_kernel(kernel_name='python3', env=env)
    try:
        def ask(metadata):
            msg = kc.session.msg('execute_request',
                                 dict(code='from lmbook.train.runnb import interactive; print(interactive())',
                                      silent=False,
                                 store_history=False, user_expressions={}, allow_stdin=False,
                                      stop_on_error=True), metadata=metadata)
            kc.shell_channel.send(msg)
            out = []
            while True:
                m = kc.get_iopub_msg(timeout=60)
                if m['parent_header'].get('msg_id') != msg['header']['msg_id']: continue
                if m['msg_type'] == 'stream': out.append(m['content']['text'])
                if m['msg_type'] == 'error': raise RuntimeError(m['content']['evalue'])
                if m['msg_type'] == 'status' and m['content']['execution_state'] == 'idle':
                    return ''.join(out).strip()
        assert ask({'cellId': 'a1b2'}) == 'True'
        assert ask({}) == 'False'
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)


def test_run_state_from_lock_or_writes(tmp_path):
    run = tmp_path/'r'
    write_run(run, FAKE, 200)
    assert run_state(run) == 'running'
    old = time.time() - 3600
    for f in [*run.iterdir(), run]: os.utime(f, (old, old))
    assert run_state(run) == 'stopped'                     # no lock, no write for an hour
    (run/'.lock').write_text(json.dumps(dict(host=socket.gethostname(), pid=os.getpid(),
                                             heartbeat=time.time())))
    assert run_state(run) == 'running'                     # the lock's heartbeat wins over old files
    (run/'.lock').write_text(json.dumps(dict(host=socket.gethostname(), pid=os.getpid(),
                                             heartbeat='2020-01-01T00:00:00Z')))
    assert run_state(run) == 'stopped'
    write_run(run, FAKE, 100)                              # meta.json's run length reached: done
    assert run_state(run) == 'done'


def test_analysis_notebook_follows_runs_to_their_end(workspace):
    """Under papermill: plain progress lines, no widgets; a run that finishes ends the loop, so does one whose
    trainer is gone."""
    live, dead = workspace/'runs'/'live-run', workspace/'runs'/'dead-run'
    # reaches its last step in about 3 s, over three of the notebook's redraws (epoch runs: length from
    # meta.json)
    write_run(live, FAKE, 200)
    write_run(dead, FAKE, 500)
    (dead/'.lock').write_text(json.dumps(dict(host=socket.gethostname(), pid=2**22 + 11,
                                              heartbeat=time.time())))
    out = workspace/'out.ipynb'
    def trainer():  # once the notebook has shown the live run running (its output is saved every second)
        deadline = time.time() + 180
        shown = lambda: 'live-run [running]' in (out.read_text() if out.exists() else '')
        while time.time() < deadline and not shown(): time.sleep(0.2)
        for s in range(110, 210, 10):
            time.sleep(0.3)
            with open(live/'metrics.jsonl', 'a') as f:
                f.write(json.dumps(dict(step=s, loss=5.5, lr=3e-4)) + '\n')
    t = threading.Thread(target=trainer); t.start()
    t0 = time.time()
    r = papermill_run('analysis.ipynb', out, ('experiments', 'live-run,dead-run'), ('refresh', 1),
                      timeout=300, extra=('--autosave-cell-every', '1'))
    t.join()
    assert r.returncode == 0, r.stderr[-3000:]
    nb = json.loads(out.read_text())
    outs = [o for c in nb['cells'] for o in c.get('outputs', [])]
    text = ''.join(''.join(o.get('text', '')) for o in outs if o['output_type'] == 'stream')
    assert not any('application/vnd.jupyter.widget-view+json' in o.get('data', {}) for o in outs)
    assert 'live-run [running]' in text and 'dead-run [stopped]' in text and 'step 200/200' in text
    assert any('live-run: **done** · dead-run: **stopped**' in ''.join(o.get('data', {}).get('text/markdown',
                                                                                             ''))
               for o in outs)
