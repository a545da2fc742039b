"""The hardware check before a run: a model over 1B parameters on a CPU is refused in one line naming the
card it needs and `lmbook pod plan`, before anything is written; `--force` (force=true) gets past it; on a
GPU a config over the card's memory is refused with what to change, and every run measured in
nbs/benchmarks/results passes on the card it ran on (the one micro-batch measured not to fit is refused)."""
import json
from pathlib import Path
import pytest
from conftest import ROOT
from lmbook.cli import main
from lmbook.overrides import parse_overrides
from lmbook.profiles import get_config
from lmbook.core import gpu_table
from lmbook.model.memory import fit_verdict
import lmbook.train.launch as launch
from lmbook.train.runnb import TRAIN_PARAMS, train_overrides

RESULTS = ROOT/'nbs'/'benchmarks'/'results'
H100, H100_NAME = 81559*2**20/1e9, 'NVIDIA H100 80GB HBM3'


def written(ws): return sorted(str(p.relative_to(ws)) for p in Path(ws).rglob('*'))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith('error: ') and len(err.strip().splitlines()) == 1, err
    return err


def test_a_2b_profile_on_a_cpu_is_refused_before_any_work(workspace, capsys, monkeypatch):
    monkeypatch.setattr(launch, 'spawn', lambda *a, **k: pytest.fail('torchrun started'))
    for extra in ([], ['--nproc', '2']):  # before torchrun too
        assert main(['train', '-p', 'runpod_2b', '-e', 'big', '--set', 'device=cpu', *extra]) == 2
        err = one_error_line(capsys)
        assert ('1.99B parameters' in err and 'NVIDIA H100' in err and '--force' in err
                and 'lmbook pod plan --profile runpod_2b' in err), err
    assert written(workspace) == []


def test_force_gets_past_the_check(workspace, capsys, monkeypatch):
    "`--force` (and the notebook's `force` parameter) reaches the run as force=true; nothing trains here."
    seen = []
    monkeypatch.setattr(launch, 'train', lambda cfg, *a, **k: seen.append(cfg) or {})
    assert main(['train', '-p', 'runpod_2b', '-e', 'big', '--set', 'device=cpu', '--force']) == 0
    assert seen[0].train.force and seen[0].model.n_embd == 2560
    out = capsys.readouterr().out
    assert out.startswith('note: force=true') and 'lmbook pod plan --profile runpod_2b' in out, out
    assert train_overrides(dict(TRAIN_PARAMS, force=True))['force'] is True
    assert 'force' not in train_overrides(TRAIN_PARAMS)


def test_launch_checks_before_it_starts_anything(workspace):
    "The train notebook's road: `spawn` refuses at its first line; forced, its first line is the note."
    with pytest.raises(ValueError, match='lmbook pod plan --profile runpod_2b'):
        next(launch.spawn('runpod_2b', 'big', dict(device='cpu')))
    lines = launch.spawn('runpod_2b', 'big', dict(device='cpu', force=True))
    assert next(lines).startswith('note: force=true')
    lines.close()  # before the first process starts
    assert written(workspace) == []


def test_a_cpu_run_over_the_free_ram_is_refused(workspace, capsys, monkeypatch):
    monkeypatch.setattr(launch, 'free_ram_gb', lambda: 0.01)
    assert main(['train', '-p', 'smoke', '-e', 's']) == 2
    assert 'GB of memory' in one_error_line(capsys)
    monkeypatch.setattr(launch, 'free_ram_gb', lambda: None)  # unknown: not refused
    assert launch.check_hardware(get_config('smoke')) is None
    assert written(workspace) == []


def test_a_config_over_the_card_is_refused_with_what_to_change(workspace, capsys, monkeypatch):
    "The GPU road without a GPU: `lmbook train` on a (pretended) 48 GB card."
    monkeypatch.setattr(launch, 'pick_device', lambda device: 'cuda')
    monkeypatch.setattr(launch, 'device_memory', lambda device: ('NVIDIA L40S', 48.3, True))
    assert main(['train', '-p', 'runpod_2b', '-e', 'big']) == 2
    err = one_error_line(capsys)
    assert ('~57.2 GB per GPU at micro-batch 8 (NVIDIA L40S) but the card has 48.3 GB' in err
            and 'batch_size=2 grad_accum=64' in err and 'act_ckpt=full' in err
            and 'nproc=2 parallel=fsdp' in err and 'lmbook pod plan --profile runpod_2b' in err), err
    assert written(workspace) == []


def test_the_gpu_verdict_is_a_function_of_the_card():
    c2 = get_config('runpod_2b')  # 57 GB measured at micro-batch 8 on an H100
    assert fit_verdict(c2, 'cuda', H100, H100_NAME, 'runpod_2b') is None
    # measured: with fp8, micro-batch 16 fits an H100 and 32 does not (batch-fit-runpod_2b)
    refused, line = fit_verdict(get_config('runpod_2b', dict(fp8='tensorwise', batch_size=32, grad_accum=4)),
                                'cuda', H100, H100_NAME, 'runpod_2b')
    assert refused and 'batch_size=16 grad_accum=8' in line and 'but the card has 85.5 GB' in line, line
    c4 = get_config('runpod_4b', dict(batch_size=16, grad_accum=8))
    refused, line = fit_verdict(c4, 'cuda', H100, H100_NAME, 'runpod_4b')
    assert refused and 'act_ckpt=full' in line and 'parallel=fsdp' in line and 'lmbook pod plan' in line, line
    # within the headroom of the card: a note, not a refusal (FSDP2 over 4 H100s measured 76.4 GB)
    c4 = get_config('runpod_4b', dict(batch_size=16, nproc=4, parallel='fsdp'))
    refused, line = fit_verdict(c4, 'cuda', H100, H100_NAME, 'runpod_4b', world_size=4)
    assert not refused and 'it may not fit' in line, line
    # a LoRA run is not sized as full training (QLoRA of a 7B model measured 6 GB on an H100)
    q7 = get_config('runpod_4b', dict(n_layer=32, n_embd=4096, n_head=32, block_size=2048, batch_size=1,
                                      lora_rank=16, quant='nf4'))
    assert fit_verdict(q7, 'cuda', H100, H100_NAME) is None


KEYS = ('batch_size', 'grad_accum', 'fp8', 'act_ckpt', 'ce_chunk', 'attn_backend', 'compile', 'dtype')

def measured() -> list[tuple]:
    "(where, config, card, GPUs) of every training run recorded in nbs/benchmarks/results."
    out = []
    for f in sorted(RESULTS.glob('*.json*')):
        text = f.read_text()
        recs = ([json.loads(l) for l in text.splitlines() if l.strip()] if f.suffix == '.jsonl'
                else [json.loads(text)])
        for r in recs:
            card = r.get('card') or (r.get('env') or {}).get('device_name')
            if 'overrides' not in r or not card or r.get('oom'): continue  # a run's config, not a summary
            ov = r['overrides'] if isinstance(r['overrides'], dict) else parse_overrides(r['overrides'])
            ov = {**ov, **{k: r[k] for k in KEYS if r.get(k) is not None}}
            if r.get('loss_kernel') == 'liger': ov['fused_ce'] = True
            n = r.get('world_size') or 1
            if n > 1: ov.update(nproc=n, parallel=r['parallel'])
            out.append((f"{f.name}:{r.get('label', '')}", get_config(r['profile'], ov), card, n))
    return out


def test_every_measured_run_passes_on_its_card():
    rows, table = measured(), gpu_table()
    assert len(rows) >= 50 and {'NVIDIA H100 80GB HBM3', 'NVIDIA H200'} <= {c for _, _, c, _ in rows}
    refused = [(where, v[1]) for where, cfg, card, n in rows
               if (v := fit_verdict(cfg, 'cuda', table[card]['mem_gb'], card, None, n)) and v[0]]
    assert not refused, refused
