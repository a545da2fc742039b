"""`lmbook eval` on a tiny trained run: validation numbers that match the trainer's, HellaSwag from a test
file, bad files, offline, two ranks."""
import json
from pathlib import Path
import pytest
from lmbook.profiles import get_config
from lmbook.train.trainer import train
from conftest import lmbook_cmd, rows

TINY = dict(take=2000, vocab_size=512, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=4,
            eval_steps=2, max_steps=8, warmup_steps=2, ckpt_every=4, tensorboard=False, device='cpu')
EX = dict(ind=1, activity_label='Python', ctx_a='Return the value', ctx_b='of', source_id='t', split='val',
          split_type='indomain')

@pytest.fixture(scope='module')
def run(ws):
    return Path(train(get_config('smoke', TINY), 'tiny', root=ws, log=lambda *a, **k: None)['run_dir'])

def write_hs(folder):
    "A HellaSwag file of seven examples in the official JSONL format."
    ends = [['the function.', 'a banana boat.', 'purple rain falls.', 'zebra zebra.'],
            ['if it is None.', 'xyzzy.', 'qq qq.', 'ha ha ha.']]
    lines = [json.dumps(dict(EX, ctx=f'Return the value {i}', endings=ends[i % 2], label=i % 4))
             for i in range(7)]
    (folder/'hs.jsonl').write_text('\n'.join(lines) + '\n')
    return folder/'hs.jsonl'

@pytest.fixture
def hs(tmp_path): return write_hs(tmp_path)

def ev(ws, *args): return lmbook_cmd('eval', 'tiny', '--root', ws, '--device', 'cpu', '--json', *args)

@pytest.fixture(scope='module')
def one_rank(ws, run, tmp_path_factory):
    "`lmbook eval --hellaswag-file` in one process, run once: the numbers the other ways must give."
    return ev(ws, '--hellaswag-file', write_hs(tmp_path_factory.mktemp('hs')))

def test_eval_matches_training_log(ws, run, one_rank):
    r = one_rank
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert (res['step'] == 8 and res['hellaswag_n'] == 7 and 0 <= res['hellaswag'] <= 1
            and 0 <= res['hellaswag_acc'] <= 1)
    assert abs(res['val_loss'] - rows(run)[-1]['val_loss']) < 1e-4  # the same batches the trainer evaluated
    assert (0 < res['val_bpb'] < res['val_loss']
            and abs(res['ppl'] - 2.718281828**res['val_loss']) < 1e-3*res['ppl'])
    assert json.loads((run/'eval.jsonl').read_text().splitlines()[-1])['val_bpb'] == res['val_bpb']

def test_malformed_hellaswag_line(ws, run, hs):
    hs.write_text(hs.read_text() + '{"ctx": "a", "endings": ["b"]\n')
    r = ev(ws, '--hellaswag-file', hs)
    assert (r.returncode == 2 and f'{hs}, line 8: not a JSON line' in r.stderr
            and 'Traceback' not in r.stderr), r.stderr

def test_offline_without_cached_file(ws, run):
    """Offline without HellaSwag's file: the validation numbers, then one line saying HellaSwag was skipped
    and how to get it."""
    for extra in ([], ['--nproc', '2']):  # under torchrun too: rank 0 says it once
        r = ev(ws, *extra)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1])['val_tokens'] == 2*4*64
        notes = [l for l in r.stderr.splitlines() if 'HellaSwag' in l]
        assert len(notes) == 1 and notes[0].startswith('note: HellaSwag skipped'), r.stderr
        assert all(w in notes[0]
                   for w in ('downloads are off (HF_HUB_OFFLINE=1)', 'hellaswag_val.jsonl',
                             '--hellaswag-file')), notes
        assert 'Traceback' not in r.stderr
    # as printed: loss, perplexity and bits per byte first
    r = lmbook_cmd('eval', 'tiny', '--root', ws, '--device', 'cpu')
    names = [l.split()[0] for l in r.stdout.splitlines()]
    assert (r.returncode == 0
            and names[:6] == ['checkpoint', 'step', 'experiment', 'val_loss', 'ppl', 'val_bpb']), r.stdout
    assert ev(ws, '--no-hellaswag').stderr.strip() == ''
    r = ev(ws, '--hellaswag-file', ws/'missing.jsonl')  # a file the user names must exist
    assert r.returncode == 2 and 'missing.jsonl does not exist' in r.stderr

def test_two_ranks_give_one_rank_numbers(ws, run, hs, one_rank):
    one, two = one_rank, ev(ws, '--hellaswag-file', hs, '--nproc', '2')
    assert two.returncode == 0, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout.strip().splitlines()[-1])
    assert (a['hellaswag_n'] == b['hellaswag_n'] == 7 and a['hellaswag'] == b['hellaswag']
            and a['hellaswag_acc'] == b['hellaswag_acc'])
    assert (a['val_tokens'] == b['val_tokens'] and abs(a['val_loss'] - b['val_loss']) < 1e-6
            and abs(a['val_bpb'] - b['val_bpb']) < 1e-6)

def test_harness_tasks_offline_on_a_local_file(ws, run, hs, tmp_path, one_rank):
    """lmbook eval --tasks: a task defined on a local JSONL and lm-eval's own hellaswag on --hellaswag-file,
    results in eval.json."""
    from lmbook.train.lmeval import local_task
    local_task('hs_local', hs, tmp_path/'tasks')
    r = ev(ws, '--tasks', 'hs_local,hellaswag', '--include-path', tmp_path/'tasks', '--hellaswag-file', hs)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # the validation numbers, and the harness's HellaSwag instead of lmbook's
    assert 'val_loss' in res and 'hellaswag_n' not in res
    assert (res['tasks']['hs_local']['n'] == res['tasks']['hellaswag']['n'] == 7
            and 0 <= res['tasks']['hellaswag']['acc_norm'] <= 1)
    ours = json.loads(one_rank.stdout)
    # the same examples scored the same way: the same choices
    assert res['tasks']['hs_local']['acc'] == ours['hellaswag_acc']
    saved = json.loads((run/'eval.json').read_text())
    assert saved['hs_local']['acc'] == res['tasks']['hs_local']['acc'] and saved['hellaswag']['step'] == 8
    r = ev(ws, '--tasks', 'hs_locl', '--include-path', tmp_path/'tasks')
    assert (r.returncode == 2 and "unknown task 'hs_locl' (did you mean hs_local?)" in r.stderr
            and 'Traceback' not in r.stderr), r.stderr
