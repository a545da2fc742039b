"""Sharded checkpoints under FSDP2 (torchrun, 2 gloo ranks on the CPU): every rank writes its part, the run
resumes from them exactly, a full checkpoint from before still resumes, a damaged part is found, and one
process resumes, samples, exports and evaluates from the parts; a LoRA run's parts hold only its adapters."""
import json, shutil
from pathlib import Path
import pytest
import torch
from safetensors.torch import load_file
from conftest import rows
from lmbook.profiles import get_config
from lmbook.distributed import check_parallel
from lmbook.train.launch import spawn
from lmbook.train.trainer import train
from lmbook.train.eval import evaluate
from lmbook.config import ModelConfig
from lmbook.model.gpt import GPT
from lmbook.runs.checkpoint.formats import MODEL_SHARDS, OPTIM_SHARDS, CheckpointSpaceError, is_sharded
from lmbook.runs.checkpoint.formats import read_shards, verify_checkpoint
from lmbook.runs.checkpoint.resume import latest_checkpoint
from lmbook.runs.checkpoint.checkpointer import Checkpointer
from lmbook.runs.find import find_checkpoint
from lmbook.model.generate import generate
from lmbook.runs.load import load_model
from lmbook.runs.export import export_hf

def _fsdp_cpu_ok():
    try: check_parallel('fsdp', 'cpu'); return True
    except ValueError: return False
pytestmark = pytest.mark.skipif(not _fsdp_cpu_ok(), reason='FSDP2 on the CPU needs torch >= 2.6')

# 2 processes x batch 4; 'wsd' without decay keeps lr constant after warmup, so a longer rerun continues the
# same schedule
TINY = dict(take=2000, block_size=64, n_embd=64, n_head=2, eval_every=2, eval_steps=2, log_every=1,
            max_steps=4, warmup_steps=2, ckpt_every=2, keep_ckpts=3, tensorboard=False, batch_size=4,
            schedule='wsd', decay_frac=0.0, parallel='fsdp')
def losses(run): return {r['step']: r['loss'] for r in rows(run) if r.get('loss') is not None}
def ckdir(ws, exp): return Path(ws)/'runs'/exp/'checkpoints'
def quiet(*a): pass

def two(ws, exp, **kw) -> str:
    "A run of `exp` under torchrun with 2 FSDP2 processes; its output."
    out = ''.join(spawn('smoke', exp, {**TINY, **kw}, nproc=2, root=ws))
    assert '2 process(es)' in out, out[-3000:]
    return out

@pytest.fixture(scope='module')
def sh(ws):
    """8 steps written as full checkpoints (as before sharded ones existed); then the run resumed from step 4,
    writing sharded ones at 6 and 8; then resumed again from step 6's parts."""
    two(ws, 'sh', ckpt_format='full', max_steps=8)
    straight = losses(Path(ws)/'runs'/'sh')
    for s in (6, 8): shutil.rmtree(ckdir(ws, 'sh')/f'step_{s:08d}')
    first = two(ws, 'sh', max_steps=8)
    from_full = losses(Path(ws)/'runs'/'sh')
    shutil.rmtree(ckdir(ws, 'sh')/'step_00000008')
    again = two(ws, 'sh', max_steps=8)
    return dict(first=first, again=again, straight=straight, from_full=from_full, ck=ckdir(ws, 'sh'))

def test_full_checkpoint_resumes_then_each_rank_writes_its_part(sh):
    assert 'resumed at step 4' in sh['first']
    assert sh['from_full'] == sh['straight'] and sorted(sh['straight']) == list(range(1, 9))
    ck = sh['ck']
    assert (ck/'step_00000004'/'model.safetensors').is_file() and not is_sharded(ck/'step_00000004')
    for step in (6, 8):
        path = ck/f'step_{step:08d}'
        files = verify_checkpoint(path)['files']  # every part hashed in the manifest
        for part in (MODEL_SHARDS, OPTIM_SHARDS):
            assert {f'{part}/.metadata', f'{part}/__0_0.distcp', f'{part}/__1_0.distcp'} <= files.keys()
        assert {'rank0.pt', 'rank1.pt', 'state.json'} <= files.keys() and 'model.safetensors' not in files
        st = json.loads((path/'state.json').read_text())
        assert (st['format'], st['world_size'], st['step']) == ('sharded', 2, step)
    assert verify_checkpoint(ck/'best')['files'].keys() >= {f'{MODEL_SHARDS}/__1_0.distcp', 'rank1.pt'}

def test_resume_from_parts_is_exact(sh):
    assert 'resumed at step 6' in sh['again']
    assert losses(sh['ck'].parent) == sh['straight']

def test_damaged_part_is_found(sh, tmp_path):
    ck = shutil.copytree(sh['ck'], tmp_path/'checkpoints')
    part = ck/'step_00000008'/MODEL_SHARDS/'__1_0.distcp'
    b = bytearray(part.read_bytes())
    b[len(b)//2] ^= 0xFF
    part.write_bytes(bytes(b))
    said = []
    assert latest_checkpoint(ck, warn=said.append).name == 'step_00000006'
    assert said and f'{MODEL_SHARDS}/__1_0.distcp does not match its sha256' in said[0]
    assert find_checkpoint(ck, warn=said.append).name == 'step_00000006'

def test_one_process_samples_exports_and_evaluates_from_parts(ws, sh, tmp_path):
    lm = load_model('sh', root=ws)
    assert lm.path.name == 'step_00000008' and is_sharded(lm.path)
    sd = read_shards(lm.path/MODEL_SHARDS)
    assert all(torch.equal(sd[k], v) for k, v in lm.model.state_dict().items() if k in sd)
    ids = generate(lm.model, torch.tensor([lm.tokenizer.encode('The')]), 8, temperature=0)
    assert ids.shape == (1, 9)
    out = export_hf('sh', tmp_path/'hf', root=ws)
    assert torch.equal(load_file(out/'model.safetensors')['model.embed_tokens.weight'], sd['wte.weight'])
    # the run's own validation set, on one process as on the run's two
    res = evaluate('sh', root=ws, device='cpu', hellaswag=False)
    val = [r['val_loss'] for r in rows(Path(ws)/'runs'/'sh') if r.get('step') == 8 and 'val_loss' in r]
    assert res['step'] == 8 and abs(res['val_loss'] - val[-1]) < 1e-4, (res, val)

def test_one_process_resumes_from_two_ranks_parts(ws, sh):
    shutil.copytree(Path(ws)/'runs'/'sh', Path(ws)/'runs'/'sh1', ignore=shutil.ignore_patterns('.lock'))
    log = []
    train(get_config('smoke', {**TINY, 'max_steps': 10}), 'sh1', root=ws,
          log=lambda *a: log.append(' '.join(map(str, a))))
    said = 'written by 2 process(es), this run has 1: model and optimizer are resharded'
    assert any(said in l for l in log)
    assert any('resumed at step 8' in l for l in log)
    got = losses(Path(ws)/'runs'/'sh1')
    assert sorted(got) == list(range(1, 11)) and abs(got[9] - got[8]) < 0.3  # trained on, not started over
    # the same tokens a step as on 2 processes (2 x 4 x 64): one process accumulates twice
    assert any('grad_accum 1 -> 2 keeps 512 tokens a step' in l for l in log), log
    assert json.loads((Path(ws)/'runs'/'sh1'/'meta.json').read_text())['tokens_per_step'] == 512
    assert [r['tokens'] for r in rows(Path(ws)/'runs'/'sh1') if r.get('loss')][-2:] == [9*512, 10*512]

def test_lora_parts_hold_only_adapters(ws, sh):
    out = two(ws, 'shlora', init_from='sh', lora_rank=4, lora_targets='q,v', max_steps=2)
    path = ckdir(ws, 'shlora')/'step_00000002'
    assert is_sharded(path) and 'done: 2 steps' in out
    keys = sorted(read_shards(path/MODEL_SHARDS))
    assert keys and all(k.endswith(('lora_A', 'lora_B')) for k in keys), keys
    lm = load_model('shlora', root=ws)  # the base read again from its own parts, the adapters merged in
    assert lm.path == path and Path(lm.state['base']['path']) == ckdir(ws, 'sh')/'step_00000008'

def test_no_room_for_parts_is_one_line_and_nothing_written(tmp_path, monkeypatch):
    model = GPT(ModelConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32))
    opt, said = torch.optim.AdamW(model.parameters()), []
    ck = Checkpointer(tmp_path, every=1, fmt='sharded', log=said.append)
    ck.save(1, model, opt, dict(tokens=0))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, 'disk_usage', lambda p: usage._replace(free=1000))
    with pytest.raises(CheckpointSpaceError, match='no space for checkpoint step_00000002'):
        ck.save(2, model, opt, dict(tokens=0))
    ck.save(3, model, opt, dict(tokens=0), best=1.0, periodic=False)  # best/ alone: a warning
    assert len(said) == 1 and said[0].startswith('warning: best/ not written at step 3'), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ['step_00000001']
