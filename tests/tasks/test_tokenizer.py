import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from tailspec.tasks.chain_sum import sample_problems
from tailspec.tasks.tokenizer import CHARACTERS, SPECIAL_TOKENS, build_tokenizer, chat_ids


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_round_trip_of_task_text(tok):
    texts = [t for p in sample_problems(50, seed=0) for t in (p.question, p.solution)]
    texts += [CHARACTERS, "  two  spaces ", "a , b . c ? (d) e:f\ng#h", "x-y*z"]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text)  # one token per character, nothing added (no BOS/EOS)
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text


def test_unknown_characters_map_to_unk(tok):
    assert tok("A")["input_ids"] == [tok.unk_token_id]


def test_special_tokens_are_single_ids(tok):
    assert tok.pad_token_id == 0
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    for s in SPECIAL_TOKENS:
        assert tok(s)["input_ids"] == [tok.convert_tokens_to_ids(s)]
    assert tok.eos_token == "<|eos|>" and tok.unk_token == "<|unk|>" and tok.pad_token == "<|pad|>"
    assert tok.bos_token is None
    assert tok.padding_side == "left"
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS)


def test_build_is_deterministic(tok):
    assert build_tokenizer().get_vocab() == tok.get_vocab()


def test_chat_template_ids(tok):
    conv = [{"role": "user", "content": "add 1 2"}]
    expected = [
        tok.convert_tokens_to_ids("<|user|>"),
        *tok("add 1 2")["input_ids"],
        tok.convert_tokens_to_ids("<|assistant|>"),
    ]
    # transformers 5 returns a BatchEncoding from tokenize=True; chat_ids gives the plain list.
    out = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    assert list(out["input_ids"]) == expected
    assert chat_ids(tok, conv, add_generation_prompt=True) == expected
    assert tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False) == "<|user|>add 1 2<|assistant|>"
    full = chat_ids(tok, conv + [{"role": "assistant", "content": "1+2=3 answer 3"}])
    assert full[: len(expected)] == expected
    assert full[-1] == tok.eos_token_id
    assert tok.decode(full) == "<|user|>add 1 2<|assistant|>1+2=3 answer 3<|eos|>"
    assert tok.decode(full, skip_special_tokens=True) == "add 1 21+2=3 answer 3"


def test_chat_template_rejects_system_messages(tok):
    with pytest.raises(TemplateError, match="user and assistant"):
        tok.apply_chat_template([{"role": "system", "content": "be nice"}], tokenize=False)


def test_left_padding(tok):
    batch = tok(["1", "123"], padding=True)
    assert batch["input_ids"][0] == [0, 0, tok.convert_tokens_to_ids("1")]
    assert batch["attention_mask"][0] == [0, 0, 1]


def test_save_and_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    conv = [{"role": "user", "content": "add 4 5"}]
    assert chat_ids(loaded, conv, True) == chat_ids(tok, conv, True)
    assert loaded.chat_template == tok.chat_template
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id) == (
        tok.eos_token_id,
        tok.pad_token_id,
        tok.unk_token_id,
    )
    assert loaded.padding_side == "left"
    text = "3+5=8 8+2=10 answer 10"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text


@pytest.mark.parametrize("folder", ["tiny/policy", "tiny/drafter", "deep/policy", "deep/drafter"])
def test_shipped_folders_load_as_hugging_face_checkpoints(tok, folder):
    """A user's two calls on the one documented location give the task's ids and a model that
    continues a task prompt (transformers 5 picks ``Qwen2Tokenizer`` from the config for these)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tailspec import weights_location
    from tailspec.tasks.sft import assets_dir

    location = weights_location(assets_dir(folder.split("/")[0]) / folder.split("/")[1])
    user_tok = AutoTokenizer.from_pretrained(location)
    model = AutoModelForCausalLM.from_pretrained(location).eval()
    problems = sample_problems(8, seed=3)
    for text in [p.question for p in problems] + [p.solution for p in problems] + ["a , b . c ? (d) e:f\ng#h"]:
        assert user_tok(text)["input_ids"] == tok(text)["input_ids"], text
        assert user_tok.decode(user_tok(text)["input_ids"]) == text
    prompt = chat_ids(user_tok, [{"role": "user", "content": problems[0].question}], add_generation_prompt=True)
    assert prompt == chat_ids(tok, [{"role": "user", "content": problems[0].question}], add_generation_prompt=True)
    assert (user_tok.pad_token_id, user_tok.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert model.config.vocab_size >= len(tok)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, len(prompt) :].tolist()
    assert tok.unk_token_id not in new and user_tok.decode(new) == tok.decode(new)
