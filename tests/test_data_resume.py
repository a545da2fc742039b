"""Interruption and exact resume: the sharder killed mid-run, tokenize rerun, loader state across shard and
epoch boundaries."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import numpy as np
import pytest, torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')

from lmbook.data.prepare import shard_corpus, read_manifest
from lmbook.data.corpus import builtin_docs
from lmbook.data.tokenizer import ensure_tokenizer, tokenize_split
from lmbook.data.loader import TokenLoader, val_batches, write_token_dir

SLOW_SHARD = """
import sys, time, itertools
from pathlib import Path
from lmbook.data.prepare import shard_corpus
from lmbook.data.corpus import builtin_docs
def slow():
    for i, d in enumerate(builtin_docs()):
        if i >= 150: time.sleep(0.01)
        yield d
out = Path(sys.argv[1])
shard_corpus(out/'train', out/'val', take=1200, lines_per_shard=100, val_ratio=0.2, docs=slow())
"""


def test_sharder_killed_then_resumed(tmp_path):
    "SIGKILL mid-run leaves only whole, listed shards; a rerun ends identical to an uninterrupted run."
    ref = shard_corpus(tmp_path/'ref'/'train', tmp_path/'ref'/'val', take=1200, lines_per_shard=100,
                       val_ratio=0.2)
    out = tmp_path/'run'
    p = subprocess.Popen([sys.executable, '-c', SLOW_SHARD, str(out)])
    t0 = time.time()
    while time.time() - t0 < 60:
        m = read_manifest(out/'train') if (out/'train').exists() else None
        if m and len(m['shards']) >= 2: break
        time.sleep(0.05)
    time.sleep(0.15)
    p.send_signal(signal.SIGKILL); p.wait()
    m = read_manifest(out/'train')
    assert not m['complete'] and len(m['shards']) >= 2
    listed = {s['name'] for s in m['shards']} | {'manifest.json'}
    assert ({q.name for q in (out/'train').iterdir() if not q.name.startswith('.')}
            <= listed | {f"shard_{len(m['shards']):05d}.txt"})
    got = shard_corpus(out/'train', out/'val', take=1200, lines_per_shard=100, val_ratio=0.2)
    assert got == ref
    for split in ('train', 'val'):
        assert (sorted(q.name for q in (out/split).iterdir())
                == sorted(q.name for q in (tmp_path/'ref'/split).iterdir()))


def test_tokenize_resumes_and_skips_done(tmp_path):
    shard_corpus(tmp_path/'train', mode='prod', take=600, lines_per_shard=150)
    tk = ensure_tokenizer(tmp_path/'tok', tmp_path/'train', vocab_size=400)
    ref = tokenize_split(tmp_path/'train', tk, tmp_path/'tokens')
    ref_bytes = {f['name']: (tmp_path/'tokens'/f['name']).read_bytes() for f in ref['files']}
    (tmp_path/'tokens'/'shard_00002.bin').unlink()                    # lost file
    (tmp_path/'tokens'/'.shard_00003.bin.tmp').write_bytes(b'partial')  # an interrupted write
    mtime0 = (tmp_path/'tokens'/'shard_00000.bin').stat().st_mtime_ns
    again = tokenize_split(tmp_path/'train', tk, tmp_path/'tokens')
    assert again == ref and not (tmp_path/'tokens'/'.shard_00003.bin.tmp').exists()
    assert (tmp_path/'tokens'/'shard_00000.bin').stat().st_mtime_ns == mtime0  # finished files are not redone
    assert {n: (tmp_path/'tokens'/n).read_bytes() for n in ref_bytes} == ref_bytes


@pytest.fixture
def toy_tokens(tmp_path):
    "Three token files of different lengths whose tokens are their global positions."
    sizes = [1000, 333, 2501]
    starts = np.cumsum([0, *sizes])
    return write_token_dir(tmp_path/'tok',
                           [np.arange(s, s+n, dtype=np.uint32) for s, n in zip(starts, sizes)])


def batches(dl, n): return [torch.cat(dl.next_batch(), 1) for _ in range(n)]


@pytest.mark.parametrize('stop', [1, 9, 23, 24, 60])
def test_loader_exact_resume(toy_tokens, stop, tmp_path):
    """A restored loader continues with exactly the batches of an uninterrupted one, across file and epoch
    boundaries."""
    ref = TokenLoader(toy_tokens, 5, 32, seed=11)
    want = batches(ref, 80)
    assert ref.batches_per_epoch == 23 and ref.epoch == 3
    a = TokenLoader(toy_tokens, 5, 32, seed=11)
    batches(a, stop)
    torch.save(a.state_dict(), tmp_path/'s.pt')
    st = torch.load(tmp_path/'s.pt', weights_only=True)
    assert json.loads(json.dumps(st)) == st
    b = TokenLoader(toy_tokens, 5, 32, seed=11)
    b.load_state_dict(st)
    got = batches(b, 80 - stop)
    assert all(torch.equal(g, w) for g, w in zip(got, want[stop:]))


def test_loader_epochs_cover_windows_once_and_reshuffle(toy_tokens):
    dl = TokenLoader(toy_tokens, 4, 32, seed=0)
    n = dl.batches_per_epoch
    e0 = torch.cat([x for x, _ in (dl.next_batch() for _ in range(n))])
    e1 = torch.cat([x for x, _ in (dl.next_batch() for _ in range(n))])
    assert dl.epoch == 1 and len(set(e0[:, 0].tolist())) == len(e0) == n*4
    assert (not torch.equal(e0, e1)
            and set(e0[:, 0].tolist()) <= set(range(0, 3834, 32)) | set(range(1000, 3834,
                                                                              32)) | set(range(1333, 3834,
                                                                                               32)))
    # reshuffled; only the dropped remainder differs
    assert len(set(e0[:, 0].tolist()) ^ set(e1[:, 0].tolist())) <= 2*3
    assert all(((x[1:] - x[:-1]) == 1).all() for x in e0)  # no window straddles two files


def test_ranks_read_disjoint_windows(toy_tokens):
    """Across a whole epoch, 3 ranks together read each window at most once and match one process's global
    batches."""
    ranks = [TokenLoader(toy_tokens, 2, 32, rank=r, world_size=3, seed=5) for r in range(3)]
    one = TokenLoader(toy_tokens, 6, 32, seed=5)
    assert ranks[0].batches_per_epoch == one.batches_per_epoch
    seen = []
    for _ in range(one.batches_per_epoch):
        xs = [r.next_batch()[0] for r in ranks]
        assert torch.equal(torch.cat(xs), one.next_batch()[0])
        seen += torch.cat(xs)[:, 0].tolist()
    assert len(seen) == len(set(seen))
    with pytest.raises(ValueError, match='rank=3'): TokenLoader(toy_tokens, 2, 32, rank=3, world_size=3)


def test_val_batches_fixed_and_rank_disjoint(toy_tokens):
    a = val_batches(toy_tokens, 20, 32, 4)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, val_batches(toy_tokens, 20, 32, 4)))
    r0, r1 = val_batches(toy_tokens, 6, 32, 2, rank=0, world_size=2), val_batches(toy_tokens, 6, 32, 2,
                                                                                  rank=1, world_size=2)
    firsts0, firsts1 = (set(torch.cat([x for x, _ in r])[:, 0].tolist()) for r in (r0, r1))
    assert not firsts0 & firsts1
    x, y = a[0]
    assert len(a) == 5 and x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_loader_state_for_other_data_is_refused(toy_tokens, tmp_path):
    st = TokenLoader(toy_tokens, 4, 32).state_dict()
    with pytest.raises(ValueError, match='same data and block_size'):
        TokenLoader(toy_tokens, 4, 16).load_state_dict(st)
    other = write_token_dir(tmp_path/'other', [np.arange(5000, dtype=np.uint16)])
    with pytest.raises(ValueError, match='same data'): TokenLoader(other, 4, 32).load_state_dict(st)


def test_many_files_resume_and_coverage(tmp_path):
    """Nine files (more than the loader keeps window orders for): an epoch reads every window once; resume
    stays exact."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(50, 400, 9)
    starts = np.cumsum([0, *sizes])
    d = write_token_dir(tmp_path/'tok', [np.arange(s, s+n, dtype=np.uint16) for s, n in zip(starts, sizes)])
    ref = TokenLoader(d, 3, 16, seed=2)
    n = ref.batches_per_epoch
    e0 = torch.cat([ref.next_batch()[0] for _ in range(n)])
    assert len(set(e0[:, 0].tolist())) == n*3 and all(((x[1:] - x[:-1]) == 1).all() for x in e0)
    want = batches(ref, 2*n)
    a = TokenLoader(d, 3, 16, seed=2)
    batches(a, n + 7)
    b = TokenLoader(d, 3, 16, seed=2); b.load_state_dict(a.state_dict())
    assert all(torch.equal(g, w) for g, w in zip(batches(b, 2*n - 7), want[7:]))
    v = val_batches(d, 8*n, 16, 4)
    assert (torch.equal(v[0][0][0], torch.arange(16))
            and all(torch.equal(x, y) for (x, _), (y, _) in zip(v, val_batches(d, 8*n, 16, 4))))


def test_tokenize_trails_an_unfinished_sharder(tmp_path):
    """Token files can be made from the shards listed so far (not complete until the shards are); once
    sharding finishes, a rerun adds only the new ones."""
    docs = list(__import__('itertools').islice(builtin_docs(), 500))
    def interrupted():
        yield from docs[:330]
        raise RuntimeError('preempted')
    with pytest.raises(RuntimeError):
        shard_corpus(tmp_path/'train', mode='prod', take=500, lines_per_shard=100, docs=interrupted())
    tk = ensure_tokenizer(tmp_path/'tok', tmp_path/'train', vocab_size=300)
    first = tokenize_split(tmp_path/'train', tk, tmp_path/'tokens')
    assert first['docs'] == 300 and not first['complete']
    mtime = (tmp_path/'tokens'/'shard_00000.bin').stat().st_mtime_ns
    shard_corpus(tmp_path/'train', mode='prod', take=500, lines_per_shard=100)
    full = tokenize_split(tmp_path/'train', tk, tmp_path/'tokens')
    assert full['docs'] == 500 and len(full['files']) == 5 and full['files'][:3] == first['files']
    assert full['complete']
    assert (tmp_path/'tokens'/'shard_00000.bin').stat().st_mtime_ns == mtime
