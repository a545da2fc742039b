"""Chat data as people have it: prompt/response, OpenAI messages, Alpaca and ShareGPT records read from
JSONL, JSON arrays and Hugging Face datasets (offline, from the cache a download leaves), each rendered
exactly as the equivalent messages; the format told from the first record; columns mapped; every bad record
one line."""
import json, os
from pathlib import Path
import pytest
from lmbook.data.tokenizer import train_bpe
from lmbook.data.sft import read_sft, render_chat
from lmbook.data.chatdata import chat_records, chat_source, parse_columns, record_format, record_messages

SYSTEM, Q1, A1 = 'Be brief.', 'Add two and two.', 'Four.'
Q2, INPUT, A2 = 'Name a colour.', 'Not red.', 'Blue.'
# the same two conversations as OpenAI messages: what every other format must read as
MESSAGES = [[dict(role='system', content=SYSTEM), dict(role='user', content=Q1),
             dict(role='assistant', content=A1)],
            [dict(role='user', content=f'{Q2}\n\n{INPUT}'), dict(role='assistant', content=A2)]]
SAME = {
    'messages.jsonl': [dict(messages=m) for m in MESSAGES],
    'prompt.jsonl': [dict(system=SYSTEM, prompt=Q1, response=A1),
                     dict(prompt=f'{Q2}\n\n{INPUT}', response=A2)],
    'alpaca.json': [dict(system=SYSTEM, instruction=Q1, input='', output=A1),
                    dict(instruction=Q2, input=INPUT, output=A2)],
    'sharegpt.jsonl': [{'conversations': [{'from': 'system', 'value': SYSTEM},
                                          {'from': 'human', 'value': Q1}, {'from': 'gpt', 'value': A1}]},
                       {'conversations': [{'from': 'user', 'value': f'{Q2}\n\n{INPUT}'},
                                          {'from': 'assistant', 'value': A2}]}],
    'sharegpt.json': [{'system': SYSTEM, 'conversations': [{'from': 'human', 'value': Q1},
                                                           {'from': 'gpt', 'value': A1}]},
                      {'conversations': [{'from': 'human', 'value': f'{Q2}\n\n{INPUT}'},
                                         {'from': 'gpt', 'value': A2}]}],
}


def write(path:Path, recs:list) -> Path:
    "JSONL for .jsonl, one indented JSON array for .json."
    path.write_text(json.dumps(recs, indent=2) if path.suffix == '.json'
                    else ''.join(json.dumps(r) + '\n' for r in recs))
    return path


@pytest.fixture
def hf_unset(monkeypatch):
    "HF_HOME and HF_DATASETS_CACHE unset, so the workspace's cache is the one used, and unset again after."
    for k in ('HF_HOME', 'HF_DATASETS_CACHE'):
        monkeypatch.setenv(k, 'unset')
        monkeypatch.delenv(k)


@pytest.fixture(scope='module')
def tk():
    return train_bpe([f'{SYSTEM} {Q1} {A1} {Q2} {INPUT} {A2}']*40, 320)


@pytest.mark.parametrize('name', list(SAME))
def test_each_format_reads_and_renders_as_its_messages(tmp_path, tk, name):
    path = write(tmp_path/name, SAME[name])
    assert [t for _, t in chat_records(path)] == MESSAGES
    assert read_sft(path, tk, 64) == [render_chat(m, tk, 65) for m in MESSAGES]


def test_the_format_is_told_from_the_first_record(tmp_path):
    assert [record_format(r[0]) for r in SAME.values()] == ['messages', 'prompt', 'alpaca', 'sharegpt',
                                                            'sharegpt']
    # an UltraChat row has a prompt beside its messages: a conversation
    assert record_format(dict(prompt=Q1, prompt_id='x', messages=MESSAGES[0])) == 'messages'
    mixed = write(tmp_path/'mixed.jsonl', [SAME['alpaca.json'][1], SAME['sharegpt.jsonl'][0]])
    with pytest.raises(ValueError) as e: list(chat_records(mixed))
    assert str(e.value) == (f"{mixed}:2: this record is ShareGPT, but the first record of {mixed} is Alpaca: "
                            "keep one format a file (split it in two)")
    # lmbook's own two shapes share a file, as they always could
    both = write(tmp_path/'both.jsonl', [SAME['prompt.jsonl'][0], SAME['messages.jsonl'][1]])
    assert [t for _, t in chat_records(both)] == MESSAGES
    # a record with none of the format's marking fields gets that format's error
    odd = write(tmp_path/'odd.jsonl', [SAME['alpaca.json'][0], dict(input=INPUT)])
    with pytest.raises(ValueError, match=r"odd.jsonl:2: the record has no 'instruction'"):
        list(chat_records(odd))
    unknown = write(tmp_path/'unknown.jsonl', [dict(question=Q1, answer=A1)])
    with pytest.raises(ValueError) as e: list(chat_records(unknown))
    assert str(e.value).startswith(f"{unknown}:1: no chat format has these fields ('question', 'answer'): ")
    assert 'sft_columns' in str(e.value)


def test_columns_name_the_data_own_fields(tmp_path):
    qa = write(tmp_path/'qa.jsonl', [dict(id=1, question=Q1, answer=A1, instruction='not this one'),
                                     dict(id=2, question=Q2, context=INPUT, answer=A2)])
    src = chat_source(qa, columns='instruction:question,input:context,output:answer')
    assert [t for _, t in chat_records(src)] == [MESSAGES[0][1:], MESSAGES[1]]
    # inside a conversation too: ShareGPT's turns keyed role/content
    conv = write(tmp_path/'conv.jsonl', [dict(conversations=[dict(role='user', content=Q1),
                                                             dict(role='assistant', content=A1)])])
    assert ([t for _, t in chat_records(chat_source(conv, columns='from:role,value:content'))]
            == [MESSAGES[0][1:]])
    # an error names the column as the data has it
    write(qa, [dict(question=Q1, answer=A1), dict(question=Q2)])
    with pytest.raises(ValueError, match=r"qa.jsonl:2: the record has no 'answer'"): list(chat_records(
        chat_source(qa, columns='instruction:question,output:answer')))
    assert parse_columns(' instruction:question , output:answer ') == dict(instruction='question',
                                                                           output='answer')
    for bad, msg in [('instruction=question', 'is not FIELD:COLUMN'), ('question:instruction', 'no field of'),
                     ('output:a,output:b', "maps 'output' twice")]:
        with pytest.raises(ValueError, match=msg): parse_columns(bad)


@pytest.mark.parametrize('name,recs,msg', [
    ('alpaca.jsonl', [dict(instruction=Q1, output=A1), dict(instruction=Q2, output=7)],
     ":2: 'output' must be text, got int: write it as a string"),
    ('alpaca.json', [dict(instruction=Q1, output=A1), dict(instruction='  ', output=A2)],
     ":6: 'instruction' is empty: fill it in or drop the record"),
    ('sharegpt.jsonl', [dict(conversations=[dict(value=Q1)])],
     ":1: 'conversations'[0] has no 'from': give a list of turns, each with 'from' and 'value'"),
    ('sharegpt.json', [dict(conversations=[dict(zip(('from', 'value'), p)) for p in
                                           [('human', Q1), ('bot', A1)]])],
     ":2: 'conversations'[1] has unknown 'from' 'bot': use one of human, gpt, system, user, assistant"),
    ('messages.jsonl', [dict(messages=[dict(role='user', content=Q1)])],
     ":1: the conversation has no assistant turn with text: nothing to learn from; drop the record"),
    ('messages.jsonl', [dict(messages=[dict(role='user', content=Q1), dict(role='assistant', content=[A1])])],
     ":1: 'messages'[1]['content'] must be text, got list"),
    ('prompt.jsonl', [dict(prompt=f'{Q1}<|end|>', response=A1)],
     ":1: 'prompt' holds the reserved token <|end|>: remove it from the text")])
def test_a_bad_record_is_one_line_naming_file_line_and_field(tmp_path, tk, name, recs, msg):
    path = write(tmp_path/name, recs)
    with pytest.raises(ValueError) as e: read_sft(path, tk, 64)
    assert str(e.value).startswith(f"{path}{msg}") and '\n' not in str(e.value), str(e.value)


def test_json_arrays_name_the_line_a_record_starts_on(tmp_path):
    p = tmp_path/'chat.json'
    p.write_text('\ufeff[\n  {"prompt": "Hi", "response": "Hello"},\n\n'
                 '  {"prompt": "Hi",\n   "response": "Yo"}\n]')
    assert [w for w, _ in chat_records(p)] == [f'{p}:2', f'{p}:4']
    p.write_text('[{"prompt": "Hi", "response": "Hello"}\n {"prompt": "Hi", "response": "Yo"}]')
    with pytest.raises(ValueError, match=r"chat.json:2: not valid JSON \(expected ',' or '\]' after a "):
        list(chat_records(p))
    p.write_text('[{"prompt": "Hi", "response": "Hello"},\n {"prompt": "Hi" "response": "Yo"}]')
    with pytest.raises(ValueError, match=r"chat.json:2: not valid JSON \(Expecting ',' delimiter at column"):
        list(chat_records(p))
    with pytest.raises(FileNotFoundError, match='or hf:ID of a Hugging Face dataset'):
        list(chat_records(tmp_path/'missing.jsonl'))
    with pytest.raises(ValueError, match="sft_split='test' picks a split of a Hugging Face dataset"):
        chat_source(p, split='test')


@pytest.mark.parametrize('name', ['chat.jsonl', 'chat.json'])
def test_a_byte_not_utf8_names_file_line_and_offset(tmp_path, name):
    "A Latin-1 byte in a JSONL or JSON file is named like any bad record: file, line and byte offset."
    p = tmp_path/name
    good = b'{"prompt": "Hi", "response": "Hello"}'
    bad = b'{"prompt": "Caf\xe9?", "response": "Yes"}'
    body = (b'\xef\xbb\xbf[\n  ' + good + b',\n  ' + bad + b'\n]' if name == 'chat.json'
            else good + b'\n\n' + bad + b'\n' + good + b'\n')
    p.write_bytes(body)
    line, off = (3, body.index(b'\xe9'))
    with pytest.raises(ValueError) as e: list(chat_records(p))
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: byte 0xe9 at offset {off} is not UTF-8") and '\n' not in msg, msg
    assert 'iconv -f latin1 -t utf-8' in msg and 'hf:' not in msg, msg
    # a binary data file given as a file keeps the advice that fits it: load its folder as a dataset
    (tmp_path/'chat.parquet').write_bytes(b'PAR1\x15\x04\xff\x81')
    with pytest.raises(ValueError, match=r'chat.parquet is a Parquet file, not JSONL or JSON: give hf:'):
        list(chat_records(tmp_path/'chat.parquet'))


def cache_as_downloaded(cache:Path, repo_id:str, split:str, rows:dict):
    """Leave in the datasets cache `cache` what `load_dataset(repo_id)` leaves there after a download of a
    Parquet dataset from the Hub: Arrow files under ORG___NAME/default/0.0.0/COMMIT."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet
    org, name = repo_id.split('/')
    src = cache.parent/'parquet'/f'{split}.parquet'
    src.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(rows).to_parquet(src)
    b = Parquet(cache_dir=str(cache), dataset_name=name, config_name='default', config_id='default',
                hash='0'*40, data_files=DataFilesDict.from_patterns({split: [str(src)]}))
    b.download_and_prepare()
    os.rename(cache/name, cache/f'{org}___{name}')


def test_a_hub_dataset_by_id_offline(tmp_path, tk, hf_unset):
    """`sft_data=hf:ORG/NAME` goes through `datasets.load_dataset` into the workspace's hf_cache: offline, the
    cache a download left is read, with its split and columns."""
    assert os.environ['HF_HUB_OFFLINE'] == '1'
    hf_cache, cols = tmp_path/'hf_cache', 'instruction:question,input:context,output:answer'
    cache_as_downloaded(hf_cache/'datasets', 'someorg/tiny_qa', 'train',
                        dict(question=[Q1, Q2], context=['', INPUT], answer=[A1, A2], id=[1, 2]))
    src = chat_source('hf:someorg/tiny_qa', 'train', cols)
    assert ([(w, t) for w, t in chat_records(src, hf_cache)]
            == [('hf:someorg/tiny_qa train row 0', MESSAGES[0][1:]), ('hf:someorg/tiny_qa train row 1',
                                                                      MESSAGES[1])])
    assert os.environ['HF_DATASETS_CACHE'] == str(hf_cache/'datasets')
    assert (read_sft(chat_source('hf:someorg/tiny_qa', 'train[1:]', cols), tk, 64, hf_cache=hf_cache)
            == [render_chat(MESSAGES[1], tk, 65)])
    # a missing column names the row and the data's own column
    with pytest.raises(ValueError, match=r"^hf:someorg/tiny_qa train row 0: the record has no 'reply'"):
        read_sft(chat_source('hf:someorg/tiny_qa', columns='instruction:question,output:reply'), tk, 64,
                 hf_cache=hf_cache)
    # what cannot be loaded is one line that says what to check
    for data, split, msg in [('hf:someorg/tiny_qa', 'test', 'Unknown split "test"'),
                             ('hf:someorg/absent', 'train', "Couldn't reach 'someorg/absent' on the Hub")]:
        with pytest.raises(ValueError) as e:
            read_sft(chat_source(data, split, cols), tk, 64, hf_cache=hf_cache)
        assert (str(e.value).startswith(f"sft_data={data} (split {split!r}) cannot be loaded: ")
                and msg in str(e.value) and 'check the id and sft_split' in str(e.value)
                and '\n' not in str(e.value)), str(e.value)


def test_a_local_dataset_folder(tmp_path, tk, hf_unset):
    "`hf:FOLDER` loads a folder of data files through the same `load_dataset` call."
    folder = tmp_path/'sharegpt'
    folder.mkdir()
    write(folder/'train.jsonl', SAME['sharegpt.jsonl'])
    assert read_sft(f'hf:{folder}', tk, 64, hf_cache=tmp_path/'hf_cache') == [render_chat(m, tk, 65)
                                                                              for m in MESSAGES]
