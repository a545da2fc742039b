"""Bad input: each a clear one-line error before training starts (or a counted skip), and nothing written is
lost."""
import json, os
from pathlib import Path
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')

from lmbook.data.prepare import shard_corpus, read_manifest, check_shards, write_manifest
from lmbook.data.corpus import input_files
from lmbook.data.tokenizer import (ensure_tokenizer, tokenize_split, token_dtype, encode_docs, load_tokenizer,
                                   adopt_tokenizer,
                              new_bpe, write_tokens)
from lmbook.data.loader import TokenLoader, val_batches, write_token_dir


@pytest.fixture(scope='module')
def built(tmp_path_factory):
    "Shards, a tokenizer and token files of 400 built-in documents."
    d = tmp_path_factory.mktemp('built')
    shard_corpus(d/'train', mode='prod', take=400, lines_per_shard=100)
    tk = ensure_tokenizer(d/'tok', d/'train', vocab_size=320)
    tokenize_split(d/'train', tk, d/'tokens')
    return d, tk


def copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def one_line(e): assert '\n' not in str(e.value); return str(e.value)


def test_token_files_missing_empty_truncated_or_disagreeing(built, tmp_path):
    d, tk = built
    t = copy(d/'tokens', tmp_path/'t1')
    (t/'shard_00001.bin').unlink()
    with pytest.raises(FileNotFoundError, match='lmbook tokenize') as e: TokenLoader(t, 2, 16)
    one_line(e)
    t = copy(d/'tokens', tmp_path/'t2'); (t/'shard_00001.bin').write_bytes(b'')
    with pytest.raises(ValueError, match='bad header'): TokenLoader(t, 2, 16)
    t = copy(d/'tokens', tmp_path/'t3'); p = t/'shard_00002.bin'; p.write_bytes(p.read_bytes()[:-6])
    with pytest.raises(ValueError, match='truncated'): val_batches(t, 2, 16)
    t = copy(d/'tokens', tmp_path/'t4')
    m = read_manifest(t); m['files'][0]['tokens'] += 1; write_manifest(t, m)
    with pytest.raises(ValueError, match='manifest says'): TokenLoader(t, 2, 16)
    t = copy(d/'tokens', tmp_path/'t5'); m = read_manifest(t); m['complete'] = False; write_manifest(t, m)
    with pytest.raises(ValueError, match='partly tokenized'): TokenLoader(t, 2, 16)
    with pytest.raises(FileNotFoundError, match='no token manifest'): TokenLoader(tmp_path, 2, 16)


def test_shards_missing_truncated_or_edited(built, tmp_path):
    d, tk = built
    s = copy(d/'train', tmp_path/'s1'); (s/'shard_00000.txt').unlink()
    with pytest.raises(FileNotFoundError, match='missing'): tokenize_split(s, tk, tmp_path/'o1')
    s = copy(d/'train', tmp_path/'s2'); p = s/'shard_00001.txt'; p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ValueError, match='truncated or edited'): tokenize_split(s, tk, tmp_path/'o2')
    s = copy(d/'train', tmp_path/'s3')
    p = s/'shard_00003.txt'; b = bytearray(p.read_bytes()); b[5] ^= 1; p.write_bytes(bytes(b))
    with pytest.raises(ValueError, match='checksum'): tokenize_split(s, tk, tmp_path/'o3')
    with pytest.raises(ValueError, match='checksum'): check_shards(s)
    with pytest.raises(FileNotFoundError, match='lmbook shard'):
        tokenize_split(tmp_path/'nothing', tk, tmp_path/'o4')


def test_bad_local_inputs(tmp_path):
    (tmp_path/'empty.jsonl').write_text('')
    with pytest.raises(ValueError, match='gave no documents'):
        shard_corpus(tmp_path/'a', tmp_path/'b', dataset=str(tmp_path/'empty.jsonl'))
    (tmp_path/'bad.jsonl').write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r'bad.jsonl:2 is not valid JSON'):
        shard_corpus(tmp_path/'c', tmp_path/'d', dataset=str(tmp_path/'bad.jsonl'))
    (tmp_path/'nofield.jsonl').write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match='--text-field'):
        shard_corpus(tmp_path/'e', tmp_path/'f', dataset=str(tmp_path/'nofield.jsonl'))
    with pytest.raises(FileNotFoundError, match='does not exist'): input_files(tmp_path/'missing.txt')
    (tmp_path/'x.csv').write_text('a,b\n')
    with pytest.raises(ValueError, match='is not one of'): input_files(tmp_path/'x.csv')
    with pytest.raises(ValueError, match='--take N'): shard_corpus(tmp_path/'g', mode='smoke')
    with pytest.raises(ValueError, match='mode='): shard_corpus(tmp_path/'g', tmp_path/'h', mode='fast')


def test_nothing_written_is_lost_or_overwritten(built, tmp_path):
    d, tk = built
    (tmp_path/'mine').mkdir(); (tmp_path/'mine'/'notes.txt').write_text('keep me')
    with pytest.raises(ValueError, match='no manifest.json'):
        shard_corpus(tmp_path/'mine', mode='prod', take=5)
    assert ((tmp_path/'mine'/'notes.txt').read_text() == 'keep me'
            and len(list((tmp_path/'mine').iterdir())) == 1)
    s = copy(d/'train', tmp_path/'s')
    before = {p.name: p.read_bytes() for p in s.iterdir()}
    with pytest.raises(ValueError, match='use another --experiment'):
        shard_corpus(s, mode='prod', take=400, lines_per_shard=50)
    assert {p.name: p.read_bytes() for p in s.iterdir()} == before
    t = copy(d/'tokens', tmp_path/'t')
    other = ensure_tokenizer(tmp_path/'tok2', d/'train', vocab_size=300)
    with pytest.raises(ValueError, match='another tokenizer'): tokenize_split(d/'train', other, t)
    with pytest.raises(ValueError, match='holds files but no'): tokenize_split(d/'train', tk, tmp_path/'mine')
    with pytest.raises(ValueError, match='vocab_size=320'):
        ensure_tokenizer(d/'tok', d/'train', vocab_size=512)


def test_token_ids_out_of_range_for_dtype(built):
    d, tk = built
    with pytest.raises(ValueError, match='does not fit uint16'): token_dtype(70_000, 'uint16')
    assert token_dtype(70_000) is np.uint32 and token_dtype(65_536) is np.uint16
    with pytest.raises(ValueError, match='use dtype uint32'): encode_docs(tk, ['some text here'], np.uint8)
    with pytest.raises(ValueError, match='choose auto'): token_dtype(100, 'int8')


def test_adopted_tokenizer_gets_special_tokens(built, tmp_path):
    d, tk = built
    tok = new_bpe()
    from tokenizers import trainers
    tok.train_from_iterator(['hello world'] * 10, trainers.BpeTrainer(vocab_size=280, show_progress=False))
    tok.save(str(tmp_path/'pub.json'))
    with pytest.raises(ValueError, match='has no <|endoftext|>'): load_tokenizer(tmp_path/'pub.json')
    a = adopt_tokenizer(tmp_path/'pub.json', tmp_path/'bundle')
    assert a.decode(a.encode('hello world')) == 'hello world' and a.token_id('<|assistant|>') is not None
    # an adopted bundle is reused as is
    assert ensure_tokenizer(tmp_path/'bundle', vocab_size=999).vocab_size == a.vocab_size
    with pytest.raises(FileNotFoundError, match='--tokenizer-json'):
        adopt_tokenizer(tmp_path/'nope.json', tmp_path/'b2')


def test_an_interrupted_first_write_does_not_block_the_experiment(built, tmp_path):
    "Ctrl-C between the first token file and the manifest's rename: the next run starts that folder afresh."
    d, tk = built
    t = tmp_path/'tokens'; t.mkdir()
    (t/'shard_00000.bin').write_bytes(b'\0'*64); (t/'.manifest.json.4242.tmp').write_text('{"files": [')
    m = tokenize_split(d/'train', tk, t)
    assert m['files'] and (t/'manifest.json').is_file() and not list(t.glob('.manifest.json.*.tmp'))
    assert sorted(p.name for p in t.iterdir() if p.suffix == '.bin') == sorted(f['name'] for f in m['files'])


BAD_INPUTS = {  # file name -> (its bytes made from a good gzip's, what the one-line error says)
    'plain.txt.gz': (lambda gz: b'plain text, not gzip\n', 'is not gzip data'),
    'cut.txt.gz': (lambda gz: gz[:len(gz)//2], 'ends before its gzip stream does'),
    'cut.jsonl.gz': (lambda gz: gz[:len(gz)//2], 'ends before its gzip stream does'),
}

@pytest.mark.parametrize('name', BAD_INPUTS)
def test_bad_compressed_input_names_the_file(tmp_path, name):
    "A plain file named .gz, or a truncated .gz: one ValueError naming the file and the fix."
    import gzip
    make, says = BAD_INPUTS[name]
    text = ''.join(json.dumps(dict(text=f'document {i} ' * 50)) + '\n' for i in range(3000))
    (tmp_path/name).write_bytes(make(gzip.compress(text.encode())))
    with pytest.raises(ValueError) as e:
        shard_corpus(tmp_path / 'train', dataset=str(tmp_path / name), mode='prod')
    msg = str(e.value)
    assert says in msg and str(tmp_path/name) in msg and '\n' not in msg, msg


@pytest.mark.parametrize('col', [[1, 2, 3], [['a'], ['b'], ['c']]])
def test_parquet_column_that_is_not_text(tmp_path, col):
    "A parquet text column of ints or lists: one ValueError naming the file, the column and its type."
    import pyarrow as pa, pyarrow.parquet as pq
    pq.write_table(pa.table({'text': col}), tmp_path/'a.parquet')
    with pytest.raises(ValueError, match=r"a\.parquet: column 'text' holds .*, not text: pass --text-field"):
        shard_corpus(tmp_path/'train', dataset=str(tmp_path/'a.parquet'), mode='prod')
    (tmp_path/'b.parquet').write_bytes(b'not parquet at all')
    with pytest.raises(ValueError, match=r"b\.parquet is not a parquet file"):
        shard_corpus(tmp_path/'train2', dataset=str(tmp_path/'b.parquet'), mode='prod')
