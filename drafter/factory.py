"""The default :data:`tailspec.draft_contract.DrafterFactory`: what a user hands the engine as
``drafter=`` (a tailspec ``Drafter``, an EAGLE-3 head for the target, or a smaller Hugging Face
causal LM sharing the tokenizer) made into drafters, plus the built-in suffix drafter and the
hybrid of both. Each is bound to the target's vocabulary here."""

from __future__ import annotations

from typing import Any

import torch

from ..draft_contract import Drafter, DrafterSet


def as_drafter(drafter: Any, target: torch.nn.Module, config: Any) -> Drafter:
    """``drafter`` as a :class:`Drafter`: an ``Eagle3Head`` drafts from ``target``'s features, any
    other ``torch.nn.Module`` is a small LM with its own paged KV cache, ``"self:L"`` the target's
    own first L layers (a self-speculative drafter)."""
    kv_tokens = config.draft_kv_cache_tokens or config.kv_cache_tokens
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, str):
        from .self_spec import SelfSpecDrafter

        layers = parse_self_drafter(drafter)
        return SelfSpecDrafter(
            target, layers, kv_cache_tokens=kv_tokens, block_size=config.block_size, seed=config.seed
        )
    from .eagle3 import Eagle3Drafter, Eagle3Head

    if isinstance(drafter, Eagle3Head):
        return Eagle3Drafter(drafter, target, kv_cache_tokens=kv_tokens, block_size=config.block_size, seed=config.seed)
    if isinstance(drafter, torch.nn.Module):
        from ..rollout.graph_pool import graph_pool_for
        from .small_lm import SmallLMDrafter

        return SmallLMDrafter(
            drafter,
            kv_cache_tokens=kv_tokens,
            block_size=config.block_size,
            seed=config.seed,
            # on CUDA, draft forwards replay captured graphs as the target's do (CPU keeps eager drafts)
            graph_pool=graph_pool_for(drafter, config) if next(drafter.parameters()).is_cuda else None,
        )
    raise ValueError(f"drafter must be a tailspec Drafter or a torch.nn.Module, got {type(drafter).__name__}")


def fit_problems(drafter: Any, target: torch.nn.Module, tokenizer: Any = None) -> list[str]:
    """What keeps ``drafter`` (anything :func:`as_drafter` takes) from drafting for ``target`` as it
    is now (vocabulary, hidden size, tapped or shared layers); empty when it fits. Checked at every
    policy sync: the policy can change shape under a drafter bound to it (resized embeddings)."""
    if drafter is None:
        return []
    if isinstance(drafter, Drafter):
        return drafter.fit_problems(target, tokenizer)
    if isinstance(drafter, str):
        from .self_spec import exit_layer_problems

        return exit_layer_problems(target, parse_self_drafter(drafter))
    from .eagle3 import Eagle3Head
    from .small_lm import output_rows, vocabulary_problem

    if isinstance(drafter, Eagle3Head):
        return drafter.config.target_problems(target.config)
    tokens = len(tokenizer) if tokenizer is not None else None
    problem = vocabulary_problem(output_rows(target), output_rows(drafter), tokens)
    return [problem] if problem is not None else []


def parse_self_drafter(spec: str) -> int:
    """The layer count of a self-speculative drafter named ``"self:L"`` (the policy's first L layers)."""
    kind, _, layers = spec.partition(":")
    if kind != "self" or not layers.isdigit():
        raise ValueError(
            "drafter must be a tailspec Drafter, an EAGLE-3 head, a smaller Hugging Face causal LM or "
            f"'self:L' (the policy's own first L layers), got {spec!r}"
        )
    return int(layers)


def build_drafters(
    drafter: Any, target: torch.nn.Module, config: Any, vocab_size: int, tokenizer: Any = None
) -> DrafterSet:
    from .hybrid import HybridDrafter
    from .suffix import SuffixDrafter

    model = None
    if drafter is not None:
        model = as_drafter(drafter, target, config)
        model.bind(vocab_size, tokenizer)
    suffix = SuffixDrafter(history_tokens=config.suffix_history_tokens)
    suffix.bind(vocab_size)
    return DrafterSet(model, suffix, HybridDrafter(model, suffix) if model is not None else None)
