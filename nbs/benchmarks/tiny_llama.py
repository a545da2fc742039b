"""Write a small random Llama (transformers folder: config.json, model.safetensors, tokenizer.json) that stands in for a
published model where the Hub cannot be reached: the tests, the finetune_published notebook's defaults, and the
CPU check of the 7B benchmark use it.
usage: python nbs/benchmarks/tiny_llama.py OUT_DIR [--vocab 512] [--layers 2] [--width 64] [--context 256]"""
import argparse
from pathlib import Path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig
from lmbook.sft import builtin_chat


def tiny_llama(out:Path, vocab:int=512, layers:int=2, width:int=64, context:int=256, seed:int=0) -> Path:
    "A random fp32 Llama with a byte-level BPE (<unk>, <s>, </s>) trained on the built-in chat records."
    out = Path(out); out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE()); tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [r['prompt'] + ' ' + r['response'] for r in builtin_chat()]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=['<unk>', '<s>', '</s>'],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(out/'tokenizer.json'))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2*width, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path)
    ap.add_argument('--vocab', type=int, default=512); ap.add_argument('--layers', type=int, default=2)
    ap.add_argument('--width', type=int, default=64); ap.add_argument('--context', type=int, default=256)
    a = ap.parse_args()
    print(tiny_llama(a.out, a.vocab, a.layers, a.width, a.context))
