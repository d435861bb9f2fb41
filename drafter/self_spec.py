"""A self-speculative drafter (Kangaroo / LayerSkip style): the policy's own first ``L`` decoder
layers, its final norm and LM head, and optionally a small adapter in front of the norm, drafting
with a paged KV cache of its own (``L`` layers deep).

Its weights *are* the policy's (the same tensors, not copies): as RL moves the policy the drafter
moves with it, so it cannot go stale the way a separately trained head does. What it can lose is
the agreement between its early exit and the full model, which :class:`ExitAdapter` (trained by
:func:`fit_adapter` on the target's own outputs) is there to recover.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from ..rollout.model.early_exit import check_exit_layer, final_norm
from ..rollout.model.eval_mode import eval_mode
from ..rollout.model.layer_taps import capture_layer_inputs
from .lm_trainer import SequenceSample, lm_held_out_acceptance
from .part_trainer import PartTrainer, StopCheck, frozen
from .small_lm import SmallLMDrafter

logger = logging.getLogger(__name__)


class ExitAdapter(nn.Module):
    """A residual bottleneck MLP on the hidden state after layer ``L``; zero-initialised, so an
    untrained adapter is the identity."""

    def __init__(self, hidden_size: int, rank: int = 64) -> None:
        super().__init__()
        if not (isinstance(rank, int) and 1 <= rank <= hidden_size):
            raise ValueError(f"adapter rank must be an int in [1, {hidden_size}], got {rank!r}")
        self.version = 0  # bumped by every training step (ExitAdapterTrainer)
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the adapter's own dtype (fp32, as it trains), returned in the hidden state's: a bf16
        policy's exit keeps an fp32 adapter."""
        inner = hidden.to(self.down.weight.dtype)
        return hidden + self.up(nn.functional.silu(self.down(inner))).to(hidden.dtype)


class _AdaptedNorm(nn.Module):
    """The adapter, then the target's final norm (what the shallow model applies after layer ``L``)."""

    def __init__(self, adapter: ExitAdapter, norm: nn.Module) -> None:
        super().__init__()
        self.adapter = adapter
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.adapter(hidden))


def exit_layer_problems(target: nn.Module, num_layers: int) -> list[str]:
    """Why ``target``'s first ``num_layers`` layers cannot be a self-speculative drafter (empty if they can)."""
    try:
        check_exit_layer(target, num_layers, "self-speculative num_layers")
    except ValueError as err:
        return [str(err)]
    return []


# the decoder's own children an early exit replaces or takes from the target one by one
_DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def _beside_layers(decoder: nn.Module) -> list[str]:
    """The decoder's other children that hold weights (Gemma 4's per-layer input embeddings and
    projection): sized by the whole stack, so a shallow model shares them and keeps the target's
    layer count in its config (the decoder still runs only the layers it holds)."""
    return [
        name
        for name, child in decoder.named_children()
        if name not in _DECODER_PARTS and any(True for _ in child.parameters())
    ]


def shallow_model(target: nn.Module, num_layers: int, adapter: ExitAdapter | None = None) -> nn.Module:
    """A causal LM of ``target``'s class whose embeddings, first ``num_layers`` decoder layers,
    final norm and LM head are ``target``'s own modules (shared, not copied), and so are whatever
    else its decoder holds beside its layers."""
    check_exit_layer(target, num_layers, "self-speculative num_layers")
    source = target.get_decoder()
    beside = _beside_layers(source)
    config = _shallow_config(target.config, num_layers, keep_count=bool(beside))
    with torch.device("meta"):
        shallow = type(target)(config)
    decoder = shallow.get_decoder()
    decoder.embed_tokens = source.embed_tokens
    decoder.layers = nn.ModuleList(list(source.layers[:num_layers]))
    decoder.norm = final_norm(target) if adapter is None else _AdaptedNorm(adapter, final_norm(target))
    for name in ("rotary_emb", *beside):
        if hasattr(source, name):
            setattr(decoder, name, getattr(source, name))
    shallow.lm_head = target.get_output_embeddings()
    left = [n for n, t in [*shallow.named_parameters(), *shallow.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(
            f"self:{num_layers} cannot draft for {type(target).__name__}: its decoder holds {left[:3]} that "
            "an early exit after some layers does not share"
        )
    return shallow.train(target.training)


def _shallow_config(config, num_layers: int, keep_count: bool):
    """``config`` for a model of ``num_layers`` layers; ``keep_count``: the layer count kept (what
    sizes the modules beside the layers), the decoder running the layers it holds."""
    config = copy.deepcopy(config)
    if not keep_count:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types[:num_layers])
    return config


class SelfSpecDrafter(SmallLMDrafter):
    """Drafts with ``target``'s first ``num_layers`` layers (plus ``adapter`` when given)."""

    name = "self_spec"

    def __init__(self, target: nn.Module, num_layers: int, *, adapter: ExitAdapter | None = None, **kwargs) -> None:
        self.num_layers = num_layers
        self.adapter = adapter
        super().__init__(shallow_model(target, num_layers, adapter), **kwargs)

    def fit_problems(self, target: nn.Module, tokenizer=None) -> list[str]:
        return exit_layer_problems(target, self.num_layers)

    @property
    def version(self) -> int:
        """Training steps of the adapter (the layers are the policy's; they move with it)."""
        return self.adapter.version if self.adapter is not None else 0

    def model_structure(self):
        rank = self.adapter.down.out_features if self.adapter is not None else None
        return partial(
            _shallow_structure, type(self.model), self.model.config, self.runner.dtype, rank, self.num_layers
        )


def _shallow_structure(cls: type, config, dtype: torch.dtype, adapter_rank: int | None, num_layers: int) -> nn.Module:
    """An untrained model shaped like a shallow model (and its adapter): a draft process's copy."""
    model = cls(config)
    model.get_decoder().layers = nn.ModuleList(list(model.get_decoder().layers[:num_layers]))
    if adapter_rank is not None:
        model.get_decoder().norm = _AdaptedNorm(ExitAdapter(config.hidden_size, adapter_rank), model.get_decoder().norm)
    return model.to(dtype)


def fit_adapter(
    target: nn.Module,
    adapter: ExitAdapter,
    sequences: Sequence[Sequence[int]],
    num_layers: int,
    *,
    steps: int = 100,
    lr: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> list[float]:
    """Train ``adapter`` so that the early exit after ``num_layers`` layers matches the target's
    own next-token distribution over ``sequences`` (KL to the full model's softmax, every
    position); the target is not changed. Returns the loss per step."""
    trainer = ExitAdapterTrainer(target, adapter, num_layers, lr=lr, batch_size=batch_size, seed=seed)
    return trainer.train(sequences, steps)


class ExitAdapterTrainer(PartTrainer):
    """Trains an :class:`ExitAdapter` towards the target's own next-token distributions and keeps
    its optimizer between calls: offline once (:func:`fit_adapter`) or online behind the held-out
    gate, a few steps after every rollout on the recent sequences (``SpecRollout(drafter="self:L",
    self_adapter_rank=R, drafter_train_steps=N)``), the teacher being the policy as it is then."""

    def __init__(
        self,
        target: nn.Module,
        adapter: ExitAdapter,
        num_layers: int,
        *,
        lr: float = 1e-3,
        batch_size: int = 8,
        rows: int | None = None,
        seed: int = 0,
    ) -> None:
        check_exit_layer(target, num_layers)
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.target = target  # the teacher; point it at the current policy object when that changes
        self.adapter = adapter
        self.num_layers = num_layers
        super().__init__(adapter, lr, seed, rows if rows is not None else batch_size * 32)

    def examples(
        self, sequences: Sequence[Sequence[int]], should_stop: StopCheck | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The hidden states after ``num_layers`` layers and the full model's next-token log-probs."""
        if not sequences:
            raise ValueError("the exit adapter needs at least one sequence to train on")
        target, device = self.target, next(self.target.parameters()).device
        hiddens, teachers = [], []
        with eval_mode(target), torch.no_grad(), capture_layer_inputs(target, [self.num_layers]) as captured:
            for tokens in sequences:
                if should_stop is not None and should_stop():
                    return None
                ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
                teachers.append(torch.log_softmax(target(input_ids=ids).logits[0].float(), dim=-1))
                hiddens.append(captured[self.num_layers][0].detach())
        return torch.cat(hiddens), torch.cat(teachers)

    @contextmanager
    def fitting(self) -> Iterator[None]:
        with frozen(final_norm(self.target), self.target.get_output_embeddings()):
            yield

    def loss(self, examples: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """KL from the full model's next-token distribution to the early exit's."""
        hidden, teacher = examples
        norm, head = final_norm(self.target), self.target.get_output_embeddings()
        device = next(self.target.parameters()).device
        pick = self.rows(hidden.shape[0], self.batch_rows)
        student = torch.log_softmax(head(norm(self.adapter(hidden[pick].to(device)))).float(), dim=-1)
        return nn.functional.kl_div(student, teacher[pick], log_target=True, reduction="batchmean")


def adapted_held_out_acceptance(
    target: nn.Module,
    num_layers: int,
    adapter: ExitAdapter,
    samples: list[SequenceSample],
    depth: int,
    max_tokens: int = 512,
    *,
    should_stop: StopCheck | None = None,
) -> float | None:
    """:func:`~tailspec.drafter.lm_trainer.lm_held_out_acceptance` of the self-speculative drafter
    that ``adapter`` makes of ``target``'s first ``num_layers`` layers."""
    shallow = shallow_model(target, num_layers, adapter)
    return lm_held_out_acceptance(shallow, samples, depth, max_tokens, should_stop=should_stop)
