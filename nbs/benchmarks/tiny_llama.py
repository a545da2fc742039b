"""Write a small random Llama (transformers folder: config.json, model.safetensors, tokenizer.json) that stands in for a
published model where the Hub cannot be reached (`lmbook.dev.fixtures.tiny_llama`).
usage: python nbs/benchmarks/tiny_llama.py OUT_DIR [--vocab 512] [--layers 2] [--width 64] [--context 256]"""
import argparse
from pathlib import Path
from lmbook.dev.fixtures import tiny_llama

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path)
    ap.add_argument('--vocab', type=int, default=512); ap.add_argument('--layers', type=int, default=2)
    ap.add_argument('--width', type=int, default=64); ap.add_argument('--context', type=int, default=256)
    a = ap.parse_args()
    print(tiny_llama(a.out, a.vocab, a.layers, a.width, a.context))
