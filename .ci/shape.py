"""The package's shape: modules (the chapters' sub-packages included), lines, longest function, and the files
`cfg` crosses from `lmbook train` to the first optimizer step."""
import argparse, ast, json, os, re, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT/'lmbook'


def module_name(path) -> str:
    "A file's dotted module name inside lmbook: `train.trainer`, `data` for `data/__init__.py`."
    parts = list(Path(path).relative_to(PKG).with_suffix('').parts)
    return '.'.join(parts[:-1] if parts[-1] == '__init__' and len(parts) > 1 else parts)


def modules() -> dict:
    "Every module of the package, the chapters' too, by dotted name (nbdev's `_modidx`, empty files aside)."
    return {module_name(p): p for p in sorted(PKG.rglob('*.py'))
            if p.stem != '_modidx' and '__pycache__' not in p.parts and p.read_text().strip()}


def notebook_order() -> dict:
    "module -> position of its notebook in nbs/ (sorted by file name)."
    out = {}
    for i, nb in enumerate(sorted((ROOT/'nbs').glob('*.ipynb'))):
        m = re.search(r'#\|\s*default_exp\s+(\S+)', nb.read_text())
        if m: out[m.group(1).replace('\\n', '').strip('"').removesuffix('.__init__')] = i
    return out


def nbdev_lines(path) -> set:
    "Lines nbdev writes itself, held to no width: the module docstring and `__all__`."
    tree, out = ast.parse(path.read_text()), set()
    for n in tree.body:
        doc = isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        names = isinstance(n, ast.Assign) and any(getattr(x, 'id', '') == '__all__' for x in n.targets)
        if (doc and n is tree.body[0]) or names: out |= set(range(n.lineno, n.end_lineno + 1))
    return out


def figures() -> dict:
    mods = modules()
    lines = sum(len(p.read_text().splitlines()) for p in mods.values())
    funcs = [(n.end_lineno - n.lineno + 1, f'{m}.{n.name}') for m, p in mods.items()
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    wide = sum(len(l) > 110 for p in mods.values() for i, l in enumerate(p.read_text().splitlines(), 1)
               if i not in nbdev_lines(p))
    return dict(modules=len(mods), lines=lines, longest_function=max(funcs), lines_over_110=wide,
                functions_over_50=sum(n > 50 for n, _ in funcs))


class _Found(Exception): pass


def _lmbook_caller(frame):
    f = frame.f_back
    while f is not None and not f.f_code.co_filename.startswith(str(PKG)): f = f.f_back
    return module_name(f.f_code.co_filename) if f is not None else 'cli'


def cfg_path(argv:list) -> dict:
    """Trace `lmbook *argv` in this process: the calls between lmbook files that hand on the config, up to the
    first step."""
    from lmbook.config import Config, config_sections
    from lmbook.cli import main
    kinds = (Config, *config_sections().values())  # the config and each of its sections
    carries = lambda v: isinstance(v, kinds) or isinstance(getattr(v, 'cfg', None), Config)
    calls = []
    def prof(frame, event, arg):
        if event != 'call': return
        co = frame.f_code
        if co.co_name == 'step' and 'torch/optim' in co.co_filename: raise _Found
        if not co.co_filename.startswith(str(PKG)) or co.co_name.startswith('__'): return
        args = [frame.f_locals.get(n) for n in co.co_varnames[:co.co_argcount + co.co_kwonlyargcount]]
        # the config's own methods
        if args and co.co_varnames[0] == 'self' and isinstance(args[0], kinds): return
        if any(carries(a) for a in args):
            caller, callee = _lmbook_caller(frame), module_name(co.co_filename)
            if caller != callee: calls.append((caller, callee, co.co_name))
    sys.setprofile(prof)
    try: main(argv)
    except _Found: pass
    finally: sys.setprofile(None)
    order = notebook_order()
    return dict(files=len({b for _, b, _ in calls} | {a for a, _, _ in calls}), steps=len(calls),
                upward=[f'{a}>{b}.{f}' for a, b, f in calls if order.get(b, -1) > order.get(a, -1)],
                path=' '.join(f'{a}>{b}.{f}' for a, b, f in calls))


def cfg_paths() -> dict:
    "The config's path for a pretraining run and for a fine-tuning run of it, each in a scratch workspace."
    os.environ['LMBOOK_WORKSPACE'] = tempfile.mkdtemp()
    tiny = ['--set', 'max_steps=2', 'eval_every=1', 'tensorboard=false', 'take=200', 'ckpt_every=1']
    out = dict(train=cfg_path(['train', '--profile', 'smoke', '-e', 'shape', *tiny]))
    from lmbook.cli import main
    main(['train', '--profile', 'smoke', '-e', 'shape', *tiny])  # a checkpoint to fine-tune
    data = Path(os.environ['LMBOOK_WORKSPACE'])/'chat.jsonl'
    data.write_text('\n'.join(json.dumps(dict(prompt=f'q{i}', response=f'a{i}')) for i in range(40)))
    out['finetune'] = cfg_path(['finetune', '--init-from', 'shape', '--data', str(data), '-e', 'shape-ft',
                                '--set', 'batch_size=2', 'max_steps=2', 'tensorboard=false'])
    return out


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--cfg', action='store_true',
                    help='also trace the config (prepares a tiny smoke run: ~1 min)')
    a = ap.parse_args()
    out = figures()
    if a.cfg: out['cfg'] = cfg_paths()
    print(json.dumps(out, indent=1))
