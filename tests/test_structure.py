"""The package's shape: imports only go down the notebooks' order, notebooks are numbered once each, lines,
docstrings and functions stay readable, in the package and in its tests and checks. Walks the source with
`ast`, so it runs in well under a second."""
import ast, functools, re
from pathlib import Path
import pytest
from conftest import ROOT
from lmbook.core import ENV
from lmbook.rundir import RUN_FILES, BEST

PKG, NBS = ROOT/'lmbook', ROOT/'nbs'
GENERATED = {'_modidx'}  # nbdev writes it: the index of every symbol's page
MAX_LINE, MAX_FUNCTION, MAX_MODULE = 110, 50, 600
# The chapters, bottom to top: a module imports from its own chapter or from one below it. The foundation
# (lmbook/*.py but the command line) sits under every chapter; `cli` sits on top of them all.
CHAPTERS = ['data', 'model', 'runs', 'train', 'serve', 'pods', 'dev']


def name_of(path:Path) -> str:
    """A module's dotted name inside lmbook: `train.trainer`, `data` for `data/__init__.py`, `__init__` for
    the package."""
    parts = list(path.relative_to(PKG).with_suffix('').parts)
    if parts[-1] == '__init__' and len(parts) > 1: parts = parts[:-1]
    return '.'.join(parts)


@functools.cache  # read-only, and the package does not change while the tests run
def modules() -> dict[str, Path]:
    return {name_of(p): p for p in sorted(PKG.rglob('*.py'))
            if p.stem not in GENERATED and '__pycache__' not in p.parts}


def rank(m:str) -> int:
    "Where module `m` sits among the chapters: 0 the foundation, then the chapters, then the command line."
    if m == 'cli': return len(CHAPTERS) + 1
    top = m.split('.')[0]
    return CHAPTERS.index(top) + 1 if top in CHAPTERS else 0


def notebooks() -> dict[str, str]:
    "module -> its notebook's file name, for every notebook with `default_exp`."
    out = {}
    for nb in sorted(NBS.glob('*.ipynb')):
        m = re.search(r'#\|\s*default_exp\s+([\w.]+)', nb.read_text())
        if m: out[m.group(1).removesuffix('.__init__')] = nb.name
    return out


def resolve(here:str, node:ast.ImportFrom) -> list[str]:
    "The lmbook modules an `ImportFrom` in module `here` names, relative or absolute."
    if node.level:
        package = here in CHAPTERS or getattr(modules().get(here), 'name', '') == '__init__.py'
        pkg = here.split('.') if package or here == '__init__' else here.split('.')[:-1]
        if here == '__init__': pkg = []
        base = pkg[:len(pkg) - node.level + 1]
        mod = '.'.join(base + ([node.module] if node.module else []))
    elif node.module and (node.module == 'lmbook' or node.module.startswith('lmbook.')):
        mod = node.module.partition('lmbook')[2].lstrip('.')
    else: return []
    known = modules()
    subs = [f"{mod}.{a.name}".lstrip('.') for a in node.names if f"{mod}.{a.name}".lstrip('.') in known]
    return subs or ([mod] if mod in known else [])


def imports(path:Path, here:str|None=None) -> list[tuple[str, int, bool]]:
    "(lmbook module, line, inside a function) of every import of the package's own modules in `path`."
    here = here or name_of(path)
    tree, out = ast.parse(path.read_text()), []
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef)) for n in ast.walk(f)}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom): names = resolve(here, n)
        elif isinstance(n, ast.Import):
            names = [a.name.partition('.')[2] for a in n.names if a.name.startswith('lmbook.')]
        else: continue
        out += [(m, n.lineno, id(n) in inner) for m in names if m in modules()]
    return out


def test_every_module_has_one_notebook():
    nbs = notebooks()
    assert sorted(nbs) == sorted(modules())
    prefixes = [n.split('_')[0] for n in nbs.values()]
    assert len(set(prefixes)) == len(prefixes), f"a number is used twice: {sorted(prefixes)}"


def test_imports_only_go_down():
    """No cycle, and no module imports one whose notebook comes later (that would be a cycle waiting to
    happen)."""
    nbs = notebooks()
    up = [f"{m} ({nbs[m]}) imports {t} ({nbs[t]}) at line {line}" for m, p in modules().items()
          for t, line, _ in imports(p) if t != m and nbs[t] > nbs[m]]
    assert not up, '\n'.join(up)


def test_chapters_are_layered():
    "A module imports from its own chapter or one below it; the foundation imports no chapter."
    up = [f"{m} imports {t} at line {line}" for m, p in modules().items()
          for t, line, _ in imports(p) if rank(t) > rank(m)]
    assert not up, '\n'.join(up)


def test_package_imports_at_top():
    """lmbook's own imports sit at a module's top; a lazy import of another package says why (its line or the
    one above)."""
    inner = [f"{m}:{line} imports lmbook.{t} inside a function" for m, p in modules().items()
             for t, line, lazy in imports(p) if lazy]
    assert not inner, '\n'.join(inner)
    silent, reasoned = [], set()
    for m, p in modules().items():
        lines, tree = p.read_text().splitlines(), ast.parse(p.read_text())
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)): continue
            for n in ast.walk(f):
                if not isinstance(n, (ast.Import, ast.ImportFrom)): continue
                above = lines[n.lineno - 2].strip()
                said = '#' in lines[n.end_lineno - 1] or above.startswith(('#', 'try:  #'))
                # one reason, one block
                joined = above.startswith(('from ', 'import ')) and (m, n.lineno - 1) in reasoned
                if said or joined: reasoned.add((m, n.lineno))
                else: silent.append(f"{m}:{n.lineno} {lines[n.lineno - 1].strip()}")
    assert not silent, "lazy imports without their reason:\n" + '\n'.join(silent)


def test_no_private_names_across_modules():
    "A module uses another's public names only: a private one (`_name`) may change without notice."
    used = []
    for m, p in modules().items():
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or '').startswith('lmbook')):
                used += [f"{m} imports {a.name} from {n.module}" for a in n.names
                         if a.name.startswith('_') and not a.name.startswith('__')]
    assert not used, '\n'.join(used)


def generated_lines(path:Path) -> set[int]:
    """Lines nbdev writes itself: the module docstring (the notebook's title and summary) and `__all__`
    (wrapped at 120)."""
    tree, out = ast.parse(path.read_text()), set()
    for n in tree.body[:2]:  # the docstring, after `__version__` in the package's own __init__
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            out |= set(range(n.lineno, n.end_lineno + 1))
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(getattr(t, 'id', '') == '__all__' for t in n.targets):
            out |= set(range(n.lineno, n.end_lineno + 1))
    return out


def test_readable_width_and_length():
    "No line of a module over 110 characters (nbdev's own lines aside), no function over 50 lines."
    wide = []
    for m, p in modules().items():
        skip = generated_lines(p)
        wide += [f"{m}:{i}" for i, l in enumerate(p.read_text().splitlines(),
                                                  1) if len(l) > MAX_LINE and i not in skip]
    assert not wide, f"lines over {MAX_LINE} characters: " + ', '.join(wide)
    long = {f"{m}.{f.name}": f.end_lineno - f.lineno + 1 for m, p in modules().items()
            for f in ast.walk(ast.parse(p.read_text())) if isinstance(f, (ast.FunctionDef,
                                                                          ast.AsyncFunctionDef))
            and f.end_lineno - f.lineno + 1 > MAX_FUNCTION}
    assert not long, f"functions over {MAX_FUNCTION} lines: {long}"


def long_modules(mods:dict[str, Path]) -> dict[str, int]:
    "Modules over MAX_MODULE lines, with their length: a subject that big is a folder of modules."
    return {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE}


def test_no_module_over_600_lines(tmp_path):
    "No module of the package over 600 lines (nbdev's index aside); the check sees one that is."
    assert not long_modules(modules()), f"modules over {MAX_MODULE} lines: {long_modules(modules())}"
    (tmp_path/'big.py').write_text('x = 1\n'*(MAX_MODULE + 1))
    (tmp_path/'ok.py').write_text('x = 1\n'*MAX_MODULE)
    assert long_modules({'big': tmp_path/'big.py', 'ok': tmp_path/'ok.py'}) == {'big': MAX_MODULE + 1}


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    "The import walk finds an import hidden in a function body, so an upward one cannot slip through."
    p = tmp_path/'x.py'
    p.write_text("from ..core import paths_for\nfrom .step import f\ndef f():\n    from lmbook.cli import "
                 "main  # late\n")
    monkeypatch.setattr('test_structure.modules', lambda: {'core': None, 'cli': None, 'train.step': None,
                                                           'x': p})
    assert imports(p, 'train.x') == [('core', 1, False), ('train.step', 2, False), ('cli', 4, True)]
    assert rank('cli') > rank('pods.boot') > rank('train.trainer') > rank('data.sft') > rank('core')


def test_exit_codes_are_named():
    "A command's exit code is one of core's names (EXIT_USER_ERROR...), never a bare 2, 3 or 130."
    bare = re.compile(r'(\breturn|\bexit\(|\brc =|\bcode =)\s*(2|3|130)\b(?!\s*[*+/-])')
    found = [f"{m}:{i}" for m, p in modules().items() for i, l in enumerate(p.read_text().splitlines(), 1)
             if bare.search(l.split('#')[0])]
    assert not found, f"bare exit codes: {found}"


# A run folder's file names belong to `lmbook.rundir`; these literals equal one but name another thing.
NOT_RUN_FILES = {'data.tokenizer': {'meta.json'}}  # the tokenizer bundle's own meta.json, not a run's


def run_file_literals(path:Path, names:set[str]) -> list[tuple[int, str]]:
    "(line, name) of each literal in `path` among `names`; a key (`{'best': 1}`, `d['best']`) is a field."
    tree = ast.parse(path.read_text())
    keys = {id(k) for d in ast.walk(tree) if isinstance(d, ast.Dict) for k in d.keys if k is not None}
    keys |= {id(s.slice) for s in ast.walk(tree) if isinstance(s, ast.Subscript)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in names and id(n) not in keys]


def test_run_folder_names_only_in_rundir():
    "No module but `rundir` spells a run folder's file name: they ask `RunDir` (or `RUN_FILES`, `BEST`)."
    names = {*RUN_FILES.values(), BEST}
    found = [f"{m}:{line} {name!r}" for m, p in modules().items() if m != 'rundir'
             for line, name in run_file_literals(p, names) if name not in NOT_RUN_FILES.get(m, ())]
    assert not found, "run-folder file names outside lmbook.rundir:\n" + '\n'.join(found)


def environ_reads(path:Path) -> list[int]:
    "Lines of `path` that read `os.environ` (or call `os.getenv`), not write it or pass it on whole."
    tree, passed = ast.parse(path.read_text()), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store):
            passed.add(id(n.value))  # os.environ[k] = v: set for this process's libraries and its children
        elif isinstance(n, ast.Attribute) and n.attr == 'setdefault':
            passed.add(id(n.value))  # a library's default, read by the library (PyTorch, Hugging Face)
        elif isinstance(n, ast.Call) and getattr(n.func, 'id', '') == 'dict' and n.args:
            passed.add(id(n.args[0]))  # dict(os.environ, ...): a child process's whole environment
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ('environ', 'getenv')]
    return [n.lineno for n in uses if getattr(n.value, 'id', '') == 'os' and id(n) not in passed]


def test_environment_read_in_one_place():
    "Only `core.env_var` reads the environment, for names in `ENV` and the docs; others set it or pass it on."
    reads = [f"{m}:{line}" for m, p in modules().items() if m != 'core' for line in environ_reads(p)]
    assert not reads, "os.environ read outside core.env_var: " + ', '.join(reads)
    calls = [(m, n) for m, p in modules().items() for n in ast.walk(ast.parse(p.read_text()))]
    unlisted = [f"{m}:{n.lineno} {n.args[0].value}" for m, n in calls
                if isinstance(n, ast.Call) and getattr(n.func, 'id', '') == 'env_var' and n.args
                and isinstance(n.args[0], ast.Constant) and n.args[0].value not in ENV]
    assert not unlisted, "variables read but not in core.ENV: " + ', '.join(unlisted)
    docs = (NBS/'index.ipynb').read_text()
    missing = [v for v in ENV if f'`{v}`' not in docs]
    assert not missing, f"not listed in nbs/index.ipynb's settings: {missing}"


def split_docstrings(path:Path) -> list[int]:
    "Lines of the docstrings in `path` written as a parenthesised run of strings instead of one line."
    src = path.read_text()
    lines = src.splitlines()
    return [n.body[0].lineno for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
            and isinstance(n.body[0].value.value,
                           str) and lines[n.body[0].lineno - 1].lstrip().startswith('(')]


def test_docstrings_are_one_line():
    "A docstring says in one line what a thing is for; details go to the notebook's prose."
    split = [f"{m}:{line}" for m, p in modules().items() for line in split_docstrings(p)]
    assert not split, "docstrings split into several strings: " + ', '.join(split)


def shared_lines(path:Path) -> list[int]:
    "Lines of `path` that hold two statements (`a; b`, or `if x: a; b`)."
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        for field in ('body', 'orelse', 'finalbody'):
            body = getattr(n, field, None)
            if isinstance(body, list):
                out |= {b.lineno for a, b in zip(body, body[1:])
                        if isinstance(a, ast.stmt) and isinstance(b, ast.stmt) and a.end_lineno == b.lineno}
    return sorted(out)


def test_one_statement_a_line():
    "No line of a module holds two statements separated by `;` (nbdev's own lines aside)."
    shared = [f"{m}:{line}" for m, p in modules().items() for line in shared_lines(p)
              if line not in generated_lines(p)]
    assert not shared, "lines with several statements: " + ', '.join(shared)


def test_the_checks_see_a_split_docstring_and_a_semicolon(tmp_path):
    "Both walks find what they look for, so a wrapper's docstring or a `;` line cannot slip through."
    p = tmp_path/'x.py'
    p.write_text('def f():\n    ("Two "\n     "strings.")\n    a = 1; b = 2\n    if a: a; b\n'
                 'def g():\n    "One line."\n    return 1\n')
    assert split_docstrings(p) == [2]
    assert shared_lines(p) == [4, 5]


def checks_and_tests() -> list[Path]:
    "The tests and the CI scripts (Python and shell), held to the package's width."
    ci = [p for p in sorted((ROOT/'.ci').iterdir()) if p.is_file() and p.suffix in ('', '.py', '.sh')]
    return sorted((ROOT/'tests').rglob('*.py')) + ci


def test_tests_and_ci_fit_the_width():
    "No line over 110 characters in tests/ and .ci/, as in the package."
    wide = [f"{p.relative_to(ROOT)}:{i}" for p in checks_and_tests()
            for i, l in enumerate(p.read_text().splitlines(), 1) if len(l) > MAX_LINE]
    assert not wide, f"lines over {MAX_LINE} characters: " + ', '.join(wide)


MAX_CELL = 40


def long_cells(nbs:Path) -> list[str]:
    """Exported code cells over MAX_CELL lines that hold more than one top-level statement (so could be split
    where a reader can see each part), or whose notebook does not say, in the markdown just before, why the
    cell is long (one class, one function or one table may run longer)."""
    import json
    bad = []
    for nb in sorted(nbs.glob('*.ipynb')):
        cells = json.loads(nb.read_text())['cells']
        for i, c in enumerate(cells):
            s = ''.join(c['source'])
            if c['cell_type'] != 'code' or not s.startswith('#| export') or len(s.splitlines()) <= MAX_CELL:
                continue
            before = cells[i - 1] if i else {}
            said = before.get('cell_type') == 'markdown' and 'long because' in ''.join(before['source'])
            if len(ast.parse(s).body) > 1: bad.append(f"{nb.name} cell {i} ({len(s.splitlines())} lines)")
            elif not said:
                bad.append(f"{nb.name} cell {i} ({len(s.splitlines())} lines, no reason before it)")
    return bad


def test_long_cells_hold_one_definition(tmp_path):
    import json
    assert not long_cells(ROOT/'nbs'), long_cells(ROOT/'nbs')
    two = '#| export\n' + '\n'.join(f'x{i} = {i}' for i in range(MAX_CELL + 1))
    cell = dict(cell_type='code', source=[two], metadata={}, outputs=[], execution_count=None)
    (tmp_path/'a.ipynb').write_text(json.dumps(dict(cells=[cell], metadata={}, nbformat=4, nbformat_minor=5)))
    assert long_cells(tmp_path) == [f'a.ipynb cell 0 ({MAX_CELL + 2} lines)']
    one = '#| export\nTABLE = {\n' + ''.join(f'    {i}: {i},\n' for i in range(MAX_CELL)) + '}'
    why = dict(cell_type='markdown', source=['The cell below is long because it is one table.'], metadata={})
    cell = dict(cell, source=[one])
    (tmp_path/'a.ipynb').write_text(json.dumps(dict(cells=[cell], metadata={}, nbformat=4, nbformat_minor=5)))
    assert long_cells(tmp_path) == [f'a.ipynb cell 0 ({MAX_CELL + 3} lines, no reason before it)']
    nb = dict(cells=[why, cell], metadata={}, nbformat=4, nbformat_minor=5)
    (tmp_path/'a.ipynb').write_text(json.dumps(nb))
    assert long_cells(tmp_path) == []


# Names every command module defines on purpose: `cli.register` looks each one up by name in the module that
# owns a command, and `main` is what `python -m` runs.
HOOKS = {'add_cli', 'add_dev_cli', 'main'}


def top_definitions(path:Path) -> list[tuple[str, int]]:
    """(name, line) of each public function and class defined at the top of `path`; a `@patch`ed function is a
    method of the class it names, not a module's name."""
    patched = lambda n: any(getattr(d, 'id', getattr(getattr(d, 'func', None), 'id', '')) == 'patch'
                            for d in n.decorator_list)
    return [(n.name, n.lineno) for n in ast.parse(path.read_text()).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not n.name.startswith('_') and not patched(n)]


def test_one_definition_per_name():
    """No two modules define a function or class of the same public name (the command hooks aside), so a
    name in a traceback, a docs link or an import says which one it is; `_private` names are each module's."""
    where = {}
    for m, p in modules().items():
        for name, line in top_definitions(p):
            if name not in HOOKS: where.setdefault(name, []).append(f"{m}:{line}")
    twice = {n: ms for n, ms in where.items() if len(ms) > 1}
    said = '\n'.join(f"{n}: {', '.join(ms)}" for n, ms in sorted(twice.items()))
    assert not twice, "names defined in more than one module:\n" + said


def test_the_name_check_sees_a_second_definition(tmp_path):
    p = tmp_path/'x.py'
    p.write_text("from fastcore.basics import patch\ndef f(): pass\nclass C: pass\n@patch\n"
                 "def f(self:C): pass\ndef _g(): pass\nasync def h(): pass\n")
    assert top_definitions(p) == [('f', 2), ('C', 3), ('h', 7)]
