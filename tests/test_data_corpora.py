"""Corpora that cannot work fail fast and say why; long documents are split with bounded memory; a failed
shard never blocks a retry."""
import os, random, time, tracemalloc
from pathlib import Path
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')

from lmbook.data.prepare import shard_corpus, shard_docs
from lmbook.data.corpus import local_docs, MAX_DOC_BYTES

WORDS = 'the of and to in a is that for it as was with be by on not café naïve 東京 données'.split()


def words(n, seed=0, vocab=WORDS):
    rng = random.Random(seed)
    return ' '.join(rng.choices(vocab, k=n))


def test_file_without_line_breaks_is_split_in_bounded_memory(tmp_path):
    src = tmp_path/'one_line.txt'
    with open(src, 'w', encoding='utf-8') as f:
        for i in range(120): f.write(words(30_000, i, WORDS[:-4]) + ' ')  # ~12 MB of ASCII, no newline at all
    size = src.stat().st_size
    tracemalloc.start()
    n = sum(1 for _ in local_docs(src))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    t0 = time.time()
    ms = shard_corpus(tmp_path/'tr', tmp_path/'va', dataset=str(src), val_ratio=0.5, seed=1)
    dt = time.time() - t0
    docs = list(shard_docs(tmp_path/'tr')) + list(shard_docs(tmp_path/'va'))
    assert all(len(d.encode()) <= MAX_DOC_BYTES for d in docs) and len(docs) >= size // MAX_DOC_BYTES
    assert ms['val']['docs'] > 0 and ms['train']['skipped']['split'] == len(docs) - 1
    # nothing lost but the cut's trailing space
    assert sum(len(d.encode()) for d in docs) >= size - len(docs) - 1
    assert peak < 8*MAX_DOC_BYTES < size/2, (peak, size)      # a few documents' worth, never the file
    assert n == len(docs)
    assert dt < 60, dt


@pytest.mark.parametrize('make', ['latin1', 'random'])
def test_not_utf8_says_so(tmp_path, make):
    src = tmp_path/f'{make}.txt'
    if make == 'latin1':
        src.write_bytes('\n\n'.join(f'Café numéro {i}, crème brûlée.' for i in range(50)).encode('latin-1'))
    else: src.write_bytes(random.Random(0).randbytes(200_000))
    with pytest.raises(ValueError, match='is not UTF-8 text') as e:
        shard_corpus(tmp_path/'tr', tmp_path/'va', dataset=str(src))
    assert '\n' not in str(e.value) and src.name in str(e.value)


def test_one_bad_document_alone_is_not_utf8(tmp_path):
    (tmp_path/'x.txt').write_bytes('crème'.encode('latin-1'))
    with pytest.raises(ValueError, match='not UTF-8 text'):
        shard_corpus(tmp_path/'tr', tmp_path/'va', dataset=str(tmp_path/'x.txt'))


def test_failed_shard_does_not_block_a_retry(tmp_path):
    bad, good = tmp_path/'bad.txt', tmp_path/'good.txt'
    bad.write_bytes('\n\n'.join(f'Café {i}' for i in range(20)).encode('latin-1'))
    with pytest.raises(ValueError, match='not UTF-8'):
        shard_corpus(tmp_path/'tr', tmp_path/'va', dataset=str(bad))
    good.write_text('\n\n'.join(words(20, i) for i in range(200)), encoding='utf-8')
    ms = shard_corpus(tmp_path/'tr', tmp_path/'va', dataset=str(good))          # another file
    assert ms['train']['complete'] and ms['train']['docs'] + ms['val']['docs'] == 200
    # the same path, corrected in place after a failure, is read afresh, not resumed
    bad.write_bytes('\n\n'.join(f'Café {i}' for i in range(20)).encode('latin-1'))
    with pytest.raises(ValueError, match='not UTF-8'):
        shard_corpus(tmp_path/'t2', tmp_path/'v2', dataset=str(bad), lines_per_shard=5)
    bad.write_text('\n\n'.join(f'Fixed {i}' for i in range(30)), encoding='utf-8')
    ms = shard_corpus(tmp_path/'t2', tmp_path/'v2', dataset=str(bad), lines_per_shard=5)
    assert sorted(shard_docs(tmp_path/'t2')) + sorted(shard_docs(tmp_path/'v2')) and \
        sorted([*shard_docs(tmp_path/'t2'), *shard_docs(tmp_path/'v2')]) == sorted(f'Fixed {i}'
                                                                                   for i in range(30))
    # a finished stage still blocks: its shards are kept
    with pytest.raises(ValueError, match='use another --experiment'):
        shard_corpus(tmp_path/'t2', tmp_path/'v2', dataset=str(good), lines_per_shard=5)


def test_too_few_documents_for_validation(tmp_path):
    (tmp_path/'tiny.txt').write_text('one document\n\nand another\n')
    with pytest.raises(ValueError, match='none went to validation'):
        shard_corpus(tmp_path/'tr', tmp_path/'va', dataset=str(tmp_path/'tiny.txt'), val_ratio=0.05)


def test_pysource_corpus_is_deterministic_and_capped(tmp_path):
    a = shard_corpus(tmp_path/'a'/'tr', tmp_path/'a'/'va', dataset='pysource', take=300, lines_per_shard=100)
    b = shard_corpus(tmp_path/'b'/'tr', tmp_path/'b'/'va', dataset='pysource', take=300, lines_per_shard=100)
    assert a['train']['docs'] + a['val']['docs'] == 300 and a['train']['source']['kind'] == 'pysource'
    for k in ('train', 'val'):
        assert [s['sha256'] for s in a[k]['shards']] == [s['sha256'] for s in b[k]['shards']]
    assert any('def ' in d for d in shard_docs(tmp_path/'a'/'tr'))


def test_pysource_imports_nothing():
    import subprocess, sys
    code = ("import sys, itertools; from lmbook.data.prepare import iter_docs; before = set(sys.modules); "
            "n = sum(1 for _ in itertools.islice(iter_docs('pysource'), 5000)); print(n, sorted(m for m in "
            "set(sys.modules) - before if not m.startswith('_sysconfigdata')))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split(' ', 1) == ['5000', '[]\n'], r.stdout + r.stderr
