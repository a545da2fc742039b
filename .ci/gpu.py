"""The GPU check: every CUDA path of lmbook at tiny shapes, one JSON row per path (card, torch, date, pass or
fail, seconds, the key figure). Run it as `bash .ci/gpu` on a machine with one GPU or more; with two or more
it also kills and resumes DDP and FSDP2 runs, and runs of two "nodes" (a GPU each, two torchrun agents
meeting on 127.0.0.1 as on two machines) whose killed agent ends both. The one-GPU rows take the GPUs in
turn, and with four GPUs the 2-GPU rows run on the last two beside them. It exits non-zero when a row fails.

usage: python .ci/gpu.py [--out FILE] [--only NAME,NAME] [--jobs N] [--keep DIR]

`ROWS` names each row and the config values it runs; tests/test_gpu_check.py holds it to a row for every value
that `config.cuda_values()` lists, so a new CUDA-only value cannot go unchecked."""
from __future__ import annotations
import argparse, contextlib, json, os, re, shutil, signal, socket, subprocess, sys, tempfile, threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE = 'cuda'  # where every row runs
# every row's runs are tiny: the smoke model (2 layers, 128 wide), 20 steps, a checkpoint and validation every
# 10
TINY = dict(device=DEVICE, compile='auto', max_steps=20, warmup_steps=2, eval_every=10, eval_steps=2,
            log_every=5, ckpt_every=10, batch_size=8, tensorboard=False)
# the fine-tuning rows: a small random Llama read through init_from=hf:, LoRA on q, k, v, o
FINETUNE = dict(device=DEVICE, lora_rank=8, lora_targets='q,k,v,o', block_size=128, batch_size=4,
                max_steps=10,
                lr=2e-3, warmup_steps=2, eval_every=5, eval_steps=2, ckpt_every=5, log_every=5,
                tensorboard=False)
# all runs read one prepared copy of the built-in corpus
SHARED = dict(LMBOOK_TRAIN_DIR='datasets/train/gpu', LMBOOK_VAL_DIR='datasets/val/gpu',
              LMBOOK_TOKENIZER_DIR='artifacts/tokenizer/gpu', LMBOOK_CACHE_DIR='cache/gpu',
              HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', PYTHONUNBUFFERED='1',
              NCCL_NVLS_ENABLE='0', TORCH_SYMM_MEM_DISABLE_MULTICAST='1', NVSHMEM_DISABLE_NVLS='1')


@dataclass
class Row:
    "One CUDA path: how it runs (`kind`), the config values it sets, what it must show."
    name: str
    kind: str                                     # train, finetune, sample, eval, serve, papermill, dist,
                                                  # nodes...
    overrides: dict = field(default_factory=dict)  # config values on top of the kind's tiny ones
    expect: dict = field(default_factory=dict)     # levers the run must report using (meta.json `levers`)
    after: tuple = ()                             # rows whose runs this one reads
    gpus: int = 1                                 # GPUs it needs
    env: dict = field(default_factory=dict)       # environment variables its runs set


ATTN = ('sdpa', 'auto', 'cudnn', 'flash', 'efficient', 'math')
ROWS = [
    Row('train-bf16-compile', 'train', dict(compile='true', dtype='bfloat16')),
    Row('train-auto', 'train', dict(compile='auto', dtype='auto')),
    Row('train-fp32-eager', 'train', dict(compile='false', dtype='float32')),
    Row('compile-blocks', 'train', dict(compile='blocks')),
    Row('fp8-auto', 'train', dict(fp8='auto'), expect=dict(fp8='tensorwise')),
    Row('fp8-tensorwise', 'train', dict(fp8='tensorwise'), expect=dict(fp8='tensorwise')),
    Row('fp8-rowwise', 'train', dict(fp8='rowwise'), expect=dict(fp8='rowwise')),
    # the fit's trials convert a float8 model each; with float8's graph cache asked for, the second start
    # finds the fit and every graph
    Row('fp8-warm-start', 'warm', dict(fp8='tensorwise', compile='true', batch_fit=True, batch_size=2,
                                       grad_accum=8), expect=dict(fp8='tensorwise'),
        env=dict(LMBOOK_FP8_GRAPH_CACHE='1')),
    # the same, stopped by a STOP request and resumed: it trains on as the run that was never stopped
    Row('fp8-fit-stop-resume', 'stop_resume', dict(fp8='tensorwise', compile='true', batch_fit=True,
                                                   batch_size=2, grad_accum=8), expect=dict(fp8='tensorwise'),
        env=dict(LMBOOK_FP8_GRAPH_CACHE='1')),
    Row('act_ckpt-none', 'train', dict(act_ckpt='none'), expect=dict(act_ckpt='none')),
    Row('act_ckpt-selective', 'train', dict(act_ckpt='selective'), expect=dict(act_ckpt='selective')),
    Row('act_ckpt-full', 'train', dict(act_ckpt='full'), expect=dict(act_ckpt='full')),
    Row('optimizer-adamw', 'train', dict(optimizer='adamw'), expect=dict(optimizer='adamw')),
    Row('optimizer-muon', 'train', dict(optimizer='muon'), expect=dict(optimizer='muon')),
    *[Row(f'attn-{b}', 'train', dict(attn_backend=b), expect=dict(attention='cudnn' if b == 'auto' else b))
      for b in ATTN],
    Row('attn-flex-doc_mask', 'train', dict(attn_backend='flex', doc_mask=True),
        expect=dict(attention='flex')),
    Row('doc_mask-sdpa', 'train', dict(doc_mask=True)),
    Row('fused_ce', 'train', dict(fused_ce=True), expect=dict(loss_kernel='chunked')),
    Row('batch_fit', 'train', dict(batch_fit=True, batch_size=2, grad_accum=8, compile='false')),
    Row('deterministic', 'train', dict(deterministic=True, compile='false')),
    Row('ckpt_async-off', 'train', dict(ckpt_async=False)),
    Row('ckpt_async-on', 'train', dict(ckpt_async=True)),
    Row('finetune-lora', 'finetune', dict(quant='none')),
    Row('finetune-qlora-nf4', 'finetune', dict(quant='nf4')),
    Row('sample-kv-cache', 'sample', after=('train-bf16-compile', 'finetune-qlora-nf4')),
    Row('eval', 'eval', after=('train-bf16-compile',)),
    Row('serve-8-clients', 'serve', after=('finetune-lora',)),
    Row('serve-openai-fields', 'serve_api', after=('finetune-lora',)),
    Row('papermill-sigterm-resume', 'papermill'),
    Row('hardware-guard', 'guard'),
    Row('ddp-kill-resume', 'dist', dict(parallel='ddp'), gpus=2),
    Row('fsdp-kill-resume', 'dist', dict(parallel='fsdp', ckpt_format='sharded'), gpus=2),
    Row('fsdp-full-kill-resume', 'dist', dict(parallel='fsdp', ckpt_format='full'), gpus=2),
    Row('nodes2-ddp-kill-resume', 'nodes', dict(parallel='ddp'), gpus=2),
    Row('nodes2-hsdp-kill-resume', 'nodes', dict(parallel='hsdp'), gpus=2),
]


class Failed(AssertionError):
    "A row's check that did not hold."


def check(ok, msg):
    if not ok: raise Failed(msg)


GPU = threading.local()  # `ids`: the GPUs (CUDA_VISIBLE_DEVICES) this thread's child processes get


def child_env(ws:Path, shared=True) -> dict:
    "The environment of a row's processes: workspace `ws`, the shared data (unless not `shared`), the GPUs."
    ids = getattr(GPU, 'ids', None)
    return {**os.environ,
            **(SHARED if shared else {k: v for k, v in SHARED.items() if not k.startswith('LMBOOK')}),
            'LMBOOK_WORKSPACE': str(ws), **({'CUDA_VISIBLE_DEVICES': ids} if ids else {})}


def pinned(ids:list[str], fn):
    "`fn`, run so that the processes it starts see only the GPUs `ids`."
    def run(*args):
        GPU.ids = ','.join(ids)
        try: return fn(*args)
        finally: GPU.ids = None
    return run


def lmbook(ws:Path, *args, timeout=600, log:Path|None=None, shared=True,
           env:dict|None=None) -> subprocess.CompletedProcess:
    """Run the `lmbook` command in workspace `ws` (on the shared data unless not `shared`, with `env` on top);
    its output also to `log`."""
    env = {**child_env(ws, shared), **(env or {})}
    p = subprocess.run([sys.executable, '-m', 'lmbook.cli', *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if log: log.write_text(p.stdout + p.stderr)
    return p


def sets(d:dict) -> list[str]: return [f'--set={k}={v}' for k, v in d.items()]
def metrics(run:Path) -> list[dict]:
    return [json.loads(l) for l in (run/'metrics.jsonl').read_text().splitlines()]


def run_ok(p, what):
    check(p.returncode == 0, f"{what} exited {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}")


def trained(run:Path) -> dict:
    "The figures of a finished run, after checking its loss fell and its validation is finite."
    rows = metrics(run)
    train = [r for r in rows if r.get('loss') is not None and r.get('tok_per_s')]
    vals = [r['val_loss'] for r in rows if r.get('val_loss') is not None]
    check(len(train) >= 2, f"{run.name}: {len(train)} train rows")
    check(train[-1]['loss'] < train[0]['loss'],
          f"{run.name}: the loss did not fall ({train[0]['loss']:.3f} -> "
                                               f"{train[-1]['loss']:.3f})")
    check(vals and all(v == v and v < 1e9 for v in vals), f"{run.name}: validation {vals}")
    samples = (run/'samples.jsonl').read_text().splitlines() if (run/'samples.jsonl').is_file() else []
    check(samples, f"{run.name}: no samples at the run's end")  # sampled with the compiled code set aside
    last = train[-1]
    return dict(tok_per_s=round(last['tok_per_s']), mfu=last.get('mfu') and round(last['mfu'], 4),
                mem_gb=round(last['mem_gb'], 3), loss_first=round(train[0]['loss'], 4),
                loss_last=round(last['loss'], 4), val_loss=round(vals[-1], 4))


def run_train(row:Row, ws:Path, out:Path) -> dict:
    p = lmbook(ws, 'train', '-p', 'smoke', '-e', row.name, *sets({**TINY, **row.overrides}),
               log=out/f'{row.name}.log')
    run_ok(p, 'lmbook train')
    run = ws/'runs'/row.name
    levers = json.loads((run/'meta.json').read_text()).get('levers', {})
    for k, v in row.expect.items():
        check(levers.get(k) == v, f"the run used {k}={levers.get(k)!r}, not {v!r}")
    check('ignored' not in p.stdout + p.stderr, f"a lever was ignored: {(p.stdout + p.stderr)[-400:]}")
    if row.overrides.get('batch_fit'): check('batch_fit: micro-batch' in p.stdout, 'no batch_fit line')
    return dict(trained(run), levers=levers)


def run_warm(row:Row, ws:Path, out:Path) -> dict:
    "Two experiments of one config on one workspace, a process each: the second finds every compiled graph."
    notes = []
    for name in (f'{row.name}-a', f'{row.name}-b'):
        run_ok(lmbook(ws, 'train', '-p', 'smoke', '-e', name, *sets({**TINY, **row.overrides}),
                      log=out/f'{name}.log', env=row.env), f'lmbook train ({name})')
        meta = json.loads((ws/'runs'/name/'meta.json').read_text())
        for k, v in row.expect.items():
            check(meta.get('levers', {}).get(k) == v, f"{name} used {k}={meta.get('levers', {}).get(k)!r}")
        notes.append(meta['startup']['notes'].get('first step', ''))
    second = notes[1]  # e.g. 'compile cache: graphs 3 found; autograd 1 found'
    check('autograd' in second and not re.search('compiled|not cacheable', second),
          f"the second start's compile cache: {second!r} (the first's: {notes[0]!r})")
    return dict(trained(ws/'runs'/f'{row.name}-b'), notes=notes)


def tiny_llama_folder(ws:Path) -> Path:
    "A small random Llama (transformers folder) and the built-in chat records, made once."
    folder = ws/'tiny-llama'
    with LOCK:
        if not (folder/'model.safetensors').is_file():
            from lmbook.dev.fixtures import tiny_llama
            from lmbook.data.sft import builtin_chat, write_jsonl
            tiny_llama(folder, vocab=1024, layers=2, width=128, context=256)
            write_jsonl(builtin_chat(), ws/'chat.jsonl')
    return folder


def run_finetune(row:Row, ws:Path, out:Path) -> dict:
    "LoRA or QLoRA from hf:, 10 steps, resumed to 20, exported merged, and the export read by transformers."
    folder, ov = tiny_llama_folder(ws), {**FINETUNE, **row.overrides}
    args = ('finetune', '--init-from', f'hf:{folder}', '--data', ws/'chat.jsonl', '-e', row.name)
    run_ok(lmbook(ws, *args, *sets(ov), log=out/f'{row.name}.log', shared=False), 'lmbook finetune')
    p = lmbook(ws, *args, *sets({**ov, 'max_steps': 20}), log=out/f'{row.name}-resume.log', shared=False)
    run_ok(p, 'lmbook finetune (resumed)')
    check('resumed at step 10' in p.stdout, f"no resume at step 10: {p.stdout[-400:]}")
    run = ws/'runs'/row.name
    ck = run/'checkpoints'/'step_00000020'
    from safetensors import safe_open
    with safe_open(ck/'model.safetensors', 'pt') as f: keys = list(f.keys())
    check(keys and all(k.endswith(('.lora_A', '.lora_B')) for k in keys),
          f"the checkpoint holds {keys[:3]}...")
    check(json.loads((ck/'state.json').read_text()).get('base'), 'the checkpoint names no base')
    exp = out.parent/'exports'/row.name
    shutil.rmtree(exp, ignore_errors=True)
    run_ok(lmbook(ws, 'export', f'{row.name}:best', exp, '--root', ws, log=out/f'{row.name}-export.log',
                  shared=False), 'lmbook export')
    figs = export_matches(ws, row.name, exp)
    return dict(trained(run), ckpt_mb=round(sum(f.stat().st_size for f in ck.iterdir()) / 1e6, 2), **figs)


def export_matches(ws:Path, exp_name:str, folder:Path) -> dict:
    "The exported folder, read by transformers on CUDA, gives lmbook's logits (and peft's adapters too)."
    # one row's own model work at a time: from_pretrained sets torch's default dtype for every thread
    with LOCK: return _export_matches(ws, exp_name, folder)


def _export_matches(ws:Path, exp_name:str, folder:Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from lmbook.runs.load import load_model
    os.environ['LMBOOK_WORKSPACE'] = str(ws)
    lm = load_model(f'{exp_name}:best', ws, DEVICE)
    ids = torch.tensor([lm.tokenizer.encode('What does abs do in Python?')], device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE, torch.bfloat16): ours = lm.model(ids).float()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(DEVICE).eval()
    with torch.no_grad(): theirs = hf(ids).logits.float()
    rel = ((ours - theirs).norm() / ours.norm()).item()
    check(rel < 2e-2, f"transformers' logits differ from lmbook's by {rel:.2e} (relative)")
    res = dict(export_rel_diff=round(rel, 5))
    if (folder/'adapter'/'adapter_config.json').is_file():
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained(folder/'base', dtype=torch.bfloat16).to(DEVICE)
        with torch.no_grad():
            peft = PeftModel.from_pretrained(base, folder/'adapter').eval()(ids).logits.float()
        res['peft_rel_diff'] = round(((ours - peft).norm() / ours.norm()).item(), 5)
        check(res['peft_rel_diff'] < 2e-2, f"peft on the exported base differs by {res['peft_rel_diff']:.2e}")
    return res


def run_sample(row:Row, ws:Path, out:Path) -> dict:
    "`lmbook sample` on CUDA (a plain run and a QLoRA one); KV-cache decoding gives the no-cache tokens."
    for src, prompt in (('train-bf16-compile', 'Return the'), ('finetune-qlora-nf4', 'What does abs do?')):
        p = lmbook(ws, 'sample', src, prompt, '--device', DEVICE, '--max-new-tokens', '24', '--num-samples',
                   '2', log=out/f'{row.name}-{src}.log')
        run_ok(p, f'lmbook sample {src}')
        check(len(p.stdout.strip()) > len(prompt), f"no text: {p.stdout!r}")
    with LOCK: return kv_cache_figures(ws)  # no from_pretrained in another row's thread meanwhile


def kv_cache_figures(ws:Path) -> dict:
    "Greedy decoding of `train-bf16-compile` with and without the KV cache: the same tokens, and the speeds."
    import torch
    from lmbook.model.generate import generate
    from lmbook.runs.load import load_model
    lm = load_model('train-bf16-compile', ws, DEVICE)
    idx = torch.tensor([lm.tokenizer.encode('Return the value')] * 4, device=DEVICE)
    times = {}
    for cache in (True, False):
        generate(lm.model, idx, 4, temperature=0, cache=cache)
        if DEVICE == 'cuda': torch.cuda.synchronize()
        t0 = time.perf_counter()
        times[cache] = (generate(lm.model, idx, 64, temperature=0, cache=cache), time.perf_counter() - t0)
    check(torch.equal(times[True][0], times[False][0]), 'greedy tokens differ with and without the KV cache')
    return dict(tok_per_s_cache=round(4*64/times[True][1]), tok_per_s_no_cache=round(4*64/times[False][1]))


def run_eval(row:Row, ws:Path, out:Path) -> dict:
    "`lmbook eval` on CUDA with a small HellaSwag file: the validation loss training logged last."
    hs = ws/'hellaswag.jsonl'
    ends = [['the function.', 'a banana boat.', 'purple rain.', 'zebra.'],
            ['if it is None.', 'xyzzy.', 'qq.', 'ha.']]
    hs.write_text(''.join(json.dumps(dict(ind=i, activity_label='Python', ctx_a='Return the value',
                                          ctx_b='of',
                                          ctx=f'Return the value {i}', endings=ends[i % 2], label=i % 4,
                                          source_id='t', split='val', split_type='indomain')) + '\n'
                          for i in range(8)))
    p = lmbook(ws, 'eval', 'train-bf16-compile', '--root', ws, '--device', DEVICE, '--json',
               '--hellaswag-file', hs, log=out/f'{row.name}.log')
    run_ok(p, 'lmbook eval')
    res = json.loads(p.stdout.strip().splitlines()[-1])
    logged = [r['val_loss'] for r in metrics(ws/'runs'/'train-bf16-compile')
              if r.get('val_loss') is not None][-1]
    check(abs(res['val_loss'] - logged) / logged < 2e-2,
          f"eval {res['val_loss']:.4f} vs training's {logged:.4f}")
    check(res.get('hellaswag_n') == 8, f"hellaswag_n {res.get('hellaswag_n')}")
    return dict(val_loss=round(res['val_loss'], 4), logged_val_loss=round(logged, 4),
                hellaswag=res.get('hellaswag'))


def free_port() -> int:
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


@contextlib.contextmanager
def serving(row:Row, ws:Path, out:Path):
    """`lmbook serve finetune-lora` on CUDA (CUDA graphs) on a free port: its base URL; SIGTERM at the end,
    which must exit 0."""
    port = free_port()
    log = open(out/f'{row.name}.log', 'w')
    srv = subprocess.Popen([sys.executable, '-m', 'lmbook.cli', 'serve', 'finetune-lora', '--port', str(port),
                            '--device', DEVICE], cwd=ROOT, env=child_env(ws), stdout=log,
                           stderr=subprocess.STDOUT)
    base = f'http://127.0.0.1:{port}/v1'
    try:
        for _ in range(240):
            try: urllib.request.urlopen(f'{base}/models', timeout=2); break
            except OSError: check(srv.poll() is None, 'the server exited'); time.sleep(0.5)
        yield base
    finally:
        srv.send_signal(signal.SIGTERM)
        try: srv.wait(30)
        except subprocess.TimeoutExpired: srv.kill(); srv.wait()
        log.close()
        # a request the server failed, or a device failure, has its line: it names the request and the error
        said = [l for l in (out/f'{row.name}.log').read_text().splitlines() if l.startswith('lmbook serve: ')]
        check(not said, 'the server said: ' + ' | '.join(said[:3]))
    check(srv.returncode == 0, f"the server exited {srv.returncode} after SIGTERM, not 0")


def post(base:str, path:str, body:dict, stream:bool=False):
    "The JSON answer of one request (a list of the events' objects for a stream)."
    req = urllib.request.Request(f'{base}/{path}', json.dumps(dict(model='finetune-lora', **body)).encode(),
                                 {'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not stream: return json.loads(r.read())
        return [json.loads(l[6:]) for l in r.read().decode().splitlines() if l.startswith('data: {')]


def run_serve(row:Row, ws:Path, out:Path) -> dict:
    "`lmbook serve` on CUDA answers 8 concurrent chat requests; SIGTERM exits 0."
    with serving(row, ws, out) as base:
        res, t0 = [None]*8, time.perf_counter()
        def ask(i):
            res[i] = post(base, 'chat/completions', dict(max_tokens=32, temperature=0, messages=[
                dict(role='user', content=f'What does abs do? ({i})')]))
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        dt = time.perf_counter() - t0
    check(all(r and r['choices'][0]['message']['content'] is not None for r in res), f"answers: {res}")
    toks = sum(r['usage']['completion_tokens'] for r in res)
    return dict(answered=8, completion_tokens=toks, tok_per_s=round(toks / dt, 1), seconds_for_8=round(dt, 2))


def run_serve_api(row:Row, ws:Path, out:Path) -> dict:
    """The OpenAI fields that take CUDA paths of their own (penalties, bias, log-probabilities of tokens
    and of a prompt's prefill, n sharing a prefill), and stop strings, on CUDA with its graphs, mixed."""
    first = dict(max_tokens=48, temperature=0)
    ask = lambda **kw: post(base, 'completions', dict(first, **kw))
    with serving(row, ws, out) as base:
        # an answer long enough to cut: greedy where the tiny model gives one, else sampled with a seed
        # (the same seed gives the same answer, so the cut must still match it)
        for first['prompt'], sampled in [(p, s) for s in (None, 11) for p in ('Return the', 'The function')]:
            if sampled: first.update(temperature=1.0, seed=sampled)
            if len(whole := ask()['choices'][0]['text']) > 8: break
        check(len(whole) > 8, f"short answers only, greedy and sampled: {whole!r}")
        stop = whole[len(whole)//2:len(whole)//2 + 2]
        cut = ask(stop=stop)['choices'][0]
        streamed = post(base, 'completions', dict(first, stop=stop, stream=True), stream=True)
        check((cut['text'], cut['finish_reason']) == (whole[:whole.index(stop)], 'stop'),
              f"stop {stop!r}: {cut}")
        check(''.join(c['choices'][0]['text'] for c in streamed) == cut['text'], f"streamed: {streamed[-2:]}")
        one, three = ask(seed=3, temperature=1.0), ask(seed=3, temperature=1.0, n=3)
        check(three['choices'][0]['text'] == one['choices'][0]['text'] and len(three['choices']) == 3,
              f"n=3 against n=1: {three['choices']}")
        lp = post(base, 'chat/completions', dict(messages=[dict(role='user', content='What does abs do?')],
                                                 max_tokens=16, temperature=0, logprobs=True, top_logprobs=3))
        ents = lp['choices'][0]['logprobs']['content']
        # greedy: each token is the likeliest (ties, such as a tiny model's untrained specials, may differ)
        check(ents and all(abs(e['logprob'] - e['top_logprobs'][0]['logprob']) < 1e-4 for e in ents),
              f"greedy logprobs: {ents[:2]}")
        ids = [101, 202, 303, 404]
        echo = ask(prompt=ids, echo=True, logprobs=1, max_tokens=0)['choices'][0]
        echo = echo['logprobs']['token_logprobs']
        forced = ask(prompt=ids[:-1], max_tokens=1, logprobs=1, logit_bias={str(ids[-1]): 100})
        diff = abs(forced['choices'][0]['logprobs']['token_logprobs'][0] - echo[-1])
        check(len(echo) == 4 and diff < 0.1, f"prefill vs decode log-probability of one token: {diff}")
        toks = ask(logprobs=1)['choices'][0]['logprobs']['tokens']
        pen = ask(frequency_penalty=2.0, presence_penalty=2.0)['choices'][0]['text']
        # a penalty of 4 logits changes an answer that repeats a token (one that never repeats may stay)
        check(pen != whole or len(set(toks)) == len(toks), f"penalties changed nothing: {toks}")
        mixed = [None]*8
        def one_of(i):
            mixed[i] = ask(**(dict(stop=[stop], logprobs=2) if i % 2 else dict(seed=i, temperature=0.8)))
        threads = [threading.Thread(target=one_of, args=(i,)) for i in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        check(all(stop not in m['choices'][0]['text'] and 'tokens' in m['choices'][0]['logprobs']
                  for m in mixed[1::2]), f"stop strings and logprobs in a mixed batch: {mixed}")
    return dict(stop=stop, n=3, logprob_entries=len(ents), echo_vs_decode_logprob_diff=round(diff, 4))


def run_papermill(row:Row, ws:Path, out:Path) -> dict:
    """papermill nbs/train.ipynb, SIGTERM to its process group mid-run, then the same command resumes from the
    stop."""
    name, env, run = row.name, child_env(ws), ws/'runs'/row.name
    cmd = [sys.executable, '-m', 'papermill', 'nbs/train.ipynb', str(out/f'{name}.ipynb'), '-p', 'profile',
           'smoke', '-p', 'experiment', name, '-p', 'device', DEVICE, '-p', 'max_steps', '3000',
           '-p', 'overrides', 'compile=false,ckpt_every=5000,eval_every=1000,log_every=1,tensorboard=false']
    with open(out/f'{name}-stopped.log', 'w') as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, stdin=subprocess.DEVNULL)
        t0 = time.time()
        while p.poll() is None and time.time() - t0 < 300:  # the run's own log says how far it got
            steps = re.findall(r' step (\d+)/',
                               (run/'train.log').read_text()) if (run/'train.log').exists() else []
            if steps and int(steps[-1]) >= 50: os.killpg(p.pid, signal.SIGTERM); break
            time.sleep(0.05)
        p.wait(120)
    # papermill itself dies of the signal; the kernel's trainer writes its stop checkpoint, says so in the
    # run's
    # log and lets go of the run's lock
    t0 = time.time()
    while ((run/'.lock').exists()
           or 'stopped by' not in (run/'train.log').read_text()) and time.time() - t0 < 180:
        time.sleep(0.5)
    stop = re.search(r'stopped by SIGTERM at step (\d+)', (run/'train.log').read_text())
    check(stop, f"no stop line: {(run/'train.log').read_text()[-600:]}")
    at = int(stop.group(1))
    check(at < 3000, f"stopped only at the end ({at})")
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=600)
    (out/f'{name}-resumed.log').write_text(again.stdout + again.stderr)
    run_ok(again, 'papermill (resumed)')
    check(f'resumed at step {at}' in (run/'train.log').read_text(), f"not resumed at step {at}")
    steps = [r['step'] for r in metrics(run) if r.get('loss') is not None]
    check(steps == sorted(set(steps)) and steps[-1] == 3000 and at + 1 in steps,
          f"train steps {steps[:3]}..{steps[-3:]}")
    return dict(stopped_at=at, exit_after_sigterm=p.returncode, **trained(run))


def run_dist(row:Row, ws:Path, out:Path) -> dict:
    "A 2-GPU run killed with SIGKILL mid-run, then the same command resumes from its newest checkpoint."
    name = row.name
    args = [sys.executable, '-m', 'lmbook.cli', 'train', '-p', 'smoke', '-e', name, '--nproc', '2',
            *sets({**TINY, 'max_steps': 60, 'ckpt_every': 20, 'eval_every': 20, 'log_every': 1,
                   **row.overrides})]
    env = child_env(ws)
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        m = re.match(r'step\s+(\d+)/', line)
        if m and int(m.group(1)) >= 30: os.kill(p.pid, signal.SIGKILL); break
    p.wait(60)
    (out/f'{name}-killed.log').write_text(''.join(seen))
    # the agent's death reaches the workers (PR_SET_PDEATHSIG): they write a stop checkpoint and end
    t0, orphans = time.time(), ['?']
    while orphans and time.time() - t0 < 120:
        time.sleep(1)
        orphans = subprocess.run(['pgrep', '-f', '--', f'--experiment {name}'], capture_output=True,
                                 text=True).stdout.split()
    gone_s = round(time.time() - t0)
    again = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    (out/f'{name}-resumed.log').write_text(again.stdout + again.stderr)
    run_ok(again, f'lmbook train --nproc 2 (resumed, {row.overrides})')
    m = re.search(r'resumed at step (\d+)', again.stdout)
    check(m and int(m.group(1)) >= 20, f"not resumed from a checkpoint: {again.stdout[-400:]}")
    check(not orphans, f"workers left 120 s after the kill: {orphans}")
    # the newest checkpoint has the layout asked for, and one process evaluates it (a sharded one: its parts)
    last = sorted((ws/'runs'/name/'checkpoints').glob('step_*'))[-1]
    sharded = (last/'model').is_dir()
    check(sharded == (row.overrides.get('ckpt_format') == 'sharded'), f"{last.name}: sharded={sharded}")
    ev = lmbook(ws, 'eval', name, '--root', ws, '--device', DEVICE, '--json', '--no-hellaswag',
                log=out/f'{name}-eval.log')
    run_ok(ev, 'lmbook eval (one process)')
    return dict(resumed_at=int(m.group(1)), workers_gone_s=gone_s, sharded=sharded,
                eval_val_loss=json.loads(ev.stdout.strip().splitlines()[-1])['val_loss'],
                **trained(ws/'runs'/name))


class Node:
    "One node's `lmbook train` of a two-node job on this host: its own GPU, its output collected as it comes."
    def __init__(self, name:str, rank:int, port:int, gpu:str, sets:list[str], ws:Path):
        flags = (f'--nnodes 2 --node-rank {rank} --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} '
                 f'--rdzv-id {name}')
        self.p = subprocess.Popen([sys.executable, '-m', 'lmbook.cli', 'train', '-p', 'smoke', '-e', name,
                                   '--nproc', '1', *sets, '--torchrun-args', flags], cwd=ROOT,
                                  env=dict(child_env(ws), CUDA_VISIBLE_DEVICES=gpu), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True)
        self.reader.start()

    def step(self) -> int:
        return max([int(m[1]) for l in self.lines if (m := re.match(r'step\s+(\d+)/', l))], default=0)

    def end(self, timeout:float) -> tuple[int, list[str], float]:
        "(exit code, its `error:` lines, when it ended)."
        try: rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            raise Failed(f"a node still ran {timeout:.0f} s on: {''.join(self.lines[-5:])}") from None
        ended = time.time()
        self.reader.join(10)
        return rc, [l.strip() for l in self.lines if l.startswith('error:')], ended


def two_nodes(name:str, sets:list[str], ws:Path, out:Path, tag:str, kill_at:int=0) -> list[tuple[int, list]]:
    """Two `lmbook train --torchrun-args "--nnodes 2 --node-rank N ..."` on this host, a GPU each, as on two
    machines; with `kill_at`, node 1's torchrun is killed with SIGKILL once a step past it is logged."""
    ids = (getattr(GPU, 'ids', None) or ','.join(visible_gpus(2))).split(',')
    port = free_port()
    nodes = [Node(name, r, port, ids[r], sets, ws) for r in (0, 1)]
    t0 = time.time()
    try:
        while kill_at and max(n.step() for n in nodes) < kill_at:
            check(time.time() - t0 < 600 and all(n.p.poll() is None for n in nodes),
                  f"no step {kill_at}: {''.join(nodes[0].lines[-5:] + nodes[1].lines[-5:])}")
            time.sleep(0.5)
        if kill_at:
            agent = subprocess.run(['pgrep', '-P', str(nodes[1].p.pid), '-f', 'torch.distributed.run'],
                                   capture_output=True, text=True).stdout.split()
            os.kill(int(agent[0]), signal.SIGKILL)
            t0 = time.time()
        ends = [n.end(600) for n in nodes]
    finally:
        for i, n in enumerate(nodes):
            if n.p.poll() is None: os.killpg(n.p.pid, signal.SIGKILL)
            (out/f'{name}-{tag}-node{i}.log').write_text(''.join(n.lines))
    return [(rc, errs, round(ended - t0)) for rc, errs, ended in ends]


def run_nodes(row:Row, ws:Path, out:Path) -> dict:
    """Two "nodes" of one GPU each on this host, as on two machines (c10d rendezvous on 127.0.0.1): train;
    node 1's torchrun killed mid-run ends both nodes within a minute, in one line each; the same two commands
    resume from the newest checkpoint; then one node of both GPUs resumes it (another node count)."""
    name = row.name
    sets_ = sets({**TINY, 'max_steps': 60, 'ckpt_every': 20, 'eval_every': 20, 'log_every': 1,
                  **row.overrides})
    (rc0, err0, s0), (rc1, err1, s1) = two_nodes(name, sets_, ws, out, 'killed', kill_at=30)
    said = [e[0] if e else '' for e in (err0, err1)]
    check(len(err0) == 1 and len(err1) == 1 and rc0 and rc1, f"not one line each: {err0} {err1}")
    check(said[1].startswith("error: torchrun (this node's agent) was killed by SIGKILL"), said[1])
    check(said[0].startswith('error: node 1 failed'), said[0])
    check(max(s0, s1) <= 60, f"the nodes ended {s0} s and {s1} s after the kill")
    left = subprocess.run(['pgrep', '-f', '--', f'--experiment {name}'], capture_output=True, text=True)
    check(not left.stdout.split(), f"processes left after the kill: {left.stdout}")
    (rc0, _, _), (rc1, _, _) = two_nodes(name, sets_, ws, out, 'resumed')
    log = ''.join((out/f'{name}-resumed-node{i}.log').read_text() for i in (0, 1))
    m = re.search(r'resumed at step (\d+)', log)
    check(rc0 == rc1 == 0 and m and int(m[1]) >= 20, f"not resumed: {rc0} {rc1} {log[-600:]}")
    # one node of both GPUs: the two nodes' checkpoint, the same 2 processes and tokens a step
    one = lmbook(ws, 'train', '-p', 'smoke', '-e', name, '--nproc', '2',
                 *sets({**TINY, 'max_steps': 70, 'ckpt_every': 20, 'log_every': 1, **row.overrides}),
                 log=out/f'{name}-one-node.log')
    run_ok(one, 'lmbook train --nproc 2 (one node, resumed)')
    check('resumed at step 60' in one.stdout, f"one node did not resume at 60: {one.stdout[-400:]}")
    last = sorted((ws/'runs'/name/'checkpoints').glob('step_*'))[-1]
    check(((last/'model').is_dir()) == (row.overrides['parallel'] == 'hsdp'), f"{last.name}: layout")
    return dict(ended_s=[s0, s1], lines=said, resumed_at=int(m[1]), **trained(ws/'runs'/name))


def run_guard(row:Row, ws:Path, out:Path) -> dict:
    "The hardware check on the card: one that fits passes; one over its memory is refused in one line, first."
    fits = subprocess.run([sys.executable, '-c', 'from lmbook.profiles import get_config; '
                           'from lmbook.train.launch import check_hardware; '
                           "print(check_hardware(get_config('runpod_2b'), 'runpod_2b'))"],
                          cwd=ROOT, env=child_env(ws), capture_output=True, text=True, timeout=300)
    run_ok(fits, 'check_hardware(runpod_2b)')
    check(fits.stdout.strip().splitlines()[-1] == 'None', f"runpod_2b did not fit: {fits.stdout[-400:]}")
    p = lmbook(ws, 'train', '-p', 'runpod_4b', '-e', row.name, '--set=batch_size=64', '--set=act_ckpt=none',
               log=out/f'{row.name}.log')
    errors = [l for l in p.stderr.splitlines() if l.startswith('error:')]
    check(p.returncode == 2 and len(errors) == 1 and 'GB' in errors[0], f"not one refusal: {p.stderr[-600:]}")
    check(not (ws/'runs'/row.name).exists(), 'the refused run made its folder')
    return dict(refusal=errors[0][:300])


def losses(run:Path) -> dict[int, float]:
    return {r['step']: r['loss'] for r in metrics(run) if r.get('loss') is not None}


def run_stop_resume(row:Row, ws:Path, out:Path) -> dict:
    """A run stopped by a STOP request at step 12 of 30 and resumed, against the same run uninterrupted: its
    losses after the stop differ no more than a few times the GPU's own run-to-run noise before it, and its
    training clock goes on from the stop's checkpoint."""
    from lmbook.runlock import request_stop
    name, ref = row.name, f'{row.name}-ref'
    cfg = sets({**TINY, 'max_steps': 30, 'log_every': 1, **row.overrides})
    run_ok(lmbook(ws, 'train', '-p', 'smoke', '-e', ref, *cfg, log=out/f'{ref}.log', env=row.env),
           'the uninterrupted run')
    p = subprocess.Popen([sys.executable, '-m', 'lmbook.cli', 'train', '-p', 'smoke', '-e', name, *cfg],
                         cwd=ROOT, env={**child_env(ws), **row.env}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen, asked = [], False
    for line in p.stdout:
        seen.append(line)
        m = re.match(r'step\s+(\d+)/', line)
        if m and int(m.group(1)) >= 12 and not asked: asked = request_stop(ws/'runs'/name, 'the GPU check')
    (out/f'{name}-stopped.log').write_text(''.join(seen))
    check(p.wait() == 128 + signal.SIGTERM, f"the stopped run exited {p.returncode}: {''.join(seen[-5:])}")
    ck = sorted((ws/'runs'/name/'checkpoints').glob('step_*'))[-1]
    state = json.loads((ck/'state.json').read_text())
    again = lmbook(ws, 'train', '-p', 'smoke', '-e', name, *cfg, log=out/f'{name}-resumed.log', env=row.env)
    run_ok(again, 'the resumed run')
    m = re.search(r'resumed at step (\d+)', again.stdout)
    check(m and int(m.group(1)) == state['step'], f"not resumed from {ck.name}: {again.stdout[-400:]}")
    at, a, b = state['step'], losses(ws/'runs'/ref), losses(ws/'runs'/name)
    check(set(a) == set(b), f"steps logged: {sorted(set(a) ^ set(b))} in one run only")
    noise = max(abs(a[s] - b[s]) for s in a if s <= at)
    after = max(abs(a[s] - b[s]) for s in a if s > at)
    check(after <= 3*noise + 0.01, f"after the resume at step {at} the losses differ by up to {after:.4f}, "
                                   f"before it by {noise:.4f}")
    clock = [r['elapsed_s'] for r in metrics(ws/'runs'/name) if r['step'] > at]
    check(clock[0] > state['elapsed_s'],
          f"the clock went back: {state['elapsed_s']} s at the stop, then {clock[0]} s")
    return dict(trained(ws/'runs'/name), stopped_at=at, loss_diff_before=round(noise, 5),
                loss_diff_after=round(after, 5), elapsed_at_stop=state['elapsed_s'])


RUNNERS = dict(train=run_train, finetune=run_finetune, sample=run_sample, eval=run_eval, serve=run_serve,
               serve_api=run_serve_api, papermill=run_papermill, dist=run_dist, guard=run_guard,
               nodes=run_nodes, warm=run_warm, stop_resume=run_stop_resume)
LOCK = threading.Lock()
SINK: list[Path] = []  # the JSON lines file each row's record is added to as soon as the row ends


def run_row(row:Row, ws:Path, out:Path, env:dict) -> dict:
    "One row's record: its figures or its failure."
    t0 = time.time()
    try: res, ok, err = RUNNERS[row.kind](row, ws, out), True, None
    except Exception as e: res, ok, err = {}, False, f"{type(e).__name__}: {str(e)[:1500]}"
    rec = dict(row=row.name, kind=row.kind, ok=ok, seconds=round(time.time() - t0, 1), **env,
               set=row.overrides, **res, **({'error': err} if err else {}))
    print(('PASS ' if ok else 'FAIL ') + json.dumps(rec), flush=True)
    with LOCK:  # a check stopped by a time limit keeps the rows it finished
        for f in SINK:
            with open(f, 'a') as fh: fh.write(json.dumps(rec) + '\n')
    return rec


def one_gpu_rows(rows:list[Row], ids:list[str], jobs:int, ws:Path, out:Path, env:dict) -> list[dict]:
    "The one-GPU rows, `jobs` at a time, over the GPUs `ids` in turn; rows reading others' runs go last."
    recs = []
    for part in ([r for r in rows if not r.after], [r for r in rows if r.after]):
        with ThreadPoolExecutor(jobs) as ex:
            futs = [ex.submit(pinned([ids[i % len(ids)]], run_row), r, ws, out, env)
                    for i, r in enumerate(part)]
            recs += [f.result() for f in futs]
    return recs


def visible_gpus(n:int) -> list[str]:
    "The ids of the `n` GPUs this process sees, as CUDA_VISIBLE_DEVICES names them."
    given = [g for g in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if g.strip()]
    return (given or [str(i) for i in range(n)])[:n]


def environment() -> dict:
    import torch
    gpus = torch.cuda.device_count()
    return dict(card=torch.cuda.get_device_name(0) if gpus else 'none', gpus=gpus, torch=torch.__version__,
                date=time.strftime('%Y-%m-%d'))


def selected(only:str) -> list:
    "The rows named in `only` (comma-separated; all when empty) and the rows whose runs they read."
    names = set(filter(None, only.split(',')))
    unknown = names - {r.name for r in ROWS}
    if unknown:
        sys.exit(f"no such row: {', '.join(sorted(unknown))} (rows: {', '.join(r.name for r in ROWS)})")
    while more := {a for r in ROWS if r.name in names for a in r.after} - names: names |= more
    return [r for r in ROWS if not names or r.name in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', type=Path,
                    help='the JSON lines file (default: nbs/benchmarks/results/gpu-check_DATE_CARD.jsonl)')
    ap.add_argument('--only', default='',
                    help='these rows only, and those whose runs they read (comma-separated)')
    ap.add_argument('--jobs', type=int, default=4, help='single-GPU rows run this many at a time')
    ap.add_argument('--keep', type=Path,
                    help='keep the workspace here (default: a temporary folder, removed)')
    a = ap.parse_args()
    env = environment()
    if env['gpus'] == 0: sys.exit('the GPU check needs a CUDA GPU (torch.cuda.device_count() is 0)')
    card = re.sub(r'[^a-z0-9]+', '',
                  env['card'].lower().replace('nvidia', '').split('80gb')[0].split('141gb')[0])
    many = 'x' + str(env['gpus']) if env['gpus'] > 1 else ''
    out = a.out or ROOT/'nbs'/'benchmarks'/'results'/f"gpu-check_{env['date']}_{card}{many}.jsonl"
    ws = a.keep or Path(tempfile.mkdtemp(prefix='lmbook-gpu-'))
    logs = ws/'logs'; logs.mkdir(parents=True, exist_ok=True)
    rows = selected(a.only)
    skipped = [r.name for r in rows if r.gpus > env['gpus']]
    rows = [r for r in rows if r.gpus <= env['gpus']]
    t0, recs = time.time(), []
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text('')
    SINK[:] = [out]
    stopped = f"the GPU check was stopped (SIGTERM); the rows it finished are in {out}"
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(stopped))
    try:
        p = lmbook(ws, 'prepare', '-p', 'smoke', '-e', 'gpu', log=logs/'prepare.log')
        if p.returncode: sys.exit(f"lmbook prepare failed: {p.stderr[-800:]}")
        ids = visible_gpus(env['gpus'])
        one, many = [r for r in rows if r.gpus == 1], [r for r in rows if r.gpus > 1]
        beside = many and len(ids) >= 4  # with 4 GPUs the 2-GPU rows run on the last two, beside the others
        with ThreadPoolExecutor(1) as side:
            two = pinned(ids[-2:], lambda: [run_row(r, ws, logs, env) for r in many])
            dist = side.submit(two) if beside else None
            recs += one_gpu_rows(one, ids[:-2] if beside else ids, a.jobs, ws, logs, env)
            recs += dist.result() if beside else [run_row(r, ws, logs, env) for r in many]
    finally:
        signal.signal(signal.SIGTERM, before)
        if not a.keep: shutil.rmtree(ws, ignore_errors=True)
    bad = [r['row'] for r in recs if not r['ok']]
    print(f"\n{len(recs) - len(bad)}/{len(recs)} rows passed in {time.time() - t0:.0f} s on {env['gpus']} "
          f"x {env['card']}"
          f" (torch {env['torch']}); rows in {out}" + (f"; not run (needs 2 GPUs): {', '.join(skipped)}"
                                                       if skipped else ''))
    for r in recs: print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['row']:28} {r['seconds']:6.1f} s  "
                         + (r.get('error', '')[:150] if not r['ok'] else ''))
    sys.exit(1 if bad else 0)


if __name__ == '__main__': main()
