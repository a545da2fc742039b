"""A float8 model's compiled graphs go into AOTAutograd's cache (`levers.cacheable_fp8`): a second process
finds its training and validation graphs, with the same numbers as torchao's own uncached graphs. It is
asked for with LMBOOK_FP8_GRAPH_CACHE=1; by default (and with 0) they stay uncached. torchao's float8 runs
on the CPU; each start is its own process, as a warm start is, and converts a model before its own, as the
micro-batch fit's trials do."""
import json, os, subprocess, sys
import pytest
from conftest import ROOT

pytest.importorskip('torchao.float8')  # a dev dependency: skipped only where lmbook's dev extras are missing

START = """
import json, sys, torch
from torch._dynamo.utils import counters
from lmbook.model.levers import convert_fp8
convert_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64)), 'tensorwise')  # an earlier model, as a fit's trial
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
convert_fp8(model, 'tensorwise')
compiled, x = torch.compile(model), torch.randn(32, 64, requires_grad=True)
def cache():  # what AOTAutograd's cache did since the last look
    said = sorted(k.removeprefix('autograd_cache_') for k, n in counters['aot_autograd'].items()
                  if k.startswith('autograd_cache') and n)
    counters['aot_autograd'].clear()
    return ','.join(said)
compiled(x).sum().backward()
train = cache()
with torch.no_grad(): out = compiled(x)
print(json.dumps(dict(train=train, val=cache(), grad=x.grad.tolist(), out=out.tolist())))
"""


def start(cache_dir, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k != 'LMBOOK_FP8_GRAPH_CACHE'}
    p = subprocess.run([sys.executable, '-c', START], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**base, 'TORCHINDUCTOR_CACHE_DIR': str(cache_dir), **env})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_float8_graphs_found_by_a_second_process(tmp_path):
    first, second = (start(tmp_path/'on', LMBOOK_FP8_GRAPH_CACHE='1') for _ in range(2))
    assert (first['train'], first['val']) == ('miss,saved', 'miss,saved'), first
    assert (second['train'], second['val']) == ('hit', 'hit'), second
    off = start(tmp_path/'off')  # the default: torchao's graphs as torchao makes them
    assert (off['train'], off['val']) == ('bypass', 'bypass'), off
    for run in (first, second):  # the same numbers, to the bit
        assert (run['grad'], run['out']) == (off['grad'], off['out'])
