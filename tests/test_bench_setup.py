"""Every script in nbs/benchmarks/ gets what it needs on a bare GPU machine (torch, transformers and peft; no
package index; none of lmbook's other dependencies) through one preamble, `arms.sh`: each .sh script
sources it before it runs anything, with the modules it needs besides lmbook's training stack in `needs`;
a .py script runs through `run.sh`, which sources it too. Each script's setup then runs on such a Python
(a venv that sees only those packages) with the wheels `.ci/gpu-wheels` gives, rebuilt here from this
environment's own packages (bitsandbytes with its CPU library only, as gpu-wheels keeps one CUDA's): it
installs what that Python lacks and checks that it is there (BENCH_SETUP_ONLY=1). Without a wheel it needs
(fastcore; torchao, which this CPU environment has none of), the script stops in one line naming it. The
setups run once per distinct `needs`: the rest of a script's setup is the same preamble."""
import base64, hashlib, importlib.metadata as md, re, subprocess, sys, zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest
from conftest import ROOT

BENCH = ROOT/'nbs'/'benchmarks'
PREAMBLE = 'source nbs/benchmarks/arms.sh'
OWN_WAY = {'pod_rehearsal.sh': 'standard library only: it installs lmbook in a pod, from its own wheels',
           'pod_wheels.sh': 'downloads wheels, where a package index is reachable',
           'arms.sh': 'the preamble itself'}
MACHINE = ['torch', 'transformers', 'peft', 'pip']  # what the GPU machine has, with what they need
WHEELS = ['fastcore', 'starlette', 'uvicorn', 'bitsandbytes']  # the wheels of .ci/gpu-wheels the scripts need


def script_needs() -> dict[str, str]:
    "Each .sh script that takes the preamble -> its `needs`, checked to come before anything runs."
    out = {}
    for sh in sorted(BENCH.glob('*.sh')):
        if sh.name in OWN_WAY: continue
        lines = [l for l in sh.read_text().splitlines() if l.strip() and not l.lstrip().startswith('#')]
        at = next((i for i, l in enumerate(lines) if l.startswith(PREAMBLE)), None)
        assert at is not None, f"{sh.name} does not source the preamble ({PREAMBLE})"
        assert not [l for l in lines[:at] if re.search(r'\b(python3?|torchrun|pip|nvidia-smi)\b', l)], \
            f"{sh.name} runs something before the preamble"
        needs = [re.fullmatch(r"needs=['\"]?([\w .-]*?)['\"]?", l) for l in lines[:at]]
        out[sh.name] = next((m.group(1) for m in needs if m), '')
    return out


def test_every_script_takes_the_one_preamble():
    needs = script_needs()
    assert set(needs) | set(OWN_WAY) == {p.name for p in BENCH.glob('*.sh')}
    assert needs['qlora_7b.sh'] == 'bitsandbytes peft transformers' and needs['profiles_fit.sh'] == '', needs
    run = (BENCH/'run.sh').read_text()
    assert 'NEEDS' in run and 'python3 nbs/benchmarks/' in run


def _closure(names:list[str]) -> dict:
    "The distributions `names` need, with them (installed here)."
    seen, todo = {}, list(names)
    while todo:
        n = re.split(r'[ ;<>=!~\[(]', todo.pop())[0].lower().replace('_', '-')
        if not n or n in seen: continue
        try: seen[n] = md.distribution(n)
        except md.PackageNotFoundError: continue
        todo += [r for r in seen[n].requires or [] if 'extra ==' not in r]
    return seen


def _wheel(name:str, out:Path) -> Path:
    "A wheel of the installed distribution `name` (CUDA libraries left out, as gpu-wheels drops all but one)."
    d = md.distribution(name)
    info = f"{d.metadata['Name'].replace('-', '_')}-{d.version}.dist-info"
    path = out/f"{d.metadata['Name'].replace('-', '_')}-{d.version}-py3-none-any.whl"
    skip = re.compile(r'__pycache__|/(INSTALLER|REQUESTED|RECORD|direct_url\.json)$|libbitsandbytes_(?!cpu)')
    record = []
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as z:
        for f in d.files or []:
            if str(f).startswith('..') or skip.search(str(f)) or not Path(d.locate_file(f)).is_file():
                continue
            data = Path(d.locate_file(f)).read_bytes()
            z.writestr(str(f), data)
            h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
            record.append(f"{f},sha256={h},{len(data)}")
        z.writestr(f'{info}/RECORD', '\n'.join(record + [f'{info}/RECORD,,']) + '\n')
    return path


@pytest.fixture(scope='module')
def bare(tmp_path_factory):
    "(a Python that sees only the GPU machine's packages, the folder of wheels the scripts are given)."
    root = tmp_path_factory.mktemp('bare')
    machine, wheels = root/'machine', root/'wheels'
    machine.mkdir(); wheels.mkdir()
    for d in _closure(MACHINE).values():
        for top in {Path(str(f)).parts[0] for f in d.files or [] if not str(f).startswith('..')}:
            src = Path(d.locate_file(top))
            if src.exists() and not (machine/top).exists(): (machine/top).symlink_to(src)
    python = getattr(sys, '_base_executable', sys.executable)
    subprocess.run([python, '-m', 'venv', '--without-pip', root/'venv'], check=True)
    (next((root/'venv'/'lib').glob('python3*/site-packages'))/'machine.pth').write_text(f"{machine}\n")
    for n in WHEELS: _wheel(n, wheels)
    return root/'venv'/'bin', wheels


def _run(bare, cmd:list[str], wheels:Path|None=None, **env) -> subprocess.CompletedProcess:
    "`cmd` from the repo root with the bare Python first on the PATH, as `python3`."
    bindir, given = bare
    (bindir/'python3').exists() or (bindir/'python3').symlink_to(bindir/'python')
    base = {'PATH': f"{bindir}:/usr/bin:/bin", 'HOME': str(bindir.parent), 'OMP_NUM_THREADS': '1',
            'LMBOOK_WHEELS': str(wheels or given), 'TMPDIR': str(bindir.parent)}
    return subprocess.run(cmd, cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=300)


def test_each_script_sets_up_on_a_bare_machine(bare, tmp_path):
    """Each distinct `needs`, on the bare Python: installed and there, or one line naming what is missing; and
    one command run through run.sh, whose preamble imports lmbook's training stack and what it installed."""
    sets = {}
    for name, needs in script_needs().items(): sets.setdefault(needs, name)
    assert set(sets) == {'', 'torchao', 'bitsandbytes peft transformers',
                         'transformers starlette uvicorn'}, sets
    empty = tmp_path/'none'; empty.mkdir()
    check = dict(BENCH_SETUP_ONLY='1')
    run = ['bash', 'nbs/benchmarks/run.sh', 'python3', '-c',
           'import os; print("ran in", os.environ["PYTHONPATH"])']
    with ThreadPoolExecutor(2) as ex:
        done = {needs: ex.submit(_run, bare, ['bash', f'nbs/benchmarks/{name}'], **check)
                for needs, name in sets.items()}
        done['bare'] = ex.submit(_run, bare, ['bash', f"nbs/benchmarks/{sets['']}"], wheels=empty, **check)
        done['run'] = ex.submit(_run, bare, run, NEEDS='starlette uvicorn')
        done = {k: f.result() for k, f in done.items()}
    for needs in ('', 'bitsandbytes peft transformers', 'transformers starlette uvicorn'):
        r = done[needs]
        said = f"setup ok: lmbook's packages{' and ' + needs if needs else ''} are there"
        assert r.returncode == 0 and said in r.stdout, (sets[needs], r.stdout, r.stderr[-2000:])
        assert 'installed for this script: ' in r.stdout and 'fastcore' in r.stdout, r.stdout
    r = done['run']  # the preamble imported lmbook and the wheels, the command ran with them, then they went
    assert r.returncode == 0 and 'ran in ' in r.stdout, r.stderr[-2000:]
    site = r.stdout.split('ran in ')[1].split(':')[0]
    assert site.endswith('/site') and not Path(site).exists()
    for r, missing in ((done['torchao'], 'torchao'), (done['bare'], 'fastcore')):
        err = [l for l in r.stderr.splitlines() if l.strip()]
        assert (r.returncode == 1 and len(err) == 1 and 'gpu-wheels' in err[0]
                and err[0].startswith(f'error: no {missing} for this Python')), (r.stdout, r.stderr[-2000:])


def test_pod_rehearsal_installs_what_the_pod_path_imports():
    """The rehearsal's virtualenv (a machine's torch and nothing else of lmbook's) gets every dependency of
    lmbook that the pod's start path, the trainer and the RunPod fake import: `NEEDS` in pod_rehearsal.py, all
    downloaded by pod_wheels.sh. A dependency missing from it stopped a GPU rehearsal in its first minute."""
    import ast, tomllib
    src = (BENCH/'pod_rehearsal.py').read_text()
    needs = next(ast.literal_eval(n.value) for n in ast.parse(src).body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'NEEDS')
    wheels_sh = (BENCH/'pod_wheels.sh').read_text()
    fetched = re.search(r'--platform linux_x86_64 \\\n\s*(.+)\n', wheels_sh).group(1).split()
    assert set(needs) <= set(fetched), f"pod_wheels.sh does not download {set(needs) - set(fetched)}"
    deps = tomllib.loads((ROOT/'pyproject.toml').read_text())['project']['dependencies']
    names = {re.match(r'[\w.-]+', d).group(0).lower() for d in deps}
    imports = {dict(pyyaml='yaml').get(n, n): n for n in names}
    mods = ['lmbook.cli', 'lmbook.pods.runpod', 'lmbook.pods.boot', 'lmbook.pods.supervise',
            'lmbook.train.trainer', 'lmbook.train.runnb', 'lmbook.dev.fake_runpod']
    code = (f"import sys\nfor m in {mods!r}: __import__(m)\n"
            "print(' '.join(sorted({k.split('.')[0] for k in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    used = {imports[m] for m in loaded & set(imports)} - {'torch'}
    assert used <= set(needs), \
        f"the pod path imports {sorted(used - set(needs))}: add it to NEEDS in pod_rehearsal.py"
