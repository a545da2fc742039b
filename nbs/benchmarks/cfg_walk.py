"""The modules a config passes through: `lmbook train -p smoke` to the first optimizer step and to the end of `train`.

A profile hook sees every call into an `lmbook` function that takes the run's `Config` (positionally or by
keyword). A call whose module differs from its caller's is a step into that module; a module's visits are its
steps in. Steps into the config's own home (`lmbook.config`, `lmbook.overrides`, `lmbook.profiles`) are counted
apart. A second count also takes
calls given one of its sections (`ModelConfig`, `DataConfig`, `TrainConfig` and its own), such as a model's own `cfg`.
    python nbs/benchmarks/cfg_walk.py [--steps 3] [--json OUT]
The workspace is a scratch folder removed when the script ends (see scratch.py).
"""
import argparse, collections, json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch

def config_arg(frame, kinds) -> bool:
    "Whether the function of `frame` was called with a config (or a section) among its arguments."
    co = frame.f_code
    n = co.co_argcount + co.co_kwonlyargcount
    return any(isinstance(frame.f_locals.get(v), kinds) for v in co.co_varnames[:n])

def walk(argv:list[str]) -> dict:
    "Run `lmbook` with `argv` under the hook; the steps into modules before the first optimizer step and in all."
    from lmbook import config
    from lmbook.cli import main
    parts = tuple(config.config_sections().values())
    steps, wide, marks = [], [], {}
    def hook(frame, event, arg):
        if event != 'call': return
        mod = frame.f_globals.get('__name__', '')
        if not mod.startswith('lmbook'): return
        if frame.f_code.co_name == 'train_step' and not marks: marks.update(first=len(steps), wide=len(wide))
        whole, part = config_arg(frame, config.Config), config_arg(frame, parts)
        if not (whole or part): return
        caller = frame.f_back.f_globals.get('__name__', '') if frame.f_back else ''
        if caller == mod: return
        if whole: steps.append((caller, mod, frame.f_code.co_name))
        wide.append((caller, mod, frame.f_code.co_name))
    sys.setprofile(hook)
    try: rc = main(argv)
    finally: sys.setprofile(None)
    assert rc == 0, f"lmbook {' '.join(argv)} exited {rc}"
    return dict(first_step=summary(steps[:marks['first']]), end=summary(steps),
                first_step_sections=summary(wide[:marks['wide']]), end_sections=summary(wide))

CONFIG_HOME = ('lmbook.config', 'lmbook.overrides', 'lmbook.profiles')  # the config's own modules

def summary(steps:list) -> dict:
    "Modules crossed, steps in, and visits per module (those into `lmbook.config` counted apart)."
    outside = [s for s in steps if s[1] not in CONFIG_HOME]
    visits = collections.Counter(m for _, m, _ in outside)
    return dict(modules=len(visits), steps=len(outside), config_steps=len(steps) - len(outside),
                max_visits=max(visits.values(), default=0), visits=dict(visits.most_common()),
                path=[f"{c.removeprefix('lmbook.')} -> {m.removeprefix('lmbook.')}.{f}" for c, m, f in outside])

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--steps', type=int, default=3, help='optimizer steps of the smoke run')
    ap.add_argument('--json', default='', help='also write the result (with the call path) here')
    a = ap.parse_args()
    root = scratch('cfg-walk-')
    res = walk(['train', '-p', 'smoke', '-e', 'walk', '--root', str(root),
                '--set', f'max_steps={a.steps}', 'eval_every=2', 'ckpt_every=2', 'tensorboard=false'])
    for k, r in res.items():
        print(f"{k}: {r['modules']} modules, {r['steps']} steps in (and {r['config_steps']} into lmbook.config), "
              f"at most {r['max_visits']} visits: {r['visits']}")
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1))

if __name__ == '__main__': main()
