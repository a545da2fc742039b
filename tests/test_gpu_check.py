"""The GPU check (`bash .ci/gpu`, rows in `.ci/gpu.py`) runs every config value that takes a CUDA path of its
own: `config.cuda_values()` lists them, and a value without a row fails here, so a new lever cannot skip the
GPU."""
import importlib.util, json, sys
from conftest import ROOT
import pytest
from lmbook.config import cuda_values, Config, config_dict, flat_config
from lmbook.overrides import apply_overrides
from lmbook.profiles import get_config

spec = importlib.util.spec_from_file_location('gpu_check', ROOT/'.ci'/'gpu.py')
gpu = sys.modules['gpu_check'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpu)


def row_config(row) -> Config:
    "The config a row's runs train with (fine-tuning rows: their settings on a default llama config)."
    if row.kind == 'finetune':
        return apply_overrides(Config(), {**gpu.FINETUNE, 'init_from': 'hf:x', **row.overrides})
    return get_config('smoke', {**gpu.TINY, **row.overrides})


def uncovered(rows, wanted:dict) -> list[str]:
    "The CUDA values `wanted` that no row's config holds."
    have = {}
    for row in rows:
        for k, v in flat_config(config_dict(row_config(row))).items(): have.setdefault(k, set()).add(v)
    return [f"{k}={v!r}" for k, vals in wanted.items() for v in vals if v not in have.get(k, set())]


def test_every_cuda_value_has_a_row():
    assert not uncovered([r for r in gpu.ROWS if r.kind in ('train', 'finetune', 'dist', 'nodes')],
                         cuda_values())


def test_a_new_value_without_a_row_is_caught():
    assert (uncovered(gpu.ROWS, {**cuda_values(), 'fp8': ('tensorwise', 'rowwise', 'mxfp8')})
            == ["fp8='mxfp8'"])
    assert (uncovered([r for r in gpu.ROWS if r.name != 'optimizer-muon'], cuda_values())
            == ["optimizer='muon'"])


def test_rows_are_valid_and_named_once():
    names = [r.name for r in gpu.ROWS]
    assert len(names) == len(set(names))
    for row in gpu.ROWS:
        row_config(row)  # a misspelled field or value fails here, not on the GPU
        assert row.kind in gpu.RUNNERS and all(a in names for a in row.after), row
    assert {r.kind for r in gpu.ROWS} == set(gpu.RUNNERS)  # every kind of path has a row


def test_only_brings_the_rows_it_reads():
    names = lambda only: [r.name for r in gpu.selected(only)]
    assert names('serve-8-clients') == ['finetune-lora', 'serve-8-clients']
    assert names('sample-kv-cache,eval') == ['train-bf16-compile', 'finetune-qlora-nf4', 'sample-kv-cache',
                                             'eval']
    assert len(names('')) == len(gpu.ROWS)
    with pytest.raises(SystemExit, match='no such row: serve'): gpu.selected('serve')


@pytest.mark.parametrize('gpus', [1, 2, 4])
def test_rows_spread_over_the_gpus(gpus, tmp_path, monkeypatch):
    "One-GPU rows take the GPUs in turn; with four, the 2-GPU rows run on the last two beside them."
    seen = {}
    def fake(row, ws, out):
        seen[row.name] = gpu.child_env(ws).get('CUDA_VISIBLE_DEVICES')
        return {}
    monkeypatch.setattr(gpu, 'RUNNERS', {k: fake for k in gpu.RUNNERS})
    monkeypatch.setattr(gpu, 'environment', lambda: dict(card='NVIDIA H100 80GB HBM3', gpus=gpus, torch='x',
                                                          date='d'))
    monkeypatch.setattr(gpu, 'lmbook', lambda *a, **k: type('Done', (), dict(returncode=0, stderr=''))())
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    argv = ['gpu', '--out', str(tmp_path/'rows.jsonl'), '--keep', str(tmp_path/'ws')]
    monkeypatch.setattr(sys, 'argv', argv)
    with pytest.raises(SystemExit) as e: gpu.main()
    assert e.value.code == 0
    one = {seen[r.name] for r in gpu.ROWS if r.gpus == 1}
    two = {seen[r.name] for r in gpu.ROWS if r.gpus == 2 and r.name in seen}
    assert one == ({'0', '1'} if gpus == 4 else {str(i) for i in range(gpus)})
    assert two == ({'2,3'} if gpus == 4 else {None} if gpus == 2 else set())


def test_each_row_is_kept_as_it_ends(tmp_path, monkeypatch):
    """A check that a time limit stops keeps the rows it finished: each row's record is in the file as soon as
    the row ends (a call's limit once ended the check after 27 rows, before it wrote any)."""
    out, lines_seen = tmp_path/'rows.jsonl', []
    def fake(row, ws, o):
        lines_seen.append(len(out.read_text().splitlines()))
        return {}
    monkeypatch.setattr(gpu, 'RUNNERS', {k: fake for k in gpu.RUNNERS})
    monkeypatch.setattr(gpu, 'environment', lambda: dict(card='NVIDIA H200', gpus=1, torch='x', date='d'))
    monkeypatch.setattr(gpu, 'lmbook', lambda *a, **k: type('Done', (), dict(returncode=0, stderr=''))())
    monkeypatch.setattr(sys, 'argv', ['gpu', '--out', str(out), '--keep', str(tmp_path/'ws'), '--jobs', '1',
                                      '--only', 'train-auto,eval'])
    with pytest.raises(SystemExit) as e: gpu.main()
    assert e.value.code == 0
    assert lines_seen == [0, 1, 2]  # train-auto, train-bf16-compile (eval reads it), then eval
    rows = [json.loads(l)['row'] for l in out.read_text().splitlines()]
    assert rows == ['train-bf16-compile', 'train-auto', 'eval']
