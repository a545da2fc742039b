"""Published Llama-family checkpoints in and out: small random Llama (with Llama 3.1's RoPE scaling), Mistral
and Qwen2 (query/key/value biases) models made with transformers give the same logits as lmbook's import of
them, and lmbook's export of those again loads in transformers with the same logits; what lmbook cannot
compute is refused in one line naming it."""
import json
import pytest
import torch
from safetensors.torch import load_file, save_file
transformers = pytest.importorskip('transformers')
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from lmbook.config import Config
from lmbook.overrides import apply_overrides
from lmbook.model.gpt import GPT
from lmbook.runs.export import hf_config, hf_state_dict
from lmbook.model.hfimport import hf_model_config, hf_init_model

SHAPE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
LLAMA3 = dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
KINDS = {'llama': (LlamaConfig, dict(rope_parameters=LLAMA3, tie_word_embeddings=False)),
         'mistral': (MistralConfig, dict(sliding_window=None, tie_word_embeddings=False, rope_theta=1e6)),
         'qwen2': (Qwen2Config, dict(tie_word_embeddings=True))}


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    "A saved random model of each kind, fp32, with non-zero biases where it has them."
    out = {}
    for name, (cls, kw) in KINDS.items():
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cls(**SHAPE, **kw), dtype=torch.float32).eval()
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith('bias'): p.normal_(0, 0.5)
        out[name] = tmp_path_factory.mktemp(name)
        m.save_pretrained(out[name])
    return out


def logits(folder, idx):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(idx).logits


@pytest.mark.parametrize('kind', list(KINDS))
def test_import_then_export_keeps_logits(folders, kind, tmp_path):
    idx = torch.randint(0, 160, (2, 48), generator=torch.Generator().manual_seed(1))
    theirs = logits(folders[kind], idx)
    cfg = Config(model=hf_model_config(folders[kind]))
    assert cfg.model.qkv_bias == (kind == 'qwen2') and cfg.model.tie_embeddings == (kind == 'qwen2')
    ours = hf_init_model(cfg, folders[kind]).eval()
    with torch.no_grad(): got = ours(idx)
    assert (got - theirs).abs().max().item() <= 1e-4
    out = tmp_path/'out'; out.mkdir()
    save_file(hf_state_dict(ours.state_dict(), cfg.model), out/'model.safetensors',
              metadata=dict(format='pt'))
    (out/'config.json').write_text(json.dumps(hf_config(cfg.model, 0)))
    assert (logits(out, idx) - theirs).abs().max().item() <= 1e-4


def test_qlora_on_an_import_trains_adapters_only(folders):
    cfg = apply_overrides(Config(model=hf_model_config(folders['qwen2'])),
                          dict(lora_rank=4, quant='nf4', lora_targets='q,v', device='cpu'))
    m = hf_init_model(cfg, folders['qwen2'])
    idx = torch.randint(0, 160, (2, 33))
    m(idx[:, :-1], idx[:, 1:]).backward()
    grads = {n for n, p in m.named_parameters() if p.grad is not None}
    assert grads and all(n.endswith(('lora_A', 'lora_B')) for n in grads)
    assert all(n.endswith('attn.c_attn.lora_A') or n.endswith('attn.c_attn.lora_B') for n in grads)


@pytest.mark.parametrize('change, named', [
    (dict(sliding_window=16),
     'sliding_window=16'), (dict(rope_parameters=dict(rope_type='yarn', rope_theta=1e4, factor=4.0)),
                            "'yarn'"),
    (dict(attention_bias=True), 'attention_bias=true'), (dict(hidden_act='gelu'), 'hidden_act=gelu'),
    (dict(model_type='mixtral', num_local_experts=8), "'mixtral'"), (dict(head_dim=32), 'head_dim=32')])
def test_unknown_features_refused_by_name(folders, tmp_path, change, named):
    c = {**json.loads((folders['mistral']/'config.json').read_text()), **change}
    (tmp_path/'config.json').write_text(json.dumps(c))
    with pytest.raises(ValueError, match=named) as e: hf_model_config(tmp_path)
    assert '\n' not in str(e.value)


def test_qlora_finetune_then_export_bf16(tmp_path, workspace):
    "lmbook finetune --init-from hf:FOLDER with QLoRA, then lmbook export: a merged bf16 transformers model."
    import subprocess, sys
    from conftest import lmbook_cmd, ROOT
    from lmbook.data.sft import builtin_chat, write_jsonl
    from lmbook.runs.load import load_model
    subprocess.run([sys.executable, str(ROOT/'nbs/benchmarks/tiny_llama.py'), str(tmp_path/'tiny')],
                   check=True)
    write_jsonl(builtin_chat()[:30], tmp_path/'chat.jsonl')
    r = lmbook_cmd('finetune', '--init-from', f"hf:{tmp_path/'tiny'}", '--data', tmp_path/'chat.jsonl', '-e',
                   'q', '--lora-rank', 4, '--quant', 'nf4', '--lora-targets', 'q,k,v,o', '--max-steps', 4,
                   '--set', 'block_size=128', 'batch_size=2', 'act_ckpt=full', 'eval_every=2', 'device=cpu')
    assert r.returncode == 0, r.stdout + r.stderr
    r = lmbook_cmd('export', 'q', tmp_path/'out')
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path/'out'/'config.json').read_text())
    assert cfg['torch_dtype'] == 'bfloat16' and cfg['model_type'] == 'llama'
    ours = load_model('q').model
    idx = torch.randint(0, 512, (1, 16))
    with torch.no_grad(): want = ours(idx).float()
    got = logits(tmp_path/'out', idx)
    assert (got - want).abs().max().item() < 0.1  # bf16 weights
    ck = load_model('q').path  # the run kept its adapters only, and the peft files apply them to the base
    assert {k.rsplit('.', 1)[-1] for k in load_file(ck/'model.safetensors')} == {'lora_A', 'lora_B'}
    assert (logits_peft(tmp_path/'out', idx) - got).abs().max().item() < 0.1


def logits_peft(folder, idx):
    "peft's LoRA adapters of an export (`adapter/`) on the base beside them (`base/`)."
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(folder/'base', dtype=torch.float32)
    with torch.no_grad(): return PeftModel.from_pretrained(base, folder/'adapter').eval()(idx).logits


def test_lora_checkpoint_resume_and_peft_round_trip(tmp_path, workspace):
    """A LoRA fine-tune of hf:FOLDER checkpoints its adapters and their base's hash, resumes, and exports them
    for peft."""
    from conftest import lmbook_cmd
    from lmbook.dev.fixtures import tiny_llama
    from lmbook.data.sft import builtin_chat, write_jsonl
    from lmbook.runs.load import load_model
    tiny_llama(tmp_path/'tiny'); write_jsonl(builtin_chat()[:30], tmp_path/'chat.jsonl')
    args = ['finetune', '--init-from', f"hf:{tmp_path/'tiny'}", '--data', tmp_path/'chat.jsonl', '-e', 'l',
            '--lora-rank', 4,
            '--lora-targets', 'q,k,v,o,mlp', '--set', 'block_size=128', 'batch_size=2', 'eval_every=2',
            'ckpt_every=2', 'device=cpu', 'lr=1e-2']
    r = lmbook_cmd(*args, '--max-steps', 2)
    assert r.returncode == 0, r.stdout + r.stderr
    ck = load_model('l').path
    state = json.loads((ck/'state.json').read_text())
    assert state['base']['path'] == str((tmp_path/'tiny').resolve()) and len(state['base']['sha256']) == 64
    assert (ck/'model.safetensors').stat().st_size < 200_000  # adapters, not the base
    r = lmbook_cmd(*args, '--max-steps', 4)
    assert r.returncode == 0 and 'resumed at step 2' in r.stdout, r.stdout + r.stderr
    r = lmbook_cmd('export', 'l:best', tmp_path/'out')
    assert r.returncode == 0 and "peft's format" in r.stdout, r.stderr
    idx = torch.randint(0, 512, (1, 16))
    with torch.no_grad(): ours = load_model('l:best').model(idx)
    merged = logits(tmp_path/'out', idx)
    assert (merged - ours).abs().max().item() < 1e-4
    assert (logits_peft(tmp_path/'out', idx) - ours).abs().max().item() < 1e-4
    assert (logits(tmp_path/'out'/'base', idx) - ours).abs().max().item() > 1e-3  # the adapters trained
    cfg_file = tmp_path/'tiny'/'config.json'
    cfg_file.write_text(cfg_file.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" '))
    r = lmbook_cmd('sample', 'l', 'Hi', '--device', 'cpu')  # a base that changed is refused in one line
    assert r.returncode == 2 and 'has changed since' in r.stderr and r.stderr.count('\n') == 1, r.stderr


def test_nf4_layout_is_bitsandbytes():
    """lmbook's 4-bit weights are bitsandbytes' own: the same bytes from its quantize_4bit, the same weights
    from its dequantize."""
    bf = pytest.importorskip('bitsandbytes.functional')
    from lmbook.model.lora import nf4_quantize, nf4_dequantize
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(0))
    packed, absmax = nf4_quantize(w)
    q, st = bf.quantize_4bit(w, blocksize=64, quant_type='nf4', compress_statistics=False)
    assert torch.equal(q.flatten(), packed) and torch.equal(st.absmax, absmax)
    assert torch.equal(bf.dequantize_4bit(q, st), nf4_dequantize(packed, absmax, w.shape))
