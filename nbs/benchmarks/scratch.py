"""Scratch folders for the benchmark scripts, removed when the script's process ends.

The GPU machines run the scripts one after another on one 64 GB disk, so nothing a script writes for its own
use (a random 7B model, run workspaces with checkpoints, prepared tokens) may outlive it: only what it reports
stays (its OUT file). `scratch(prefix)` makes a fresh folder under $TMPDIR and removes it, with everything in
it, when the process ends: on success, on an error, on Ctrl-C, and on SIGTERM or SIGHUP, which by default end
Python at once, skipping the removal; here they raise SystemExit instead, so `finally` blocks run too
(`subprocess.run` then kills its child first). Only SIGKILL leaves the folder behind. Processes forked by
multiprocessing (DataLoader workers) leave it alone: they end without running exit handlers.
"""
import atexit, shutil, signal, sys, tempfile, threading
from pathlib import Path


def _exit(signum, frame): sys.exit(128 + signum)


def exit_on_signals():
    "SIGTERM and SIGHUP raise SystemExit (status 128 + the signal) where they would end the process at once."
    if threading.current_thread() is not threading.main_thread(): return
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) == signal.SIG_DFL: signal.signal(s, _exit)


def scratch(prefix:str='lmbook-bench-', # start of the folder's name
            root:Path|str|None=None, # where to make it (default: $TMPDIR, else /tmp)
           ) -> Path:
    "A fresh empty folder that is removed, with everything in it, when this process ends."
    exit_on_signals()
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d
