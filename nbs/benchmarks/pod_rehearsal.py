"""The pod rehearsal: the nearest thing to a real RunPod pod without RunPod. It runs the pod's exact start command
(`lmbook.pods.runpod.start_command`) under bash as a container's PID 1 (a process group of its own), with a stand-in for
the image's /start.sh, a fresh folder as /workspace and the REST API v2 fake (lmbook/dev/fake_runpod.py, run as a script)
on 127.0.0.1 as RunPod. The start command clones a snapshot of this checkout at its commit, installs it into the volume's
virtualenv, and its supervisor runs `lmbook boot`: volume layout, data (the built-in corpus: no download), training
through papermill. The script plays RunPod's part: a stop the API takes sends the container SIGTERM, and a resume starts
the container again. Three containers, three endings:
  1. mid-run the trainer is killed with SIGKILL (as the kernel's out-of-memory killer kills): the pod must stop itself
     through the API, its boot log naming the newest checkpoint that exists, never one that does not;
  2. resumed from that checkpoint, the run gets a stop request (`runs/<exp>/STOP`, what `lmbook pod stop` writes), the
     laptop gone: the trainer writes a stop checkpoint at the step it reached, and the pod stops itself;
  3. resumed from the stop checkpoint, the run finishes, and the pod stops itself once, after the final checkpoint.
It writes a JSON with: seconds from start command to first step, the steps lost on each ending, the seconds from each
ending to the pod's stop call, and the API calls.

Standard library only: lmbook's dependencies come from a folder of wheels (--wheels), installed with --no-index into
the volume's virtualenv, which sees the machine's torch. Fill that folder where a package index is reachable:
    bash nbs/benchmarks/pod_wheels.sh 3.11        # the GPU machine's Python version
usage (repository root; one GPU):
    python3 nbs/benchmarks/pod_rehearsal.py --wheels nbs/benchmarks/pod-wheels --steps 60 --stop-at 35 \
        --set ckpt_every=30 --out pod_rehearsal.json      # runpod_1b: three 14 GB checkpoints, ~8 minutes on an H100
    python3 nbs/benchmarks/pod_rehearsal.py --tiny --wheels DIR        # the smoke profile on the CPU, a few minutes
It keeps only the JSON (--out, else $OUT/pod_rehearsal.json, else ./pod_rehearsal.json) and the boot log
($OUT/boot.log, else beside the JSON as NAME.boot.log). The work folder (the volume with its virtualenv and
checkpoints, the snapshot, HOME, and TMPDIR: the container's own /tmp, where the start command writes its script) is
--work, kept, else a scratch folder removed when the script ends, however it ends (see scratch.py).
"""
import argparse, json, os, re, shlex, shutil, signal, subprocess, sys, time, urllib.request
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

ROOT = Path(__file__).resolve().parents[2]
NEEDS = ['numpy', 'pyyaml', 'tokenizers', 'safetensors', 'fastcore', 'papermill', 'ipykernel', 'matplotlib']  # what lmbook's pod path imports
IMPORTS = dict(pyyaml='yaml')
KEY, POD, EXP = 'rpa_REHEARSALkey0000', 'podrehearsal01', 'rehearsal'


def say(*a): print(f"[rehearsal {time.strftime('%H:%M:%S')}]", *a, flush=True)


def sh(cmd, **kw): return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout.strip()


def snapshot(dest:Path) -> tuple[str, str]:
    "A git repository holding this checkout's files as one commit (uncommitted changes included): (URL, commit)."
    try: files = sh(['git', 'ls-files', '-z', '-co', '--exclude-standard'], cwd=ROOT).split('\0')
    except (subprocess.CalledProcessError, FileNotFoundError): files = [str(p.relative_to(ROOT)) for p in ROOT.rglob('*') if p.is_file()
                                                                       and not {'.venv', 'runs', '.git', '_docs', '_proc', 'pod-wheels'} & set(p.relative_to(ROOT).parts)]
    for f in filter(None, files):
        if (ROOT/f).is_file(): (dest/f).parent.mkdir(parents=True, exist_ok=True); shutil.copy2(ROOT/f, dest/f)
    g = ['git', '-C', str(dest), '-c', 'user.email=rehearsal@lmbook.invalid', '-c', 'user.name=rehearsal']
    sh(['git', 'init', '-q', str(dest)]); sh(g + ['add', '-A']); sh(g + ['commit', '-qm', 'rehearsal snapshot'])
    return f'file://{dest}', sh(['git', '-C', str(dest), 'rev-parse', 'HEAD'])


def volume_venv(v:Path, wheels:Path) -> float:
    "The volume's virtualenv (sees the machine's torch) with lmbook's dependencies from `wheels`, offline; seconds taken."
    t0 = time.time()
    sh([sys.executable, '-m', 'venv', '--system-site-packages', str(v)])
    if sys.prefix != sys.base_prefix:  # this Python is itself a virtualenv: the volume's sees its packages (torch) as a pod's sees the image's
        outer = sh([sys.executable, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'])
        next((v/'lib').glob('python*/site-packages')).joinpath('machine-packages.pth').write_text(outer + '\n')
    missing = [n for n in NEEDS if subprocess.run([str(v/'bin'/'python'), '-c', f'import {IMPORTS.get(n, n)}'], capture_output=True).returncode]
    if missing:
        if not wheels.is_dir(): raise SystemExit(f"missing {', '.join(missing)} and no wheels folder {wheels}: fill it with nbs/benchmarks/pod_wheels.sh")
        say('installing from', wheels, ':', ' '.join(missing))
        subprocess.run([str(v/'bin'/'python'), '-m', 'pip', 'install', '-q', '--no-index', '--find-links', str(wheels), *missing], check=True)
    return time.time() - t0


def metrics_steps(run:Path) -> list[int]:
    f = run/'metrics.jsonl'
    if not f.is_file(): return []
    out = []
    for l in f.read_text().splitlines():
        try: r = json.loads(l)
        except ValueError: continue
        if 'loss' in r and 'step' in r: out.append(int(r['step']))
    return out


def wait(cond, timeout, what, proc=None, calls=None, log=None, n_stops=0):
    "Poll `cond` until it holds; fail at once when PID 1 exits or the pod stops itself through the API before its time."
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (v := cond()): return v
        tail = lambda: '\n'.join(log.read_text().splitlines()[-15:]) if log and log.is_file() else ''
        if proc is not None and proc.poll() is not None: raise RuntimeError(f"PID 1 exited ({proc.returncode}) while waiting for {what}:\n{tail()}")
        if calls is not None and len(stop_calls(calls)) > n_stops:
            raise RuntimeError(f"the pod stopped itself through the API while waiting for {what}:\n{tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def api_calls(path:Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()] if path.is_file() else []


def stop_calls(path:Path) -> list[dict]:
    "The pod's own stop (or terminate) calls, the ones the API took."
    return [c for c in api_calls(path) if c['method'] == 'POST' and c['path'].endswith('/action')
            and (c['body'] or {}).get('action') in ('stop', 'terminate') and c['status'] == 200]


def resume(url:str):
    "What `lmbook pod resume` asks RunPod for: the stopped pod starts again (a new container)."
    req = urllib.request.Request(f'{url}/v2/pods/{POD}/action', json.dumps(dict(action='start')).encode(),
                                 {'Authorization': f'Bearer {KEY}', 'Content-Type': 'application/json'}, method='POST')
    urllib.request.urlopen(req, timeout=30).read()


def container(start, env, calls, log, timeout, pids) -> tuple[subprocess.Popen, int]:
    "PID 1 of a new container, and how many stop calls were taken before it."
    p = subprocess.Popen(start, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    pids.append(p.pid)
    return p, len(stop_calls(calls))


def ended(p, calls, n_stops, timeout) -> dict:
    "Wait for the pod's stop call, then play RunPod: SIGTERM to PID 1, SIGKILL to its group after a grace; the call."
    c = wait(lambda: (s := stop_calls(calls)) and len(s) > n_stops and s[-1], timeout, "the pod's stop call")
    os.kill(p.pid, signal.SIGTERM)
    try: p.wait(30)
    except subprocess.TimeoutExpired: pass
    try: os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError: pass
    p.wait()
    return c


def saved_steps(run:Path) -> list[int]:
    "The steps of the run's complete checkpoints, oldest first."
    return sorted(int(c.parent.name[5:]) for c in (run/'checkpoints').glob('step_*/COMPLETE'))


def after(run:Path, t0:float, stop:float) -> list[dict]:
    "Where the seconds from the final checkpoint (`t0`) to the stop call went: each cell of the newest executed notebook that ran past `t0` (papermill's own times), then the rest."
    from datetime import datetime
    nbs = sorted(run.glob('train-*.ipynb'))
    if not nbs: return [dict(part='no executed notebook', s=round(stop - t0, 1))]
    rows, end = [], t0
    for c in json.loads(nbs[-1].read_text()).get('cells', []):
        pm = c.get('metadata', {}).get('papermill', {})
        if c.get('cell_type') != 'code' or not pm.get('end_time'): continue
        a, b = (datetime.fromisoformat(pm[k].replace('Z', '+00:00')).timestamp() for k in ('start_time', 'end_time'))
        if b <= t0: continue
        first = next((l.strip() for l in ''.join(c.get('source', '')).splitlines() if l.strip() and not l.startswith('#')), '')
        rows.append(dict(part=f'cell: {first[:60]}', s=round(b - max(a, t0), 1)))
        end = max(end, b)
    return rows + [dict(part="papermill's end to the stop call", s=round(stop - end, 1))]


def resumes(run:Path) -> list[int]:
    "The steps the trainer resumed at, in order (its train.log)."
    tl = (run/'train.log').read_text() if (run/'train.log').is_file() else ''
    return [int(s.split()[0].rstrip(')|,')) for s in tl.split('resumed at step ')[1:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--tiny', action='store_true', help='the smoke profile on the CPU (checks the rehearsal itself)')
    ap.add_argument('--profile', default=None); ap.add_argument('--steps', type=int, default=None)
    ap.add_argument('--stop-at', type=int, default=None, help='step at which the container is stopped (default: steps/2 + a few)')
    ap.add_argument('--set', default='', help='more config overrides, k=v,k=v')
    ap.add_argument('--wheels', default=str(ROOT/'nbs'/'benchmarks'/'pod-wheels'))
    ap.add_argument('--work', default=None, help='work folder, kept (default: a scratch folder, removed)')
    ap.add_argument('--out', default=None)
    ap.add_argument('--timeout', type=float, default=900, help='seconds each phase may take')
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit('terminated by SIGTERM'))
    profile = a.profile or ('smoke' if a.tiny else 'runpod_1b')
    steps = a.steps or (40 if a.tiny else 300)
    every = max(2, steps//4)
    stop_at = a.stop_at or steps//2 + max(1, every//3)  # between two checkpoints: a stop without its own checkpoint would lose steps
    ov = (f'dataset=builtin,max_steps={steps},ckpt_every={every},keep_ckpts=1,log_every=1,eval_every={every},eval_steps=2,warmup_steps={min(20, steps//4)},'
          'tensorboard=false') + ('' if a.tiny else ',vocab_size=8192,batch_size=8,grad_accum=1') + (',' + a.set if a.set else '')
    work = Path(a.work) if a.work else scratch('lmbook-pod-rehearsal-')
    if a.work and work.exists(): shutil.rmtree(work)
    ws, src = work/'workspace', work/'src'
    for d in (ws, src, work/'home', work/'tmp'): d.mkdir(parents=True, exist_ok=True)
    card = subprocess.run([sys.executable, '-c', 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"); print(torch.__version__)'],
                          capture_output=True, text=True).stdout.split('\n')
    say(f"{profile}, {steps} steps, stop at step {stop_at}, on {card[0] or '?'} (torch {card[1] if len(card) > 1 else '?'}); work folder {work}")
    if not a.tiny and card[0] in ('cpu', ''): raise SystemExit("no CUDA GPU: run with --tiny on a CPU")
    repo, commit = snapshot(src)
    deps_s = volume_venv(ws/'venvs'/'lmbook', Path(a.wheels))
    start = shlex.split(sh([str(ws/'venvs'/'lmbook'/'bin'/'python'), '-c', 'import sys; sys.path.insert(0, sys.argv[1]); '
                            'from lmbook.pods.runpod import start_command; print(start_command())', str(src)]))
    standin = work/'start.sh'
    standin.write_text('#!/bin/bash\n# stands in for the image\'s /start.sh (sshd, JupyterLab), which then sleeps\nexec sleep infinity\n'); standin.chmod(0o755)
    calls = work/'api-calls.jsonl'
    # the fake runs in the volume's virtualenv, which has lmbook's dependencies (fastcore) where this Python may not
    fake = subprocess.Popen([str(ws/'venvs'/'lmbook'/'bin'/'python'), str(ROOT/'lmbook'/'dev'/'fake_runpod.py'), '--key', KEY, '--pod', POD, '--calls', str(calls)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    url = fake.stdout.readline().strip()
    if not url: raise SystemExit(f"the RunPod fake did not start (exit code {fake.wait()}): its error is above")
    env = {k: v for k, v in os.environ.items() if k in ('PATH', 'LANG', 'LC_ALL', 'CUDA_VISIBLE_DEVICES', 'LD_LIBRARY_PATH')}
    env |= dict(HOME=str(work/'home'), TMPDIR=str(work/'tmp'), LMBOOK_WORKSPACE=str(ws), RUN_CONFIG=profile, RUN_EXPERIMENT=EXP, RUN_SHARD='1', RUN_OVERRIDES=ov,
                AUTOKILL='stop', ON_FAILURE='stop', TENSORBOARD_PORT='0', RUNPOD_POD_ID=POD, RUNPOD_API_KEY=KEY, RUNPOD_API_BASE_URL=url,
                LMBOOK_REPO=repo, LMBOOK_COMMIT=commit, LMBOOK_START=str(standin), PIP_NO_INDEX='1', PIP_NO_DEPS='1',
                PIP_FIND_LINKS=str(Path(a.wheels).resolve()), HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', PYTHONUNBUFFERED='1')
    env['PATH'] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"  # `python3` in the start command: this interpreter
    run, log, pids = ws/'runs'/EXP, ws/'logs'/f'boot-{EXP}.log', []
    res = dict(date=time.strftime('%Y-%m-%d'), card=card[0], torch=card[1] if len(card) > 1 else '', profile=profile, overrides=ov, steps=steps,
               stop_at=stop_at, deps_install_s=round(deps_s, 1))
    try:
        # 1. the first container: start command -> first step, then the trainer killed by SIGKILL mid-run
        t0 = time.time()
        p, n = container(start, env, calls, log, a.timeout, pids)
        wait(lambda: metrics_steps(run), a.timeout, 'the first step', p, calls, log, n)
        res['first_step_s'] = round(time.time() - t0, 1)
        say(f"first step {res['first_step_s']} s after the start command")
        # the kill comes once the checkpoint before `stop_at` is complete (a large one is still being written a few
        # steps after its step on a fast card), so the resume shows what was saved and what was lost
        ck = int(re.findall(r'ckpt_every=(\d+)', ov)[-1])
        due = stop_at//ck*ck
        wait(lambda: max(metrics_steps(run), default=0) >= stop_at and (not due or due in saved_steps(run)), a.timeout,
             f'step {stop_at} and the checkpoint of step {due}', p, calls, log, n)
        trainer = json.loads((run/'.lock').read_text())['pid']
        os.kill(trainer, signal.SIGKILL)  # as the kernel's out-of-memory killer kills
        killed_at, t_kill = max(metrics_steps(run)), time.time()
        c = ended(p, calls, n, a.timeout)
        saved = saved_steps(run)
        said = [l for l in log.read_text().splitlines() if '] pod: the trainer was killed by SIGKILL' in l]
        res |= dict(killed_at_step=killed_at, kill_to_stop_call_s=round(c['t'] - t_kill, 1),
                    kill_newest_checkpoint=saved[-1] if saved else None, kill_log=said[-1].split('] ', 1)[-1] if said else None)
        named = said and (f'step_{saved[-1]:08d}' if saved else 'none') in said[-1]
        say(f"killed at step {killed_at}; the pod stopped itself {res['kill_to_stop_call_s']} s later; log names the checkpoint: {bool(named)}")
        # 2. resumed: a stop request (what `lmbook pod stop` writes) with nobody waiting for it
        resume(url)
        t0 = time.time()
        p, n = container(start, env, calls, log, a.timeout, pids)
        before = len(resumes(run))
        wait(lambda: len(resumes(run)) > before, a.timeout, 'the resume', p, calls, log, n)
        resumed1 = resumes(run)[-1]
        target = resumed1 + max(2, every//3)
        wait(lambda: max(metrics_steps(run), default=0) >= target, a.timeout, f'step {target}', p, calls, log, n)
        (run/'STOP').write_text('lmbook pod stop\n')
        t_stop = time.time()
        c = ended(p, calls, n, a.timeout)
        reached = max(metrics_steps(run))
        tl = (run/'train.log').read_text()
        stopped = [l for l in tl.splitlines() if 'stopped by SIGTERM at step' in l]
        stop_ck = int(stopped[-1].split('at step ')[1].split('/')[0]) if stopped else None
        res |= dict(resumed_after_kill_at_step=resumed1, steps_lost_on_kill=killed_at - resumed1, stop_request_at_step=target,
                    step_reached_before_stop=reached, stop_checkpoint_step=stop_ck, steps_lost_on_stop=reached - (stop_ck or 0),
                    stop_request_to_stop_call_s=round(c['t'] - t_stop, 1))
        say(f"resumed at {resumed1}; stop request at step {target}: checkpoint at {stop_ck} (reached {reached}); the pod stopped itself {res['stop_request_to_stop_call_s']} s later")
        # 3. resumed again: the run finishes, and the pod stops itself once, after the final checkpoint
        resume(url)
        t0 = time.time()
        p, n = container(start, env, calls, log, a.timeout, pids)
        before = len(resumes(run))
        wait(lambda: len(resumes(run)) > before, a.timeout, 'the second resume', p, calls, log, n)
        res['resumed_after_stop_at_step'] = resumes(run)[-1]
        res['first_step_after_resume_s'] = round(time.time() - t0, 1)
        c = ended(p, calls, n, 2*a.timeout)
        final = run/'checkpoints'/f'step_{steps:08d}'/'COMPLETE'
        res |= dict(final_checkpoint=final.is_file(), final_call=c['body'], final_call_status=c['status'],
                    stop_after_final_checkpoint=final.is_file() and c['t'] >= final.stat().st_mtime,
                    idle_s_final_checkpoint_to_stop_call=round(c['t'] - final.stat().st_mtime, 1) if final.is_file() else None)
        say(f"finished; the pod stopped itself {res['idle_s_final_checkpoint_to_stop_call']} s after the final checkpoint")
        if final.is_file(): res['after_final_checkpoint'] = after(run, final.stat().st_mtime, c['t'])
        res['api_calls'] = [dict(method=c['method'], path=c['path'], status=c['status'], body=c['body']) for c in api_calls(calls)]
        res['ok'] = bool(named and not any('after writing its checkpoint' in l for l in said)
                         and resumed1 == (saved[-1] if saved else 0) and stop_ck == reached == resumes(run)[-1]
                         and res['stop_after_final_checkpoint'] and len(stop_calls(calls)) == 3)
    except BaseException as e:  # a SIGTERM (a time limit) too: the JSON keeps what was measured
        res |= dict(ok=False, error=f"{type(e).__name__}: {e}")
        raise
    finally:
        for pid in pids:
            try: os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError: pass
        os.killpg(fake.pid, signal.SIGTERM)
        if log.is_file(): shutil.copy(log, work/'boot.log')
        out = Path(a.out or (Path(os.environ['OUT'])/'pod_rehearsal.json' if os.environ.get('OUT') else 'pod_rehearsal.json'))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + '\n')
        boot = Path(os.environ['OUT'])/'boot.log' if os.environ.get('OUT') else out.with_suffix('.boot.log')
        if log.is_file(): shutil.copy(log, boot)
        say('wrote', out)
    print(json.dumps({k: v for k, v in res.items() if k != 'api_calls'}, indent=1))
    if not res['ok']: raise SystemExit('the rehearsal found a problem: see the JSON and the boot log')


if __name__ == '__main__': main()
