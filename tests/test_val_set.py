"""A run's validation set is one set of sequences: the same whatever micro-batch the fit picks for it and
however many processes share it, for every kind of data (token files, a mixture, fine-tuning rows)."""
import types
import numpy as np
import pytest
import torch
from lmbook.profiles import get_config
from lmbook.overrides import apply_overrides
from lmbook.core import paths_for
from lmbook.distributed import DistInfo
from lmbook.data.loader import prepare_data, write_token_dir
from lmbook.train.inputs import SFTData, run_loaders
from lmbook.train.runstart import settle

GIVEN = dict(batch_size=4, grad_accum=2, eval_steps=3, block_size=16, vocab_size=512)  # 12 sequences
TRAINED = [(4, 2), (8, 1), (2, 4), (1, 8)]  # micro-batch x accumulation: as given, and as a fit may change it
PROCESSES = [1, 2, 3, 5]


@pytest.fixture(scope='module')
def kinds(tmp_path_factory):
    "Prepared data of each kind `run_loaders` takes."
    d = tmp_path_factory.mktemp('val')
    rng = np.random.default_rng(0)
    tok = write_token_dir(d/'tok', [rng.integers(0, 512, 3000).astype(np.uint16)])
    (d/'notes.txt').write_text('\n\n'.join(f"note {i}: a mixture draws by document." for i in range(300)))
    mix = prepare_data(get_config('smoke', dict(GIVEN, sources=f'builtin:0.7,corpus:{d}/notes.txt:0.3',
                                                take=300)), paths_for('mix', root=d/'ws'))
    x = torch.from_numpy(rng.integers(0, 512, (7, 16)))
    y = torch.where(torch.arange(16) < 5, -1, x.roll(-1, 1))  # each row's prompt is not scored
    train = tuple(t.repeat(8, 1) for t in (x, y))  # enough rows for the train loader on 5 processes
    sft = SFTData(d, 512, 0, train, (x, y), train[0].numel(), x.numel(), 7)
    return dict(tokens=types.SimpleNamespace(train_tokens=tok, val_tokens=tok, more=None),
                mixture=types.SimpleNamespace(train_tokens=mix.train_tokens, val_tokens=mix.val_tokens,
                                              more=None), sft=sft)


def scored(cfg, data, world:int) -> tuple[torch.Tensor, torch.Tensor, set, int]:
    "All ranks' validation rows on `world` processes, padding left out; the ranks' passes; the largest pass."
    xs, ys, passes, most = [], [], set(), 0
    for rank in range(world):
        _, val = run_loaders(cfg, data, DistInfo(rank=rank, world_size=world))
        passes.add(len(val))
        for x, y in val:
            most = max(most, len(x))
            keep = (y >= 0).any(1)  # a padding row scores nothing
            xs.append(x[keep]); ys.append(y[keep])
    return torch.cat(xs), torch.cat(ys), passes, most


@pytest.mark.parametrize('kind', ['tokens', 'mixture', 'sft'])
def test_one_validation_set(kinds, kind, tmp_path):
    data = kinds[kind]
    given = get_config('smoke', GIVEN)
    cfg, _ = settle(given, types.SimpleNamespace(init_from=''), data, tmp_path/'run', DistInfo())
    assert cfg.train.eval.eval_rows == 12  # fixed from the config as given, before any fit
    want_x, want_y, _, _ = scored(cfg, data, 1)
    assert len(want_x) == 12
    for (b, acc) in TRAINED:
        fitted = apply_overrides(cfg, dict(batch_size=b, grad_accum=acc))
        for world in PROCESSES:
            x, y, passes, most = scored(fitted, data, world)
            assert len(passes) == 1, (kind, b, world, passes)  # every rank makes as many passes
            assert torch.equal(x, want_x) and torch.equal(y, want_y), (kind, b, world)
            assert most <= b  # a pass holds no more than the micro-batch it trains with


@pytest.mark.parametrize('kind,rows,what', [('tokens', 400, 'windows of 16 tokens'),
                                             ('sft', 12, '7 packed rows')])
def test_a_set_that_repeats_rows_says_so_once(kinds, kind, rows, what):
    """A validation split smaller than the set asked for repeats rows, and says so in one line; a large one is
    quiet."""
    said = []
    run_loaders(get_config('smoke', dict(GIVEN, eval_rows=rows)), kinds[kind], DistInfo(), said.append)
    assert len(said) == 1 and what in said[0] and f'fewer than the {rows}' in said[0], said
    assert 'raise val_ratio' in said[0]
    run_loaders(get_config('smoke', dict(GIVEN, eval_rows=5)), kinds[kind], DistInfo(), said.append)
    assert len(said) == 1, said[1:]
