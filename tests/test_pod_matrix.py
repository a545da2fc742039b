"""The money matrix: every way a pod's run ends, under every state of RunPod's API, run through the pod's
real start command and `lmbook boot` (tests/pod_matrix.py). Each cell asserts that the pod ends EXITED (or
TERMINATED after a finished run with --autokill), how many billed minutes it may take after the run ended,
what the boot log says, and that no step is lost that the ending allowed to save. After an end the API never
took, the container starts again as RunPod may restart it: it must stop the pod at once, not train again.
The table in the pods chapter (nbs/07_pods.ipynb) is rendered from these results; `LMBOOK_WRITE_MATRIX=1`
rewrites it."""
import json, os, re
from pod_matrix import run_matrix, LIMIT_MIN, STEPS, EVERY, ROOT

DOC, MARK = ROOT/'nbs'/'07_pods.ipynb', '<!-- the money matrix: written by tests/test_pod_matrix.py -->'
STOPS = ('STOP request', 'container SIGTERM', 'spend cap')  # endings that ask the trainer to save first
SAYS = {  # ending -> (what the boot log says, as a regex; the same in words for the table)
    'finished': (rf'the run finished \(step_{STEPS:08d} complete\)', 'the run finished (step_N complete)'),
    'failed': (rf'the trainer ended \(exit code 1\); the newest complete checkpoint is step_{EVERY:08d}',
               'the trainer ended (exit code 1); ... is step_N'),
    'SIGKILL of the trainer': (rf"the trainer was killed by SIGKILL, as the kernel's out-of-memory killer "
                               rf"kills.*; the newest complete checkpoint is step_{EVERY:08d}",
                               "the trainer was killed by SIGKILL, as ... out-of-memory ... is step_N"),
    'boot crashes': (rf'the run finished \(step_{STEPS:08d} complete\) after lmbook boot ended '
                     r'\(killed by SIGKILL\)',
                     'the run finished (step_N complete) after lmbook boot ended (killed by SIGKILL)'),
    'SIGKILL of the supervisor': (r'the supervisor was killed \(exit code 137\): the container ends',
                                  'the supervisor was killed (exit code 137): the container ends'),
    'trainer hangs': (r'the trainer logged nothing for 0.05 min \(STALL_MINUTES\) and was stopped; the '
                      rf'newest complete checkpoint is step_{EVERY:08d}',
                      'the trainer logged nothing for M min (STALL_MINUTES) and was stopped; ... is step_N'),
    'STOP request': (r'the run stopped on a stop request at step (\d+)',
                     'the run stopped on a stop request at step N'),
    'container SIGTERM': (r'the container got SIGTERM: the run checkpointed',
                          'the container got SIGTERM: the run checkpointed'),
    'spend cap': (r'the spend cap: the pod has billed [\d.]+ h, over --max-hours',
                  'the spend cap: the pod has billed H h, over --max-hours H'),
    'failed install': (r'the install failed \(git clone file://\S+/no-such-repo.git failed\)',
                       'the install failed (git clone URL failed)'),
    'failed data stage': (r'error: .*missing.txt does not exist', 'error: FILE does not exist'),
}
ENDED = {'answering': 'RunPod took the {action}', 'down 3 min': 'RunPod took the {action}',
         'down for good': "RunPod's API did not take the {action} in 10 min: ending the container"}


def expected(ending:str, api:str) -> tuple[str|None, str]:
    "(the action the pod's end takes, the status the pod ends in)."
    if ending == 'container SIGTERM': return None, 'EXITED'  # the container exits: RunPod is ending the pod
    if ending == 'SIGKILL of the supervisor': return None, 'EXITED'  # the container exits: nothing is left
    action = 'terminate' if ending == 'finished' else 'stop'
    return action, 'TERMINATED' if action == 'terminate' and api != 'down for good' else 'EXITED'


def saved_ok(ending:str, r:dict) -> tuple[bool, str]:
    "(whether every step the ending allowed to save is saved, what that is in words)."
    last = r['saved'][-1] if r['saved'] else 0
    if ending in ('finished', 'boot crashes'): return last == STEPS, 'the final step'
    if ending in STOPS: return last == r['steps'], 'the step reached'
    if ending in ('failed', 'SIGKILL of the trainer', 'trainer hangs'):
        return last == EVERY and r['steps'] > EVERY, 'the checkpoint before, named'
    if ending == 'SIGKILL of the supervisor':  # the container's end kills the trainer as it stands
        return last == EVERY and r['steps'] > EVERY, 'the checkpoint before'
    return r['steps'] == 0 and not r['saved'], '(none trained)'


def problems(ending:str, api:str, r:dict) -> list[str]:
    "What is wrong with one cell's results."
    at, bad = f"{ending} / {api}:", []
    action, status = expected(ending, api)
    if r['status'] != status: bad.append(f"{at} the pod is {r['status']}, not {status}")
    if r['timed_out']: bad.append(f"{at} the container was still up at the time limit")
    if not r['end_seen'] or r['after_end_min'] > LIMIT_MIN[api]:
        bad.append(f"{at} {r['after_end_min']:.1f} billed minutes after the run ended, over {LIMIT_MIN[api]}")
    if not re.search(f"pod: .*{SAYS[ending][0]}", r['log']):
        bad.append(f"{at} the log does not say: {SAYS[ending][1]}")
    if action and ENDED[api].format(action=action) not in r['log']:
        bad.append(f"{at} the log does not say: {ENDED[api].format(action=action)}")
    if 'after writing its checkpoint' in r['log']: bad.append(f"{at} the log claims a checkpoint")
    ok, what = saved_ok(ending, r)
    if not ok: bad.append(f"{at} saved {r['saved']} after {r['steps']} steps, not {what}")
    again = 'TERMINATED' if action == 'terminate' else 'EXITED'
    s = r.get('restart')
    if s and ending == 'SIGKILL of the supervisor':  # the run was not over: started again, it resumes
        if not (s['status'] == 'EXITED' and s['trained'] and
                re.search(rf'pod: the run finished \(step_{STEPS:08d} complete\)', s['log'])):
            bad.append(f"{at} started again, the run did not resume and finish: {s['status']}, "
                       f"trained {s['trained']}")
    elif s and not (s['status'] == again and not s['trained'] and s['billed_min'] <= 2
                    and 'started again after its run ended' in s['log']):
        bad.append(f"{at} a restarted container did not end the pod at once: {s['status']}, trained again "
                   f"{s['trained']}, {s['billed_min']:.1f} billed minutes")
    return bad


def render(res:dict) -> str:
    "The matrix as the pods chapter shows it."
    rows = [MARK, '', "| the run ends | RunPod's API | the pod ends | billed after, at most | the boot log "
            "says | saved |", '|---|---|---|---|---|---|']
    for (ending, api), r in res.items():
        state = api if api == 'answering' else f"{api}, {dict(refuse='refused', hang='hanging')[r['kind']]}"
        again = r.get('restart')
        how = 'resumes, then ' if ending == 'SIGKILL of the supervisor' else ''
        ends = r['status'] + (f"; started again: {how}{again['status']}" + ('' if how else ' at once')
                              if again else '')
        rows.append(f"| {ending} | {state} | {ends} | {LIMIT_MIN[api]} min | {SAYS[ending][1]} | "
                    f"{saved_ok(ending, r)[1]} |")
    return '\n'.join(rows)


def test_every_way_a_run_ends_stops_the_bill_under_every_api_state(tmp_path):
    res = run_matrix(tmp_path)
    bad = [p for (e, a), r in res.items() for p in problems(e, a, r)]
    assert not bad, '\n'.join(bad)
    table, nb = render(res), json.loads(DOC.read_text())
    (cell,) = [c for c in nb['cells'] if ''.join(c['source']).startswith(MARK)]
    if os.environ.get('LMBOOK_WRITE_MATRIX'):
        cell['source'] = [l + '\n' for l in table.split('\n')[:-1]] + [table.split('\n')[-1]]
        DOC.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    assert ''.join(cell['source']) == table, ("the money matrix in nbs/07_pods.ipynb is not this test's: "
                                              "rerun with LMBOOK_WRITE_MATRIX=1 and commit it")
