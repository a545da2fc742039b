"""Weights & Biases as a run uses it, offline: the run folder keeps the W&B run with the config, entity, group
and tags it was given (by config fields or by W&B's own variables) and its metrics; a resume goes on with the
same W&B run id; the run ends by printing the `wandb sync` command that uploads it."""
import json, shlex, struct
from pathlib import Path
import pytest
from lmbook.profiles import get_config
from lmbook.runs.metrics import wandb_start
from lmbook.train.trainer import train
from conftest import rows

wandb = pytest.importorskip('wandb')  # the wandb extra (the dev extra installs it)
from wandb.proto import wandb_internal_pb2 as pb

TINY = dict(take=2000, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=2, eval_steps=1,
            log_every=1, max_steps=3, warmup_steps=1, ckpt_every=3, tensorboard=False, wandb='lmbook-tests')
def cfg(**kw): return get_config('smoke', {**TINY, **kw})
def quiet(lines): return lambda *a, **k: lines.append(' '.join(map(str, a)))


@pytest.fixture
def wb(tmp_path, monkeypatch):
    "W&B's own folders in the test's, offline unless a test says otherwise, and none of its variables set."
    for k in ('WANDB_ENTITY', 'WANDB_RUN_GROUP', 'WANDB_TAGS', 'WANDB_PROJECT', 'WANDB_API_KEY',
              'WANDB_RUN_ID'):
        monkeypatch.delenv(k, raising=False)
    for k in ('WANDB_DIR', 'WANDB_CONFIG_DIR', 'WANDB_CACHE_DIR', 'WANDB_DATA_DIR', 'WANDB_ARTIFACT_DIR'):
        monkeypatch.setenv(k, str(tmp_path/'wandb-home'/k.lower()))
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')


def records(path:Path):
    "The records of a W&B run file (`run-ID.wandb`: a LevelDB-style log of 32 KiB blocks of protobufs)."
    data, pos, block, buf = path.read_bytes(), 7, 32768, b''  # after the 7-byte header ':W&B', magic, version
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack('<IHB', data[pos:pos + 7])
        if kind == 0: break
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk  # full or first; middle and last go on
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            yield r


def offline_run(folder:Path) -> dict:
    "What an offline W&B run folder holds: the run's id, entity, project, group, tags, config and history."
    (f,) = folder.glob('run-*.wandb')
    out = dict(history=[])
    for r in records(f):
        kind = r.WhichOneof('record_type')
        if kind == 'run':
            config = {u.key: json.loads(u.value_json) for u in r.run.config.update}
            out.update(id=r.run.run_id, entity=r.run.entity, project=r.run.project, group=r.run.run_group,
                       tags=list(r.run.tags), config=config)
        if kind == 'history':
            out['history'].append({i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json)
                                   for i in r.history.item})
    return out


def synced(lines:list[str]) -> list[Path]:
    "The folders the run's `wandb sync` lines name."
    return [Path(shlex.split(l.split('upload it with: ', 1)[1])[2]) for l in lines if 'wandb sync' in l]


def test_an_offline_run_keeps_its_w_and_b_run_and_a_resume_goes_on_with_it(ws, wb):
    said = []
    res = train(cfg(wandb_entity='lmbook-team', wandb_group='sweep-1', wandb_tags='smoke,ci'), 'wb', root=ws,
                log=quiet(said))
    run_dir = Path(res['run_dir'])
    (first,) = synced(said)
    assert first.parent == run_dir/'wandb' and first.name.startswith('offline-run-') and first.is_dir()
    r = offline_run(first)
    assert (r['entity'], r['project'], r['group'], r['tags']) == ('lmbook-team', 'lmbook-tests', 'sweep-1',
                                                                  ['smoke', 'ci'])
    assert r['id'].startswith('wb-') and first.name.endswith(r['id'])
    assert r['config']['train']['sched']['max_steps'] == 3 and r['config']['model']['n_embd'] == 64
    assert [h['_step'] for h in r['history']] == [x['step'] for x in rows(run_dir)] == [0, 1, 2, 3]
    assert [h.get('loss') for h in r['history']] == [x.get('loss') for x in rows(run_dir)]
    assert all(('val_loss' in h) == ('val_loss' in x) for h, x in zip(r['history'], rows(run_dir)))
    said.clear()
    train(cfg(max_steps=5, wandb_entity='lmbook-team', wandb_group='sweep-1', wandb_tags='smoke,ci'), 'wb',
          root=ws, log=quiet(said))
    (second,) = synced(said)
    again = offline_run(second)
    assert second != first and again['id'] == r['id']  # the same W&B run, in a folder of this start's
    assert [h['_step'] for h in again['history']][0] == 4


def test_w_and_b_variables_fill_what_the_config_leaves_empty(ws, wb, monkeypatch):
    for k, v in dict(WANDB_ENTITY='env-team', WANDB_RUN_GROUP='env-group', WANDB_TAGS='a,b',
                     WANDB_MODE='online').items():
        monkeypatch.setenv(k, v)
    said = []
    train(cfg(max_steps=1, wandb_mode='offline'), 'wb-env', root=ws, log=quiet(said))  # the field wins
    r = offline_run(synced(said)[0])
    assert (r['entity'], r['group'], r['tags']) == ('env-team', 'env-group', ['a', 'b'])


def test_without_wandb_or_a_login_the_run_goes_on(monkeypatch):
    said = []
    monkeypatch.setattr(wandb, 'init', lambda **kw: (_ for _ in ()).throw(
        wandb.errors.UsageError('No API key configured. Use `wandb login` to log in.')))
    assert wandb_start(dict(project='p'), said.append) is None
    monkeypatch.setitem(__import__('sys').modules, 'wandb', None)  # as if it were not installed
    assert wandb_start(dict(project='p'), said.append) is None
    assert said[0].startswith('warning: W&B did not start (No API key configured.')
    assert said[1].startswith('wandb is not installed: pip install wandb')
