"""What a request must satisfy before the engine takes it: integer token ids inside the
vocabulary, a length that fits the context and the KV pool, valid sampling parameters. Every
check raises ``ValueError`` naming the request and the field, before any work starts."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .model.kv_cache import blocks_for
from .params import RolloutConfig, SamplingParams
from .token_ids import token_id_list


def eos_ids_of(model: torch.nn.Module, tokenizer=None) -> frozenset[int]:
    """EOS ids from the model's generation config, falling back to its config / the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
        if ids:
            break
    return frozenset(ids)


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context length and the KV pool."""

    vocab_size: int
    max_model_len: int
    block_size: int
    total_blocks: int

    @classmethod
    def of(cls, model: torch.nn.Module, config: RolloutConfig) -> RequestLimits:
        from .model.runner import model_vocab_size

        max_len = config.max_model_len or int(getattr(model.config, "max_position_embeddings", 1 << 30))
        return cls(model_vocab_size(model), max_len, config.block_size, config.total_blocks)

    def check(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request cannot be served."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = token_id_list(prompt_ids)
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token")
        for i, tok in enumerate(prompt_ids):
            if not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"prompt_ids[{i}] = {tok!r} is not a token id in the vocabulary [0, {self.vocab_size})"
                )
        if params.prompt_logprobs >= len(prompt_ids):
            raise ValueError(
                f"prompt_logprobs = {params.prompt_logprobs} must be smaller than the prompt length "
                f"{len(prompt_ids)} (the first prompt token has no prediction)"
            )
        bad_stops = [s for s in params.stop_token_ids if s >= self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops} are outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt length {len(prompt_ids)} + max_new_tokens {params.max_new_tokens} = {total} "
                f"exceeds the context length max_model_len = {self.max_model_len}"
            )
        need = blocks_for(total, self.block_size)
        if need > self.total_blocks:
            raise ValueError(
                f"a request of {total} tokens needs {need} KV blocks but the pool has "
                f"{self.total_blocks}; raise RolloutConfig.num_blocks or kv_cache_tokens"
            )


def prepare_requests(
    prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None, limits: RequestLimits
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts as lists and one ``SamplingParams`` per prompt, every request checked first: one
    bad request raises ``ValueError`` naming its index (and all the others that are bad)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts is text; pass a list of token-id sequences (tokenize first)")
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        per_request = [params or SamplingParams()] * len(prompts)
    else:
        per_request = list(params)
        if len(per_request) != len(prompts):
            raise ValueError(f"got {len(per_request)} SamplingParams for {len(prompts)} prompts")
    errors = []
    for i, (p, sp) in enumerate(zip(prompts, per_request)):
        try:
            prompts[i] = token_id_list(p)
            limits.check(prompts[i], sp)
        except ValueError as e:
            errors.append(f"request {i}: {e}")
    if errors:
        raise ValueError("invalid request(s): " + "; ".join(errors))
    return prompts, per_request
