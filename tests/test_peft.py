"""A LoRA run's adapters written in peft's format: `PeftModel.from_pretrained` puts them on the published
Llama and gives lmbook's logits (all projections, a partial set whose fused blocks need cutting, alpha !=
rank); a swapped block or a wrong scale would show."""
import json
import pytest
import torch
transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')
from transformers import AutoModelForCausalLM
from peft import PeftModel
from lmbook.config import Config
from lmbook.overrides import apply_overrides
from lmbook.model.hfimport import hf_model_config, hf_init_model, hf_tokenizer
from lmbook.dev.fixtures import tiny_llama
from lmbook.runs.export import write_peft_adapter

VOCAB, RANK, ALPHA = 512, 4, 12.0  # tiny_llama's published vocabulary; alpha/rank = 3


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp('tiny'), vocab=VOCAB)


def adapted(folder, targets):
    "lmbook's model of `folder` with LoRA on `targets`, every adapter random and non-zero, and its config."
    m = hf_model_config(folder, 64, hf_tokenizer(folder)[0].vocab_size)  # + the tokens lmbook adds
    cfg = apply_overrides(Config(model=m), dict(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets))
    model = hf_init_model(cfg, folder, 'cpu').eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            # B starts at zero: that would hide a wrong block
            if n.endswith(('lora_A', 'lora_B')): p.normal_(0, 0.3)
    assert m.vocab_size > VOCAB
    return model, cfg


def peft_logits(folder, adapter_dir, idx):
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad(): return PeftModel.from_pretrained(base, adapter_dir).eval()(idx).logits


@pytest.mark.parametrize('targets', ['q,k,v,o,mlp', 'q,v', 'k,o,mlp'])
def test_peft_loads_lmbooks_adapters(folder, tmp_path, targets):
    model, cfg = adapted(folder, targets)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): ours = model(idx)[..., :VOCAB].float()
    out = write_peft_adapter(tmp_path/'adapter', model.state_dict(), cfg.model, RANK, ALPHA, targets,
                             str(folder))
    assert sorted(p.name for p in out.iterdir()) == ['adapter_config.json', 'adapter_model.safetensors']
    got = peft_logits(folder, out, idx)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad(): plain = base(idx).logits
    assert (ours - plain).abs().max().item() > 0.1  # the adapters matter, so a mistake in them would show
    assert (got - ours).abs().max().item() < 1e-4


def test_a_swapped_block_or_wrong_scale_shows(folder, tmp_path):
    """The comparison above is sharp enough: gate and up's adapters exchanged, or alpha misread, change the
    logits."""
    model, cfg = adapted(folder, 'q,k,v,o,mlp')
    idx = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(): ours = model(idx)[..., :VOCAB].float()
    sd = dict(model.state_dict())
    A = sd['h.0.mlp.c_fc.lora_A']
    sd['h.0.mlp.c_fc.lora_A'] = torch.cat([A[RANK:], A[:RANK]])  # same shapes, wrong parts
    swapped = write_peft_adapter(tmp_path/'swapped', sd, cfg.model, RANK, ALPHA, 'q,k,v,o,mlp')
    assert (peft_logits(folder, swapped, idx) - ours).abs().max().item() > 1e-2
    scaled = write_peft_adapter(tmp_path/'scaled', model.state_dict(), cfg.model, RANK, RANK, 'q,k,v,o,mlp')
    assert (peft_logits(folder, scaled, idx) - ours).abs().max().item() > 1e-2


def test_config_is_what_peft_reads(folder, tmp_path):
    model, cfg = adapted(folder, 'q,v')
    out = write_peft_adapter(tmp_path/'a', model.state_dict(), cfg.model, RANK, ALPHA, 'q,v', 'me/tiny-llama')
    c = peft.PeftConfig.from_pretrained(out)
    assert (c.peft_type, c.task_type, c.r, c.lora_alpha, set(c.target_modules)) == ('LORA', 'CAUSAL_LM', RANK,
                                                                                    ALPHA,
                                                                                     {'q_proj', 'v_proj'})
    assert json.loads((out/'adapter_config.json').read_text())['base_model_name_or_path'] == 'me/tiny-llama'


def test_lmbook_lora_trains_as_peft_does(tmp_path):
    """LoRA without 4-bit (bitsandbytes has no CPU path) at a tiny Llama shape, in float32 on the CPU: peft,
    trained on the rows lmbook trained on, in its order, from its initial adapters, with its optimizer,
    learning rate and clipping, gives each step's loss within 0.01% of lmbook's. The benchmark's own code
    (`qlora_7b.py`), whose 4-bit row on a GPU asks 2% at 7B."""
    import argparse, sys
    from conftest import ROOT
    from lmbook.data.sft import builtin_chat, write_jsonl
    sys.path.insert(0, str(ROOT/'nbs'/'benchmarks'))
    import qlora_7b as q
    folder = q.make_model(tmp_path/'model', q.SHAPE_TINY, 'cpu')
    data = write_jsonl(builtin_chat(), tmp_path/'chat.jsonl')
    a = argparse.Namespace(seq=128, steps=30, warmup=1, lr=1e-2, device='cpu', compile='auto')
    q.run_lmbook(folder, data, a, 'none', 'none', tmp_path/'record')
    r = q.run_parity(folder, tmp_path/'record', 'cpu', quant=False)
    assert r['lr_constant'] and r['steps'] == 30 and r['loss_last'] < r['loss_first'] - 0.1, r  # it learns
    assert r['parity_max_rel'] < 1e-4, r
