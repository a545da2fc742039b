"""What a run's samples cost once training is done: the trainer's sampling pass (`sample_texts` on the run's model,
in its autocast, its seed and prompts) through the model's compiled code and with it set aside (`uncompiled`).

One process, the profile's model as the trainer makes it (`make_trainable`: float8 and compilation as configured),
randomly initialised, a fresh inductor cache (a cold start's end: nothing of the sampling graphs on disk). The
uncompiled pass runs first, so it finds nothing compiled; then the compiled pass, which compiles what it needs
(torch's count of graphs is reported); then each once more, both warm. A byte-level stand-in tokenizer (the
prompts' lengths in bytes, longer than a BPE's tokens) keeps the script free of a trained tokenizer.

GPU, from the repo root (about 3 minutes at runpod_2b on an H200):
    bash nbs/benchmarks/run.sh python3 nbs/benchmarks/sample_end.py --profile runpod_2b --out $OUT/sample_end.json
CPU, to check the script itself (seconds):
    PYTHONPATH=$PWD python3 nbs/benchmarks/sample_end.py --profile smoke --set device=cpu compile=true --out /tmp/s.json
"""
import argparse, contextlib, json, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch


class Bytes:
    "A stand-in tokenizer: a token a byte, end-of-text 0, any id decoded as its byte (mod 256)."
    eot_id = 0
    def encode(self, s:str) -> list[int]: return [b or 1 for b in s.encode()]
    def decode(self, ids) -> str: return bytes(i % 256 for i in ids).decode(errors='replace')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--profile', default='runpod_2b')
    ap.add_argument('--set', nargs='*', default=[], help='k=v overrides of the profile')
    ap.add_argument('--out', required=True)
    a = ap.parse_args()
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = str(scratch('lmbook-sample-end-'))  # before torch reads it
    import torch
    from torch._dynamo.utils import counters
    from lmbook.profiles import get_config
    from lmbook.overrides import parse_assignments
    from lmbook.model.gpt import GPT
    from lmbook.runs.sample import prompts_for, sample_texts
    from lmbook.train.step import make_trainable, uncompiled
    cfg = get_config(a.profile, parse_assignments(a.set))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    dev = 'cuda' if torch.cuda.is_available() and cfg.train.device in ('auto', 'cuda') else 'cpu'
    t = make_trainable(GPT(cfg.model).to(dev), cfg)
    made = time.perf_counter() - t0
    prompts = prompts_for(cfg)

    def timed(eager:bool) -> dict:
        graphs = counters['stats']['unique_graphs']
        if dev == 'cuda': torch.cuda.synchronize()
        s = time.perf_counter()
        with t.autocast(), (uncompiled(t.eval_model) if eager else contextlib.nullcontext()):  # as `_samples`
            out = sample_texts(t.eval_model, Bytes(), prompts, block_size=cfg.model.block_size,
                               seed=cfg.train.seed, device=t.device)
        if dev == 'cuda': torch.cuda.synchronize()
        return dict(s=round(time.perf_counter() - s, 2), graphs=counters['stats']['unique_graphs'] - graphs,
                    texts=[o['text'] for o in out])

    rows = dict(eager_cold=timed(True), compiled_cold=timed(False), eager_warm=timed(True),
                compiled_warm=timed(False))
    res = dict(profile=a.profile, sets=a.set, fp8=t.fp8, compile=cfg.train.levers.compile, compiled=t.compiled,
               card=torch.cuda.get_device_name() if dev == 'cuda' else 'cpu', torch=torch.__version__,
               date=time.strftime('%Y-%m-%d'), prompts=len(prompts), model_s=round(made, 1),
               same_texts=rows['eager_cold']['texts'] == rows['compiled_cold']['texts'],
               **{k: {kk: vv for kk, vv in v.items() if kk != 'texts'} for k, v in rows.items()})
    print(json.dumps(res), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + '\n')


if __name__ == '__main__': main()
