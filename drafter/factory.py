"""Drafters are built here and only here. The default :data:`tailspec.draft_contract.DrafterFactory`
(:func:`build_drafters`) makes what a user hands the engine as ``drafter=`` into a :class:`Drafter`
(:func:`as_drafter`), adds the built-in suffix drafter and the hybrid of both, and binds each to
the target's vocabulary.

What a user may hand over is a registry of kinds (:data:`DRAFTER_KINDS`, tried in order): a
:class:`DrafterFor` (built for the model the engine decodes on), a tailspec ``Drafter`` as it is,
``"self:L"`` (the target's own first L layers), an EAGLE-3 head (it drafts from the target's
features), and any other ``torch.nn.Module`` (a smaller causal LM with its own paged KV cache).
Each kind says how it is built and what keeps it from fitting a target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..draft_contract import Drafter, DrafterSet


@dataclass(frozen=True)
class DraftSettings:
    """How a drafter is built for an engine: its KV pool and block size, its seed, and the parts
    online training hands it (``buffer``: an EAGLE-3 drafter records training samples into it;
    ``adapter``: ``self:L`` drafts through this exit adapter). ``config``: the engine's
    ``RolloutConfig`` (a drafter LM on CUDA replays captured graphs from a pool it sizes)."""

    kv_cache_tokens: int
    block_size: int
    seed: int
    buffer: Any = None
    adapter: Any = None
    config: Any = None

    @classmethod
    def of(cls, config: Any, **parts: Any) -> DraftSettings:
        kv_tokens = config.draft_kv_cache_tokens or config.kv_cache_tokens
        return cls(kv_tokens, config.block_size, parts.pop("seed", config.seed), config=config, **parts)


@dataclass(frozen=True)
class DrafterFor:
    """A drafter made for the model the engine decodes on (the model itself, or its copy in
    ``RolloutConfig.dtype``): ``build(model)`` returns what ``drafter=`` takes. Online training
    hands the engine this, so that ``self:L`` drafts with the copy's layers and an EAGLE-3 head
    reads the copy's embeddings."""

    build: Callable[[torch.nn.Module], Any]


@dataclass(frozen=True)
class DrafterKind:
    name: str
    takes: Callable[[Any], bool]
    build: Callable[[Any, torch.nn.Module, DraftSettings], Drafter]
    fit_problems: Callable[[Any, torch.nn.Module, Any], list[str]]


def _self_drafter(spec: str, target: torch.nn.Module, s: DraftSettings) -> Drafter:
    from .self_spec import SelfSpecDrafter

    layers = parse_self_drafter(spec)
    return SelfSpecDrafter(
        target, layers, adapter=s.adapter, kv_cache_tokens=s.kv_cache_tokens, block_size=s.block_size, seed=s.seed
    )


def _self_fit(spec: str, target: torch.nn.Module, tokenizer: Any) -> list[str]:
    from .self_spec import exit_layer_problems

    return exit_layer_problems(target, parse_self_drafter(spec))


def _is_eagle3_head(spec: Any) -> bool:
    from .eagle3 import Eagle3Head

    return isinstance(spec, Eagle3Head)


def check_same_device(drafter: torch.nn.Module, target: torch.nn.Module, what: str) -> None:
    """A model drafter runs on its target's device (it reads the target's features or tokens
    there): a clear error otherwise, before a forward fails on mixed devices."""
    here, there = next(drafter.parameters()).device, next(target.parameters()).device
    if here != there:
        raise ValueError(
            f"drafter ({what}) is on {here}, the model it drafts for on {there}: move it there first "
            f"(drafter.to({str(there)!r}))"
        )


def _eagle3_drafter(head: Any, target: torch.nn.Module, s: DraftSettings) -> Drafter:
    from .eagle3 import Eagle3Drafter

    check_same_device(head, target, "an EAGLE-3 head")
    return Eagle3Drafter(
        head, target, kv_cache_tokens=s.kv_cache_tokens, block_size=s.block_size, seed=s.seed, buffer=s.buffer
    )


def _small_lm_drafter(lm: torch.nn.Module, target: torch.nn.Module, s: DraftSettings) -> Drafter:
    from ..rollout.model.graph_pool import graph_pool_for
    from .small_lm import SmallLMDrafter

    check_same_device(lm, target, "a drafter LM")
    return SmallLMDrafter(
        lm,
        kv_cache_tokens=s.kv_cache_tokens,
        block_size=s.block_size,
        seed=s.seed,
        # draft forwards replay from a pool of their own as the target's do: captured graphs on
        # CUDA, padded eager buckets where the config asks for them (the CPU rehearsal of that path)
        graph_pool=graph_pool_for(lm, s.config) if s.config is not None else None,
    )


def _small_lm_fit(lm: torch.nn.Module, target: torch.nn.Module, tokenizer: Any) -> list[str]:
    from .small_lm import output_rows, vocabulary_problem

    tokens = len(tokenizer) if tokenizer is not None else None
    problem = vocabulary_problem(output_rows(target), output_rows(lm), tokens)
    return [problem] if problem is not None else []


DRAFTER_KINDS: list[DrafterKind] = [
    DrafterKind(
        "for_target",
        lambda spec: isinstance(spec, DrafterFor),
        lambda spec, target, s: as_drafter(spec.build(target), target, s.config),
        lambda spec, target, tokenizer: [],  # known once built: SpecRollout checks its own drafter
    ),
    DrafterKind(
        "drafter",
        lambda spec: isinstance(spec, Drafter),
        lambda spec, target, s: spec,
        lambda spec, target, tokenizer: spec.fit_problems(target, tokenizer),
    ),
    DrafterKind("self", lambda spec: isinstance(spec, str), _self_drafter, _self_fit),
    DrafterKind(
        "eagle3",
        _is_eagle3_head,
        _eagle3_drafter,
        lambda head, target, tokenizer: head.config.target_problems(target.config),
    ),
    DrafterKind("small_lm", lambda spec: isinstance(spec, torch.nn.Module), _small_lm_drafter, _small_lm_fit),
]


def drafter_kind(spec: Any) -> DrafterKind:
    """The registered kind that takes ``spec``."""
    for kind in DRAFTER_KINDS:
        if kind.takes(spec):
            return kind
    raise ValueError(f"drafter must be a tailspec Drafter or a torch.nn.Module, got {type(spec).__name__}")


def as_drafter(spec: Any, target: torch.nn.Module, config: Any, **parts: Any) -> Drafter:
    """``spec`` as a :class:`Drafter` for ``target`` under the engine's ``config``; ``parts``:
    ``buffer``, ``adapter`` or ``seed`` (:class:`DraftSettings`)."""
    return drafter_kind(spec).build(spec, target, DraftSettings.of(config, **parts))


def fit_problems(spec: Any, target: torch.nn.Module, tokenizer: Any = None) -> list[str]:
    """What keeps ``spec`` (anything :func:`as_drafter` takes) from drafting for ``target`` as it
    is now (vocabulary, hidden size, tapped or shared layers); empty when it fits. Checked at every
    policy sync: the policy can change shape under a drafter bound to it (resized embeddings)."""
    if spec is None:
        return []
    return drafter_kind(spec).fit_problems(spec, target, tokenizer)


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
    """The engine's drafters: the model drafter made from ``drafter`` (None without one), the
    model-free suffix drafter, the hybrid that fuses both (for ``hybrid`` strategies), and the model
    drafter's mirror steps (``mirror`` strategies, drafting beside ``target``'s forward)."""
    from ..rollout.mirror.drafter import MirrorDrafter
    from .hybrid import HybridDrafter
    from .suffix import SuffixDrafter

    suffix = SuffixDrafter(history_tokens=config.suffix_history_tokens)
    suffix.bind(vocab_size)
    if drafter is None:
        return DrafterSet(None, suffix, None)
    model = as_drafter(drafter, target, config)
    model.bind(vocab_size, tokenizer)
    mirror = MirrorDrafter(model, target, config.mirror, config.kernels)
    return DrafterSet(model, suffix, HybridDrafter(model, suffix), mirror)
