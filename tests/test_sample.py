"""Loading checkpoints for inference and `lmbook sample` on a tiny trained run: fallback, refusals, greedy
cache equality."""
import json
from pathlib import Path
import pytest
import torch
from lmbook.profiles import get_config
from lmbook.train.trainer import train
from lmbook.model.generate import generate
from lmbook.runs.load import load_model
from lmbook.runs.sample import sample_run
from conftest import lmbook_cmd

TINY = dict(take=2000, vocab_size=512, batch_size=4, block_size=64, n_embd=64, n_head=2, eval_every=4,
            eval_steps=1,
            max_steps=8, warmup_steps=2, ckpt_every=4, keep_ckpts=3, tensorboard=False, device='cpu')

@pytest.fixture(scope='module')
def run(ws):
    return Path(train(get_config('smoke', TINY), 'tiny', root=ws, log=lambda *a, **k: None)['run_dir'])

def test_sample_cli(ws, run):
    r = lmbook_cmd('sample', 'tiny', 'Return the', '--max-new-tokens', 8, '--num-samples', 2, '--device',
                   'cpu', '--json', '--root', ws)
    assert r.returncode == 0, r.stderr
    out = [json.loads(l) for l in r.stdout.splitlines()]
    assert len(out) == 2 and all(o['prompt'] == 'Return the' for o in out)
    assert 'weights_only' not in r.stderr
    again = lmbook_cmd('sample', '-e', 'tiny', 'Return the', '--max-new-tokens', 8, '--num-samples', 2,
                       '--device', 'cpu', '--json', '--root', ws)
    assert again.stdout == r.stdout  # seeded, and the old --experiment form still works

def test_prompt_longer_than_context(ws, run):
    r = lmbook_cmd('sample', str(run), 'word '*200, '--device', 'cpu')
    assert r.returncode == 2 and 'more than the context of block_size=64' in r.stderr, r.stderr

def test_truncated_checkpoint(ws, run, tmp_path):
    import shutil
    copy = tmp_path/'tiny'; shutil.copytree(run, copy)
    newest = copy/'checkpoints'/'step_00000008'
    with open(newest/'model.safetensors', 'r+b') as f: f.truncate(1000)
    r = lmbook_cmd('sample', newest, 'Return the', '--device', 'cpu', '--max-new-tokens', 2)
    assert r.returncode == 2 and 'cannot be used' in r.stderr and 'Traceback' not in r.stderr, r.stderr
    warned = []
    lm = load_model(copy, warn=warned.append)  # a run folder falls back to the previous good checkpoint
    assert lm.step == 4 and 'step_00000008' in warned[0]

def test_best_folder_beside_the_checkpoints(ws, run):
    import shutil
    shutil.copytree(run/'checkpoints'/'step_00000004', run/'best')
    lm = load_model(run/'best', device='cpu')
    assert lm.step == 4 and lm.experiment == 'tiny' and lm.run == run and lm.tokenizer is not None

def test_optimizer_state_is_never_read(ws, run, tmp_path):
    import pickle, shutil
    copy = tmp_path/'run'; shutil.copytree(run, copy)
    class Boom:
        def __reduce__(self): return (exec, ("raise SystemExit('pickle ran')",))
    payload = pickle.dumps(Boom())
    for opt in (copy/'checkpoints'/'step_00000008').glob('optim*'):  # same size, other content: unreadable
        opt.write_bytes(payload + b' '*(opt.stat().st_size - len(payload)))
    assert load_model(copy, device='cpu').step == 8

def test_no_source_samples_the_default_experiment(ws, run):
    """With nothing named, `lmbook sample` samples the experiment `lmbook train` would use ($RUN_EXPERIMENT
    here)."""
    r = lmbook_cmd('sample', '--root', ws, '--max-new-tokens', 2, '--device', 'cpu', '--json',
                   env=dict(RUN_EXPERIMENT='tiny'))
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])['text'] is not None, r.stderr
    r = lmbook_cmd('sample', '--root', ws, env=dict(RUN_EXPERIMENT='never-trained'))
    assert (r.returncode == 2 and "no run 'never-trained'" in r.stderr
            and 'lmbook train -e never-trained' in r.stderr), r.stderr

def test_missing_experiment(ws):
    r = lmbook_cmd('sample', 'no-such-run', '--root', ws)
    assert (r.returncode == 2 and "no run 'no-such-run'" in r.stderr
            and 'lmbook train -e no-such-run' in r.stderr), r.stderr

def test_greedy_cache_matches_no_cache(ws, run):
    lm = load_model('tiny', root=ws)
    x = torch.tensor([[lm.tokenizer.eot_id] + lm.tokenizer.encode('Return the value')])
    a = generate(lm.model, x, 40, temperature=0)
    assert torch.equal(a, generate(lm.model, x, 40, temperature=0, cache=False))

def test_sample_prompts_field():
    with pytest.raises(ValueError, match="sample_prompts=.*separated by '|'"):
        get_config('smoke', dict(sample_prompts='a||b'))
    assert get_config('smoke', dict(sample_prompts='a|b')).train.eval.sample_prompts == 'a|b'

def test_sample_notebook(ws, run, tmp_path):
    from test_notebooks import papermill_run
    r = papermill_run('sample.ipynb', tmp_path/'out.ipynb', ('source', run),
                      ('prompts', 'Return the|The function'), ('device', 'cpu'), ('max_new_tokens', 8))
    assert r.returncode == 0, r.stderr[-3000:]
    txt = (tmp_path/'out.ipynb').read_text()
    assert '**Return the**' in txt and '**The function**' in txt and 'speed-up' in txt

def test_sample_notebook_refuses_unknown_parameters(tmp_path):
    from test_notebooks import papermill_run
    r = papermill_run('sample.ipynb', tmp_path/'out.ipynb', ('max_new_token', 5))
    assert (r.returncode != 0
            and 'unknown parameter(s) max_new_token' in r.stderr + (tmp_path/'out.ipynb').read_text())

@pytest.mark.parametrize('opt,bad,msg',
                         [('--temperature', 'nan', 'temperature=nan must be a finite number >= 0'),
                          ('--temperature', 'inf', 'temperature=inf must be a finite number >= 0'),
                          ('--temperature', '-1', 'temperature=-1.0'),
                          ('--top-p', '0', 'top_p=0.0 must be in (0, 1]'),
                          ('--top-k', '-3', 'top_k=-3 must be >= 0'),
                          ('--max-new-tokens', '-1', 'max_new_tokens=-1'),
                          ('--num-samples', '0', 'num_samples=0')])
def test_sampling_options_checked(ws, run, opt, bad, msg, capsys):
    """Every sampling option is range-checked like a config field: one line, exit 2, before the model loads
    (the command's own function, in this process; the first also through the `lmbook` command)."""
    from lmbook.cli import main
    args = ['sample', 'tiny', 'Return the', opt, bad, '--device', 'cpu', '--root', str(ws)]
    code, err = main(args), [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert code == 2 and len(err) == 1 and msg in err[0], err
    if (opt, bad) == ('--temperature', 'nan'):
        r = lmbook_cmd(*args)
        assert r.returncode == 2 and [l for l in r.stderr.splitlines() if l.strip()] == err, r.stderr

def test_huge_max_new_tokens_capped_and_streamed(ws, run):
    """--max-new-tokens 1000000000 is capped at the context with a note; the streamed text is the samples'
    text, clean UTF-8."""
    args = ('sample', 'tiny', 'Return the', 'The function', '--max-new-tokens', 10**9, '--num-samples', 2,
            '--device', 'cpu', '--root', ws)
    r = lmbook_cmd(*args, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ('max_new_tokens=1000000000 is more than the model can use: capped at its context, block_size=64'
            in r.stderr)
    j = lmbook_cmd(*args, '--json', timeout=120)
    want = ''.join(f"{s['prompt']}{s['text']}\n---\n" for s in map(json.loads, j.stdout.splitlines()))
    assert r.stdout == want and r.stdout.encode('utf-8').decode('utf-8', 'strict') == want

class Bytes:
    "A stand-in tokenizer: a token a byte, end-of-text 0."
    eot_id = 0
    def encode(self, s): return [b or 1 for b in s.encode()]
    def decode(self, ids): return bytes(i % 256 for i in ids).decode(errors='replace')


def test_stream_ends_on_whole_characters():
    """Tokens that split a character (here one token a byte) are held until it is whole: no broken character
    mid-stream."""
    from lmbook.model.generate import TextStream
    ts, text = TextStream(Bytes(), 0), 'naïve — 日本語 🙂'
    pieces = [ts.push(b) for b in text.encode()]
    assert ''.join(pieces) + ts.flush() == text and all('\ufffd' not in p for p in pieces)
def test_a_prompt_ending_in_a_space_gets_no_second_one(ws, run):
    r = lmbook_cmd('sample', 'tiny', 'Return the ', '--max-new-tokens', 6, '--num-samples', 4, '--device',
                   'cpu', '--json', '--root', ws)
    assert r.returncode == 0, r.stderr
    out = [json.loads(l) for l in r.stdout.splitlines()]
    assert all(o['prompt'] == 'Return the ' and not o['text'].startswith(' ') for o in out), out


def compiled_trainable(blocks:bool):
    "A tiny model compiled whole or per block, on a backend that counts what it compiles; no inductor."
    from torch._dynamo.testing import CompileCounter
    from lmbook.model.gpt import GPT
    from lmbook.train.step import Trainable
    c = get_config('smoke', dict(n_layer=2, n_embd=32, n_head=2, vocab_size=256, block_size=32, device='cpu'))
    m, frames = GPT(c.model), CompileCounter()
    for part in (m.h if blocks else [m]): part.compile(backend=frames)
    return c, Trainable(m, m, torch.optim.SGD(m.parameters()), 'cpu', None, compiled=True), frames


@pytest.mark.parametrize('blocks', [False, True], ids=['whole', 'blocks'])
@pytest.mark.parametrize('stance', [True, False], ids=['set_stance', 'torch-before-2.6'])
def test_run_samples_compile_nothing(tmp_path, monkeypatch, blocks, stance):
    "A run's samples (its end, `sample_every`) skip the compiled code, whole or per block, on any torch."
    import types
    import lmbook.train.trainer as tr
    from lmbook.distributed import DistInfo
    torch._dynamo.reset()
    if not stance: monkeypatch.delattr(torch.compiler, 'set_stance')
    c, t, frames = compiled_trainable(blocks)
    monkeypatch.setattr(tr, 'load_tokenizer', lambda d: Bytes())
    r = types.SimpleNamespace(info=DistInfo(), t=t, tok_dir=tmp_path, cfg=c, dir=tmp_path)
    tr._samples(r, 7)
    assert frames.frame_count == 0  # nothing compiled for the samples
    assert '"step": 7' in (tmp_path/'samples.jsonl').read_text()
    with torch.no_grad(): t.raw(torch.zeros(1, 4, dtype=torch.long))
    assert frames.frame_count > 0  # the compiled code is back after them
