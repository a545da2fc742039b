"`lmbook export --format hf`: transformers loads the folder offline with lmbook's logits (both flavours); nothing half-written; no upload without a token; GPT-2 weights in."
import json, os
from pathlib import Path
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel
from lmbook.core import paths_for
from lmbook.config import get_config, config_dict
from lmbook.checkpoint import save_checkpoint, tokenizer_ref
from lmbook.tokenizer import train_bpe, save_bundle
from lmbook.model import GPT
from lmbook.sample import load_model
from lmbook import export
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
    save_checkpoint(paths.checkpoints, 3, m, torch.optim.AdamW(m.parameters()),
                    dict(tokens=0, config=config_dict(cfg), tokenizer=tokenizer_ref(paths.tokenizer)))
    return exp

@pytest.mark.parametrize('kw', [dict(arch='gpt2'), dict(arch='llama', n_kv_head=2, tie_embeddings=False)])
def test_export_roundtrip_through_transformers(workspace, kw):
    exp = tiny_run(workspace, f"e-{kw['arch']}", **kw)
    out = workspace/'hf'/exp
    r = lmbook_cmd('export', exp, out, '--format', 'hf')
    assert r.returncode == 0, r.stderr
    assert {'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'} <= {p.name for p in out.iterdir()}
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
    with pytest.raises(ValueError, match='no Hugging Face token'): export.push_to_hub(workspace/'hf'/'m', 'me/tiny')
    assert calls == []
    r = lmbook_cmd('export', exp, workspace/'hf'/'m2', '--push-to-hub', 'me/tiny', env=dict(HF_HOME=str(tmp_path/'hf_home')))
    assert r.returncode == 2 and 'no Hugging Face token' in r.stderr and not (workspace/'hf'/'m2').exists()

def test_gpt2_weights_in(tmp_path):
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('.bias'): p.zero_()
            elif n.endswith('ln_1.weight') or n.endswith('ln_f.weight'): p.add_(0.1*torch.randn_like(p))
    snap = tmp_path/'hub'/'models--me--tiny-gpt2'  # laid out as the Hugging Face cache keeps a download
    hf.save_pretrained(snap/'snapshots'/'abc123')
    (snap/'refs').mkdir(); (snap/'refs'/'main').write_text('abc123')
    folder = export.find_hf_model('me/tiny-gpt2', tmp_path/'hub')
    with pytest.raises(FileNotFoundError, match='has no tokenizer.json'): export.hf_tokenizer_json('me/tiny-gpt2', tmp_path/'hub')
    (folder/'tokenizer.json').write_text('{}')
    assert export.hf_tokenizer_json('me/tiny-gpt2', tmp_path/'hub') == folder/'tokenizer.json'
    m, sd = export.gpt2_from_hf(folder)
    ours = GPT(m).eval(); ours.load_state_dict(sd)
    x = torch.randint(0, 100, (2, 16))
    with torch.no_grad(): assert torch.allclose(ours(x), hf(x).logits, atol=1e-4)
    with torch.no_grad(): hf.transformer.h[0].mlp.c_fc.bias[3] = 0.5
    hf.save_pretrained(tmp_path/'biased')
    with pytest.raises(ValueError, match=r'bias terms \(largest \|h.0.mlp.c_fc.bias\| = 0.5\)'): export.gpt2_from_hf(tmp_path/'biased')

def test_gpt2_not_in_cache(tmp_path):
    with pytest.raises(FileNotFoundError, match='not in the local Hugging Face cache'): export.find_hf_model('openai-community/gpt2', tmp_path)

def test_bfloat16_export(workspace):
    exp = tiny_run(workspace, 'e-bf16')
    r = lmbook_cmd('export', exp, workspace/'hf'/'bf16', '--dtype', 'bfloat16')
    assert r.returncode == 0, r.stderr
    hf = AutoModelForCausalLM.from_pretrained(workspace/'hf'/'bf16', local_files_only=True)
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert (workspace/'hf'/'bf16'/'model.safetensors').stat().st_size < 0.6*sum(p.numel()*4 for p in load_model(exp).model.parameters())
