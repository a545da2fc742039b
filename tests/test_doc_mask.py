"""Per-document attention where FlexAttention is missing (torch before 2.5, as on older pod images): the SDPA
mask, or a clear refusal."""
import pytest
import torch
import lmbook.model.gpt as model
from lmbook.config import ModelConfig


def test_without_flex_attention(monkeypatch):
    monkeypatch.setattr(model, 'flex', lambda: {})  # a torch without FlexAttention (before 2.5)
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    x = torch.tensor([[0, 5, 6, 0, 7, 8, 9, 0]])
    m = model.GPT(cfg)
    # flex asked for: the SDPA mask instead
    loss = m(x[:, :-1], x[:, 1:], mask=model.doc_mask(x[:, :-1], 0, 'flex'))
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"attn_backend='flex' needs FlexAttention, which torch .* lacks "
                                         r".*use attn_backend='sdpa'"):
        model.GPT(ModelConfig(**{**vars(cfg), 'attn_backend': 'flex'}))
