"""The dashboard in a real JupyterLab: a server on 127.0.0.1, a notebook whose cell follows a fake run, run
from headless Chromium the way a reader runs it (click, Shift+Enter). Skipped where no Chromium is
installed."""
import json, os, subprocess, sys, time, urllib.request
from pathlib import Path
import pytest
from test_docs import Chromium, Tab, chromium

CELL = '''import json, time
from pathlib import Path
from lmbook.train.runnb import follow, interactive
run = Path('demo'); run.mkdir(exist_ok=True)
(run/'meta.json').write_text(json.dumps(dict(total_steps=60)))
(run/'samples.jsonl').write_text(json.dumps(dict(step=20, prompt='Once', text=' upon a time')) + '\\n')
def lines():
    with open(run/'metrics.jsonl', 'w') as f:
        for s in range(0, 61, 5):
            rec = dict(step=s, loss=8-s/20, val_loss=8.2-s/21, lr=3e-4, tok_per_s=9000.0, mfu=0.4,
                       dt_ms=120.0)
            f.write(json.dumps(rec) + '\\n')
            f.flush(); yield f'step {s}'; time.sleep(0.3)
print('interactive:', interactive())
follow(lines(), run, max_steps=60, every=0.3)'''


@pytest.mark.skipif(chromium() is None, reason='no Chromium installed (Debian: apt-get install chromium)')
@pytest.mark.skipif(os.environ.get('LMBOOK_LAB_TEST') != '1',
                    reason='a real JupyterLab session: timing-sensitive on a loaded 2-core machine; '
                           'LMBOOK_LAB_TEST=1 runs it')
def test_dashboard_in_jupyterlab(tmp_path):
    nb = dict(cells=[dict(cell_type='code', id='c1', metadata={}, source=CELL, outputs=[],
                          execution_count=None)],
              metadata={'kernelspec': {'display_name': 'Python 3', 'language': 'python', 'name': 'python3'}},
              nbformat=4, nbformat_minor=5)
    root = tmp_path/'lab'; root.mkdir()
    (root/'dash.ipynb').write_text(json.dumps(nb))
    env = {k: v for k, v in os.environ.items() if k not in ('LMBOOK_DASHBOARD', 'JPY_SESSION_NAME')}
    for k in ('JUPYTER_RUNTIME_DIR', 'JUPYTERLAB_WORKSPACES_DIR', 'JUPYTERLAB_SETTINGS_DIR'):
        env[k] = str(tmp_path/k.lower())
    import socket
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    lab = subprocess.Popen([str(Path(sys.executable).parent/'jupyter'), 'lab', '--no-browser',
                            '--ip=127.0.0.1', f'--port={port}',
                            '--ServerApp.token=', '--ServerApp.password=', f'--ServerApp.root_dir={root}',
                            '--LabApp.news_url=',
                            '--allow-root'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           stdin=subprocess.DEVNULL, env=env)
    b = None
    try:
        for _ in range(120):
            try: urllib.request.urlopen(f'http://127.0.0.1:{port}/api/status', timeout=1); break
            except OSError: time.sleep(0.5)
        b = Chromium(chromium(), tmp_path/'profile', size=(1280, 1000))
        tab = Tab(b)
        tab.open(f'http://127.0.0.1:{port}/lab/tree/dash.ipynb')
        for _ in range(120):
            if tab.js("!!document.querySelector('.jp-Notebook .jp-Cell .cm-content')"): break
            time.sleep(0.5)
        prompt = "document.querySelector('.jp-Notebook .jp-Cell .jp-InputPrompt').innerText"
        # click the cell and press Shift+Enter, as a reader runs it, until the cell has started
        for _ in range(20):
            tab.js("document.querySelector('.jp-Notebook .jp-Cell').click()")
            for typ in ('rawKeyDown', 'keyUp'):
                b.send('Input.dispatchKeyEvent', tab.s, type=typ, key='Enter', code='Enter',
                       windowsVirtualKeyCode=13, modifiers=8)
            for _ in range(10):
                if tab.js(prompt).strip() != '[ ]:': break
                time.sleep(0.5)
            if tab.js(prompt).strip() != '[ ]:': break
        out = ''
        for _ in range(240):
            out = tab.js("(document.querySelector('.jp-OutputArea') || {innerText: ''}).innerText")
            if tab.js(prompt).strip() not in ('[ ]:', '[*]:') and 'step 60/60' in out: break
            time.sleep(0.5)
        time.sleep(0.5)
        shot = tab.screenshot(tmp_path/'jupyterlab-dashboard.png')
        assert 'interactive: True' in out, out
        assert '100%' in out and 'step 60/60' in out and 'MFU 40.0%' in out and 'upon a time' in out, out
        widgets = tab.js("""(() => ({
            bars: document.querySelectorAll(
              '.jp-OutputArea .widget-progress, .jp-OutputArea progress, .jp-OutputArea .progress-bar'
            ).length,
            imgs: [...document.querySelectorAll('.jp-OutputArea img')]
              .filter(i => i.naturalWidth > 0).length}))()""")
        assert widgets['bars'] >= 1 and widgets['imgs'] >= 1, widgets
        print(f"screenshot: {shot}")
    finally:
        if b is not None: b.close()
        lab.terminate()
        try: lab.wait(30)
        except subprocess.TimeoutExpired: lab.kill(); lab.wait()
