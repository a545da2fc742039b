"""On a machine with 2 CUDA GPUs (skipped elsewhere): a DDP run killed with kill -9 resumes and finishes.

Run by hand: `pytest -s tests/test_dist_gpu.py` (about 3-5 minutes; bf16 autocast and torch.compile on). It
prints one JSON line `GPU_KILL_RESUME {...}` for the experiment log and writes it to
runs/gpu-kill/kill_resume.json."""
import json, os, random, signal, subprocess, time
from pathlib import Path
import pytest, torch
from lmbook.train.launch import worker_cmd
from lmbook.runs.checkpoint.formats import list_checkpoints

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason='needs 2 CUDA GPUs')

CFG = dict(device='cuda', compile='auto', dtype='auto', n_layer=4, n_embd=256, n_head=4, block_size=256,
           batch_size=16,
           max_steps=200, warmup_steps=20, ckpt_every=50, eval_every=50, eval_steps=4, log_every=10,
           tensorboard=False)

def rows(run): return [json.loads(l) for l in (Path(run)/'metrics.jsonl').read_text().splitlines()]
def losses(run): return {r['step']: r['loss'] for r in rows(run) if r.get('loss') is not None}

def start(ws, exp):
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1')
    return subprocess.Popen(worker_cmd('smoke', exp, CFG, nproc=2, root=ws), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, start_new_session=True)

def workers(exp, ws):
    out = subprocess.run(['ps', '-eo', 'pid,args'], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if f'--experiment {exp} ' in l + ' '
            and 'lmbook.train.launch' in l and str(ws) in l]

def test_ddp_two_gpus_kill9_and_resume(tmp_path):
    ws = Path(os.environ.get('LMBOOK_GPU_TEST_WS', tmp_path))
    p = start(ws, 'gpu-ref'); ref_out = p.stdout.read()
    assert p.wait() == 0, ref_out
    kill_at = random.Random().randint(110, 170)
    p = start(ws, 'gpu-kill'); before = []
    for line in p.stdout:
        before.append(line)
        if line.startswith('step') and int(line.split()[1].split('/')[0]) >= kill_at: break
    t0 = time.time(); os.kill(p.pid, signal.SIGKILL); p.wait()
    while workers('gpu-kill', ws) and time.time() - t0 < 10: time.sleep(0.2)
    orphans = workers('gpu-kill', ws)
    ck = list_checkpoints(ws/'runs'/'gpu-kill'/'checkpoints')[0].name
    p = start(ws, 'gpu-kill'); out = p.stdout.read()
    assert p.wait() == 0, out
    ref, got = losses(ws/'runs'/'gpu-ref'), losses(ws/'runs'/'gpu-kill')
    diff = max(abs(got[s] - ref[s])/ref[s] for s in ref)
    last = rows(ws/'runs'/'gpu-kill')[-1]
    summary = dict(card=torch.cuda.get_device_name(0), torch=torch.__version__, killed_after_step=kill_at,
                   resumed_from=ck,
                   orphans_after_kill=len(orphans), steps=sorted(got)[-1],
                   max_rel_loss_diff_vs_uninterrupted=diff,
                   val_loss=last.get('val_loss'), tok_per_s=last.get('tok_per_s'), mfu=last.get('mfu'),
                   resumed_line=[l for l in out.splitlines() if 'resumed at step' in l])
    print('GPU_KILL_RESUME', json.dumps(summary))
    (ws/'runs'/'gpu-kill'/'kill_resume.json').write_text(json.dumps(summary, indent=1))
    assert not orphans, orphans
    assert f"resumed at step {int(ck[5:])}" in out
    assert sorted(got) == sorted(ref) and diff < 0.05, summary

if __name__ == '__main__':  # without pytest: python tests/test_dist_gpu.py [workspace]
    import sys, tempfile
    ws = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    os.environ['LMBOOK_GPU_TEST_WS'] = str(ws)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2: sys.exit('needs 2 CUDA GPUs')
    test_ddp_two_gpus_kill9_and_resume(ws); print('PASSED')
