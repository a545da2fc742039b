"""Memory bounded by a buffer, not by the input: one long line prepares, and one long fine-tuning record
reads, with a peak RSS that does not grow with the line (measured in a subprocess; the 200 MB figure is
nbs/benchmarks/long_line.py's)."""
import json, subprocess, sys
from pathlib import Path
import pytest
from lmbook.data.prepare import shard_corpus
from lmbook.chatformat import SPECIAL_TOKENS
from lmbook.data.tokenizer import train_bpe, save_bundle

sys.path.insert(0, str(Path(__file__).resolve().parent.parent/'nbs'/'benchmarks'))
from long_line import write_long_line

GROWTH = """
import resource, sys
{imports}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
{work}
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)//1024)
"""

def growth_mb(imports:str, work:str) -> int:
    "MB the peak RSS of a fresh Python grows by while it runs `work` (after `imports`)."
    r = subprocess.run([sys.executable, '-c', GROWTH.format(imports=imports, work=work)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


def bundle(d:Path) -> Path:
    tk = train_bpe(['the quick brown fox jumps over the lazy dog. ' * 20] * 50, 320)
    return save_bundle(tk, d/'tok')


def test_long_line_tokenizes_in_bounded_memory(tmp_path):
    "A 12 MB file with no newline: tokenizing grows the peak RSS by one batch (~170 MB), not 80x the file."
    src = write_long_line(tmp_path/'line.txt', 12e6)
    shard_corpus(tmp_path/'train', dataset=str(src), mode='prod')
    tok = bundle(tmp_path)
    mb = growth_mb('from lmbook.data.tokenizer import tokenize_split',
                   f"tokenize_split({str(tmp_path/'train')!r}, {str(tok)!r}, {str(tmp_path/'tokens')!r})")
    assert mb < 250, f"tokenizing a 12 MB line grew the peak RSS by {mb} MB"


@pytest.mark.parametrize('name', ['chat.jsonl', 'sharegpt.json'])
def test_long_record_is_cut_as_it_is_read(tmp_path, name):
    """One 8 MB fine-tuning record, cut to 65 tokens: the peak RSS grows by about its size, not 150x it; in a
    JSONL file, or in a ShareGPT JSON array (read whole, parsed a record at a time)."""
    words = (tmp_path/'w.txt'); write_long_line(words, 8e6)
    story = words.read_text()
    if name == 'chat.jsonl':
        (tmp_path/name).write_text(json.dumps(dict(prompt='Tell me a story.', response=story)) + '\n')
    else:
        turns = [dict(zip(('from', 'value'), t)) for t in [('human', 'Tell me a story.'), ('gpt', story)]]
        (tmp_path/name).write_text(json.dumps([dict(conversations=turns)]))
    tok = bundle(tmp_path)
    mb = growth_mb('from lmbook.data.sft import read_sft; from lmbook.data.tokenizer import load_tokenizer',
                   f"ex = read_sft({str(tmp_path/name)!r}, load_tokenizer({str(tok)!r}), 64)\n"
                   "assert len(ex) == 1 and len(ex[0][0]) == 65, len(ex[0][0])")
    assert mb < 120, f"reading an 8 MB record grew the peak RSS by {mb} MB"
