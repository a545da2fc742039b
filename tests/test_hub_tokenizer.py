"""A published tokenizer named by Hub id (tokenizer='gpt2', the gpt2_124m default) is adopted from the local
Hugging Face cache; offline without it, prepare fails in one line before writing anything."""
import json, os
from pathlib import Path
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')

from lmbook.cli import main
from lmbook.profiles import get_config
from lmbook.core import paths_for
from lmbook.data.loader import prepare_data
from lmbook.chatformat import EOT, CHAT_TOKENS
from lmbook.data.tokenizer import load_tokenizer, open_tokens, hub_tokenizer_json, token_dir


def bpe_json(path:Path, size:int=0):
    """A byte-level BPE `tokenizer.json` whose last id is `<|endoftext|>`; `size` > 0 pads it with unused
    tokens to that many (GPT-2: 50257)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    if size:
        vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        vocab.update({f'<unused{i}>': i for i in range(len(vocab), size - 1)})
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    else: tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    if not size:
        tok.train_from_iterator(['the quick brown fox jumps over the lazy dog']*50, trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([EOT])
    tok.save(str(path))
    return tok


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache (HF_HOME), offline; `put(repo_dir, size)` stores a tokenizer.json there as
    a download would."""
    monkeypatch.setenv('HF_HOME', str(tmp_path/'hf'))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path/'xdg'))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1'); monkeypatch.delenv('HF_HUB_CACHE', raising=False)
    def put(repo_dir='models--gpt2', size=0, rev='f27b190eeac4c2302d24068eabf5e9d6044389ae'):
        snap = tmp_path/'hf'/'hub'/repo_dir
        (snap/'snapshots'/rev).mkdir(parents=True); (snap/'refs').mkdir()
        (snap/'refs'/'main').write_text(rev)
        return bpe_json(snap/'snapshots'/rev/'tokenizer.json', size), snap/'snapshots'/rev/'tokenizer.json'
    return put


def files_under(root:Path) -> list[Path]: return sorted(p for p in Path(root).rglob('*') if p.is_file())


@pytest.mark.parametrize('repo_dir', ['models--gpt2', 'models--openai-community--gpt2'])
def test_prepare_adopts_the_cached_tokenizer(workspace, hub, repo_dir):
    tok, path = hub(repo_dir)
    assert main(['prepare', '-p', 'smoke', '-e', 'pub', '-s', 'tokenizer=gpt2', 'take=200', '-q']) == 0
    p = paths_for('pub', root=workspace)
    tk, meta = load_tokenizer(p.tokenizer), json.loads((p.tokenizer/'meta.json').read_text())
    assert (meta['hub_id'] == 'gpt2' and Path(meta['adopted_from']) == path
            and meta['added_tokens'] == CHAT_TOKENS)
    assert (tk.eot_id == tok.token_to_id(EOT) == tok.get_vocab_size() - 1
            and tk.vocab_size == tok.get_vocab_size() + len(CHAT_TOKENS))
    ids = np.asarray(open_tokens(token_dir(p, 'train')/'shard_00000.bin'))
    # the published ids, not new ones
    assert ids[0] == tk.eot_id and tk.encode('the quick fox') == tok.encode('the quick fox').ids


def test_offline_without_the_file_fails_before_writing(workspace, hub, capsys):
    for args in (['-p', 'smoke', '-s', 'tokenizer=gpt2'],
                 ['-p', 'gpt2_124m', '-s', 'dataset=builtin', 'dataset_config=', 'take=50']):
        assert main(['prepare', *args, '-e', 'nothing']) == 2
        err = capsys.readouterr().err.strip()
        assert (len(err.splitlines()) == 1 and 'huggingface-cli download gpt2 tokenizer.json' in err
                and '--tokenizer-json FILE' in err), err
    assert files_under(workspace) == []


def test_gpt2_124m_takes_gpt2s_tokenizer(workspace, hub, capsys):
    """GPT-2's 50257 ids plus lmbook's four chat tokens fit gpt2_124m's padded vocab_size 50304; <|endoftext|>
    keeps GPT-2's id 50256."""
    hub('models--gpt2', size=50257)
    small = ['-s', 'dataset=builtin', 'dataset_config=', 'take=200']
    # refused before tokenizing
    assert main(['prepare', '-p', 'gpt2_124m', '-e', 'g124', *small, 'vocab_size=8192', '-q']) == 2
    assert 'has 50261 tokens but vocab_size=8192: set vocab_size=50304' in capsys.readouterr().err
    cfg = get_config('gpt2_124m', dict(dataset='builtin', dataset_config='', take=200))
    pd = prepare_data(cfg, paths_for('g124', root=workspace))
    assert (pd.vocab_size, pd.eot_id) == (50261, 50256) and pd.vocab_size <= cfg.model.vocab_size
    assert main(['train', '-p', 'gpt2_124m', '-e', 'g124', *small, 'n_layer=1', 'n_embd=32', 'n_head=2',
                 'block_size=32', 'batch_size=2',
                 'grad_accum=1', 'max_steps=2', 'warmup_steps=1', 'eval_every=2', 'eval_steps=1',
                 'tensorboard=false', 'device=cpu', 'compile=false', 'sample_prompts=The']) == 0
    assert (workspace/'runs'/'g124'/'metrics.jsonl').is_file()


def test_a_trained_bundle_is_not_silently_kept(workspace, hub, capsys):
    hub()
    assert main(['prepare', '-p', 'smoke', '-e', 'mix', '-s', 'take=200', 'vocab_size=300', '-q']) == 0
    assert main(['prepare', '-p', 'smoke', '-e', 'mix', '-s', 'take=200', 'vocab_size=300', 'tokenizer=gpt2',
                 '-q']) == 2
    assert "was trained on the corpus, not adopted from gpt2" in capsys.readouterr().err


def test_downloaded_when_online(tmp_path, hub, monkeypatch):
    import huggingface_hub as hh
    monkeypatch.delenv('HF_HUB_OFFLINE')
    calls = []
    def fake_download(repo_id, filename, cache_dir=None, **kw):
        calls.append((repo_id, filename, Path(cache_dir)))
        out = Path(cache_dir)/'got'/filename; out.parent.mkdir(parents=True); bpe_json(out)
        return str(out)
    monkeypatch.setattr(hh, 'hf_hub_download', fake_download)
    assert hub_tokenizer_json('gpt2', tmp_path/'ws-cache').name == 'tokenizer.json'
    # into HF_HOME's cache, where the libraries look
    assert calls == [('gpt2', 'tokenizer.json', tmp_path/'hf'/'hub')]
    def unreachable(*a, **kw): raise OSError('Network is unreachable')
    monkeypatch.setattr(hh, 'hf_hub_download', unreachable)
    with pytest.raises(FileNotFoundError, match=r'cannot be downloaded \(OSError\).*'
                                                r'huggingface-cli download gpt2 tokenizer.json'):
        hub_tokenizer_json('gpt2')


def test_nanogpt_bins_with_the_hub_tokenizer(workspace, hub, tmp_path):
    "nanoGPT's GPT-2-tokenized train.bin/val.bin need only tokenizer=gpt2, no tokenizer file beside them."
    tok, _ = hub()
    d = tmp_path/'nano'; d.mkdir()
    ids = np.concatenate([[tok.token_to_id(EOT), *tok.encode(f'the lazy dog {i}').ids]
                          for i in range(300)]).astype('<u2')
    ids.tofile(d/'train.bin'); ids[:500].tofile(d/'val.bin')
    assert main(['prepare', '-p', 'smoke', '-e', 'nano', '-s', f'dataset={d}', 'tokenizer=gpt2', '-q']) == 0
    p = paths_for('nano', root=workspace)
    assert np.array_equal(np.asarray(open_tokens(token_dir(p, 'train')/'shard_00000.bin')), ids)
    assert json.loads((p.tokenizer/'meta.json').read_text())['hub_id'] == 'gpt2'


def test_training_starts_from_published_gpt2(workspace, hub, capsys, monkeypatch):
    """init_from=hf:gpt2 loads the cached published weights exactly (step-0 model == the import), reading them
    once; shape and tokenizer are checked before any data is written."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from lmbook.train.inputs import check_init, find_init, init_model
    from lmbook.model.hfimport import gpt2_from_hf
    tok, path = hub('models--gpt2')
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2,
                                    n_head=2))
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1: p.add_(0.1*torch.randn_like(p))
    hf.save_pretrained(path.parent)
    shape = dict(arch='gpt2', bias=True, vocab_size=320, block_size=64, n_layer=2, n_head=2, n_embd=32,
                 tokenizer='gpt2', init_from='hf:gpt2')
    cfg = get_config('smoke', shape)
    ours = init_model(cfg, check_init(cfg, find_init('hf:gpt2')))
    sd = gpt2_from_hf('gpt2', vocab_size=320)[1]
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in sd.items())
    sets = [f'{k}={v}' for k,
            v in {**shape, 'take': 200, 'max_steps': 2, 'eval_every': 2, 'eval_steps': 1, 'batch_size': 2,
                                     'tensorboard': False, 'device': 'cpu'}.items()]
    from lmbook.train import inputs
    loads = []
    monkeypatch.setattr(inputs, 'gpt2_from_hf', lambda *a, **k: loads.append(a) or gpt2_from_hf(*a, **k))
    assert main(['train', '-p', 'smoke', '-e', 'from-gpt2', '-s', *sets]) == 0
    assert len(loads) == 1, loads  # the weights the check read are the model's (they were read twice)
    for bad, says in (('n_layer=3', 'is a model of shape'),
                      ('tokenizer=', 'needs that model\'s tokenizer: set tokenizer=gpt2')):
        assert main(['train', '-p', 'smoke', '-e', 'bad-gpt2', '-s', *sets, bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith('error:') and says in err[-1], err
        assert not (workspace/'datasets'/'train'/'bad-gpt2').exists()
    assert main(['finetune', '--init-from', 'hf:gpt2', '--data', 'x.jsonl', '-e', 'ft-gpt2']) == 2
    assert ('fine-tuning starts from an lmbook run or a Llama-family model, not \'hf:gpt2\''
            in capsys.readouterr().err)
