"""The `lmbook` command and the project-level promises: README in sync, settings, a model import that stays
light."""
import json, re, subprocess, sys
from conftest import ROOT, lmbook_cmd


def test_profiles_lists_every_profile_with_counts():
    r = lmbook_cmd('profiles', '--json')
    assert r.returncode == 0, r.stderr
    rows = {row['profile']: row for row in json.loads(r.stdout)}
    assert list(rows) == ['smoke', 'm3_medium', 'gpt2_124m', 'runpod_1b', 'runpod_2b', 'runpod_4b']
    assert 1.95e9 < rows['runpod_2b']['params'] < 2.0e9
    assert ((rows['runpod_2b']['n_embd'], rows['runpod_2b']['n_layer'], rows['runpod_2b']['n_head'])
            == (2560, 24, 40))
    assert ((rows['runpod_4b']['n_embd'], rows['runpod_4b']['n_layer'], rows['runpod_4b']['n_head'])
            == (3072, 32, 48))
    assert rows['gpt2_124m']['vocab_size'] == 50304 and rows['gpt2_124m']['arch'] == 'gpt2'
    r = lmbook_cmd('profiles')
    assert 'runpod_4b' in r.stdout and 'B' in r.stdout


def test_readme_is_rendered_from_index():
    r = lmbook_cmd('readme', '--check', '--checkout', ROOT)
    assert r.returncode == 0, r.stderr


def test_readme_quickstart_is_two_commands_and_ci_calls_the_test_one():
    txt = (ROOT/'README.md').read_text()
    quick = txt.split('## Quickstart', 1)[1].split('\n## ', 1)[0]
    cmds = [b.split('```', 1)[0].strip() for b in quick.split('```bash\n')[1:]]
    assert len(cmds) == 2 and all('\n' not in c for c in cmds), cmds
    assert 'papermill nbs/train.ipynb' in cmds[0] and 'analysis.ipynb' in cmds[0]
    assert cmds[1] in (ROOT/'.ci'/'run').read_text()


def test_unknown_command_and_bad_profile_are_one_line_errors(workspace):
    r = lmbook_cmd('train', '--profile', 'smok', '--experiment', 'x')
    assert (r.returncode == 2 and r.stderr.strip().startswith('error:')
            and len(r.stderr.strip().splitlines()) == 1)
    assert 'smoke' in r.stderr


def test_misspellings_get_the_closest_name(workspace):
    r = lmbook_cmd('train', '--profile', 'smok', '--experiment', 'x')
    assert "unknown profile 'smok' (did you mean smoke?)" in r.stderr, r.stderr
    r = lmbook_cmd('train', '--experiment', 'x', '--set', 'n_layers=2')
    assert r.returncode == 2 and "unknown config key 'n_layers' (did you mean n_layer?)" in r.stderr, r.stderr


def test_help_names_the_profiles_the_keys_and_the_api_key():
    h = lmbook_cmd('train', '--help').stdout
    assert all(p in h for p in ('smoke', 'm3_medium', 'gpt2_124m', 'runpod_4b')) and 'config keys' in h
    assert all(k in h for k in ('n_layer', 'warmup_steps', 'sft_data', 'hellaswag_file')), h
    assert 'RUNPOD_API_KEY' in lmbook_cmd('pod', '--help').stdout


def test_sampling_an_unknown_run_names_the_runs_there(workspace):
    (workspace/'runs'/'smoke-demo'/'checkpoints').mkdir(parents=True)
    for src in ('smoke-dem:best', 'smoke-dem'):
        r = lmbook_cmd('sample', src, 'The')
        assert (r.returncode == 2 and "no run 'smoke-dem'" in r.stderr
                and '(did you mean smoke-demo?)' in r.stderr), r.stderr
        assert 'name smoke-dem alone' not in r.stderr  # no advice that fails the same way


def test_model_import_pulls_in_no_cloud_notebook_or_dataset_library():
    code = ("import sys, lmbook.model.gpt; bad = [m for m in ('runpod', 'papermill', 'datasets', 'IPython', "
            "'nbdev', 'matplotlib', 'tokenizers') "
            "if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert r.stdout.strip() == '[]', r.stdout + r.stderr


def test_settings_env_overrides(workspace, monkeypatch):
    from lmbook.core import load_settings, paths_for
    monkeypatch.setenv('RUN_EXPERIMENT', 'fw-2b')
    monkeypatch.setenv('SHARD_LINES', '1000')
    s = load_settings(ROOT/'settings.ini')
    assert (s.experiment, s.shard_lines, s.profile) == ('fw-2b', 1000, 'smoke')
    assert paths_for('fw-2b').run == workspace/'runs'/'fw-2b'


def test_shared_options_read_the_same_everywhere():
    "One spelling and one help text per shared option, and --root always means the workspace."
    from lmbook.cli import build_parser
    from lmbook.core import CLI_OPTIONS
    subs = next(a for a in build_parser()._actions if a.dest == 'command').choices
    seen = {}
    for cmd in ('shard', 'tokenizer', 'tokenize', 'prepare', 'bench', 'plot'):
        for act in subs[cmd]._actions:
            for name, (flags, kw) in CLI_OPTIONS.items():
                if set(act.option_strings) & set(flags):
                    assert tuple(act.option_strings) == flags, (cmd, act.option_strings)
                    assert act.help.split(' (default:')[0] == kw['help'].split(' (default:')[0], (cmd, name)
                    seen.setdefault(name, []).append(cmd)
    assert (seen['experiment'] == ['shard', 'tokenizer', 'tokenize', 'prepare'] and 'plot' in seen['root']
            and 'bench' in seen['profile'])
    for cmd, p in subs.items():
        root = [a for a in p._actions if '--root' in a.option_strings]
        assert not root or 'workspace' in root[0].help, cmd
    assert '--checkout' in subs['readme'].format_help()


def test_help_loads_no_torch_and_the_table_matches_the_modules():
    "`lmbook --help` imports no torch; each command's module registers the help line the table lists for it."
    import argparse, subprocess, sys
    from lmbook.cli import COMMANDS, build_parser
    code = "import sys, lmbook.cli as c; c.main(['--help'])"
    out = subprocess.run([sys.executable, '-X', 'importtime', '-c', code], capture_output=True, text=True)
    assert 'usage: lmbook' in out.stdout and not re.search(r'\|\s+torch$', out.stderr, re.M)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {a.dest: a.help for a in sub._choices_actions} == {c: h for c, (_, h) in COMMANDS.items()}
    light = next(a for a in build_parser('train', light=True)._actions
                 if isinstance(a, argparse._SubParsersAction))
    assert '--nproc' in light.choices['train'].format_help() and not light.choices['bench']._actions


def test_a_lever_the_machine_lacks_is_one_warning_line(tmp_path):
    "fp8 on the CPU: one `warning:` line that says the run goes on, not Python's file, line and source."
    r = lmbook_cmd('train', '-p', 'smoke', '-e', 'fp8-cpu', '--root', tmp_path, '--set', 'max_steps=1',
                   'fp8=tensorwise', 'eval_every=1', 'ckpt_every=1', 'take=300', timeout=300)
    out = r.stdout + r.stderr
    said = [l for l in out.splitlines() if 'fp8=tensorwise ignored' in l]
    assert r.returncode == 0 and len(said) == 1 and said[0].startswith('warning: '), out
    assert 'UserWarning' not in out and 'apply_fp8(' not in out, out


def test_the_readme_first_hour_gives_users_no_developer_command():
    "No `lmbook` command the README hands a user (its quickstart and first hour) is marked [developers]."
    from lmbook.cli import COMMANDS
    readme = (ROOT/'README.md').read_text()
    hour = readme.split('## The first hour', 1)[1].split('\n## ', 1)[0]
    used = set(re.findall(r'^\.venv/bin/lmbook (\w+)', readme.split('## The first hour')[0] + hour, re.M))
    assert 'docs' in used and 'sample' in used, used
    marked = {c for c in used if COMMANDS[c][1].startswith('[developers]')}
    assert not marked, marked


def test_docs_serve_after_a_build_does_not_tell_to_serve(tmp_path, monkeypatch, capsys):
    "`lmbook docs --serve` that builds first says how many pages and serves them, not 'run --serve'."
    import lmbook.dev.docs as docs
    from lmbook.cli import main
    served = []
    monkeypatch.setattr(docs, 'build_docs', lambda checkout, out: (tmp_path, []))
    monkeypatch.setattr(docs, 'serve_site', lambda site, port: served.append(site))
    (tmp_path/'index.html').write_text('')
    assert main(['docs', '--out', str(tmp_path), '--serve', '--rebuild']) == 0
    out = capsys.readouterr().out
    assert served == [tmp_path] and out.startswith(f'1 pages in {tmp_path}') and '--serve' not in out, out
    assert main(['docs', '--out', str(tmp_path)]) == 0  # a plain build says how to look at it
    assert 'lmbook docs --serve' in capsys.readouterr().out


def test_what_the_readme_says_of_the_tests_is_true():
    """The README's test paragraph says what CI runs (`.ci/run`, which runs `.ci/test` and nothing else),
    what the CI-only installs of `.ci/test` are, and whether a GitHub workflow runs the tests."""
    readme = (ROOT/'README.md').read_text()
    para = readme.split('**The tests**', 1)[1].split('```', 1)[0]  # what comes before the command
    run = [l for l in (ROOT/'.ci'/'run').read_text().splitlines()
           if l.strip() and not l.startswith(('#', 'set ', 'cd '))]
    assert run == ['bash .ci/test'] and '`CI=true bash .ci/run`' in para, para
    test = (ROOT/'.ci'/'test').read_text()
    ci_only = re.findall(r'apt-get install -y -qq ([\w -]+)\)', test)
    assert ci_only, 'no CI-only install found in .ci/test'
    for pkgs in ci_only:
        for pkg in pkgs.split(): assert pkg.lower().split('-')[0] in para.lower(), (pkg, para)
    workflows = [f.read_text() for f in (ROOT/'.github'/'workflows').glob('*.yml')]
    runs_tests = any('.ci/test' in w or '.ci/run' in w for w in workflows)
    assert ('no GitHub workflow runs them' in para) == (not runs_tests), para
    assert 'exactly this' not in para or runs_tests, para


def test_the_first_hour_fine_tune_reads_one_checkpoint_and_holds_out_enough(tmp_path, monkeypatch):
    """The README's first-hour fine-tune: every command after it reads the same checkpoint of the fine-tuned
    run, and its data holds out enough records for the validation loss (and so `:best`) to mean something."""
    from lmbook.profiles import get_config
    from lmbook.data.sft import split_examples
    hour = (ROOT/'README.md').read_text().split('## The first hour', 1)[1].split('\n## ', 1)[0]
    ft = re.search(r'lmbook finetune .*-e (\S+)', hour)
    assert ft, hour
    specs = set(re.findall(rf'lmbook (?:sample|chat|export|eval) ({re.escape(ft.group(1))}\S*)', hour))
    assert len(specs) == 1, specs  # one checkpoint: not the newest for one command and best/ for another
    code = re.search(r'^\.venv/bin/python -c "(from lmbook\.data\.sft import .*)"$', hour, re.M).group(1)
    monkeypatch.chdir(tmp_path)
    exec(code, {})
    recs = [json.loads(l) for l in (tmp_path/'chat.jsonl').read_text().splitlines()]
    d = get_config('smoke').data
    train, val = split_examples(recs, d.val_ratio, d.data_seed)
    assert len(val) >= 5 and len(train) >= 100, (len(train), len(val))


def test_the_wheel_leaves_the_developer_tools_out():
    """pyproject.toml builds a wheel without `lmbook.dev` (modules and data) and with every chapter; in
    a clone the tools still import, and a wheel's `lmbook docs` says where to run it (nbs/09_cli.ipynb)."""
    import tomllib
    from setuptools import find_packages
    st = tomllib.loads((ROOT/'pyproject.toml').read_text())['tool']['setuptools']
    pkgs = find_packages(str(ROOT), **st['packages']['find'])
    chapters = {'lmbook.data', 'lmbook.model', 'lmbook.runs', 'lmbook.train', 'lmbook.serve', 'lmbook.pods'}
    assert chapters <= set(pkgs) and not [p for p in pkgs if p.startswith('lmbook.dev')], pkgs
    assert st['exclude-package-data']['lmbook'] == ['dev/*']
    assert not [f for f in st['package-data']['lmbook'] if f.startswith('dev/')]
    import lmbook.dev.docs  # noqa: F401 (a clone has them)
