"""Pages that show commands show today's output: every notebook whose cells run `lmbook` commands against
the stand-in account (`account.show`) or print a plan is run again, as `bash .ci/outputs` runs it, from a
copy, and its outputs must be the ones committed. A stale page (a plan at an old micro-batch and price, a
start command of another size) fails here, with the command that refreshes it."""
import json, os, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest
from conftest import ROOT

SHOWS = ('account.show', 'print(format_plan(')  # what a cell that shows a command's output calls


def pages() -> list[str]:
    def shows(p:Path) -> bool:
        return any(s in ''.join(c['source']) for c in json.loads(p.read_text())['cells'] for s in SHOWS)
    return sorted(p.name for p in (ROOT/'nbs').glob('*.ipynb') if shows(p))


def outputs(path:Path) -> list:
    return [c.get('outputs') for c in json.loads(Path(path).read_text())['cells']]


def rerun(name:str, tmp:Path) -> tuple[str, int, str]:
    "(name, exit code, stderr) of running a copy of nbs/`name` as `bash .ci/outputs` does."
    shutil.copy(ROOT/'nbs'/name, tmp/name)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='', HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1',
               PYTHONHASHSEED='0', TZ='UTC', COLUMNS='100',
               MPLBACKEND='module://matplotlib_inline.backend_inline')
    r = subprocess.run([sys.executable, str(ROOT/'.ci'/'outputs.py'), '--one', str(tmp/name)], env=env,
                       capture_output=True, text=True, timeout=300)
    return name, r.returncode, r.stderr[-2000:]


def test_pages_that_show_commands_show_todays_output(tmp_path):
    names = pages()
    assert {'on_runpod.ipynb', '07a_plan.ipynb', '07fa_podcli.ipynb'} <= set(names), names
    with ThreadPoolExecutor(2) as ex: runs = list(ex.map(lambda n: rerun(n, tmp_path), names))
    failed = [f"{n}: {err}" for n, rc, err in runs if rc]
    assert not failed, '\n'.join(failed)
    stale = [n for n in names if outputs(tmp_path/n) != outputs(ROOT/'nbs'/n)]
    assert not stale, (f"the committed outputs of {', '.join(stale)} are not today's: "
                       f"bash .ci/outputs {' '.join('nbs/' + n for n in stale)}")
