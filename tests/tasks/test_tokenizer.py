from transformers import AutoTokenizer

from tailspec.tasks.chain_sum import sample_problems
from tailspec.tasks.tokenizer import SPECIAL_TOKENS, build_tokenizer


def test_round_trip_of_task_text():
    tok = build_tokenizer()
    for p in sample_problems(50, seed=0):
        for text in (p.question, p.solution):
            ids = tok(text)["input_ids"]
            assert len(ids) == len(text)  # one token per character, nothing added
            assert tok.decode(ids) == text


def test_special_tokens_are_single_ids():
    tok = build_tokenizer()
    assert tok.pad_token_id == 0
    for s in SPECIAL_TOKENS:
        assert len(tok(s)["input_ids"]) == 1
    assert tok.eos_token == "<|eos|>" and tok.padding_side == "left"


def test_chat_template_ids():
    tok = build_tokenizer()
    conv = [{"role": "user", "content": "add 1 2"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    expected = [
        tok.convert_tokens_to_ids("<|user|>"),
        *tok("add 1 2")["input_ids"],
        tok.convert_tokens_to_ids("<|assistant|>"),
    ]
    assert list(ids) == expected
    full = tok.apply_chat_template(
        conv + [{"role": "assistant", "content": "1+2=3 answer 3"}], tokenize=True, return_dict=True
    )["input_ids"]
    assert full[-1] == tok.eos_token_id
    assert tok.decode(full, skip_special_tokens=True) == "add 1 21+2=3 answer 3"


def test_save_and_load(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    conv = [{"role": "user", "content": "add 4 5"}]
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=True)
    assert loaded.apply_chat_template(conv, **kw)["input_ids"] == tok.apply_chat_template(conv, **kw)["input_ids"]
    assert loaded.eos_token_id == tok.eos_token_id and loaded.padding_side == "left"
    assert len(loaded) == len(tok)
