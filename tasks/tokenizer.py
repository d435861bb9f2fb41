"""A character-level tokenizer for the tiny tasks, built locally with ``tokenizers``."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|unk|>")
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz +=-*().,:?\n#"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|eos|>"
    "{% else %}{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|eos|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
        padding_side="left",
        model_max_length=1024,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
