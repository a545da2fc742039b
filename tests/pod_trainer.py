"""A stand-in trainer for the pod tests, run by `lmbook boot` through `LMBOOK_TRAIN_CMD` in the run folder: it
holds the run's lock, resumes from its newest complete checkpoint, logs one metrics line a step, checkpoints
every `--every` steps and at the last, and on SIGTERM, SIGHUP, SIGINT or a STOP request writes a checkpoint at
the step it reached and exits 128 + the signal, as lmbook's trainer does. `--fail-at N` exits 1 at step N;
`--hang-at N` hangs at step N, deaf to every stop (as a process stuck in a read or a collective)."""
import argparse, json, signal, sys, time
from pathlib import Path
from lmbook.rundir import RunDir
from lmbook.runlock import RunLock, take_stop_request

STOPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def checkpoint(rd:RunDir, step:int):
    "A complete checkpoint folder of `step`: one weights file, then its COMPLETE manifest."
    d = rd.checkpoints/f'step_{step:08d}'
    d.mkdir(parents=True, exist_ok=True)
    (d/'model.bin').write_bytes(step.to_bytes(8, 'little'))
    (d/'COMPLETE').write_text(json.dumps(dict(step=step, files={'model.bin': dict(size=8, sha256='')})))


def newest(rd:RunDir) -> int:
    done = [int(p.parent.name[5:]) for p in rd.checkpoints.glob('step_*/COMPLETE')]
    return max(done, default=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, required=True)
    ap.add_argument('--every', type=int, required=True)
    ap.add_argument('--dt', type=float, default=0.1, help='seconds a step')
    ap.add_argument('--fail-at', type=int, default=0)
    ap.add_argument('--hang-at', type=int, default=0)
    a = ap.parse_args()
    rd, got = RunDir(Path.cwd()), []
    for s in STOPS: signal.signal(s, lambda n, f: got.append(n))
    lock = RunLock(rd.path, log=print)
    lock.acquire()
    rd.meta.write_text(json.dumps(dict(total_steps=a.steps)))
    start = newest(rd)
    log = open(rd.log, 'a', buffering=1)
    if start: log.write(f"resumed at step {start}\n")
    rc = 0
    for step in range(start + 1, a.steps + 1):
        time.sleep(a.dt)
        with open(rd.metrics, 'a') as f: f.write(json.dumps(dict(step=step, loss=10/step)) + '\n')
        print(f"step {step:4d}/{a.steps} | loss {10/step:.3f}", flush=True)
        if a.hang_at == step:
            for s in STOPS: signal.signal(s, signal.SIG_IGN)
            while True: time.sleep(1)
        if a.fail_at == step:
            print(f"error: the loss diverged at step {step}", flush=True)
            rc = 1
            break
        signum = got[0] if got else take_stop_request(rd.path)
        if signum:
            checkpoint(rd, step)
            msg = (f"stopped by {signal.Signals(signum).name} at step {step}/{a.steps}; "
                   f"checkpoint step_{step:08d}")
            log.write(msg + '\n')
            print(msg, flush=True)
            rc = 128 + signum
            break
        if step % a.every == 0 or step == a.steps: checkpoint(rd, step)
    lock.release()
    sys.exit(rc)


if __name__ == '__main__': main()
