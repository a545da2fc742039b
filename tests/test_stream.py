"""Training while the data is prepared: the run starts before the last shard is tokenized, reads the same
batches as on data prepared beforehand, prepares only what it reads, and resumes exactly."""
import itertools, json, threading, time
from pathlib import Path
import pytest
from lmbook.profiles import get_config
from lmbook.core import paths_for
from lmbook.data.corpus import builtin_docs
from lmbook.data.loader import prepare_data
from lmbook.data.prepare import read_manifest
from lmbook.data.tokenizer import token_dir
from lmbook.rundir import RunDir
from lmbook.runlock import request_stop
import lmbook.data.stream as stream
import lmbook.data.tokenizer as tokenizer
import lmbook.train.trainer as trainer
from conftest import rows

# shards of 100 documents (about 190 train windows of 64 tokens each); 220 steps of 8 windows read about ten
TINY = dict(vocab_size=512, batch_size=8, block_size=64, n_embd=32, n_head=2, n_layer=1, max_steps=220,
            warmup_steps=2, eval_every=55, eval_steps=2, log_every=1, ckpt_every=55, keep_ckpts=5,
            tensorboard=False, schedule='wsd', decay_frac=0.0, deterministic=True, val_ratio=0.2)


@pytest.fixture(scope='module')
def corpus(ws, tmp_path_factory):
    p = tmp_path_factory.mktemp('corpus')/'docs.jsonl'
    docs = itertools.islice(builtin_docs(), 100, 2600)  # past pydoc's long topics
    p.write_text(''.join(json.dumps(dict(text=t)) + '\n' for t in docs))
    return p


@pytest.fixture
def held_back(monkeypatch):
    """Train token files after the first two wait until the run's first step is done, then come slowly: the
    run must start without them, and a stop finds the preparation going on."""
    started, orig_tok, orig_log = threading.Event(), stream.tokenize_split, trainer.log_startup
    def tokenize(shard_dir, tk, out_dir, **kw):
        m = read_manifest(out_dir) if Path(out_dir, 'manifest.json').is_file() else None
        if Path(out_dir).name == 'train' and m and len(m['files']) >= 2:
            assert started.wait(60), "the run never started"
            time.sleep(0.1)
        return orig_tok(shard_dir, tk, out_dir, **kw)
    def log_startup(r):
        orig_log(r)
        started.set()
    monkeypatch.setattr(stream, 'tokenize_split', tokenize)
    monkeypatch.setattr(trainer, 'log_startup', log_startup)
    monkeypatch.setenv('SHARD_LINES', '100')
    monkeypatch.setattr(tokenizer, 'BPE_BYTES', 30_000)  # the tokenizer made after the first shard or so


def losses(run): return {r['step']: r['loss'] for r in rows(run) if r.get('loss') is not None}


def test_trains_while_preparing_and_resumes_exactly(ws, corpus, held_back):
    cfg = get_config('smoke', dict(TINY, dataset=str(corpus)))
    tokens = Path(ws)/'cache'/'shared'/'tokens'/'train'
    asked = []
    def stop_midway(line, *a, **k):  # once a held-back file is there: the run stops mid-preparation
        m = read_manifest(tokens) if (tokens/'manifest.json').is_file() else {}
        if str(line).startswith('step ') and len(m.get('files', [])) >= 3 and not asked:
            asked.append(request_stop(Path(ws)/'runs'/'b'))
    stopped = trainer.train(cfg, 'b', root=ws, log=stop_midway)
    first_step = RunDir(stopped['run_dir']).read_meta()['startup']['ended']
    m = read_manifest(tokens)
    made = sorted((tokens/f['name']).stat().st_mtime for f in m['files'])
    # the files after the first two were tokenized after the first step; the run stopped before its end
    assert stopped['stopped'] == 'SIGTERM' and stopped['step'] < 220 and first_step < made[-1]
    assert stream.train_windows(m, 64) < 220*8
    res = trainer.train(cfg, 'b', root=ws, log=lambda *a, **k: None)  # resumed: the preparation goes on too
    m = read_manifest(tokens)
    # only what the run reads: the corpus is not done, and its shards stop at the run's windows
    assert res['step'] == 220 and not m['complete'] and stream.train_windows(m, 64) >= 220*8
    assert stream.train_windows(dict(files=m['files'][:-1]), 64) < 220*8
    # the same run, its data there before it started: the same losses as the run stopped and resumed
    want = losses(trainer.train(cfg, 'a', root=ws, log=lambda *a, **k: None)['run_dir'])
    assert losses(res['run_dir']) == want and sorted(want) == list(range(1, 221))
    # and on the whole corpus, prepared beforehand: the same batches, so the same losses
    prepare_data(cfg, paths_for('a', root=ws))
    assert read_manifest(tokens)['complete']
    assert losses(trainer.train(cfg, 'c', root=ws, log=lambda *a, **k: None)['run_dir']) == want


def test_a_mixture_prepares_what_the_run_reads(tmp_path, corpus, monkeypatch):
    "Each source is sharded and tokenized only until its train tokens cover the run; a longer run goes on."
    from lmbook.data.mixture import open_mixture, sources_dir
    monkeypatch.setenv('SHARD_LINES', '100')
    cfg = get_config('smoke', dict(sources=f'builtin:0.5,corpus:{corpus}:0.5', vocab_size=512, block_size=64))
    paths, said = paths_for('mix', root=tmp_path), []
    short = prepare_data(cfg, paths, log=said.append, need=300)  # 300 windows: 19,200 tokens
    srcs, _ = open_mixture(short.train_tokens)
    shards = [read_manifest(p) for p in sources_dir(paths).glob('*/shards/train')]
    # at most two of the 74 and 25 shards of 100 documents
    assert len(shards) == 2 and all(not m['complete'] and len(m['shards']) <= 2 for m in shards)
    assert all(s.n_tokens >= 300*64 for s in srcs) and sum('cover the' in l for l in said) == 2
    longer = prepare_data(cfg, paths, need=3000)
    assert [s.n_tokens for s in open_mixture(longer.train_tokens)[0]] > [s.n_tokens for s in srcs]
    # the short run's data is a prefix of the longer one's: each source's first files
    assert all(s.n_tokens >= 3000*64 for s in open_mixture(longer.train_tokens)[0])
