"""The modules a config passes through: `lmbook train -p smoke` to the first optimizer step and to the end of `train`.

A profile hook sees every call into an `lmbook` function that takes the run's `Config` (positionally or by
keyword). A call whose module differs from its caller's is a step into that module; a module's visits are its
steps in. Steps into the config's own home (`lmbook.config`, `lmbook.overrides`, `lmbook.profiles`) are counted
apart. A second count also takes
calls given one of its sections (`ModelConfig`, `DataConfig`, `TrainConfig` and its own), such as a model's own `cfg`.
A third looks inside one module (`--module`, default the run's build stage, `lmbook.train.runstart`): its visits
are the calls of its functions given the run's `Config` from anywhere, its own calls included (a nested function
or a lambda counts with the function that defines it), and its hand-offs the calls its functions make into
other modules' functions given the config or a section (`lmbook.config` included): each climbs back into it.
    python nbs/benchmarks/cfg_walk.py [--steps 3] [--module lmbook.train.runstart] [--json OUT]
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

def nested(code) -> bool:
    "Whether `code` is a nested function or a lambda: part of the function that defines it."
    return '<locals>' in getattr(code, 'co_qualname', '') or code.co_name.startswith('<')

def walk(argv:list[str], module:str='lmbook.train.runstart') -> dict:
    "Run `lmbook` with `argv` under the hook; the steps into modules before the first optimizer step and in all."
    from lmbook import config
    from lmbook.cli import main
    parts = tuple(config.config_sections().values())
    steps, wide, marks = [], [], {}
    inside = dict(visits=collections.Counter(), handoffs=collections.Counter())
    def hook(frame, event, arg):
        if event != 'call': return
        mod = frame.f_globals.get('__name__', '')
        if not mod.startswith('lmbook'): return
        if frame.f_code.co_name == 'train_step' and not marks: marks.update(first=len(steps), wide=len(wide))
        whole, part = config_arg(frame, config.Config), config_arg(frame, parts)
        if not (whole or part): return
        caller = frame.f_back.f_globals.get('__name__', '') if frame.f_back else ''
        if mod == module and whole and not nested(frame.f_code): inside['visits'][frame.f_code.co_name] += 1
        if caller == module and mod != module:
            inside['handoffs'][f"{mod.removeprefix('lmbook.')}.{frame.f_code.co_name}"] += 1
        if caller == mod: return
        if whole: steps.append((caller, mod, frame.f_code.co_name))
        wide.append((caller, mod, frame.f_code.co_name))
    sys.setprofile(hook)
    try: rc = main(argv)
    finally: sys.setprofile(None)
    assert rc == 0, f"lmbook {' '.join(argv)} exited {rc}"
    return dict(first_step=summary(steps[:marks['first']]), end=summary(steps),
                first_step_sections=summary(wide[:marks['wide']]), end_sections=summary(wide),
                module=dict(name=module, visits=sum(inside['visits'].values()),
                            handoffs=sum(inside['handoffs'].values()), visited=dict(inside['visits']),
                            handed=dict(inside['handoffs'])))

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
    ap.add_argument('--module', default='lmbook.train.runstart', help='the module whose visits are counted')
    ap.add_argument('--json', default='', help='also write the result (with the call path) here')
    a = ap.parse_args()
    root = scratch('cfg-walk-')
    res = walk(['train', '-p', 'smoke', '-e', 'walk', '--root', str(root),
                '--set', f'max_steps={a.steps}', 'eval_every=2', 'ckpt_every=2', 'tensorboard=false'], a.module)
    m = res['module']
    print(f"{m['name']}: {m['visits']} visits {m['visited']}; {m['handoffs']} hand-offs out {m['handed']}")
    for k, r in ((k, r) for k, r in res.items() if k != 'module'):
        print(f"{k}: {r['modules']} modules, {r['steps']} steps in (and {r['config_steps']} into lmbook.config), "
              f"at most {r['max_visits']} visits: {r['visits']}")
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1))

if __name__ == '__main__': main()
