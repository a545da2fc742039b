"""`lmbook bench` on the CPU: rows written, real token files, user errors, torchrun; the memory estimate's
shape."""
import json, os, subprocess, sys
from pathlib import Path
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
ROOT = Path(__file__).resolve().parent.parent
TINY = ['--profile', 'smoke', '--set', 'block_size=32', 'n_layer=1', 'n_embd=64', 'grad_accum=2',
        '--batch-sizes', '2,4', '--steps', '1', '--warmup', '1']
KEYS = {'profile', 'label', 'date', 'arch', 'n_layer', 'n_embd', 'n_head', 'batch_size', 'block_size',
        'grad_accum',
        'tokens_per_step', 'tok_per_s', 'mfu', 'mem_gb', 'mem_est_gb', 'card', 'torch', 'world_size', 'oom',
        'loss'}


def _rows(p): return [json.loads(l) for l in Path(p).read_text().splitlines()]


def test_bench_cli_writes_one_row_per_batch_size(tmp_path, capsys):
    from lmbook.train.bench import main
    out = tmp_path/'b.jsonl'
    assert main([*TINY, '--out', str(out), '--label', 'ci']) == 0
    rows = _rows(out)
    assert [r['batch_size'] for r in rows] == [2, 4]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r['tok_per_s'] > 0 and r['mfu'] is None and not r['oom'] and r['label'] == 'ci'
        assert r['tokens_per_step'] == r['batch_size']*32*2 and r['torch'].startswith(('2.', '3.'))
    assert 'tok/s' in capsys.readouterr().out  # the table comes last


def test_bench_reads_real_token_files(tmp_path):
    from lmbook.data.loader import write_token_dir
    from lmbook.train.bench import bench
    tok = write_token_dir(tmp_path/'tok',
                          [np.random.default_rng(0).integers(0, 4000, 20_000).astype(np.uint16)], eot_id=0)
    rows = bench('smoke', dict(block_size=32, n_layer=1, n_embd=64), [4], steps=1, warmup=1, data=tok)
    assert rows[0]['data'] == str(tok) and rows[0]['tok_per_s'] > 0


@pytest.mark.parametrize('args,msg',
                         [(['--set', 'ce_chunk'], 'name=value'),
                          (['--set', 'nonsense=1'], 'unknown config key'),
                                      (['--data', '/nonexistent/tok'], 'does not exist')])
def test_bench_user_errors(args, msg, capsys):
    from lmbook.train.bench import main
    assert main(['--profile', 'smoke', '--steps', '1', *args]) == 2
    assert msg in capsys.readouterr().err


def test_bench_under_torchrun_ddp(tmp_path):
    out = tmp_path/'d.jsonl'
    torchrun = Path(sys.executable).parent/'torchrun'
    r = subprocess.run([str(torchrun), '--standalone', '--nproc_per_node', '2', '--no-python', sys.executable,
                        '-c',
                        'from lmbook.train.bench import main; main()', *TINY[:-6], '--batch-sizes', '2',
                        '--steps', '1',
                        '--warmup', '1', '--out', str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _rows(out)
    assert len(rows) == 1 and rows[0]['world_size'] == 2 and rows[0]['parallel'] == 'ddp'  # rank 0 writes
    assert rows[0]['tokens_per_step'] == 2*32*2*2


def test_memory_estimate_shape():
    from lmbook.profiles import get_config
    from lmbook.model.memory import estimate_memory, max_batch_size
    c = get_config('runpod_2b')
    est = [estimate_memory(c, b)['total_gb'] for b in (1, 8, 16)]
    assert est[0] < est[1] < est[2]
    b = max_batch_size(c, 85.5)
    assert b >= 8 and estimate_memory(c, b)['total_gb'] <= 85.5 < estimate_memory(c, b + 1)['total_gb']/0.94
    fsdp = estimate_memory(get_config('runpod_4b'), 1, world_size=2, parallel='fsdp')['total_gb']
    assert fsdp < estimate_memory(get_config('runpod_4b'), 1)['total_gb']/1.5


def test_levers_script_runs_end_to_end_on_cpu(tmp_path):
    """The GPU levers table's script, toy shapes: every lever row is written; fp8 degrades to off, the fused
    loss to chunked."""
    out = tmp_path/'lev.jsonl'
    env = {**os.environ, 'PYTHONPATH': f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(ROOT/'nbs/benchmarks/levers.py'), str(out), '--tiny', '--shapes',
                        '124m',
                        '--levers', 'recipe,all', '--parity-steps', '2', '--workspace', str(tmp_path/'ws')],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = _rows(out)
    assert [r['lever'] for r in rows] == ['recipe', 'all']
    assert (rows[1]['fp8'] == 'off' and rows[1]['loss_kernel'] == 'chunked'
            and rows[0]['loss_kernel'] == 'logits')
    assert all(r['val_loss'] > 0 and len(r['losses']) == 4 for r in rows)
    assert '| 124m-b64 | all |' in p.stdout


def test_time_to_loss_script_and_plot_on_cpu(tmp_path):
    """The time-to-loss script, toy shapes: AdamW sets the target, a Muon run reports against it; the plot is
    drawn."""
    out, png = tmp_path/'ttl.jsonl', tmp_path/'ttl.png'
    env = {**os.environ, 'PYTHONPATH': f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(ROOT/'nbs/benchmarks/time_to_loss.py'), str(out), '--tiny',
                        '--steps', '4',
                        '--muon-runs', '0.5@0.001', '--eval-every', '2', '--eval-batches', '1', '--workspace',
                        str(tmp_path/'ws')],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = _rows(out)
    ends = [r for r in rows if r.get('summary')]
    assert ([e['run'] for e in ends] == ['adamw', 'muon-0.5@0.001']
            and ends[1]['target'] == ends[0]['final_val_loss'])
    assert [r['step'] for r in rows if r['run'] == 'adamw' and not r.get('summary')] == [0, 2, 4]
    p = subprocess.run([sys.executable, str(ROOT/'nbs/benchmarks/plot_time_to_loss.py'), str(out), str(png)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert png.stat().st_size > 5000


def test_fp8_verdict_gives_the_time_to_bf16s_final_loss(tmp_path):
    "When fp8's validation first reaches bf16's final loss, as a share of bf16's time (and with compiling)."
    sys.path.insert(0, str(ROOT/'nbs'/'benchmarks'))
    from fp8_parity import verdict
    rows = [dict(run='bf16', step=s, train_s=s/10, loss=4.0, val_loss=v) for s, v in [(100, 3.5), (200, 3.0)]]
    rows += [dict(run='fp8', step=s, train_s=s/20, loss=4.0, val_loss=v) for s, v in [(100, 3.2), (200, 2.9)]]
    rows += [dict(run=a, summary=True, max_steps=200, train_s=t, compile_s=c, final_val_loss=v, card='cpu')
             for a, t, c, v in [('bf16', 20.0, 5.0, 3.0), ('fp8', 10.0, 15.0, 2.9)]]
    out = tmp_path/'rows.jsonl'
    out.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    text = verdict(out)
    assert "at step 200, 10.0s of training: 0.50x bf16's 20.0s (1.00x with compilation)" in text
    assert '(below the 0.5% bound)' in text
    rows = [r for r in rows if r['run'] == 'bf16' or r.get('val_loss') != 2.9]  # fp8 stops at 3.2
    out.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    assert "fp8 never reached bf16's final val_loss 3.0" in verdict(out)
    rows = [r for r in rows if not (r['run'] == 'fp8' and r.get('summary'))]  # fp8 stopped before its end
    rows.append(dict(run='fp8', step=200, train_s=10.0, loss=4.0, val_loss=2.95))
    out.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    assert ("at step 200, 10.0s of training: 0.50x bf16's 20.0s (the arm stopped at step 200 before its "
            "summary: compilation not known)") in verdict(out)


def test_fp8_parity_arm_takes_an_accumulation(tmp_path):
    "An arm at micro-batch 2 x accumulation 2 counts four rows' tokens a step (the equal-tokens comparison)."
    script, out, ws = ROOT/'nbs/benchmarks/fp8_parity.py', tmp_path/'rows.jsonl', tmp_path/'ws'
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1'}
    p = subprocess.run([sys.executable, str(script), str(out), '--arm', 'bf16', '--tiny', '--batch-size', '2',
                        '--grad-accum', '2', '--steps', '4', '--eval-every', '2', '--eval-batches', '1',
                        '--workspace', str(ws)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    rows = [r for r in _rows(out) if not r.get('summary')]
    assert [(r['step'], r['tokens']) for r in rows] == [(0, 0), (2, 2*4*64), (4, 4*4*64)]


def test_fp8_time_to_loss_refuses_an_unknown_arm(tmp_path):
    "ARMS picks one arm a call (one GPU, two calls); a misspelt one stops before anything is installed."
    p = subprocess.run(['bash', 'nbs/benchmarks/fp8_time_to_loss.sh', '7', 'runpod_1b-equal'], cwd=ROOT,
                       env={**os.environ, 'ARMS': 'fp16', 'OUT': str(tmp_path)}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == 'fp8_time_to_loss.sh: ARMS=fp16: write both, bf16 or fp8'
    assert not list(tmp_path.iterdir())


def test_muon_scale_arms_and_verdict_on_cpu(tmp_path):
    "Two arms on one prepared workspace, then the verdict: the best AdamW sets the target, each arm is timed."
    script, out, ws = ROOT/'nbs/benchmarks/muon_scale.py', tmp_path/'rows.jsonl', tmp_path/'ws'
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1'}
    run = lambda *a: subprocess.run([sys.executable, str(script), str(out), *a], env=env, capture_output=True,
                                    text=True, timeout=300)
    assert run('--prepare', '--workspace', str(ws), '--tiny').returncode == 0
    for arm in ('adamw@6e-3', 'muon@0.5@3e-3'):
        p = run('--arm', arm, '--tiny', '--steps', '8', '--batch-size', '4', '--eval-every', '2',
                '--eval-batches', '2', '--workspace', str(ws))
        assert p.returncode == 0, p.stderr[-1500:]
    text = run('--verdict').stdout
    assert 'the final val_loss of adamw@6e-3 (8 steps' in text and 'muon@0.5@3e-3: 4 steps' in text, text
    stopped = tmp_path/'stopped.jsonl'  # no AdamW arm finished: a stopped one's last row is the target
    row = lambda run, step, s, loss: json.dumps(dict(run=run, step=step, train_s=s, val_loss=loss))
    stopped.write_text('\n'.join([row('adamw@3e-4', 0, 0.0, 10.8), row('adamw@3e-4', 90, 160.0, 6.1),
                                  row('muon@0.7@9e-4', 20, 40.0, 5.8)]) + '\n')
    text = subprocess.run([sys.executable, str(script), str(stopped), '--verdict'], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert 'target: 6.1, the last val_loss of adamw@3e-4, stopped at step 90' in text, text
    assert ('muon@0.7@9e-4: stopped before its end, last row step 20; reached it at step 20, 40.0s: 0.25x'
            in text), text
    bad = run('--arm', 'adam@1', '--tiny')
    assert bad.returncode != 0 and 'write adamw@LR' in bad.stderr
    first = []  # --seed sets the model's first weights: step 0's validation loss differs
    for seed in ('1', '2'):
        out = tmp_path/f'seed{seed}.jsonl'
        p = run('--arm', 'adamw@6e-3', '--tiny', '--steps', '1', '--batch-size', '4', '--eval-every', '1',
                '--eval-batches', '2', '--workspace', str(ws), '--seed', seed)
        assert p.returncode == 0, p.stderr[-1500:]
        first.append(json.loads(out.read_text().splitlines()[0])['val_loss'])
    assert first[0] != first[1], first
