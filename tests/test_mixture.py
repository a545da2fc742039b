"""Weighted mixtures of sources: draws by weight, exact resume, one token cache per source and tokenizer
shared by experiments, tokens per source in the plan and in train.log, nanoGPT's .bin read in place, and the
one-line errors of a bad `sources`."""
import json, os, re
from pathlib import Path
import numpy as np
import pytest, torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')

from lmbook.cli import main
from lmbook.profiles import get_config, load_config_file
from lmbook.core import paths_for
from lmbook.data.loader import open_loader, prepare_data, val_batches, write_token_dir
from lmbook.data.mixture import (GPT2_EOT, MixtureLoader, SourceTokens, doc_starts, draw_sources,
                                 open_mixture, sources_dir)
from lmbook.data.tokenizer import open_tokens, token_dir
from lmbook.pods.plan import format_plan, plan
from lmbook.train.trainer import train
from conftest import rows
from test_hub_tokenizer import bpe_json


def toy(tmp_path, name, tok, n, rng, files=2):
    "A source of `n` documents, each `0` then 1 to 4 copies of `tok`, in `files` token files."
    docs = [np.array([0, *[tok]*int(rng.integers(1, 5))], np.uint16) for _ in range(n)]
    parts = [np.concatenate(p) for p in np.array_split(np.array(docs, dtype=object), files)]
    d = write_token_dir(tmp_path/name, parts)
    arrays = [open_tokens(d/f'shard_{i:05d}.bin') for i in range(files)]
    return SourceTokens(name, arrays, doc_starts(arrays, 0))


def test_documents_drawn_by_weight(tmp_path):
    "Over 100k documents each source gives its weight's share of them, within 2%."
    rng = np.random.default_rng(0)
    srcs = [toy(tmp_path, 'a', 1, 3000, rng), toy(tmp_path, 'b', 2, 200, rng), toy(tmp_path, 'c', 3, 17, rng)]
    dl = MixtureLoader(srcs, [6, 3, 1], batch_size=8, block_size=64, seed=1337)
    while dl.k < 100_000: dl.next_batch()
    assert np.allclose(np.array(dl.taken)/dl.k, [0.6, 0.3, 0.1], atol=0.02), dl.taken
    assert dl.epoch == dl.taken[2]//17 > 100  # the small source repeats, in a new order each pass
    x = torch.cat([dl.next_batch()[0] for _ in range(50)])
    assert set(x.unique().tolist()) == {0, 1, 2, 3}
    counts = np.bincount(draw_sources([6, 3, 1], 5, 0, 100_000), minlength=3)/100_000
    assert np.allclose(counts, [0.6, 0.3, 0.1], atol=0.02)
    assert (draw_sources([6, 3, 1], 5, 99_000, 2000) == draw_sources([6, 3, 1], 5, 0, 101_000)[99_000:]).all()


@pytest.mark.parametrize('stop', [1, 13, 40, 97])
def test_mixture_exact_resume(tmp_path, stop):
    """A loader restored from a saved state (through torch.save, weights_only) gives exactly the batches of
    an uninterrupted one, mid-document and across passes over a small source."""
    rng = np.random.default_rng(1)
    srcs = [toy(tmp_path, 'big', 1, 800, rng), toy(tmp_path, 'small', 2, 9, rng, files=1)]
    def batches(dl, n): return [torch.cat(dl.next_batch(), 1) for _ in range(n)]
    want = batches(MixtureLoader(srcs, [0.7, 0.3], 3, 32, seed=11), 120)
    a = MixtureLoader(srcs, [0.7, 0.3], 3, 32, seed=11)
    batches(a, stop)
    torch.save(a.state_dict(), tmp_path/'s.pt')
    st = torch.load(tmp_path/'s.pt', weights_only=True)
    assert json.loads(json.dumps(st)) == st and st['offset'] >= 0
    b = MixtureLoader(srcs, [0.7, 0.3], 3, 32, seed=0)
    b.load_state_dict(st)
    assert all(torch.equal(g, w) for g, w in zip(batches(b, 120 - stop), want[stop:]))
    ranks = [MixtureLoader(srcs, [0.7, 0.3], 1, 32, rank=r, world_size=3, seed=11) for r in range(3)]
    for w in want[:10]: assert torch.equal(torch.cat([torch.cat(r.next_batch(), 1) for r in ranks]), w)
    with pytest.raises(ValueError, match='same sources and weights'):
        MixtureLoader(srcs, [0.5, 0.5], 3, 32).load_state_dict(st)


def write_notes(folder:Path, n:int=300) -> Path:
    "A folder of two text files of short documents, blank-line separated."
    folder.mkdir(parents=True)
    for k in range(2):
        docs = [f"Note {k}.{i}: the mixture keeps {i % 9} apples and {i % 4} pears." for i in range(n)]
        (folder/f'notes{k}.txt').write_text('\n\n'.join(docs))
    return folder


MIX = dict(take=150, vocab_size=512, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=3,
           eval_steps=2, log_every=1, warmup_steps=2, ckpt_every=3, tensorboard=False, sample_every=0)


def test_run_on_pysource_and_a_folder(workspace, tmp_path):
    """pysource and a local folder at 80:20: the plan and train.log give tokens per source; a second
    experiment shares the sources' token files; a run resumed at step 3 has the losses of an uninterrupted
    one."""
    notes = write_notes(tmp_path/'my_text')
    ov = dict(MIX, sources=f'pysource:0.8,corpus:{notes}:0.2')
    text = format_plan(plan('smoke', 'H100', overrides=ov))
    assert re.search(r'data +pysource: weight 0\.80, ~[0-9.]+M tokens', text), text
    assert f'corpus:{notes}: weight 0.20' in text
    log = []
    train(get_config('smoke', dict(ov, max_steps=3)), 'mix', log=lambda *a, **k: log.append(' '.join(a)))
    res = train(get_config('smoke', dict(ov, max_steps=6)), 'mix', log=lambda *a, **k: None)
    head = (Path(res['run_dir'])/'train.log').read_text()
    assert 'data: a mixture of 2 sources, drawn by document; 1,536 tokens in the run' in head
    m = re.search(r'  pysource: weight 0\.80, ([0-9.]+)% of the tokens \(~([0-9,]+)\)', head)
    assert m and re.search(rf'  corpus:{notes}: weight 0\.20, [0-9.]+% of the tokens', head), head
    assert 'resumed at step 3' in head and any('data: a mixture' in l for l in log)
    ref = train(get_config('smoke', dict(ov, max_steps=6)), 'mix-ref', log=lambda *a, **k: None)
    got, want = rows(res['run_dir']), rows(ref['run_dir'])
    assert [(r['step'], r.get('loss'), r.get('val_loss')) for r in got] == [(r['step'], r.get('loss'),
                                                                             r.get('val_loss')) for r in want]
    shared = sources_dir(paths_for('mix', root=workspace))
    assert shared == workspace/'cache'/'_sources' and len(list(shared.iterdir())) == 2
    assert len(list(shared.glob('*/tokens/*/train'))) == 2  # one token folder a source: made once, shared
    mix = json.loads((token_dir(paths_for('mix-ref', root=workspace), 'train')/'manifest.json').read_text())
    assert mix['format'] == 'lmbook-mixture' and [e['weight'] for e in mix['sources']] == [0.8, 0.2]


def nanogpt_folder(tmp_path, tok) -> tuple[Path, np.ndarray]:
    "A nanoGPT folder: GPT-2-style ids, each document then <|endoftext|>, as its prepare.py writes them."
    d = tmp_path/'owt'
    d.mkdir()
    ids = np.concatenate([[*tok.encode(f'the lazy dog {i} sleeps').ids, GPT2_EOT] for i in range(400)])
    ids.astype('<u2').tofile(d/'train.bin')
    ids[:600].astype('<u2').tofile(d/'val.bin')
    return d, ids


@pytest.fixture
def gpt2_cache(tmp_path, monkeypatch):
    "A Hugging Face cache (offline) holding a tokenizer.json of GPT-2's size as `gpt2`'s."
    monkeypatch.setenv('HF_HOME', str(tmp_path/'hf'))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path/'xdg'))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.delenv('HF_HUB_CACHE', raising=False)
    rev = 'f27b190eeac4c2302d24068eabf5e9d6044389ae'
    snap = tmp_path/'hf'/'hub'/'models--gpt2'
    (snap/'snapshots'/rev).mkdir(parents=True)
    (snap/'refs').mkdir()
    (snap/'refs'/'main').write_text(rev)
    return bpe_json(snap/'snapshots'/rev/'tokenizer.json', 50257)


def test_nanogpt_bins_read_in_place(workspace, tmp_path, gpt2_cache, capsys):
    "nanogpt:PATH memory-maps train.bin/val.bin where they are; nothing is copied; the ids are GPT-2's."
    d, ids = nanogpt_folder(tmp_path, gpt2_cache)
    assert gpt2_cache.token_to_id('<|endoftext|>') == GPT2_EOT
    cfg = get_config('smoke', dict(sources=f'nanogpt:{d}:1', tokenizer='gpt2', vocab_size=50304))
    pd = prepare_data(cfg, paths_for('owt', root=workspace))
    assert pd.n_train_tokens == len(ids) and pd.eot_id == GPT2_EOT
    assert not [p for p in workspace.rglob('*.bin')]  # no copy anywhere in the workspace
    (src,), _ = open_mixture(pd.train_tokens)
    assert Path(src.arrays[0].filename) == d/'train.bin' and np.array_equal(src.arrays[0], ids)
    assert src.n_docs == 400 and src.doc(0)[-1] == GPT2_EOT and src.doc(1)[0] != GPT2_EOT
    x, y = open_loader(pd.train_tokens, 2, 96).next_batch()
    docs = {tuple(src.doc(i).tolist()) for i in range(src.n_docs)}
    for r in x.tolist():  # every document a window holds whole is one of the file's
        ends = [i for i, t in enumerate(r) if t == GPT2_EOT]
        assert len(ends) >= 2 and all(tuple(r[i + 1:j + 1]) in docs for i, j in zip(ends, ends[1:]))
    assert len(val_batches(pd.val_tokens, 6, 32, 2)) == 3
    # as `dataset`, the same; with another tokenizer, refused in one line before anything is read
    assert main(['prepare', '-p', 'smoke', '-e', 'owt2', '-q', '-s', f'dataset=nanogpt:{d}', 'tokenizer=gpt2',
                 'vocab_size=50304']) == 0
    capsys.readouterr()
    assert main(['prepare', '-p', 'smoke', '-e', 'owt3', '-q', '-s', f'sources=nanogpt:{d}:1']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'holds GPT-2 token ids' in err and 'set tokenizer=gpt2' in err
    np.array([5, 50300, GPT2_EOT], '<u2').tofile(tmp_path/'bad.bin')
    (tmp_path/'bad').mkdir()
    os.replace(tmp_path/'bad.bin', tmp_path/'bad'/'train.bin')
    (tmp_path/'bad'/'val.bin').write_bytes(ids[:10].astype('<u2').tobytes())
    assert main(['prepare', '-p', 'smoke', '-e', 'bad', '-q', '-s', f'sources=nanogpt:{tmp_path}/bad:1',
                 'tokenizer=gpt2', 'vocab_size=50304']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'holds token id 50300 at position 1' in err, err


@pytest.mark.parametrize('sources, words', [
    ('wiki:1', ["unknown source 'wiki'", 'corpus:PATH']),
    ('pysource:0', ['pysource has weight 0', '> 0']),
    ('pysource:-2', ['weight -2']),
    ('pysource:lots', ['does not end in a weight', 'SOURCE:WEIGHT']),
    ('pysource', ['has no weight']),
    ('pysource:1,builtin:2,pysource:3', ['one source twice']),
    ('builtin:1,,pysource:1', ['empty entry']),
    ('corpus:/no/such/dir:1', ['source corpus:/no/such/dir', 'does not exist']),
])
def test_bad_sources_one_line(workspace, capsys, sources, words):
    "A bad `sources` stops `lmbook prepare` with one `error:` line that says what to write, writing nothing."
    assert main(['prepare', '-p', 'smoke', '-e', 'bad', '-q', '-s', f'sources={sources}']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith('error: '), err
    for w in words: assert w in err, err
    assert not (workspace/'cache').exists() or not any((workspace/'cache').rglob('manifest.json'))


def test_sources_table_in_a_config_file(tmp_path):
    "A `[data.sources]` table in a TOML config is the same mixture as the text; a bad weight is refused."
    f = tmp_path/'mix.toml'
    f.write_text('[data.sources]\npysource = 0.8\n"corpus:my_text/" = 0.2\n')
    assert load_config_file(f).data.sources == 'pysource:0.8,corpus:my_text/:0.2'
    f.write_text('[data.sources]\npysource = true\n')
    with pytest.raises(ValueError, match='does not end in a weight'): load_config_file(f)
