"""Two nodes on one machine, as on two: two `lmbook train --torchrun-args "--nnodes 2 --node-rank N ..."`
launchers meet in a c10d rendezvous on 127.0.0.1 (gloo, one process a node). HSDP trains and writes sharded
checkpoints; killing one node's torchrun ends both nodes within seconds, in one line each; the run then
resumes on one process (another node count) from the newest checkpoint, at the same tokens a step."""
import os, re, socket, signal, subprocess, sys, threading, time
from pathlib import Path
import pytest
from conftest import rows
from lmbook.profiles import get_config
from lmbook.distributed import check_parallel
from lmbook.runs.checkpoint.formats import is_sharded
from lmbook.runs.checkpoint.resume import latest_checkpoint
from lmbook.runlock import LOCK, lock_state
from lmbook.train.trainer import train


def _fsdp_cpu_ok():
    try: check_parallel('hsdp', 'cpu'); return True
    except ValueError: return False
pytestmark = pytest.mark.skipif(not _fsdp_cpu_ok(), reason='FSDP2 on the CPU needs torch >= 2.6')

# 2 nodes x 1 process x batch 4 x 64 tokens: 512 tokens a step
TINY = dict(take=2000, block_size=64, n_embd=64, n_head=2, eval_every=4, eval_steps=2, log_every=1,
            max_steps=400, warmup_steps=3, ckpt_every=4, keep_ckpts=2, tensorboard=False, batch_size=4,
            schedule='wsd', decay_frac=0.0, parallel='hsdp')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Node:
    "One node's `lmbook train`, its output collected as it comes."
    def __init__(self, ws, exp, rank, port):
        flags = (f'--nnodes 2 --node-rank {rank} --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} '
                 f'--rdzv-id {exp}')
        args = ['train', '-p', 'smoke', '-e', exp, '--root', str(ws), '--torchrun-args', flags,
                *[f'--set={k}={v}' for k, v in TINY.items()]]
        self.p = subprocess.Popen([sys.executable, '-m', 'lmbook.cli', *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                  env=dict(os.environ, LMBOOK_NODE_TIMEOUT_S='5'))
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True)
        self.reader.start()

    def step(self) -> int:
        return max([int(m[1]) for l in self.lines if (m := re.match(r'step\s+(\d+)/', l))], default=0)

    def torchrun(self) -> int:
        out = subprocess.run(['pgrep', '-P', str(self.p.pid), '-f', 'torch.distributed.run'],
                             capture_output=True, text=True).stdout.split()
        return int(out[0])

    def end(self, timeout) -> tuple[int, list[str]]:
        rc = self.p.wait(timeout)
        self.reader.join(5)
        return rc, [l.strip() for l in self.lines if l.startswith('error:')]


def whole(d:Path) -> bool:
    return latest_checkpoint(d, hashes=False, warn=lambda m: None) is not None


def test_killing_one_nodes_agent_ends_both_in_a_line_each_then_one_process_resumes(ws):
    exp, port = 'two-nodes', free_port()
    nodes = [Node(ws, exp, r, port) for r in (0, 1)]
    try:
        t0 = time.time()
        # killed once a checkpoint is whole (under load one may still be in flight at step 6)
        while max(n.step() for n in nodes) < 6 or not whole(Path(ws)/'runs'/exp/'checkpoints'):
            assert time.time() - t0 < 240 and all(n.p.poll() is None for n in nodes), nodes[0].lines[-20:]
            time.sleep(0.2)
        os.kill(nodes[1].torchrun(), signal.SIGKILL)
        t_kill = time.time()
        (rc0, err0), (rc1, err1) = nodes[0].end(60), nodes[1].end(60)
        took = time.time() - t_kill
    finally:
        for n in nodes:
            if n.p.poll() is None: os.killpg(n.p.pid, signal.SIGKILL)
    out = ''.join(nodes[0].lines + nodes[1].lines)
    assert took < 20 and 'Traceback' not in out, (took, out[-3000:])
    assert rc1 == 137 and len(err1) == 1 and err1[0].startswith(
        "error: torchrun (this node's agent) was killed by SIGKILL"), err1
    assert rc0 == 1 and len(err0) == 1, err0
    assert err0[0].startswith('error: node 1 failed: the training on this node stopped with it'), err0
    assert 'the same command on every node resumes from the newest checkpoint' in err0[0] + err1[0]
    # the newest that verifies: one the kill cut short is skipped on resume
    ck = latest_checkpoint(Path(ws)/'runs'/exp/'checkpoints', warn=lambda m: None)
    at = int(ck.name[5:])
    assert at >= 4 and is_sharded(ck)
    # node 0's training process may still be closing after its agent returned: the rerun waits for its lock
    lock, t0 = Path(ws)/'runs'/exp/LOCK, time.time()
    while lock_state(lock)[0] is not None and lock_state(lock)[1] is None and time.time() - t0 < 30:
        time.sleep(0.2)
    assert lock_state(lock)[1] is not None or lock_state(lock)[0] is None, lock.read_text()
    # one process, one node: the 2 nodes' parts resharded, grad_accum 2 keeps the 512 tokens a step
    log = []
    train(get_config('smoke', {**TINY, 'max_steps': at + 2}), exp, root=ws,
          log=lambda *a: log.append(' '.join(map(str, a))))
    assert any(f'resumed at step {at}' in l for l in log)
    assert any('grad_accum 1 -> 2 keeps 512' in l for l in log)
    got = [r for r in rows(Path(ws)/'runs'/exp) if r.get('loss') is not None]
    assert [r['tokens'] for r in got][-2:] == [(at + 1)*512, (at + 2)*512]
