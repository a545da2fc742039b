"""`lmbook export --format hf`: transformers loads the folder offline with lmbook's logits (both flavours);
nothing half-written; no upload without a token; GPT-2 weights in."""
import json, os
from pathlib import Path
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel
from lmbook.core import paths_for
from lmbook.rundir import RunDir
from lmbook.config import config_dict
from lmbook.profiles import get_config
from lmbook.runs.checkpoint.formats import tokenizer_ref
from lmbook.runs.checkpoint.writer import save_checkpoint
from lmbook.data.tokenizer import train_bpe, save_bundle
from lmbook.model.gpt import GPT
from lmbook.runs.load import load_model
from lmbook.runs import export
from lmbook.model import hfimport
from conftest import lmbook_cmd

TEXT = 'The cat ate the mat. The dog sat on the bone.'

def tiny_run(ws, exp, **kw):
    "A checkpoint of a tiny random model (norm weights perturbed) with its tokenizer."
    paths = paths_for(exp, root=ws)
    save_bundle(train_bpe(['The cat sat on the mat. The dog ate the bone.']*50, 300), paths.tokenizer)
    cfg = get_config('smoke', dict(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=32, **kw))
    torch.manual_seed(1); m = GPT(cfg.model)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1: p.add_(0.1*torch.randn_like(p))
    save_checkpoint(RunDir(paths.run).checkpoints, 3, m, torch.optim.AdamW(m.parameters()),
                    dict(tokens=0, config=config_dict(cfg), tokenizer=tokenizer_ref(paths.tokenizer)))
    return exp

@pytest.mark.parametrize('kw',
                         [dict(arch='gpt2'), dict(arch='gpt2', bias=True),
                          dict(arch='llama', n_kv_head=2, tie_embeddings=False)])
def test_export_roundtrip_through_transformers(workspace, kw):
    exp = tiny_run(workspace, f"e-{kw['arch']}", **kw)
    out = workspace/'hf'/exp
    r = lmbook_cmd('export', exp, out, '--format', 'hf')
    assert r.returncode == 0, r.stderr
    assert ({'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'}
            <= {p.name for p in out.iterdir()})
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == ('GPT2LMHeadModel' if kw['arch'] == 'gpt2' else 'LlamaForCausalLM')
    lm = load_model(exp)
    ids = AutoTokenizer.from_pretrained(out, local_files_only=True)(TEXT, add_special_tokens=False).input_ids
    assert ids == lm.tokenizer.encode(TEXT)
    with torch.no_grad():
        a, b = hf(torch.tensor([ids])).logits[0], lm.model(torch.tensor([ids]))[0]
    assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4), (a - b).abs().max()

def test_nothing_half_written(workspace, monkeypatch):
    exp = tiny_run(workspace, 'e-fail')
    def boom(*a, **k): raise OSError(28, 'No space left on device')
    real = export.write_tokenizer
    monkeypatch.setattr(export, 'write_tokenizer', boom)
    with pytest.raises(OSError): export.export_hf(exp, workspace/'hf'/'out')
    assert list((workspace/'hf').iterdir()) == []  # neither the folder nor a temporary one
    monkeypatch.setattr(export, 'write_tokenizer', real)
    export.export_hf(exp, workspace/'hf'/'out')
    with pytest.raises(ValueError, match='already exists'): export.export_hf(exp, workspace/'hf'/'out')
    export.export_hf(exp, workspace/'hf'/'out', overwrite=True)
    assert sorted(p.name for p in (workspace/'hf').iterdir()) == ['out']

def test_no_upload_without_token(workspace, monkeypatch, tmp_path):
    import huggingface_hub as hh
    exp = tiny_run(workspace, 'e-hub')
    monkeypatch.delenv('HF_TOKEN', raising=False)
    monkeypatch.setenv('HF_HOME', str(tmp_path/'hf_home'))  # no saved login there
    calls = []
    monkeypatch.setattr(hh.HfApi, 'upload_folder', lambda self, **kw: calls.append(kw))
    monkeypatch.setattr(hh.HfApi, 'create_repo', lambda self, *a, **kw: calls.append(kw))
    export.export_hf(exp, workspace/'hf'/'m')
    with pytest.raises(ValueError, match='no Hugging Face token'):
        export.push_to_hub(workspace/'hf'/'m', 'me/tiny')
    assert calls == []
    r = lmbook_cmd('export', exp, workspace/'hf'/'m2', '--push-to-hub', 'me/tiny',
                   env=dict(HF_HOME=str(tmp_path/'hf_home')))
    assert r.returncode == 2 and 'no Hugging Face token' in r.stderr and not (workspace/'hf'/'m2').exists()

def fake_hub(root, repo_dir, files:dict, rev='abc123'):
    """A Hugging Face cache under `root` holding `files` (name -> writer) for one repository, laid out as a
    download is."""
    snap = root/'hub'/repo_dir
    (snap/'snapshots'/rev).mkdir(parents=True); (snap/'refs').mkdir()
    (snap/'refs'/'main').write_text(rev)
    for name, write in files.items(): write(snap/'snapshots'/rev/name)
    return snap/'snapshots'/rev

def random_gpt2(seed=0, **kw):
    "A tiny random GPT2LMHeadModel with non-zero biases everywhere (transformers starts them at zero)."
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(**{**dict(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=4),
                                       **kw})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1: p.add_(0.1*torch.randn_like(p))
    return hf

def test_gpt2_weights_in(tmp_path, monkeypatch):
    """Published GPT-2's layout (biases everywhere) imports exactly from the local cache, under either of its
    Hub names."""
    monkeypatch.setenv('HF_HOME', str(tmp_path/'hf'))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path/'xdg'))
    hf = random_gpt2()
    folder = fake_hub(tmp_path/'hf', 'models--gpt2', {})
    hf.save_pretrained(folder)
    assert hfimport.hf_gpt2_folder('gpt2') == hfimport.hf_gpt2_folder('openai-community/gpt2') == folder
    m, sd = hfimport.gpt2_from_hf('gpt2')
    assert m.bias and m.vocab_size == 100 and m.mlp_hidden == 0
    ours = GPT(m).eval(); ours.load_state_dict(sd)
    x = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert torch.allclose(ours(x), hf(x).logits, atol=1e-4), (ours(x) - hf(x).logits).abs().max()
    m2, sd2 = hfimport.gpt2_from_hf(folder, vocab_size=128)  # room for added tokens: the extra rows are zeros
    assert m2.vocab_size == 128 and sd2['wte.weight'][100:].abs().sum() == 0
    wide = GPT(m2).eval(); wide.load_state_dict(sd2)
    with torch.no_grad():
        assert (torch.allclose(wide(x)[..., :100], hf(x).logits, atol=1e-4)
                and wide(x)[..., 100:].abs().max() == 0)
    folder_nb = tmp_path/'no-bias'
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('.bias'): p.zero_()
    hf.save_pretrained(folder_nb)
    assert not hfimport.gpt2_from_hf(folder_nb)[0].bias  # lmbook's own bias-free exports come back bias-free

def test_gpt2_import_export_roundtrip(tmp_path, workspace, monkeypatch):
    "GPT-2 imported, saved as an lmbook checkpoint and exported again is the same transformers model."
    hf = random_gpt2(1, vocab_size=300)
    hf.save_pretrained(tmp_path/'src')
    m, sd = hfimport.gpt2_from_hf(tmp_path/'src')
    paths = paths_for('from-gpt2', root=workspace)
    save_bundle(train_bpe(['The cat sat on the mat. The dog ate the bone.']*50, 300), paths.tokenizer)
    cfg = get_config('smoke',
                     dict(arch='gpt2', bias=True, vocab_size=300, block_size=16, n_layer=2, n_head=4,
                          n_embd=32))
    assert cfg.model == m
    model = GPT(m); model.load_state_dict(sd)
    save_checkpoint(RunDir(paths.run).checkpoints, 0, model, torch.optim.AdamW(model.parameters()),
                    dict(tokens=0, config=config_dict(cfg), tokenizer=tokenizer_ref(paths.tokenizer)))
    out = export.export_hf('from-gpt2', workspace/'hf'/'back')
    back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    a, b = hf.state_dict(), back.state_dict()
    assert {k for k in a if not k.endswith('attn.bias')} <= set(b)
    for k, v in a.items():
        if k in b: assert torch.equal(v, b[k]), k

def test_gpt2_not_in_cache(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match='not in the local Hugging Face cache'):
        hfimport.find_hf_model('openai-community/gpt2', tmp_path)
    monkeypatch.setenv('HF_HOME', str(tmp_path/'hf'))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path/'xdg'))
    with pytest.raises(FileNotFoundError,
                       match='huggingface-cli download gpt2 config.json model.safetensors'):
        hfimport.gpt2_from_hf('gpt2')
    # the tokenizer alone is not the weights
    fake_hub(tmp_path/'hf', 'models--gpt2', {'tokenizer.json': lambda p: p.write_text('{}')})
    with pytest.raises(FileNotFoundError, match='weights of gpt2 are not in the local'):
        hfimport.hf_gpt2_folder('gpt2')
    with pytest.raises(FileNotFoundError, match='is not a folder'): hfimport.gpt2_from_hf(tmp_path/'nope')

def test_bias_needs_gpt2():
    with pytest.raises(ValueError, match="bias=True is published GPT-2's layout: set arch='gpt2'"):
        get_config('smoke', dict(bias=True))
    r = lmbook_cmd('train', '--profile', 'smoke', '--set', 'bias=true')
    assert r.returncode == 2 and "set arch='gpt2'" in r.stderr

def test_bfloat16_export(workspace):
    exp = tiny_run(workspace, 'e-bf16')
    r = lmbook_cmd('export', exp, workspace/'hf'/'bf16', '--dtype', 'bfloat16')
    assert r.returncode == 0, r.stderr
    hf = AutoModelForCausalLM.from_pretrained(workspace/'hf'/'bf16', local_files_only=True)
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert ((workspace/'hf'/'bf16'/'model.safetensors').stat().st_size
            < 0.6*sum(p.numel()*4 for p in load_model(exp).model.parameters()))

def test_export_under_a_file(workspace):
    exp = tiny_run(workspace, 'e-file')
    (workspace/'a_file').write_text('not a folder')
    r = lmbook_cmd('export', exp, workspace/'a_file'/'sub')
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(err) == 1 and 'a_file is a file, not a folder' in err[0], r.stderr

# token-shaped, made here so no token-like literal sits in the repository
FAKE_HF = 'hf' + '_' + 'abcdefghijklmnopqrstuvwx'

def test_push_fails_after_the_export(workspace, monkeypatch, capsys):
    """Offline, the upload fails after the export is written: one line says so and how to retry; the retry
    keeps the export."""
    exp, out = tiny_run(workspace, 'e-offline'), workspace/'hf'/'offline'
    argv = ['export', exp, str(out), '--push-to-hub', 'me/tiny']
    r = lmbook_cmd(*argv, env=dict(HF_TOKEN=FAKE_HF, HF_HUB_OFFLINE='1'))
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(err) == 1 and 'Traceback' not in r.stderr, r.stderr
    assert (f'the export is on disk in {out}' in err[0] and 'upload to me/tiny failed' in err[0]
            and 'run the same command again' in err[0])
    assert (out/'config.json').is_file()
    written = (out/'model.safetensors').stat().st_mtime_ns
    import huggingface_hub as hh
    from lmbook.cli import main
    calls = []
    monkeypatch.setenv('HF_TOKEN', FAKE_HF)
    monkeypatch.setattr(hh.HfApi, 'create_repo', lambda self, *a, **kw: calls.append('create'))
    monkeypatch.setattr(hh.HfApi, 'upload_folder', lambda self, **kw: calls.append(kw['folder_path']))
    assert main(argv) == 0 and calls == ['create', str(out)]
    assert 'uploaded to https://huggingface.co/me/tiny' in capsys.readouterr().out
    assert (out/'model.safetensors').stat().st_mtime_ns == written  # only the upload ran again


def test_push_to_a_stand_in_hub(workspace, tmp_path):
    """huggingface_hub itself uploads the export to a local stand-in (HF_ENDPOINT): every file arrives, the
    token goes only"""
    "in the Authorization header, and no file anywhere under the workspace or HF_HOME holds it."
    from fake_hub import FakeHub
    exp, out, hub = tiny_run(workspace, 'e-hub'), workspace/'hf'/'hub', FakeHub()
    try:
        r = lmbook_cmd('export', exp, out, '--push-to-hub', 'me/tiny',
                       env=dict(HF_TOKEN=FAKE_HF, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path/'hfhome'),
                                HF_HUB_OFFLINE='0'))
    finally: hub.close()
    assert r.returncode == 0, r.stderr
    assert f'uploaded to {hub.url}/me/tiny' in r.stdout
    assert {p for (repo, p) in hub.files if repo == 'me/tiny'} == {f.name for f in out.iterdir()}
    assert hub.files[('me/tiny', 'model.safetensors')] == (out/'model.safetensors').read_bytes()
    assert f'Bearer {FAKE_HF}' in hub.auth
    for f in [*workspace.rglob('*'), *tmp_path.rglob('*')]:
        assert not f.is_file() or FAKE_HF.encode() not in f.read_bytes(), f
