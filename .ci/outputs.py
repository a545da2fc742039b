"""Refresh the outputs of module notebooks, or check every notebook's outputs; run it through `bash
.ci/outputs`, which sets the environment (CPU only, offline, fixed hash seed, inline plots)."""
import argparse, json, os, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT/'nbs'
MAX_KB = 200  # outputs of one notebook, in KB of notebook JSON: a plot is 15-40 KB at 72 dpi
VOLATILE = [  # what an output must not hold: it would differ on the next machine or the next run
    # (/tmp/lmbook-start.sh is where a pod's start command writes its script, the same on every pod)
    (re.compile(r'(?<![\w.])(/tmp/(?!lmbook-start\.sh\b)|/var/folders/|/home/|/Users/|/root/|/private/)'),
     "a machine's path"),
    (re.compile(r'\b20\d\d-\d\d-\d\d[T ]\d\d:\d\d'), 'a timestamp'),
    (re.compile(r'\bat 0x[0-9a-f]{6,}'), 'an object address'),
]
SETUP = """import matplotlib
matplotlib.rcParams.update({'figure.dpi': 72, 'savefig.dpi': 72})
from matplotlib_inline.backend_inline import set_matplotlib_formats
set_matplotlib_formats('png', metadata={'Software': None})
import random, numpy, torch
# cells that draw without a seed still draw the same
random.seed(0); numpy.random.seed(0); torch.manual_seed(0)"""


def is_run_notebook(nb:dict) -> bool:
    "A notebook papermill runs (train, analysis, sample, finetune): a `parameters` cell and no `default_exp`."
    code = [c for c in nb['cells'] if c['cell_type'] == 'code']
    return (not any(re.search(r'^#\|\s*default_exp\b', ''.join(c['source']), re.M) for c in code)
            and any('parameters' in c.get('metadata', {}).get('tags', []) for c in code))


def _text(o:dict) -> str:
    parts = [o.get('text', '')] + [v for k, v in o.get('data', {}).items() if k.startswith('text/')]
    return ''.join(''.join(p) if isinstance(p, list) else p for p in parts) + ''.join(o.get('traceback', []))


def problems(path:Path) -> list[str]:
    "What is wrong with the outputs of notebook `path`."
    nb = json.loads(Path(path).read_text())
    outs = [(i, o) for i, c in enumerate(nb['cells']) for o in c.get('outputs', [])]
    if is_run_notebook(nb):
        if not outs: return []
        return [f"{path.name}: a run notebook keeps no outputs in git (cell {outs[0][0]} has one): "
                "clear them"]
    found = []
    for i, o in outs:
        if o['output_type'] == 'error': found.append(f"{path.name}: cell {i} holds an error")
        t = _text(o).replace(str(ROOT), '<checkout>')
        for rx, what in VOLATILE:
            if m := rx.search(t):
                found.append(f"{path.name}: cell {i} prints {what} ({m.group(0)!r}): show a relative name or "
                             "end the line with ;")
        if str(ROOT) in _text(o):
            found.append(f"{path.name}: cell {i} prints the checkout's path: show a relative name")
    kb = sum(len(json.dumps(o)) for _, o in outs)/1e3
    if kb > MAX_KB:
        found.append(f"{path.name}: outputs take {kb:.0f} KB (limit {MAX_KB}): fewer or smaller plots")
    return found


def execute(path:Path) -> list[str]:
    """Run module notebook `path` as nbdev-test does, keep the outputs, clean them; write it only if nothing
    is wrong."""
    from execnb.shell import CaptureShell
    from fastcore.nbio import write_nb
    from nbdev.config import get_config
    from nbdev.process import NBProcessor
    from nbdev.test import nb_test_cells
    cfg = get_config(NBS)
    flags = cfg.tst_flags.split() if isinstance(cfg.tst_flags, str) else list(cfg.tst_flags)
    nb = NBProcessor(path, rm_directives=False, process=True).nb
    if is_run_notebook(nb):
        return [f"{path.name} is a run notebook: its outputs belong to runs, it keeps none in git"]
    run = {c.id for c in nb_test_cells(path, flags)}
    for c in nb.cells:
        if c.cell_type == 'code' and c.id not in run: c.outputs = []
    os.environ['IN_TEST'] = '1'
    os.chdir(path.parent)
    sh = CaptureShell(path, mpl_format=None)
    sh.run_cell(SETUP)
    try: sh.run_all(nb, exc_stop=True, preproc=lambda c: c.id not in run)
    except Exception:
        return [f"{path.name} failed:\n{sh.prettytb(fname=path)}"]
    # warnings and progress bars are noise on a page; so is what a cell marked `#| output: false` shows
    for c in nb.cells:
        if c.cell_type != 'code': continue
        quiet = str((getattr(c, 'directives_', None) or {}).get('output', '')).lower() == 'false'
        c.outputs = [] if quiet else [o for o in c.outputs
                                      if not (o.get('output_type') == 'stream' and o.get('name') == 'stderr')]
    tmp = path.with_name(f'.{path.stem}.outputs.ipynb')
    write_nb(nb, tmp)
    clean = Path(sys.executable).parent/'nbdev-clean'
    try:
        # as CI cleans
        subprocess.run([str(clean) if clean.exists() else 'nbdev-clean', '--fname', str(tmp)], check=True)
        if found := problems(tmp): return [f.replace(tmp.name, path.name) for f in found]
        tmp.replace(path)
        return []
    finally: tmp.unlink(missing_ok=True)


def _outputs(p:Path) -> list:
    return [c.get('outputs') for c in json.loads(p.read_text())['cells']]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog='bash .ci/outputs', description=__doc__)
    ap.add_argument('notebooks', nargs='*',
                    help='module notebooks to execute in place (default with --check: all of nbs/)')
    ap.add_argument('--check', action='store_true',
                    help='only check the outputs in git: run notebooks keep none, module notebooks nothing '
                         'volatile')
    ap.add_argument('--verify', action='store_true',
                    help='execute each notebook twice and fail where an output differs')
    ap.add_argument('--one', help=argparse.SUPPRESS)  # the worker: one notebook in a fresh process
    a = ap.parse_args(argv)
    if a.one:
        found = execute(Path(a.one).resolve())
        for f in found: print(f"error: {f}", file=sys.stderr)
        return 1 if found else 0
    if a.check:
        found = [f for p in (map(Path, a.notebooks) if a.notebooks else sorted(NBS.glob('*.ipynb')))
                 for f in problems(p)]
        for f in found: print(f"error: {f}", file=sys.stderr)
        return 1 if found else 0
    if not a.notebooks: ap.error('name the notebooks to execute, e.g. nbs/05a_optim.ipynb')
    rc = 0
    for nb in a.notebooks:
        p = Path(nb).resolve()
        if not p.is_file() or p.suffix != '.ipynb': print(f"error: {nb} is not a notebook",
                                                          file=sys.stderr); rc = 1; continue
        before = p.stat().st_size
        r = subprocess.run([sys.executable, __file__, '--one', str(p)])
        if r.returncode: rc = 1; continue
        if a.verify:
            first = _outputs(p)
            r = subprocess.run([sys.executable, __file__, '--one', str(p)])
            if r.returncode or (diff := [i for i, (x, y) in enumerate(zip(first, _outputs(p))) if x != y]):
                print(f"error: {p.name}: a second run gave other outputs in "
                      f"cells {diff if not r.returncode else '?'}", file=sys.stderr)
                rc = 1; continue
        print(f"{p.name}: {before/1e3:.1f} KB -> {p.stat().st_size/1e3:.1f} KB")
    return rc


if __name__ == '__main__': sys.exit(main())
