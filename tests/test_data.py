"Data pipeline end to end: FineWeb-shaped corpora through shard, tokenizer, tokenize and the loader."
import gzip, json, os, random
from pathlib import Path
import numpy as np
import pytest, torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')

from lmbook.data.prepare import (shard_corpus, shard_docs, read_manifest, _route_val, add_cli as data_cli,
                                 source_kind)
from lmbook.chatformat import CHAT_TOKENS, EOT
from lmbook.data.tokenizer import (ensure_tokenizer, tokenize_split, load_tokenizer, open_tokens, read_header,
                                   add_cli as tok_cli, token_dir)
from lmbook.data.loader import TokenLoader, val_batches, prepare_data, token_files

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
         "have an they "
         "you were her she there been one all we their has would when if more no out so said what up its "
         "about into than "
         "them can only other new some could time these two may then do first any my now such like our over "
         "man me even "
         "café naïve Zürich 東京 données — “quoted” π≈3.14159 tab\there back\\slash").split(' ')


def fineweb_docs(n=3000, seed=0):
    "Documents shaped like FineWeb rows: text with paragraphs, plus id, url and other fields."
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        paras = [' '.join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))).capitalize() + '.'
                 for _ in range(rng.randint(1, 4))]
        text = '\n\n'.join(paras) + ('\r\n  trailing  ' if i % 97 == 0 else '')
        rows.append(dict(text=text, id=f'<urn:uuid:{i:08d}>', dump='CC-MAIN-2024-10',
                         url=f'https://example.com/{i}',
                         date='2024-02-20T00:00:00Z', file_path=f's3://x/{i}.warc.gz', language='en',
                         language_score=0.9, token_count=len(text)//4))
    return rows


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp('corpus')
    rows = fineweb_docs()
    with open(d/'fw.jsonl', 'w') as f:
        for r in rows: f.write(json.dumps(r, ensure_ascii=False) + '\n')
    return d/'fw.jsonl', [r['text'] for r in rows]


def decoded_docs(tk, tdir):
    "Every document of a token folder, decoded, in order."
    out = []
    for p, _ in token_files(tdir):
        a = np.asarray(open_tokens(p))
        cuts = np.flatnonzero(a == tk.eot_id)
        assert len(cuts) and cuts[0] == 0
        out += [tk.decode(a[s+1:e]) for s, e in zip(cuts, [*cuts[1:], len(a)])]
    return out


def test_pipeline_roundtrip(corpus, tmp_path):
    "Counts add up across manifests, and decoded token files equal the input documents."
    path, texts = corpus
    ms = shard_corpus(tmp_path/'train', tmp_path/'val', dataset=str(path), take=0, val_ratio=0.1, seed=7,
                      lines_per_shard=700)
    tr, va = ms['train'], ms['val']
    assert tr['docs'] + va['docs'] == len(texts) == tr['source_docs']
    for m in (tr, va):
        assert (m['complete']
                and m['docs'] == sum(s['docs'] for s in m['shards']) == sum(s['lines'] for s in m['shards']))
        assert m['bytes'] == sum((tmp_path/m['split']/s['name']).stat().st_size for s in m['shards'])
    assert len(tr['shards']) == 4 and all(s['lines'] == 700 for s in tr['shards'][:-1])
    want_val = [t for i, t in enumerate(texts) if _route_val(i, 7, 0.1)]
    want_train = [t for i, t in enumerate(texts) if not _route_val(i, 7, 0.1)]
    assert list(shard_docs(tmp_path/'train')) == want_train and list(shard_docs(tmp_path/'val')) == want_val
    tk = ensure_tokenizer(tmp_path/'tok', tmp_path/'train', vocab_size=512)
    assert tk.vocab_size == 512 and all(tk.token_id(t) is not None for t in [EOT, *CHAT_TOKENS])
    for split, want in (('train', want_train), ('val', want_val)):
        tm = tokenize_split(tmp_path/split, tk, tmp_path/'tokens'/split)
        assert (tm['docs'] == len(want)
                and tm['tokens'] == sum(read_header(p)['tokens'] for p,
                                        _ in token_files(tmp_path/'tokens'/split)))
        assert decoded_docs(tk, tmp_path/'tokens'/split) == want
    # reused
    assert ensure_tokenizer(tmp_path/'tok', tmp_path/'train', vocab_size=512).tok.to_str() == tk.tok.to_str()


def test_gzip_smoke_mode_and_uint32(corpus, tmp_path):
    path, texts = corpus
    ms = shard_corpus(tmp_path/'train', mode='smoke', take=500, lines_per_shard=200, gz=True,
                      dataset=str(path))
    assert list(ms) == ['train'] and ms['train']['docs'] == 500 and [s['name']
                                                                     for s in ms['train']['shards']] == \
        ['shard_00000.txt.gz', 'shard_00001.txt.gz', 'shard_00002.txt.gz']
    assert gzip.open(tmp_path/'train'/'shard_00000.txt.gz', 'rt').read().count('\n') == 200
    tk = ensure_tokenizer(tmp_path/'tok', tmp_path/'train', vocab_size=400)
    m16 = tokenize_split(tmp_path/'train', tk, tmp_path/'t16')
    m32 = tokenize_split(tmp_path/'train', tk, tmp_path/'t32', dtype='uint32')
    assert (m16['dtype'], m32['dtype']) == ('uint16', 'uint32') and m16['tokens'] == m32['tokens']
    assert decoded_docs(tk, tmp_path/'t32') == texts[:500]
    a, b = TokenLoader(tmp_path/'t16', 4, 32, seed=3), TokenLoader(tmp_path/'t32', 4, 32, seed=3)
    for _ in range(5): assert torch.equal(a.next_batch()[0], b.next_batch()[0])


def test_local_inputs(tmp_path):
    """--input reads txt (blank-line separated), jsonl(.gz), parquet and folders of them; bad bytes are
    counted."""
    import pyarrow as pa, pyarrow.parquet as pq
    d = tmp_path/'in'; d.mkdir()
    (d/'a.txt').write_bytes(b'one\nstill one\n\n\ntwo\n\n\xff bad\n')
    with gzip.open(d/'b.jsonl.gz', 'wt') as f: f.write(json.dumps({'text': 'three', 'id': 1}) + '\n')
    pq.write_table(pa.table({'text': ['four', 'five'], 'id': [1, 2]}), d/'c.parquet')
    ms = shard_corpus(tmp_path/'tr', tmp_path/'va', dataset=str(d), val_ratio=0.0)
    assert list(shard_docs(tmp_path/'tr')) == ['one\nstill one', 'two', 'three', 'four', 'five']
    assert ms['train']['skipped'] == {'bad_bytes': 1, 'empty': 0, 'split': 0}
    # now it looks like a HF dataset folder to `auto`, but --input reads it locally
    (d/'README.md').write_text('# my corpus\n')
    assert source_kind(str(d)) == 'hf'
    ms2 = shard_corpus(tmp_path/'tr2', tmp_path/'va2', dataset=str(d), val_ratio=0.0, kind='local')
    assert (list(shard_docs(tmp_path/'tr2')) == list(shard_docs(tmp_path/'tr'))
            and ms2['train']['source']['kind'] == 'local')


def fake_fineweb_repo(root, rows):
    """A local dataset folder laid out like HuggingFaceFW/fineweb: README configs and parquet under
    sample/10BT."""
    import pyarrow as pa, pyarrow.parquet as pq
    (root/'sample'/'10BT').mkdir(parents=True)
    (root/'README.md').write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: "
                                  "train\n    path: data/*/*\n"
                                  "- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: "
                                  "sample/10BT/*\n---\n# fake fineweb\n")
    (root/'data'/'CC-MAIN-2024-10').mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:10]), root/'data'/'CC-MAIN-2024-10'/'000_00000.parquet')
    half = len(rows)//2
    for i, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part), root/'sample'/'10BT'/f'{i:03d}_00000.parquet',
                       row_group_size=300)
    return root


def test_hf_streaming_path(tmp_path, monkeypatch):
    """The FineWeb path: `datasets` streaming of a local dataset of FineWeb's shape, offline; HF caches in the
    workspace."""
    # restored afterwards
    for k in ('HF_HOME', 'HF_DATASETS_CACHE'): monkeypatch.setenv(k, 'x'); monkeypatch.delenv(k)
    monkeypatch.setenv('HF_TOKEN', 'hf_secret_token_value')
    rows = fineweb_docs(1200, seed=1)
    repo = fake_fineweb_repo(tmp_path/'fineweb', rows)
    ms = shard_corpus(tmp_path/'train', tmp_path/'val', dataset=str(repo), config='sample-10BT', take=1000,
                      val_ratio=0.05, lines_per_shard=400, hf_cache=tmp_path/'hf_cache')
    assert os.environ['HF_HOME'] == str(tmp_path/'hf_cache')
    assert ms['train']['docs'] + ms['val']['docs'] == 1000
    assert (list(shard_docs(tmp_path/'train'))
            == [r['text'] for i, r in enumerate(rows[:1000]) if not _route_val(i, 1337, 0.05)])
    for p in tmp_path.rglob('*'):
        if p.is_file() and p.suffix in ('.json', '.txt'):
            assert 'hf_secret_token_value' not in p.read_text(errors='ignore')
    # interrupted mid-stream, then resumed from the stream state saved with the last complete shard
    import lmbook.data.prepare as D
    route, opened = D._route_val, []
    def crash(i, *a):
        if i == 650: raise RuntimeError('pod preempted')
        return route(i, *a)
    class Spy(D.HFDocs):
        def __init__(self, *a, **k): super().__init__(*a, **k); opened.append(self.resume)
    monkeypatch.setattr(D, '_route_val', crash); monkeypatch.setattr(D, 'HFDocs', Spy)
    kw = dict(dataset=str(repo), config='sample-10BT', take=1000, val_ratio=0.05, lines_per_shard=400,
              hf_cache=tmp_path/'hf_cache')
    with pytest.raises(RuntimeError, match='preempted'): shard_corpus(tmp_path/'t2', tmp_path/'v2', **kw)
    part = read_manifest(tmp_path/'t2')
    assert len(part['shards']) == 1 and part['source_state'] is not None and not part['complete']
    monkeypatch.setattr(D, '_route_val', route)
    again = shard_corpus(tmp_path/'t2', tmp_path/'v2', **kw)
    assert opened[-1] == part['source_state']  # continued from the saved state, not from the start
    strip = lambda m: {k: v for k, v in m.items() if k not in ('source', 'source_state')}
    assert {k: strip(m) for k, m in again.items()} == {k: strip(m) for k, m in ms.items()}


def test_hf_unreachable_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv('HF_TOKEN', 'hf_secret_token_value')
    with pytest.raises(ValueError, match='cannot open dataset') as e:
        shard_corpus(tmp_path/'train', tmp_path/'val', dataset='HuggingFaceFW/no-such-dataset', take=10)
    assert 'hf_secret_token_value' not in str(e.value)
    assert read_manifest(tmp_path/'train')['shards'] == []


def test_cli_commands(corpus, workspace, capsys):
    "`lmbook shard/tokenizer/tokenize` through argparse, as lmbook.cli wires them."
    import argparse
    path, texts = corpus
    ap = argparse.ArgumentParser(); sub = ap.add_subparsers(); data_cli(sub); tok_cli(sub)
    run = lambda *a: (lambda args: args.func(args))(ap.parse_args(list(map(str, a))))
    assert run('shard', '--input', path, '--experiment', 'fw', '--take', 800, '--lines-per-shard', 300,
               '--quiet') == 0
    assert run('tokenizer', '--experiment', 'fw', '--vocab-size', 384) == 0
    assert run('tokenize', '--experiment', 'fw', '--quiet') == 0
    out = capsys.readouterr().out
    assert 'train:' in out and 'vocab_size 384' in out
    from lmbook.core import paths_for
    p = paths_for('fw', root=workspace)
    tk = load_tokenizer(p.tokenizer)
    got = decoded_docs(tk, token_dir(p, 'train')) + decoded_docs(tk, token_dir(p, 'val'))
    assert sorted(got) == sorted(texts[:800])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('SHARD_LINES', '40')
        assert run('shard', '--input', path, '--experiment', 'fw3', '--take', 100, '--quiet') == 0
        assert [s['lines'] for s in read_manifest(workspace/'datasets/train/fw3')['shards']][:2] == [40, 40]
    with pytest.raises(ValueError, match='either --input or --dataset'):
        run('shard', '--input', path, '--dataset', 'x', '--experiment', 'fw')
    with pytest.raises(FileNotFoundError):
        run('shard', '--input', workspace/'missing.jsonl', '--experiment', 'fw2')


def test_prepare_data_smoke_profile(tmp_path):
    "prepare_data on the smoke profile: builtin corpus, idempotent, loader-ready."
    from lmbook.profiles import get_config
    from lmbook.core import paths_for
    cfg = get_config('smoke', {'take': 800, 'vocab_size': 600})
    paths = paths_for('smoke-t', root=tmp_path)
    pd = prepare_data(cfg, paths)
    assert pd.vocab_size == 600 and pd.n_train_tokens > pd.n_val_tokens > 0
    assert prepare_data(cfg, paths) == pd
    dl = TokenLoader(pd.train_tokens, 4, cfg.model.block_size)
    x, y = dl.next_batch()
    assert x.shape == (4, 128) and x.dtype == torch.int64 and int(x.max()) < pd.vocab_size
    assert len(val_batches(pd.val_tokens, 12, 128, 4)) == 3


def test_console_script(corpus, workspace):
    """The three commands through the installed `lmbook` script; a user mistake is one `error:` line and exit
    code 2."""
    import subprocess, sys
    path, texts = corpus
    lm = lambda *a: subprocess.run([str(Path(sys.executable).parent/'lmbook'), *map(str, a)],
                                   capture_output=True, text=True,
                                   env={**os.environ, 'LMBOOK_WORKSPACE': str(workspace)}, timeout=300)
    r = lm('shard', '--input', path, '-h')
    # the CLI wires the data commands
    assert r.returncode == 0 and 'usage: lmbook shard' in r.stdout, r.stderr
    for args in (('shard', '--input', path, '--experiment', 'cs', '--take', 300, '--quiet'),
                 ('tokenizer', '--experiment', 'cs', '--vocab-size', 300),
                 ('tokenize', '--experiment', 'cs', '--quiet')):
        r = lm(*args)
        assert r.returncode == 0, r.stderr
    assert 'tokens (uint16)' in r.stdout
    r = lm('tokenize', '--experiment', 'nothing-here')
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith('error: no tokenizer at')
