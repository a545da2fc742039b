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


def test_a_disk_that_fills_while_preparing_in_the_background_is_one_line(tmp_path, corpus, held_back,
                                                                        monkeypatch, capsys):
    """The background preparation finds the disk full after two train token files, while the run trains on
    them: `lmbook train` says so in one line and exits 2 as on any user error, leaves no temporary file, and
    the same command then continues the preparation from its whole files and the run from its checkpoint."""
    import errno
    from lmbook.cli import main
    from test_faults_data import FullDisk
    tokens = tmp_path/'cache'/'shared'/'tokens'/'train'
    args = ['train', '-p', 'smoke', '-e', 'full', '--root', str(tmp_path), '--set', f'dataset={corpus}',
            *[f'--set={k}={v}' for k, v in dict(TINY, max_steps=100, ckpt_every=20, eval_every=20).items()]]
    monkeypatch.setattr(tokenizer, 'open', FullDisk(tokens, 60_000).open, raising=False)
    assert main(args) == 2
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert (len(lines) == 1 and lines[0].startswith('error: no space left on device while sharding (')
            and 'of them tokenized)' in lines[0] and f'free space on the disk of {tmp_path} ' in lines[0]
            and 'rerun the same command to continue' in lines[0]), err
    assert 'Traceback' not in out + err
    assert not [f for f in tmp_path.rglob('*') if f.name.endswith('.tmp') or '.tmp-' in f.name]
    kept = {f: f.stat().st_ino for f in tokens.glob('*.bin')}
    run = tmp_path/'runs'/'full'
    assert len(kept) == 2 and 20 <= max(r['step'] for r in rows(run)) < 100  # it trained on the first two
    monkeypatch.setattr(tokenizer, 'open', open, raising=False)
    assert main(args) == 0
    out, _ = capsys.readouterr()
    assert 'resumed at step 40' in out, out[-2000:]
    assert all(f.stat().st_ino == ino for f, ino in kept.items())  # the rerun continued from the whole files
    assert max(r['step'] for r in rows(run)) == 100


def test_lmbook_prepare_prepares_what_the_profiles_run_reads(tmp_path, corpus, monkeypatch, capsys):
    "`lmbook prepare -p PROFILE` stops at the windows its run reads, saying so; `--all` prepares the rest."
    from lmbook.cli import main
    monkeypatch.setenv('SHARD_LINES', '100')
    args = ['prepare', '-p', 'smoke', '-e', 'prep', '--root', str(tmp_path), '-q', '--set',
            f'dataset={corpus}',
            'vocab_size=512', 'block_size=64', 'batch_size=8', 'max_steps=50', 'eval_steps=2']
    assert main(args) == 0
    out = capsys.readouterr().out
    assert 'what a run of smoke reads, 25,600 train tokens and 16 validation windows' in out, out
    m = read_manifest(tmp_path/'cache'/'shared'/'tokens'/'train')
    # of the 25 shards, those that hold the run's windows and the tokenizer's sample (4 characters a token)
    assert not m['complete'] and stream.train_windows(m, 64) >= 400 and len(m['files']) <= 6, m['files']
    assert main([*args, '--all']) == 0
    assert read_manifest(tmp_path/'cache'/'shared'/'tokens'/'train')['complete']


def test_the_pods_data_stage_prepares_what_the_run_reads(tmp_path, corpus, monkeypatch):
    """Boot's data stage (RUN_SHARD=1, or a pod of `lmbook pod prepare`) stops at the run's windows, saying
    so, and another node waits for those; RUN_PREPARE=all prepares all of the corpus."""
    from lmbook.pods.stages import BootOptions, stage_data, wait_for_data
    monkeypatch.setenv('SHARD_LINES', '100')
    ov = dict(dataset=str(corpus), vocab_size=512, block_size=64, batch_size=8, max_steps=50, eval_steps=2)
    o, paths, said = BootOptions.from_env(dict(RUN_CONFIG='smoke', RUN_EXPERIMENT='pod', RUN_PREPARE='1'),
                                          overrides=ov), paths_for('pod', root=tmp_path), []
    stage_data(o, paths, said.append, env={})
    assert any('what the run reads, 25,600 train tokens and 16 validation windows' in l for l in said)
    assert any(l.startswith('data: ') and 'train tokens of the 25,600 the run reads' in l for l in said), said
    m = read_manifest(token_dir(paths, 'train'))
    assert not m['complete'] and stream.train_windows(m, 64) >= 400 and len(m['files']) <= 6
    waited = []  # a second node on the same volume: what the run reads is there
    wait_for_data(paths, waited.append, timeout_s=5, poll_s=0.1, need=(400, 16), block_size=64)
    assert waited[-1] == 'stage 3/4 data: ready'
    with pytest.raises(ValueError, match='node 0 did not prepare'):  # not all of the corpus, though
        wait_for_data(paths, waited.append, timeout_s=0.3, poll_s=0.1)
    o = BootOptions.from_env(dict(RUN_CONFIG='smoke', RUN_EXPERIMENT='pod', RUN_PREPARE='all'), overrides=ov)
    assert o.prepare and o.prepare_all and o.shard
    stage_data(o, paths, said.append, env={})
    assert read_manifest(token_dir(paths, 'train'))['complete']


def _two_nodes(rank, port, ws):
    "Rank `rank` as the first process of node `rank`: who prepares, on one volume and on two."
    import torch.distributed as dist
    from lmbook.data.loader import data_leader
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2)
    same = data_leader(Path(ws)/'cache', rank, 0)  # both nodes' workspace at the same path
    own = data_leader(Path(ws)/f'node{rank}'/'cache', rank, 0)  # each node's workspace at its own path
    (Path(ws)/f'rank{rank}.json').write_text(json.dumps([same, own]))
    dist.destroy_process_group()


def test_another_node_follows_node_0_on_a_shared_volume(tmp_path):
    """A node that sees node 0's data folder at the same path leaves the preparation to node 0 (its processes
    follow the shards as they appear); a node whose workspace is elsewhere prepares its own."""
    import socket, torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.spawn(_two_nodes, (port, str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path/f'rank{r}.json').read_text()) for r in (0, 1)]
    assert got == [[True, True], [False, True]]
    assert not list(tmp_path.rglob('.node0-*'))  # node 0's marks are gone
