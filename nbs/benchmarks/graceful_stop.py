"""The two ways a run on a pod ends early, at a profile's real size on one GPU, through `lmbook train` itself:

  hard kill   SIGKILL to the trainer's process group (a pod that dies, a stop past its grace period) after the
              first time-based checkpoint (`ckpt_minutes`): what is lost is the steps and seconds since the newest
              COMPLETE checkpoint, at most `ckpt_minutes` plus one checkpoint's write;
  graceful    the same run resumed, then a stop request in the run folder (what `lmbook pod stop` writes, over SSH
              or the volume's S3 API), which the trainer polls at every step: seconds from the request until the
              stop checkpoint is COMPLETE and the trainer has exited, and steps lost (the stop checkpoint's step
              against the last step the run reached).
One JSON object, printed and written to --out. The built-in corpus (no download); everything else in a scratch
folder, removed when the script ends.

GPU, from the repo root (about 5 minutes at runpod_1b on one H100):
    PYTHONPATH=$PWD python3 nbs/benchmarks/graceful_stop.py --out ${OUT:-.}/graceful_stop.json
CPU, to check the script itself (about 1 minute):
    PYTHONPATH=$PWD python3 nbs/benchmarks/graceful_stop.py --profile smoke --minutes 0.2 --out /tmp/gs.json
"""
import argparse, json, os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

ROOT = Path(__file__).resolve().parents[2]


def steps(run:Path) -> list[int]:
    "The training steps the run has logged so far."
    from lmbook.runs.metrics import read_metrics
    try: return [r['step'] for r in read_metrics(run) if r.get('loss') is not None]
    except FileNotFoundError: return []


def complete(run:Path) -> dict[int, float]:
    "Step -> time its checkpoint became COMPLETE, for every complete checkpoint of the run."
    from lmbook.runs.checkpoint.formats import ckpt_step, list_checkpoints
    return {ckpt_step(c): (c/'COMPLETE').stat().st_mtime for c in list_checkpoints(run/'checkpoints')
            if (c/'COMPLETE').is_file()}


def wait(cond, timeout:float, what:str, p:subprocess.Popen):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (v := cond()): return v
        if p.poll() is not None: raise SystemExit(f"the trainer exited ({p.returncode}) before {what}")
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_1b')
    ap.add_argument('--minutes', type=float, default=1.0, help='ckpt_minutes of the run')
    ap.add_argument('--set', default='', help='more overrides, k=v,k=v')
    ap.add_argument('--timeout', type=float, default=300)
    ap.add_argument('--out', type=Path)
    a = ap.parse_args()
    ws = scratch('lmbook-graceful-stop-')
    env = {**os.environ, 'LMBOOK_WORKSPACE': str(ws), 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1',
           'PYTHONUNBUFFERED': '1'}
    small = a.profile == 'smoke'
    ov = ['dataset=builtin', 'max_steps=100000', 'ckpt_every=100000', f'ckpt_minutes={a.minutes}', 'keep_ckpts=2',
          'log_every=1', 'eval_every=100000', 'tensorboard=false', 'warmup_steps=10',
          *([] if small else ['vocab_size=8192', 'batch_size=8', 'grad_accum=1']), *filter(None, a.set.split(','))]
    cli = [sys.executable, '-m', 'lmbook.cli']
    p = subprocess.run([*cli, 'prepare', '-p', a.profile, '-e', 'gs', '-q', '--set', *ov], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if p.returncode: raise SystemExit(f"prepare failed: {p.stderr[-800:]}")
    run, res = ws/'runs'/'gs', dict(profile=a.profile, ckpt_minutes=a.minutes, overrides=','.join(ov))
    log = open(ws/'train.out', 'a')
    train = lambda: subprocess.Popen([*cli, 'train', '-p', a.profile, '-e', 'gs', '--set', *ov], cwd=ROOT,
                                     env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # 1. hard kill some seconds after the first time-based checkpoint is complete
        t0, tr = time.time(), train()
        first = wait(lambda: complete(run), a.timeout + a.minutes*60, 'the first checkpoint', tr)
        res['start_to_first_checkpoint_s'] = round(time.time() - t0, 1)
        time.sleep(a.minutes*60/2)
        reached, t_kill = max(steps(run)), time.time()
        os.killpg(tr.pid, signal.SIGKILL); tr.wait()
        done = complete(run); newest = max(done)
        res |= dict(kill_step_reached=reached, kill_newest_checkpoint=newest, kill_steps_lost=reached - newest,
                    kill_seconds_lost=round(t_kill - done[newest], 1))
        print(json.dumps(res), flush=True)
        # 2. resume, then a graceful stop through the stop request
        # the resume sets aside the rows logged past its checkpoint: wait for it, then for new steps
        out, resumes = ws/'train.out', lambda: (ws/'train.out').read_text().count('resumed at step')
        n0, t0, tr = resumes(), time.time(), train()
        wait(lambda: resumes() > n0, a.timeout, 'the resume', tr)
        wait(lambda: max(steps(run), default=0) > newest + 5, a.timeout, 'steps after the resume', tr)
        res['resume_to_step_s'] = round(time.time() - t0, 1)
        from lmbook.runlock import request_stop
        before, t_req = set(complete(run)), time.time()
        request_stop(run, 'graceful stop benchmark')
        at_request = max(steps(run))
        rc = tr.wait(a.timeout)
        t_exit = time.time()
        new = sorted(set(complete(run)) - before)
        reached = max(steps(run))
        res |= dict(resumed_at=int(out.read_text().split('resumed at step ')[-1].split()[0].rstrip(')|,')),
                    stop_exit_code=rc, stop_step_at_request=at_request, stop_step_reached=reached,
                    stop_checkpoint=new[-1] if new else None,
                    stop_steps_lost=reached - new[-1] if new else None,
                    stop_request_to_complete_s=round(complete(run)[new[-1]] - t_req, 1) if new else None,
                    stop_request_to_exit_s=round(t_exit - t_req, 1))
    finally:
        for q in [tr] if 'tr' in locals() else []:
            if q.poll() is None: os.killpg(q.pid, signal.SIGKILL)
        log.close()
        tail = (ws/'train.out').read_text()[-1500:] if (ws/'train.out').is_file() else ''
        res['train_log_tail'] = tail
    import torch
    res |= dict(card=torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', torch=torch.__version__,
                date=time.strftime('%Y-%m-%d'))
    print(json.dumps(res, indent=1))
    if a.out: a.out.write_text(json.dumps(res, indent=1) + '\n')


if __name__ == '__main__': main()
