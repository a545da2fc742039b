"""The money matrix's bench: one pod container per cell, run on this machine as RunPod runs one. The pod's
exact start command is PID 1 of a session of its own, over a fresh workspace, against the REST v2 fake; the
real `lmbook boot` runs the stand-in trainer (tests/pod_trainer.py). A cell ends the run one way (finished,
failed, SIGKILL of the trainer, boot crashing, SIGKILL of the supervisor, a trainer that hangs deaf to
stops, a STOP request, a container stop, the spend cap, a failed install, a failed data stage) while the
API answers, is down 3 minutes from the pod's first stop call, or never answers. The bench plays RunPod's
part too: a pod the API stopped gets SIGTERM, then its processes are killed; a container whose PID 1 exits
leaves its pod EXITED. Every pod-side wait runs LMBOOK_TIME_SCALE = 60 times faster, and so does the fake's
clock: three minutes of outage take three seconds."""
import json, os, shlex, signal, subprocess, sys, threading, time
from dataclasses import dataclass, field
from pathlib import Path
from lmbook.dev.fake_runpod import FakeRunPodV2, serve
from lmbook.pods.runpod import start_command
from test_pod_start import end_container, volume_venv  # as the start-command tests make and end them

ROOT = Path(__file__).resolve().parents[1]
SCALE = 60                       # pod seconds a wall second
KEY, POD, EXP = 'rpa_PODSCOPEDkey42', 'pod1234abc', 'mx'
STEPS, EVERY, DT, AT = 30, 10, 0.25, 14  # the trainer's steps, checkpoint interval, seconds a step; the step
                                         # at which a kill, a stop request or a container stop comes
STALL_S = 3                      # wall seconds without a metrics line before boot stops the trainer
CAP_H = 0.2                      # the spend cap's hours: 12 pod minutes, mid-way through the cap's longer run
ENDINGS = ('finished', 'failed', 'SIGKILL of the trainer', 'boot crashes', 'SIGKILL of the supervisor',
           'trainer hangs', 'STOP request', 'container SIGTERM', 'spend cap', 'failed install',
           'failed data stage')
APIS = ('answering', 'down 3 min', 'down for good')
LIMIT_MIN = {'answering': 2, 'down 3 min': 3 + 2, 'down for good': 10 + 2}  # billed minutes after the end
UNFINISHED = ('container SIGTERM', 'SIGKILL of the supervisor')  # the container ends before the run
GRACE_S = 10                     # pod seconds RunPod gives a stopped container before it kills it
# ... on this machine at least 2 s: at 60x, 10 pod seconds are 0.17 s, in which a loaded 2-core machine
# once let the supervisor be killed before RunPod's answer to its own stop call reached it (a broken pipe)
GRACE_WALL_S = max(GRACE_S/SCALE, 2.0)


def alive(pid:int) -> bool:
    try: os.kill(pid, 0)
    except ProcessLookupError: return False
    try: return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError: return False


def ppid(pid:int) -> int:
    try: return int(Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[1])
    except OSError: return 0


@dataclass
class Cell:
    "One way a run ends, under one state of the API."
    ending: str
    api: str
    root: Path
    venv: Path
    out: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:  # outages alternate between refused and hanging connections, row by row
        return ('refuse', 'hang')[ENDINGS.index(self.ending) % 2]

    def env(self, url:str) -> dict:
        ws = self.root/'workspace'
        start = self.root/'start.sh'  # the image's own start script (sshd, JupyterLab): it sleeps
        start.write_text('#!/bin/bash\nexec sleep 600\n')
        start.chmod(0o755)
        base = {k: v for k, v in os.environ.items() if k in ('PATH', 'LANG')}
        steps = 2*STEPS if self.ending == 'spend cap' else STEPS  # a run that lasts past the cap
        trainer = (f"{sys.executable} {ROOT/'tests'/'pod_trainer.py'} --steps {steps} --every {EVERY} "
                   f"--dt {DT}" + (' --fail-at 12' if self.ending == 'failed' else '')
                   + (f' --hang-at {AT}' if self.ending == 'trainer hangs' else ''))
        env = base | dict(HOME=str(self.root/'home'), TMPDIR=str(self.root/'tmp'), LMBOOK_WORKSPACE=str(ws),
                          RUN_EXPERIMENT=EXP, RUN_CONFIG='smoke', RUN_OVERRIDES=f'max_steps={steps}',
                          RUNPOD_POD_ID=POD, RUNPOD_API_KEY=KEY, RUNPOD_API_BASE_URL=url,
                          LMBOOK_START=str(start), LMBOOK_REPO=f'file://{ROOT}', LMBOOK_SRC=str(ROOT),
                          LMBOOK_COMMIT='', LMBOOK_VENV=str(self.venv), LMBOOK_TRAIN_CMD=trainer,
                          LMBOOK_TIME_SCALE=str(SCALE), LMBOOK_T0=f'{time.time():.3f}', TENSORBOARD_PORT='0',
                          HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', PYTHONUNBUFFERED='1')
        if self.ending == 'finished': env['AUTOKILL'] = 'terminate'
        if self.ending == 'spend cap': env['MAX_HOURS'] = f'{CAP_H}'
        if self.ending == 'trainer hangs': env['STALL_MINUTES'] = f'{STALL_S/60:g}'
        if self.ending == 'failed install': env |= dict(LMBOOK_SRC=str(self.root/'src'),
                                                        LMBOOK_REPO=f'file://{self.root}/no-such-repo.git')
        if self.ending == 'failed data stage':
            env |= dict(RUN_SHARD='1', RUN_INPUT=str(self.root/'missing.txt'))
        return env

    def run(self, timeout:float=90) -> dict:
        "Run the cell's container to its end (after an end the API never took, its restart too); the results."
        for d in ('workspace', 'home', 'tmp'): (self.root/d).mkdir(parents=True, exist_ok=True)
        fake = FakeRunPodV2(KEY)
        t0 = time.monotonic()
        fake.clock = lambda: t0 + (time.monotonic() - t0)*SCALE
        srv, url = serve(fake)
        vol = dict(network=[dict(volumeId='vol123abc', path='/workspace')])
        fake.add_pod(POD, name='mx', mounts=vol)
        if self.api == 'down 3 min': fake.down(180, kind=self.kind, on=r'POST /v2/pods/.*/action')
        if self.api == 'down for good': fake.down(10**9, kind=self.kind)
        env = self.env(url)
        try:
            self.out = self.container(fake, env, timeout)
            # after a container stop RunPod is ending the pod: it does not start it again
            restart = self.api == 'down for good' and self.ending != 'container SIGTERM'
            if restart: self.out['restart'] = self.restarted(fake, env, timeout)
        finally:
            self.kill_all()
            srv.shutdown()
        return self.out

    def container(self, fake, env:dict, timeout:float, act:bool=True) -> dict:
        "Start PID 1, end the run the cell's way, play RunPod's part until the container is gone."
        run, log = self.root/'workspace'/'runs'/EXP, self.root/'workspace'/'logs'/f'boot-{EXP}.log'
        p1 = subprocess.Popen(shlex.split(start_command()), env=env, start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t_end = trainer = boot = None
        fired, stopped_at, t0 = False, None, time.monotonic()
        while time.monotonic() - t0 < timeout:
            time.sleep(0.02)
            steps = self.steps()
            if act and trainer is None and (run/'.lock').is_file():
                try: trainer = int(json.loads((run/'.lock').read_text())['pid'])
                except (ValueError, KeyError, OSError): pass
                boot = trainer and ppid(trainer)
            if not fired and steps and max(steps) >= AT and trainer:
                fired = self.fire(p1, run, trainer, boot)
                if self.ending in ('SIGKILL of the trainer', *UNFINISHED): t_end = fake.billed_s(POD)
            if t_end is None: t_end = self.end_seen(fake, log, trainer)
            status = fake.pods[POD]['status'] if POD in fake.pods else 'TERMINATED'
            if status not in ('RUNNING', 'STARTING') and p1.poll() is None:  # RunPod stops the container
                if stopped_at is None:
                    stopped_at = time.monotonic()
                    os.kill(p1.pid, signal.SIGTERM)
                elif time.monotonic() - stopped_at > GRACE_WALL_S: self.kill_all()
            if p1.poll() is not None:
                fake.container_exited(POD)
                break
        timed_out = p1.poll() is None  # still up (and billing, unless the API stopped it) at the time limit
        self.kill_all()
        billed = fake.billed_s(POD)
        p1.wait()
        return dict(status=fake.pods[POD]['status'] if POD in fake.pods else 'TERMINATED', rc=p1.returncode,
                    billed_min=billed/60, after_end_min=(billed - (billed if t_end is None else t_end))/60,
                    end_seen=t_end is not None, log=log.read_text() if log.is_file() else '',
                    steps=max(self.steps(), default=0), saved=self.saved(), stops=len(self.stop_calls(fake)),
                    timed_out=timed_out)

    def fire(self, p1, run:Path, trainer:int, boot:int) -> bool:
        "End the run the cell's way, from outside."
        if self.ending == 'SIGKILL of the trainer': os.kill(trainer, signal.SIGKILL)
        elif self.ending == 'boot crashes': os.kill(boot, signal.SIGKILL)
        elif self.ending == 'SIGKILL of the supervisor':  # as the kernel's out-of-memory killer kills
            os.kill(ppid(boot), signal.SIGKILL)
        elif self.ending == 'STOP request':  # as `lmbook pod stop` writes it; then the laptop is gone
            (run/'STOP').write_text('lmbook pod stop\n')
        elif self.ending == 'container SIGTERM':  # to PID 1, as docker stop sends it; or to its process group
            (os.kill if self.api == 'answering' else os.killpg)(p1.pid, signal.SIGTERM)
        return True

    def end_seen(self, fake, log:Path, trainer) -> float|None:
        "The pod's bill when the run's end shows: the trainer gone, the cap reached, the stage failed."
        if self.ending == 'spend cap':
            return CAP_H*3600 if fake.billed_s(POD) >= CAP_H*3600 else None
        if self.ending in ('failed install', 'failed data stage'):
            txt = log.read_text() if log.is_file() else ''
            said = 'git clone' if self.ending == 'failed install' else 'does not exist'
            return fake.billed_s(POD) if said in txt else None
        if trainer and not alive(trainer): return fake.billed_s(POD)
        return None

    def restarted(self, fake, env:dict, timeout:float) -> dict:
        "RunPod starts the exited container again, with the API back: it must stop the pod, not train again."
        fake.down_until = 0.0
        fake.set_status(fake.pods[POD], 'RUNNING')
        before, b0 = self.steps(), fake.billed_s(POD)
        out = self.container(fake, env, timeout, act=False)
        return dict(status=out['status'], billed_min=(fake.billed_s(POD) - b0)/60,
                    trained=self.steps() != before, log=out['log'])

    def steps(self) -> list[int]:
        f = self.root/'workspace'/'runs'/EXP/'metrics.jsonl'
        return [json.loads(l)['step'] for l in f.read_text().splitlines() if l.strip()] if f.is_file() else []

    def saved(self) -> list[int]:
        ck = self.root/'workspace'/'runs'/EXP/'checkpoints'
        return sorted(int(p.parent.name[5:]) for p in ck.glob('step_*/COMPLETE'))

    @staticmethod
    def stop_calls(fake) -> list:
        return [b for m, p, b in fake.calls('POST', f'/v2/pods/{POD}/action')]

    def kill_all(self):
        "Kill every process of this cell's container."
        end_container(self.root/'workspace')


def run_matrix(root:Path, cells:list[tuple[str, str]]|None=None, timeout:float=90,
               parallel:bool=True) -> dict:
    "Every cell at once, each in its own thread and folder; {(ending, api): results}."
    venv = volume_venv(root/'venv')
    cells = [Cell(e, a, root/f'{i:02d}', venv) for i, (e, a) in
             enumerate(cells or [(e, a) for e in ENDINGS for a in APIS])]
    errors = {}
    def one(c):
        try: c.run(timeout)
        except BaseException as e: errors[(c.ending, c.api)] = e
    threads = [threading.Thread(target=one, args=(c,)) for c in cells]
    for t in threads:
        t.start()
        if not parallel: t.join()
    for t in threads: t.join()
    for k, e in errors.items(): raise AssertionError(f"cell {k}: {e}") from e
    return {(c.ending, c.api): dict(c.out, kind=c.kind) for c in cells}
