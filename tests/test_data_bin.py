"""nanoGPT's train.bin/val.bin train as they are, with the tokenizer that made them; an id outside its
vocabulary is refused by file."""
import os
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')

from lmbook.cli import main
from lmbook.data.tokenizer import train_bpe, open_tokens
from lmbook.data.loader import TokenLoader


@pytest.fixture
def nano(tmp_path):
    "A nanoGPT-style data folder: a tokenizer and its ids as raw uint16 train.bin / val.bin."
    d = tmp_path/'nano'; d.mkdir()
    tk = train_bpe([f'document {i}: the quick brown fox jumps over the lazy dog' for i in range(300)],
                   vocab_size=300)
    tk.tok.save(str(tmp_path/'tokenizer.json'))
    ids = np.concatenate([[tk.eot_id, *tk.encode(f'text number {i} about foxes and dogs')]
                          for i in range(400)]).astype('<u2')
    ids.tofile(d/'train.bin'); ids[:3000].tofile(d/'val.bin')
    return d, tmp_path/'tokenizer.json', ids, tk


def test_prepare_and_train_on_nanogpt_bins(nano, workspace, capsys):
    d, tj, ids, tk = nano
    assert main(['prepare', '-e', 'nano', '-s', f'dataset={d}', 'vocab_size=320', '--tokenizer-json', str(tj),
                 '-q']) == 0
    tokens = workspace/'cache'/'nano'/'tokens'
    # the same ids, not re-tokenized
    assert np.array_equal(np.asarray(open_tokens(tokens/'train'/'shard_00000.bin')), ids)
    assert TokenLoader(tokens/'val', 2, 32).n_tokens == 3000
    assert main(['train', '-e', 'nano', '-s', f'dataset={d}', 'vocab_size=320', 'n_layer=1', 'n_embd=32',
                 'n_head=2', 'block_size=32',
                 'batch_size=2', 'max_steps=2', 'warmup_steps=1', 'eval_every=2', 'eval_steps=1',
                 'tensorboard=false']) == 0
    assert (workspace/'runs'/'nano'/'metrics.jsonl').is_file()


def test_tokenizer_beside_the_bins_and_errors(nano, workspace, capsys):
    d, tj, ids, tk = nano
    assert main(['prepare', '-e', 'no-tok', '-s', f'dataset={d}', 'vocab_size=320']) == 2
    assert 'give the tokenizer that made them' in capsys.readouterr().err
    (d/'tokenizer.json').write_bytes(tj.read_bytes())
    np.array([5, 7, 999, 3], dtype='<u2').tofile(d/'val.bin')
    assert main(['prepare', '-e', 'bad-ids', '-s', f'dataset={d}', 'vocab_size=320', '-q']) == 2
    err = capsys.readouterr().err.strip()
    assert 'val.bin holds token id 999 at position 2' in err and len(err.splitlines()) == 1
    assert not list((workspace/'cache'/'bad-ids'/'tokens'/'val').glob('*.bin'))   # nothing half-written
    (d/'val.bin').write_bytes(b'\x01\x00\x02')
    assert main(['prepare', '-e', 'odd', '-s', f'dataset={d}', 'vocab_size=320', '-q']) == 2
    assert 'not a whole number of uint16' in capsys.readouterr().err
