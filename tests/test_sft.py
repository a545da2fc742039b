"""Fine-tuning: packing and masks, bad records, init_from (weights, tokenizer, shape), LoRA (frozen base,
merged export), exact resume, and the CI path pretrain -> finetune -> sample -> export -> transformers."""
import json, os, shutil, subprocess, sys
from pathlib import Path
import pytest
import torch
from safetensors.torch import load_file
from lmbook.profiles import get_config
from lmbook.core import paths_for
from lmbook.train.trainer import train
from lmbook.model.gpt import GPT
from lmbook.model.lora import add_lora
from lmbook.runs.load import load_model
from lmbook.runs.find import find_checkpoint
from lmbook.data.tokenizer import load_tokenizer, train_bpe
from lmbook.train.finetune import finetune, finetune_config, FINETUNE_PARAMS
from lmbook.train.inputs import check_init, find_init, init_model, resolve_init
from lmbook.chatformat import chat_prompt
from lmbook.data.sft import read_sft, pack, render_chat, builtin_chat, write_jsonl
from lmbook.data.chatdata import record_messages
from conftest import lmbook_cmd, rows

quiet = lambda *a, **k: None
TINY = dict(take=300, vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32, batch_size=4,
            max_steps=6, warmup_steps=1,
            eval_every=6, eval_steps=1, ckpt_every=6, tensorboard=False, device='cpu', ckpt_async=False,
            deterministic=True)
FT = dict(max_steps=6, batch_size=2, eval_steps=1, ckpt_every=3, eval_every=3, log_every=1)


@pytest.fixture(scope='module')
def pre(tmp_path_factory):
    "A tiny pretrained run 'pre' and a chat file, in a workspace of their own."
    root = tmp_path_factory.mktemp('ws')
    train(get_config('smoke', TINY), 'pre', root=root, log=quiet)
    return root, write_jsonl(builtin_chat()[:40], root/'chat.jsonl')


def weights(run):
    return load_file(find_checkpoint(run)/'model.safetensors')


def test_packing_targets_are_exactly_the_response_tokens():
    tk = train_bpe(['What is two and two? Four. Say hello. Hello there!']*30, 300)
    exs = [render_chat(record_messages(r), tk) for r in
           [dict(prompt='Say hello.', response='Hello there!'),
            dict(prompt='What is two and two?', response='Four.', system='Be brief.'),
            dict(messages=[dict(role='user', content='Say hello.'), dict(role='assistant', content='Hello!'),
                           dict(role='user', content='Again.'),
                           dict(role='assistant', content='Hello there!')])]]
    x, y = pack(exs, 24, tk.eot_id)
    assert x.shape[1] == 24 and len(x) >= 2
    # every trained token once, in order
    assert y[y != -1].tolist() == [i for ids, m in exs for i, k in zip(ids, m) if k]
    flat = [tk.decode(x[r].tolist()) for r in range(len(x))]
    assert flat[0].startswith('<|endoftext|><|user|>') and flat[2].startswith('<|endoftext|><|user|>')
    # an example of exactly block_size + 1 tokens fills a row without the start token
    assert flat[1].startswith('<|system|>')
    assert (tk.decode(exs[1][0])
            == '<|system|>Be brief.<|end|><|user|>What is two and '
               'two?<|end|><|assistant|>Four.<|end|><|endoftext|>')
    m = GPT(get_config('smoke', dict(vocab_size=384, block_size=24, n_layer=1, n_head=2, n_embd=16)).model)
    keep = y != -1
    manual = torch.nn.functional.cross_entropy(m(x).float()[keep], y[keep])
    assert torch.allclose(m(x, y), manual, atol=1e-6)
    m.cfg.fused_ce = True  # the chunked, fused path ignores the same targets
    assert torch.allclose(m(x, y), manual, atol=1e-5)


PR, ALPACA = '{"prompt": "Hi", "response": "Hello"}', '{"instruction": "Hi", "output": "Hello"}'
SHAREGPT = '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}'


@pytest.mark.parametrize('first,line,msg', [
    (PR, '{"prompt": "Hi"}', ":2: the record has no 'response': give it one"),
    (PR, '{"messages": []}', ":2: 'messages' is empty: give a list of turns, each with 'role' and 'content'"),
    (PR, '{"messages": [{"role": "robot", "content": "x"}]}', ":2: 'messages'[0] has unknown 'role' 'robot': "
     "use one of system, developer, user, assistant"),
    (PR, '{"prompt": "Hi", "response": ', ':2: not valid JSON'),
    (ALPACA, '{"instruction": "Hi", "input": 3, "output": "Hello"}', ":2: 'input' must be text, got int"),
    (ALPACA, '{"instruction": "Hi", "input": ""}', ":2: the record has no 'output'"),
    (SHAREGPT, '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt"}]}',
     ":2: 'conversations'[1] has no 'value': give a list of turns, each with 'from' and 'value'"),
    (SHAREGPT, ALPACA, ":2: this record is Alpaca, but the first record of")])
def test_bad_records_name_file_and_line_and_write_nothing(pre, first, line, msg):
    root, _ = pre
    bad = root/'bad.jsonl'
    bad.write_text(first + '\n' + line + '\n')
    with pytest.raises(ValueError) as e: finetune('pre', bad, 'ft-bad', FT, root=root, log=quiet)
    assert str(e.value).startswith(f"{bad}{msg}") and '\n' not in str(e.value)
    assert (not paths_for('ft-bad', root=root).run.exists()
            and not paths_for('ft-bad', root=root).tokenizer.exists())


def test_cli_bad_record_one_line(pre):
    root, _ = pre
    bad = root/'bad-cli.jsonl'
    bad.write_text('{"prompt": "Hi", "response": "Hello"}\n{"prompt": "Hi"}\n')
    r = lmbook_cmd('finetune', '--init-from', 'pre', '--data', bad, '-e', 'ft-cli-bad', '--root', root)
    assert r.returncode == 2 and r.stderr == (f"error: {bad}:2: the record has no 'response': give it one, "
                                              "or map a column to it with sft_columns\n"), r.stderr
    assert not paths_for('ft-cli-bad', root=root).run.exists()


def test_init_from_loads_weights_only_and_refuses_another_shape(pre):
    root, data = pre
    cfg = finetune_config('pre', data, FT, root)
    paths = paths_for('ft-init', root=root)
    m = init_model(cfg, resolve_init(cfg, paths, paths.run))
    src = load_model('pre', root).model.state_dict()
    assert all(torch.equal(v, src[k]) for k, v in m.state_dict().items())
    with pytest.raises(ValueError) as e:
        finetune('pre', data, 'ft-shape', dict(FT, n_layer=2), root=root, log=quiet)
    msg = str(e.value)
    assert 'n_layer=1' in msg and 'n_layer=2' in msg and '\n' not in msg
    assert not paths_for('ft-shape', root=root).run.exists()
    with pytest.raises(ValueError, match='sft_data=.* needs init_from'):
        train(get_config('smoke', dict(TINY, sft_data=str(data))), 'ft-noinit', root=root, log=quiet)


def test_init_from_a_checkpoint_older_than_the_bias_option(pre):
    """A pretrained checkpoint written before ModelConfig had `bias` (no such key in its state.json) still
    starts a fine-tuning run."""
    import hashlib
    root, data = pre
    ck = find_checkpoint(paths_for('pre', root=root).run)
    old = root/'old-ckpt'; shutil.copytree(ck, old)
    st = json.loads((old/'state.json').read_text()); del st['config']['model']['bias']
    (old/'state.json').write_text(json.dumps(st))
    man = json.loads((old/'COMPLETE').read_text())
    man['files']['state.json'] = dict(size=(old/'state.json').stat().st_size,
                                      sha256=hashlib.sha256((old/'state.json').read_bytes()).hexdigest())
    (old/'COMPLETE').write_text(json.dumps(man))
    cfg = finetune_config(str(old), data, FT, root)
    assert cfg.model.bias is False
    # before: "is a model of shape ... bias=None, but this config has ... bias=False"
    init_model(cfg, check_init(cfg, find_init(str(old), root)))


def test_lora_resume_is_bit_exact_base_frozen_and_export_matches(pre):
    root, data = pre
    lora = dict(FT, lora_rank=2, lora_alpha=4.0, lr=1e-2)
    full = finetune('pre', data, 'ft-a', lora, root=root, log=quiet)
    assert full['step'] == 6 and rows(full['run_dir'])[0]['step'] == 0  # starts at step 0
    a, losses = weights(full['run_dir']), [r['loss'] for r in rows(full['run_dir']) if 'loss' in r]
    # as if stopped after the checkpoint of step 3
    shutil.rmtree(full['run_dir']/'checkpoints'/'step_00000006')
    again = finetune('pre', data, 'ft-a', lora, root=root, log=quiet)
    assert again['step'] == 6 and rows(again['run_dir'])[-1]['step'] == 6
    b = weights(again['run_dir'])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r['loss'] for r in rows(again['run_dir']) if 'loss' in r] == losses
    assert a and all(k.endswith(('.lora_A', '.lora_B')) for k in a)  # the checkpoint holds the adapters only
    assert any(k.endswith('lora_B') and a[k].abs().sum() > 0 for k in a)  # the adapters trained
    base = weights(paths_for('pre', root=root).run)
    st = json.loads((find_checkpoint(full['run_dir'])/'state.json').read_text())
    assert st['base']['path'] == str(find_checkpoint(paths_for('pre', root=root).run).resolve())
    unmerged = load_model('ft-a', root, merge=False).model.state_dict()
    assert all(torch.equal(unmerged[k], base[k]) for k in base)  # the pretrained weights stayed frozen
    # the unmerged LoRA model, as trained, against transformers on the exported (merged) folder
    cfg = finetune_config('pre', data, lora, root)
    m = GPT(cfg.model); m.load_state_dict({**base, 'lm_head.weight': base['wte.weight']})  # tied head
    add_lora(m, 2, 4.0); m.load_state_dict(a, strict=False); m.eval()
    out = root/'hf-lora'
    from lmbook.runs.export import export_hf
    export_hf('ft-a', out, root=root)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert not any('lora' in k for k in load_file(out/'model.safetensors'))
    tok = load_tokenizer(paths_for('ft-a', root=root).tokenizer)
    ids = torch.tensor([tok.encode(chat_prompt('What does abs do in Python?'))])
    with torch.no_grad(): x, y = m(ids), hf(ids).logits
    assert torch.allclose(x, y, atol=1e-4), (x - y).abs().max()
    # and it is not the pretrained model
    assert not torch.allclose(x, load_model('pre', root).model(ids), atol=1e-3)


def test_ci_path_pretrain_finetune_sample_export(pre):
    root, data = pre
    r = lmbook_cmd('finetune', '--init-from', 'pre', '--data', data, '-e', 'ft-ci', '--root', root, '--set',
                   'max_steps=4', 'batch_size=2', 'eval_steps=1', 'ckpt_async=false')
    assert r.returncode == 0, r.stderr[-2000:]
    run = paths_for('ft-ci', root=root).run
    assert ((run/'checkpoints').is_dir()
            and (paths_for('ft-ci', root=root).tokenizer/'tokenizer.json').is_file())
    assert (load_tokenizer(paths_for('ft-ci', root=root).tokenizer).sha256
            == load_tokenizer(paths_for('pre', root=root).tokenizer).sha256)
    r = lmbook_cmd('sample', 'ft-ci', chat_prompt('What does abs do in Python?'), '--max-new-tokens', '8',
                   '--device', 'cpu', '--root', root, '--json')
    assert (r.returncode == 0
            and json.loads(r.stdout.splitlines()[0])['prompt'].startswith('<|user|>')), r.stderr
    # a plain question to a chat run is asked in its chat format; the answer holds no reserved token or broken
    # character
    r = lmbook_cmd('sample', 'ft-ci', 'What does abs do in Python?', '--max-new-tokens', '12',
                   '--num-samples', '3', '--device', 'cpu', '--root', root, '--json', '--temperature', '1.5')
    outs = [json.loads(l) for l in r.stdout.splitlines()]
    assert (r.returncode == 0
            and all(o['chat'] and o['prompt'] == 'What does abs do in Python?' for o in outs)), r.stderr
    assert not any('<|' in o['text'] or '\ufffd' in o['text'] for o in outs), outs
    raw = json.loads(lmbook_cmd('sample', 'ft-ci', 'What does abs', '--raw', '--max-new-tokens', '4',
                                '--device', 'cpu', '--root', root, '--json').stdout.splitlines()[0])
    assert 'chat' not in raw  # --raw continues the text
    md = (paths_for('ft-ci', root=root).run/'samples.md').read_text()
    # the run's own samples are questions from its held-out examples
    assert '** → ' in md and '**What does ' in md, md
    out = root/'hf-ci'
    r = lmbook_cmd('export', 'ft-ci', out, '--format', 'hf', '--root', root)
    assert r.returncode == 0, r.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    lm = load_model('ft-ci', root)
    ids = torch.tensor([lm.tokenizer.encode('<|user|>What does len do?<|end|><|assistant|>')])
    with torch.no_grad(): assert torch.allclose(hf(ids).logits, lm.model(ids), atol=1e-4)
    # transformers renders a conversation with the exported chat template exactly as lmbook does
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    q = [dict(role='user', content='What does len do?')]
    assert (tok.apply_chat_template(q, tokenize=False, add_generation_prompt=True)
            == '<|endoftext|>' + chat_prompt('What does len do?'))
    talk = [dict(role='system', content='Be brief.'), *q, dict(role='assistant', content='It counts.')]
    ids, _ = render_chat(talk, lm.tokenizer)
    got = tok.apply_chat_template(talk, tokenize=True)
    got = got['input_ids'] if hasattr(got, 'keys') else got  # a BatchEncoding in transformers 5
    assert list(got) == [lm.tokenizer.eot_id] + ids[:-1]
    end = lm.tokenizer.token_id('<|end|>')
    assert end in json.loads((out/'generation_config.json').read_text())['eos_token_id']
    # and lmbook chat keeps the conversation
    r = subprocess.run([str(Path(sys.executable).parent/'lmbook'), 'chat', 'ft-ci', '--root', str(root),
                        '--device', 'cpu', '--json',
                        '--max-new-tokens', '8'], input='What does abs do in Python?\n\nAnd len?\n',
                       capture_output=True, text=True, timeout=300)
    turns = [json.loads(l) for l in r.stdout.splitlines()]
    assert (r.returncode == 0
            and [t['user'] for t in turns] == ['What does abs do in Python?',
                                               'And len?']), r.stdout + r.stderr
    assert not any('<|' in t['assistant'] for t in turns)


def test_finetune_notebook(pre, tmp_path):
    import papermill
    nb = Path(__file__).resolve().parent.parent/'nbs'/'finetune.ipynb'
    assert ({k: v['default'] for k, v in papermill.inspect_notebook(str(nb)).items()}
            == {k: repr(v) for k, v in FINETUNE_PARAMS.items()})
    root, data = pre
    pm = str(Path(sys.executable).parent/'papermill')
    run = lambda *ps: subprocess.run([pm, str(nb), str(tmp_path/'out.ipynb'), '-k', 'python3',
                                      *[a for k, v in ps for a in ('-p', k, v)]],
                                     capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    r = run(('init_from', 'pre'), ('data', str(data)), ('root', str(root)), ('experiment', 'ft-nb'),
            ('max_steps', '3'))
    assert r.returncode == 0, r.stderr[-3000:]
    assert find_checkpoint(paths_for('ft-nb', root=root).run).name == 'step_00000003'
    r = run(('init_frm', 'pre'), ('root', str(root)))
    assert r.returncode != 0 and 'unknown parameter(s) init_frm' in r.stderr + r.stdout


def test_finetune_notebook_defaults(tmp_path):
    """Left as they are, the parameters pretrain a tiny model in a scratch workspace and fine-tune it on the
    CPU, end to end."""
    nb = Path(__file__).resolve().parent.parent/'nbs'/'finetune.ipynb'
    pm = str(Path(sys.executable).parent/'papermill')
    r = subprocess.run([pm, str(nb), str(tmp_path/'out.ipynb'), '-k', 'python3'], capture_output=True,
                       text=True,
                       stdin=subprocess.DEVNULL, timeout=600, env={**os.environ, 'CUDA_VISIBLE_DEVICES': ''})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path/'out.ipynb').read_text())
    text = ''.join(''.join(o.get('text', '')) + ''.join(o.get('data', {}).get('text/plain', ''))
                   for c in out['cells'] for o in c.get('outputs', []))
    assert "'step': 40" in text, text[-2000:]


def test_prepare_only_prepares_the_fine_tuning_set(pre):
    """--prepare-only (what several processes run first) prepares the fine-tuning set and the init run's
    tokenizer, not pretraining shards and a new tokenizer."""
    from lmbook.cli import main
    root, data = pre
    run = paths_for('pre', root=root).run
    assert main(['train', '-p', str(run/'training.toml'), '-e', 'ft-prep', '--root', str(root),
                 '--prepare-only', '--set', 'init_from=pre', f'sft_data={data}']) == 0
    p = paths_for('ft-prep', root=root)
    assert not (root/'datasets'/'train'/'ft-prep').exists()
    assert load_tokenizer(p.tokenizer).sha256 == load_tokenizer(paths_for('pre', root=root).tokenizer).sha256


def test_eval_scores_a_fine_tuned_run_on_its_own_validation_examples(pre):
    """`lmbook eval` of a fine-tuning run gives the validation loss its trainer logged (responses only), not a
    pretraining set's."""
    root, data = pre
    res = finetune('pre', data, 'ft-eval', FT, root=root, log=quiet)
    from lmbook.profiles import load_config_file
    # packed examples see only themselves
    assert load_config_file(paths_for('ft-eval', root=root).run/'training.toml').train.levers.doc_mask
    r = lmbook_cmd('eval', 'ft-eval', '--root', root, '--device', 'cpu', '--json', '--no-hellaswag')
    assert r.returncode == 0, r.stderr
    assert abs(json.loads(r.stdout)['val_loss'] - res['val_loss']) < 1e-5, (r.stdout, res['val_loss'])


def test_small_file_fine_tunes_with_a_batch_it_fills(pre):
    """Eight short records pack into fewer rows than a batch of 16 (the smoke profile's): a note and a batch
    they fill, not a refusal. The same records as an Alpaca JSON file fine-tune too."""
    root, _ = pre
    words = 'one two three four five six seven eight'.split()
    small = write_jsonl([dict(prompt=f'Say {w}.', response=f'{w.title()}!') for w in words],
                        root/'small.jsonl')
    r = lmbook_cmd('finetune', '--init-from', 'pre', '--data', small, '-e', 'ft-small', '--root', root,
                   '--max-steps', '3', '--batch-size', '16', '--set', 'eval_steps=1', 'ckpt_async=false')
    assert r.returncode == 0, r.stderr[-2000:]
    note = [l for l in r.stdout.splitlines() if 'the fine-tuning data packs into' in l]
    assert len(note) == 1 and 'less than one batch of 1x16: batch_size ' in note[0], r.stdout
    from lmbook.profiles import load_config_file
    c = load_config_file(paths_for('ft-small', root=root).run/'training.toml').train
    assert c.sched.max_steps == 3 and 1 <= c.batch_size < 16
    assert str(c.batch_size) == note[0].rsplit(' ', 1)[1]
    assert find_checkpoint(paths_for('ft-small', root=root).run).name == 'step_00000003'
    alpaca = root/'small-alpaca.json'
    alpaca.write_text(json.dumps([dict(instruction=f'Say {w}.', input='', output=f'{w.title()}!')
                                  for w in words]))
    r = lmbook_cmd('finetune', '--init-from', 'pre', '--data', alpaca, '-e', 'ft-small-1', '--root', root,
                   '--max-steps', '2', '--batch-size', '1', '--set', 'eval_steps=1', 'ckpt_async=false')
    assert r.returncode == 0 and 'note:' not in r.stdout, r.stdout + r.stderr
    assert find_checkpoint(paths_for('ft-small-1', root=root).run).name == 'step_00000002'
    c = load_config_file(paths_for('ft-small-1', root=root).run/'training.toml').data
    assert c.sft_data == str(alpaca) and (c.sft_split, c.sft_columns) == ('train', '')


def test_finetune_takes_the_training_road(pre, monkeypatch):
    """`lmbook finetune --nproc 2` checks first, then hands torchrun the checked config as its profile, as
    `train` would."""
    import lmbook.train.launch as launch
    from lmbook.cli import main
    from lmbook.profiles import load_config_file
    root, data = pre
    seen = {}
    monkeypatch.setattr(launch, 'spawn', lambda profile, experiment, ov,
                        **kw: seen.update(profile=profile, **kw) or (l for l in ()))
    assert main(['finetune', '--init-from', 'pre', '--data', str(data), '-e', 'ft-road', '--root', str(root),
                 '--nproc', '2', '--lora-rank', '4', '--max-steps', '3']) == 0
    cfg = load_config_file(Path(seen['profile']))
    assert ((cfg.train.nproc, cfg.train.finetune.lora_rank, cfg.train.sched.max_steps) == (2, 4, 3)
            and cfg.train.finetune.init_from.endswith('pre'))
    assert seen['forward_signals'] and not (root/'runs'/'ft-road').exists()  # nothing trained in this process
    assert main(['finetune', '--init-from', 'pre', '--data', str(root/'missing.jsonl'), '-e', 'ft-road2',
                 '--root', str(root), '--nproc', '2']) == 2 and 'profile' in seen


def counter(monkeypatch, fn) -> list:
    "Count the calls of `fn` through every lmbook module that holds it by name."
    n = [0]
    def counted(*a, **k):
        n[0] += 1
        return fn(*a, **k)
    for m in list(sys.modules.values()):
        if not getattr(m, '__name__', '').startswith('lmbook'): continue
        for k, v in list(vars(m).items()):
            if v is fn: monkeypatch.setattr(m, k, counted)
    return n


def test_a_finetune_resolves_its_init_and_reads_its_data_once(pre, monkeypatch):
    "One fine-tune finds its init checkpoint once, checks its shape once and reads the fine-tuning file once."
    from lmbook.train import inputs
    from lmbook.data import sft
    root, data = pre
    found = counter(monkeypatch, inputs.init_checkpoint)
    checked = counter(monkeypatch, inputs.check_init_shape)
    read = counter(monkeypatch, sft.read_sft)
    finetune('pre', data, 'ft-once', dict(FT, max_steps=1, ckpt_every=1, eval_every=1), root=root, log=quiet)
    assert (found[0], checked[0], read[0]) == (1, 1, 1)


def test_finetune_checks_the_machine_before_reading_its_data(pre, monkeypatch, capsys):
    "`lmbook finetune` without the RAM refuses in one line before the records are read; --force goes on."
    import lmbook.train.launch as launch
    from lmbook.cli import main
    from lmbook.data import sft
    root, data = pre
    monkeypatch.setattr(launch, 'free_ram_gb', lambda: 1e-4)
    read = counter(monkeypatch, sft.read_sft)
    args = ['finetune', '--init-from', 'pre', '--data', str(data), '-e', 'ft-ram', '--root', str(root),
            '--max-steps', '1', '--set', 'eval_steps=1', 'ckpt_every=1', 'eval_every=1', 'ckpt_async=false']
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: ') and len(err.strip().splitlines()) == 1 and 'GB of memory' in err, err
    assert read[0] == 0 and not paths_for('ft-ram', root=root).run.exists()
    assert main(args + ['--force']) == 0 and read[0] == 1
    assert 'note: force=true' in capsys.readouterr().out
