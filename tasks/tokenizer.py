"""A character-level tokenizer for the tiny tasks, built locally with ``tokenizers`` (no hub download).

Every character of :data:`CHARACTERS` is one token; the special tokens are single tokens with
ids 0-4 (``<|pad|>`` is 0). Plain ``tokenizer(text)`` adds nothing (no BOS/EOS), and
``decode`` joins characters without inserting spaces, so ``decode(encode(s)) == s`` for any
string over the character set. Characters outside the set map to ``<|unk|>``.

It is written as a byte-level BPE without merges: each character's token is named by the GPT-2
byte alphabet (``" "`` is ``Ġ``, ``"\n"`` is ``Ċ``). The shipped models are Qwen2, for which
transformers 5 loads ``Qwen2Tokenizer`` from a model folder whatever ``tokenizer_config.json``
says; that class rebuilds a byte-level pre-tokenizer over the saved vocabulary, so only byte-level
names give it the same ids as this tokenizer (with plain names it silently drops spaces).

The chat template renders ``<|user|>{question}<|assistant|>{response}<|eos|>``. In transformers
5.x ``apply_chat_template(..., tokenize=True)`` returns a ``BatchEncoding`` (``return_dict``
defaults to True); :func:`chat_ids` returns the plain list of ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, EOS, USER, ASSISTANT, UNK = "<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, USER, ASSISTANT, UNK)
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz +=-*().,:?\n#"
MODEL_MAX_LENGTH = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|eos|>"
    "{% else %}{{ raise_exception('the chat template supports only user and assistant messages, got role '"
    " + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer (deterministic: same vocabulary and ids on every call)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        ((name, _),) = byte_level.pre_tokenize_str(ch)
        vocab[name] = len(vocab)
    core = Tokenizer(models.BPE(vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT],
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_beside(model_dir: str | Path) -> None:
    """The tokenizer's files into a model folder, so that the folder is a whole Hugging Face
    checkpoint (``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained``)."""
    build_tokenizer().save_pretrained(model_dir)


def chat_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template, as a plain list."""
    out: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]
