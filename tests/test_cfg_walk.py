"""The run's config passes through its build stage a bounded number of times: the walk of `cfg` from
`lmbook train` (nbs/benchmarks/cfg_walk.py) visits `lmbook.train.runstart` at most 8 times."""
import sys
from conftest import ROOT

MAX_VISITS = 8


def test_the_build_stage_is_visited_at_most_8_times(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT/'nbs'/'benchmarks'))
    from cfg_walk import walk
    res = walk(['train', '-p', 'smoke', '-e', 'walk', '--root', str(tmp_path), '--set', 'max_steps=1',
                'eval_every=1', 'ckpt_every=1', 'tensorboard=false', 'take=300'])
    m = res['module']
    assert m['name'] == 'lmbook.train.runstart' and 0 < m['visits'] <= MAX_VISITS, m
    assert res['end']['visits']['lmbook.train.runstart'] == 1  # the trainer calls `build`, once
