"""QLoRA and LoRA at Llama-2-7B's shape on one GPU: lmbook against transformers + peft + bitsandbytes, one call.

A random model of Llama-2-7B's shape (32 layers, 4096 wide, 11008 MLP, 32 heads, vocabulary 32000; the Hub cannot be
reached) is written once as a transformers folder, with a byte-level BPE trained on the built-in chat records. Each
row then runs in a fresh process, so its peak memory is its own, on the same packed rows of those chat records
(sequence 2048, micro-batch 1, AdamW at lr 2e-4, LoRA rank 16 and alpha 16 on q, k, v, o):

- `lmbook-qlora`: `lmbook finetune --init-from hf:DIR --quant nf4` (4-bit base, bf16 compute), activation
  checkpointing as `--ckpt` says (default: none, then full);
- `lmbook-lora-bf16`: the same without `--quant` (the frozen base in bf16);
- `hf-peft-bnb`: the usual recipe: `AutoModelForCausalLM.from_pretrained(DIR, quantization_config=BitsAndBytesConfig(
  load_in_4bit, nf4, double quantization, bf16 compute))`, `prepare_model_for_kbit_training` (gradient
  checkpointing on), `get_peft_model(LoraConfig(r=16, alpha=16, q/k/v/o_proj))`, a plain loop with torch's AdamW.

Each row: peak GPU memory of its whole process (allocated and reserved, GB), tokens/s over the steps after the
first `--warmup`, and the training loss at its first and last step (it must fall). Rows go to OUT as JSON.

Parity (does lmbook train the same model peft does?): every lmbook row records what it trained on (its initial
LoRA adapters and each step's packed rows, in its order). `peft-qlora-parity` then trains peft on exactly that:
the same rows in the same order, lmbook's initial adapters (written in peft's format by `write_peft_adapter`),
the same optimizer (AdamW, betas, eps, no weight decay), constant learning rate, gradient clipping at the run's
grad_clip, NF4 without double quantization (as lmbook quantizes), no dropout, loss on the same tokens (the
responses), and compares the loss of each step with `lmbook-qlora-ckpt-full`'s: within 2% on every step passes.
`peft-lora-parity` does the same without 4-bit against `lmbook-lora-bf16-ckpt-full` (the CPU check of `--tiny`,
where bitsandbytes has no 4-bit path: LoRA alone, in float32).
Usage (repo root): python3 nbs/benchmarks/qlora_7b.py OUT.json [--steps 30] [--warmup 5] [--seq 2048] [--rows A,B]
                   python3 nbs/benchmarks/qlora_7b.py OUT.json --tiny      (a tiny model on the CPU: the script's check)
It keeps only OUT: the model's work folder (13 GB at 7B) goes when the script ends, however it ends (see scratch.py),
and each row's workspace (its checkpoints) when the row's process ends, so rows do not pile up on the disk.
"""
import argparse, contextlib, json, os, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scratch import scratch
SHAPE_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)
SHAPE_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
LORA = dict(r=16, alpha=16.0, targets=('q_proj', 'k_proj', 'v_proj', 'o_proj'), lr=2e-4)
PARITY = {'peft-qlora-parity': 'lmbook-qlora-ckpt-full', 'peft-lora-parity': 'lmbook-lora-bf16-ckpt-full'}
PARITY_TOL = 0.02  # the largest relative difference of one step's loss that the parity rows pass


def make_model(folder:Path, shape:dict, device:str) -> Path:
    "A random bf16 Llama of `shape` with a BPE of the built-in chat records, saved as a transformers folder."
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    sys.path.insert(0, str(HERE))
    from tiny_llama import tiny_llama
    tiny_llama(folder, vocab=min(shape['vocab_size']//2, 8192))  # the tokenizer (a tiny model too, replaced below);
    # its added tokens (<|endoftext|>, the chat tokens) land on rows the model has, as in every row here
    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device): m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for f in folder.glob('model*.safetensors*'): f.unlink()
    m.save_pretrained(folder, max_shard_size='5GB')
    return folder


def chat_rows(folder:Path, seq:int):
    "The packed (inputs, targets) rows of the built-in chat records, as lmbook's fine-tuning makes them."
    from lmbook.data.sft import builtin_chat, record_messages, render_chat, pack
    from lmbook.model.hfimport import hf_tokenizer
    tk = hf_tokenizer(folder)[0]
    ex = [render_chat(record_messages(r), tk) for r in builtin_chat()]
    return pack([(i[:seq + 1], m[:seq + 1]) for i, m in ex], seq, tk.eot_id), tk


def peak(dev:str) -> dict:
    import torch
    if not dev.startswith('cuda'): return dict(peak_alloc_gb=None, peak_reserved_gb=None)
    return dict(peak_alloc_gb=round(torch.cuda.max_memory_allocated()/1e9, 2),
                peak_reserved_gb=round(torch.cuda.max_memory_reserved()/1e9, 2))


@contextlib.contextmanager
def recording(out:Path):
    """Record what an lmbook run in this process trains on, into `out`: `adapters.pt` (its LoRA adapters as built,
    before the first step) and `rows.pt` (each step's (inputs, targets), in its order)."""
    import torch
    import lmbook.train.runstart as rs
    build, loaders, rows = rs.build_trainable, rs.run_loaders, []
    def built(*a, **k):  # the last call is the run's model (a batch fit builds trial models first)
        t = build(*a, **k)
        torch.save({n.replace('_orig_mod.', ''): p.detach().float().cpu().clone()
                    for n, p in t.model.named_parameters() if '.lora_' in n}, out/'adapters.pt')
        return t
    def loaded(*a, **k):
        loader, val = loaders(*a, **k)
        nb = loader.next_batch
        def next_batch():
            x, y = nb()
            rows.append((x.clone(), y.clone()))
            return x, y
        loader.next_batch = next_batch
        return loader, val
    out.mkdir(parents=True, exist_ok=True)
    rs.build_trainable, rs.run_loaders = built, loaded
    try: yield rows
    finally:
        rs.build_trainable, rs.run_loaders = build, loaders
        torch.save(rows, out/'rows.pt')


def run_lmbook(folder:Path, data:Path, a, quant:str, ckpt:str, record:Path|None=None) -> dict:
    "One lmbook fine-tuning run; its rows read back from metrics.jsonl (what it trained on into `record`)."
    import torch
    from lmbook.train.finetune import finetune
    ws = scratch('lmbook-ws-', folder)  # inside the work folder, so a row killed mid-run leaves nothing behind either
    ov = dict(lora_rank=LORA['r'], lora_alpha=LORA['alpha'], lora_targets='q,k,v,o', quant=quant, block_size=a.seq,
              batch_size=1, grad_accum=1, max_steps=a.steps, warmup_steps=1, lr=a.lr, min_lr_ratio=1.0, log_every=1,
              eval_every=10**6, eval_steps=1, ckpt_every=10**6, keep_ckpts=1, act_ckpt=ckpt, device=a.device,
              compile=a.compile, tensorboard=False, doc_mask=False, val_ratio=0.02)
    with recording(record) if record else contextlib.nullcontext():
        res = finetune(f'hf:{folder}', data, 'bench', ov, root=ws, log=lambda s: print(s, flush=True))
    rows = [json.loads(l) for l in (Path(res['run_dir'])/'metrics.jsonl').read_text().splitlines()]
    train = [r for r in rows if 'loss' in r and 'tok_per_s' in r]
    timed = [r for r in train if r['step'] > a.warmup] or train
    if record:  # what the parity rows need: the run's config and its loss and learning rate at each step
        (record/'training.toml').write_text((Path(res['run_dir'])/'training.toml').read_text())
        (record/'steps.json').write_text(json.dumps([dict(step=r['step'], loss=r['loss'], lr=r['lr']) for r in train]))
    return dict(**peak(a.device), tok_per_s=round(sum(r['tok_per_s'] for r in timed)/len(timed), 1),
                **falls([r['loss'] for r in train]))


def falls(losses:list) -> dict:
    "The loss at the start and end of a row: the mean of its first and of its last three steps."
    k = min(3, len(losses)//2) or 1
    return dict(loss_first=round(sum(losses[:k])/k, 4), loss_last=round(sum(losses[-k:])/k, 4), steps=len(losses))


def run_hf(folder:Path, a) -> dict:
    "The transformers + peft + bitsandbytes recipe on the same rows."
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    (x, y), _ = chat_rows(folder, a.seq)
    cuda = a.device.startswith('cuda')
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16) if cuda else None  # bitsandbytes' 4-bit layers need CUDA
    m = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.bfloat16 if cuda else torch.float32,
                                             device_map={'': a.device})
    m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=True) if cuda else m
    if not cuda: m.gradient_checkpointing_enable(); m.enable_input_require_grads()
    m = get_peft_model(m, LoraConfig(r=LORA['r'], lora_alpha=LORA['alpha'], target_modules=list(LORA['targets']),
                                     lora_dropout=0.0, bias='none', task_type='CAUSAL_LM'))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
    m.train(); losses, times = [], []
    for step in range(a.steps):
        i = step % len(x)
        ids, lab = x[i:i+1].to(a.device), y[i:i+1].to(a.device)
        labels = torch.cat([torch.full_like(lab[:, :1], -100), lab[:, :-1].masked_fill(lab[:, :-1] < 0, -100)], 1)
        t0 = time.perf_counter()
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs
        times.append(time.perf_counter() - t0)
    timed = times[a.warmup:] or times
    return dict(**peak(a.device), tok_per_s=round(a.seq/(sum(timed)/len(timed)), 1), **falls(losses))


def run_parity(folder:Path, rec:Path, device:str, quant:bool) -> dict:
    """peft on what the lmbook row recorded in `rec` (`recording`): its rows in its order, from its initial adapters,
    with its optimizer settings; each step's loss against lmbook's."""
    import torch, torch.nn.functional as F
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from peft import PeftModel, prepare_model_for_kbit_training
    from lmbook.profiles import get_config
    from lmbook.runs.export import write_peft_adapter
    from lmbook.model.hfimport import new_token_rows
    cfg, steps = get_config(str(rec/'training.toml')), json.loads((rec/'steps.json').read_text())
    rows, ft, oc = torch.load(rec/'rows.pt'), cfg.train.finetune, cfg.train.optim
    assert len(rows) == len(steps), (len(rows), len(steps))  # one micro-batch a step (grad_accum=1)
    adapter = write_peft_adapter(rec/'adapter-step-0', torch.load(rec/'adapters.pt'), cfg.model, ft.lora_rank,
                                 ft.lora_alpha, ft.lora_targets, str(folder))
    # NF4 in blocks of 64 with bf16 compute, as lmbook quantizes: no double quantization of the scales
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=False,
                           bnb_4bit_compute_dtype=torch.bfloat16) if quant else None
    dtype = torch.bfloat16 if device.startswith('cuda') else torch.float32
    m = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=dtype, device_map={'': device})
    with torch.no_grad():  # the same base: the rows of the tokens lmbook adds (EOT, chat markers) set as lmbook sets them
        emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
        for i, (rows_in, rows_out) in new_token_rows(folder).items():
            emb[i], head[i] = emb[rows_in].mean(0), head[rows_out].mean(0)
    m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=True) if quant else m
    m = PeftModel.from_pretrained(m, adapter, is_trainable=True)  # lora_dropout 0, alpha/r as the run's
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=1e-8, weight_decay=oc.weight_decay)
    m.train(); losses = []
    for x, y in rows:  # lmbook's rows, in its order
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.split(':')[0], torch.bfloat16, enabled=device.startswith('cuda')):
            logits = m(input_ids=x).logits
        # the same tokens carry the loss: lmbook's targets (-1: none), every position of the row
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, oc.grad_clip if oc.grad_clip > 0 else float('inf'))
        opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return dict(**peak(device), **compare(losses, steps, oc.lr), **falls(losses))


def compare(peft_losses:list, steps:list[dict], lr:float) -> dict:
    "Each step's loss of lmbook (`steps`, its metrics) against peft's on the same rows; pass within `PARITY_TOL`."
    ours = [s['loss'] for s in steps]
    rel = [abs(o - p)/abs(p) for o, p in zip(ours, peft_losses)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    return dict(parity_max_rel=round(rel[worst], 5), parity_worst_step=steps[worst]['step'],
                parity_mean_rel=round(sum(rel)/len(rel), 5), parity_pass=rel[worst] <= PARITY_TOL,
                lr_constant=all(abs(s['lr'] - lr) <= 1e-12 + 1e-9*lr for s in steps),
                loss_lmbook=[round(v, 5) for v in ours], loss_peft=[round(v, 5) for v in peft_losses])


def child(a) -> dict:
    "One row, in this (fresh) process."
    folder, data = Path(a.dir), Path(a.dir)/'chat.jsonl'
    t0 = time.time()
    if a.row == 'hf-peft-bnb': r = run_hf(folder, a)
    elif a.row in PARITY: r = run_parity(folder, folder/'record'/PARITY[a.row], a.device, 'qlora' in a.row)
    else:
        quant, ckpt = ('nf4' if a.row.startswith('lmbook-qlora') else 'none'), a.row.rsplit('-ckpt-', 1)[-1]
        r = run_lmbook(folder, data, a, quant, ckpt, folder/'record'/a.row)
    return dict(row=a.row, seconds=round(time.time() - t0, 1), **r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', type=Path)
    ap.add_argument('--steps', type=int, default=30); ap.add_argument('--warmup', type=int, default=5)
    ap.add_argument('--lr', type=float, default=LORA['lr'], help='AdamW learning rate of every row')
    ap.add_argument('--seq', type=int, default=2048); ap.add_argument('--tiny', action='store_true')
    ap.add_argument('--ckpt', default='none,full', help='act_ckpt values of the lmbook QLoRA rows')
    ap.add_argument('--compile', default='auto', help="lmbook's compile setting (auto: on CUDA, as a run has it)")
    ap.add_argument('--rows', default='', help='only these rows (comma-separated names)')
    ap.add_argument('--row', help=argparse.SUPPRESS); ap.add_argument('--dir', help=argparse.SUPPRESS)
    ap.add_argument('--device', default='', help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.row: print('ROW ' + json.dumps(child(a)), flush=True); return
    import torch
    a.device = 'cuda' if torch.cuda.is_available() and not a.tiny else 'cpu'
    if a.tiny: a.seq, a.steps, a.warmup, a.lr = 128, min(a.steps, 8), 1, 1e-2  # a loss that visibly falls in 8 steps
    work = scratch('qlora7b-')
    t0 = time.time()
    make_model(work, SHAPE_TINY if a.tiny else SHAPE_7B, a.device)
    from lmbook.data.sft import builtin_chat, write_jsonl
    write_jsonl(builtin_chat(), work/'chat.jsonl')
    made = round(time.time() - t0, 1)
    names = [f'lmbook-qlora-ckpt-{c}' for c in a.ckpt.split(',')] + ['lmbook-lora-bf16-ckpt-full', 'hf-peft-bnb',
                                                                      'peft-lora-parity' if a.tiny else 'peft-qlora-parity']
    names = [n for n in names if not a.rows or n in a.rows.split(',')]
    if bad := [n for n in names if n in PARITY and PARITY[n] not in names]:
        ap.error(f"{bad[0]} compares with the row {PARITY[bad[0]]}: list that row too (before it)")
    card = torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'
    out = dict(card=card, date=time.strftime('%Y-%m-%d'), torch=torch.__version__, shape='tiny' if a.tiny else 'Llama-2-7B',
               seq=a.seq, batch=1, steps=a.steps, warmup=a.warmup, lora=dict(LORA, lr=a.lr), compile=a.compile, model_written_s=made, rows=[])
    for n in names:
        cmd = [sys.executable, __file__, str(a.out), '--row', n, '--dir', str(work), '--device', a.device, '--steps', str(a.steps),
               '--warmup', str(a.warmup), '--seq', str(a.seq), '--compile', a.compile, '--lr', str(a.lr)]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
        rows = [json.loads(l[4:]) for l in p.stdout.splitlines() if l.startswith('ROW ')]
        out['rows'].append(rows[0] if rows else dict(row=n, error=(p.stderr.strip().splitlines() or ['?'])[-1][:300]))
        print(json.dumps(out['rows'][-1]), flush=True)
        a.out.write_text(json.dumps(out, indent=1) + '\n')
    versions = {}
    for mod in ('transformers', 'peft', 'bitsandbytes'):
        try: versions[mod] = __import__(mod).__version__
        except Exception: versions[mod] = None
    out['versions'] = versions
    a.out.write_text(json.dumps(out, indent=1) + '\n')


if __name__ == '__main__': main()
