"""Every config field has a declared range; out-of-range values are one-line errors naming the key, before
anything is written."""
import math
from dataclasses import fields
import pytest, yaml
from lmbook.config import field_index, Range, config_sections, config_fields, is_section
from lmbook.overrides import RANGES
from lmbook.profiles import get_config
from lmbook.config import config_dict, flat_config
from lmbook.overrides import config_from_dict
from lmbook.profiles import load_config_file, save_config, to_toml
from lmbook.cli import main

IDX = field_index()


def candidates(r:Range, typ:str) -> list:
    "Values just outside `r` (and absurd ones) for a field of type `typ`."
    if typ == 'bool': return ['maybe', 2]
    if r.choices: return ['no-such-choice', '', ' ']
    if typ == 'str': return ['', ' ', ' padded ', '\t', 'two words!']
    vals = [float('nan'), float('inf'), -float('inf'), -10**30] if typ == 'float' else ['nan', -10**30,
                                                                                        10**30, 1.5]
    step = 1 if typ == 'int' else 1e-6
    if r.lo is not None: vals += [r.lo] if r.lo_open else [r.lo - step]
    if r.hi is not None: vals += [r.hi] if r.hi_open else [r.hi + step]
    return vals


def rejected(k, v):
    "The one-line error for `k=v`, or None when it is accepted."
    try: get_config('smoke', {k: v})
    except ValueError as e: return str(e)
    return None


CASES = [(k, v) for k, (sec, typ) in IDX.items() for v in candidates(RANGES.get(k, Range()), typ)
         if rejected(k, v)]


def test_every_field_has_a_range():
    "A new field fails here until it gets an entry in its section's *_RANGES table."
    assert set(RANGES) == set(IDX), set(IDX) ^ set(RANGES)
    for k, (sec, typ) in IDX.items():
        r = RANGES[k]
        assert r.choices or r.pattern or r.lo is not None, f"{k} has no bound"
        assert any(ck == k for ck, _ in CASES), f"no out-of-range value of {k} is refused"


@pytest.mark.parametrize('k', [k for k, (_, typ) in IDX.items() if typ in ('int', 'float')])
def test_numbers_refuse_absurd_values(k):
    "Independent of the tables: no numeric field takes NaN, infinity or -1e30."
    for v in ('nan', 'inf', -10**30):
        err = rejected(k, v)
        assert err and k in err and '\n' not in err, (k, v, err)


@pytest.mark.parametrize('k', [k for k, (_, typ) in IDX.items() if typ == 'str'])
def test_text_refuses_blank_and_padded(k):
    for v in (' ', ' x '):
        err = rejected(k, v)
        assert err and k in err and '\n' not in err, (k, v, err)


@pytest.mark.parametrize('k,v',
                         [('warmup_steps', -5), ('min_lr_ratio', 5), ('seed', -1), ('n_kv_head', -2),
                          ('beta2', -1),
                                 ('weight_decay', -3), ('grad_clip', -1), ('rope_theta', 0), ('norm_eps', -1),
                          ('take', -3),
                                 ('mlp_hidden', -4), ('data_seed', -1), ('dropout', 1), ('lr', 0),
                          ('device', 'gpu')])
def test_values_that_were_accepted(k, v):
    err = rejected(k, v)
    assert err and err.startswith(f'{k}=') and '\n' not in err, err


def test_train_with_any_bad_value_writes_nothing(workspace, capsys, monkeypatch):
    """`lmbook train --set k=v` for every out-of-range value: exit 2, one `error:` line naming the key, an
    empty workspace."""
    import lmbook.train.launch
    monkeypatch.setattr(lmbook.train.launch, 'train', lambda *a,
                        **k: pytest.fail('a bad value reached the trainer'))
    from lmbook.overrides import parse_assignments
    seen = set()
    for k, v in CASES:
        # as the command line reads it
        if k in seen or not rejected(k, parse_assignments([f'{k}={v}'])[k]): continue
        seen.add(k)
        assert main(['train', '-e', 'bad-values', '--set', f'{k}={v}']) == 2, (k, v)
        err = capsys.readouterr().err.strip()
        assert err.startswith('error:') and k in err and len(err.splitlines()) == 1, (k, v, err)
    # their only bad values are padded with spaces, which the command line strips
    assert seen == set(IDX) - {'dataset_config', 'sample_prompts', 'sft_data', 'init_from', 'hellaswag_file'}
    assert list(workspace.iterdir()) == []


def test_key_in_the_wrong_section_of_a_file(workspace, tmp_path, capsys):
    (tmp_path/'run.toml').write_text('[model]\nn_layer = 2\nwarmup_steps = 10\n')
    (tmp_path/'run.yaml').write_text('train:\n  take: 100\n')
    (tmp_path/'typo.toml').write_text('[modle]\nn_layer = 2\n')
    for f, msg in (('run.toml', 'warmup_steps belongs in [train.sched], not [model]'),
                   ('run.yaml', 'take belongs in [data], not [train]'),
                   ('typo.toml', 'unknown config section [modle]')):
        assert main(['train', '-p', str(tmp_path/f), '-e', 'bad-file']) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and f in err and len(err.splitlines()) == 1, err
    assert list(workspace.iterdir()) == []


def test_true_is_not_a_number_and_inf_is_said_so():
    "A YAML `true` where a number goes is refused (bool is not int); inf and nan say they are not finite."
    assert Range(0).error('max_tokens', True) == 'max_tokens=True must be a number >= 0'
    from lmbook.runs.sample import check_sampling
    with pytest.raises(ValueError, match=r"max_new_tokens=True must be a number >= 0"):
        check_sampling(max_new_tokens=True)
    with pytest.raises(ValueError, match=r"^temperature=inf must be a finite number >= 0$"):
        check_sampling(temperature=math.inf)


@pytest.mark.parametrize('v', ['nan', 'inf', '-inf'])
def test_lock_stale_setting_must_be_finite(monkeypatch, v):
    from lmbook.runlock import stale_after
    monkeypatch.setenv('LMBOOK_LOCK_STALE_S', v)
    with pytest.raises(
        ValueError, match=rf"LMBOOK_LOCK_STALE_S='{v}' must be a finite number of seconds > 0"
    ):
        stale_after()


def test_names_are_unique_across_sections():
    "Every field has one home and a bare name that no other field or section has, so `lr=3e-4` finds it."
    secs = config_sections()
    names = [f.name for cls in secs.values() for f in fields(cls) if not is_section(f)]
    assert len(names) == len(set(names)) == len(IDX) == len(config_fields())
    assert not set(names) & {p.rsplit('.', 1)[-1] for p in secs}, 'a field named like a section'
    assert {sec for sec, _ in IDX.values()} == set(secs)  # no section without fields
    assert all('allowed' in f.metadata for f in config_fields().values())  # each made by `cfield`
    assert IDX['lr'] == ('train.optim', 'float') and IDX['batch_size'] == ('train', 'int')


def test_a_config_file_from_before_the_sections(tmp_path):
    "Every train field straight under [train], as run folders from before the sections hold it: same config."
    cfg = get_config('smoke', dict(lr=1e-3, ckpt_every=7, hellaswag_limit=3, fp8='rowwise', init_from='x'))
    d = config_dict(cfg)
    old = dict(d, train=flat_config(d['train']))
    assert old['train']['lr'] == 1e-3 and not any(isinstance(v, dict) for v in old['train'].values())
    (tmp_path/'old.toml').write_text(to_toml(old))
    (tmp_path/'old.yaml').write_text(yaml.safe_dump(old))
    assert load_config_file(tmp_path/'old.toml') == cfg == load_config_file(tmp_path/'old.yaml')
    assert config_from_dict(old) == cfg
    # a user's file of the old layout, written by hand
    (tmp_path/'mine.toml').write_text('[model]\nn_layer = 3\n\n[train]\nbatch_size = 4\nlr = 1e-3\n'
                                      'max_steps = 50\nckpt_every = 10\nwandb = "proj"\n')
    t = load_config_file(tmp_path/'mine.toml').train
    got = (t.batch_size, t.optim.lr, t.sched.max_steps, t.checkpoint.ckpt_every, t.logging.wandb)
    assert got == (4, 1e-3, 50, 10, 'proj')
    # what a run writes now: a table per section, read back the same
    toml = save_config(cfg, tmp_path/'run')[0]
    assert '\n[train.optim]\noptimizer = "adamw"\nlr = 0.001\n' in toml.read_text()
    assert load_config_file(toml) == cfg


def test_a_file_with_a_field_outside_its_section(workspace, tmp_path, capsys):
    (tmp_path/'a.toml').write_text('[train.optim]\nckpt_every = 5\n')
    (tmp_path/'b.toml').write_text('[train]\nlr = 1e-3\n\n[train.optim]\nlr = 2e-3\n')
    (tmp_path/'c.toml').write_text('[train.optm]\nlr = 1e-3\n')
    for f, msg in (('a.toml', 'ckpt_every belongs in [train.checkpoint], not [train.optim]'),
                   ('b.toml', 'lr is given twice'), ('c.toml', 'unknown config section [train.optm] (did you '
                                                            'mean train.optim?)')):
        assert main(['train', '-p', str(tmp_path/f), '-e', 'bad-file']) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    assert list(workspace.iterdir()) == []
