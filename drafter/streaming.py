"""Speculative streaming for a small-LM drafter: extra heads that read the drafter's last hidden
state and guess the tokens after the next one, so one drafter forward emits several draft tokens
(Mirror-SD's speculative streaming, Medusa-style heads).

Head ``j`` (0-based) maps the hidden state the LM head reads at position ``t`` to the distribution
of token ``t + 2 + j``, through a residual block and the drafter's own LM head. A chain of ``n``
tokens then costs about ``n / (1 + heads)`` drafter forwards. Each streamed token is drawn from its
head's processed distribution and handed to the verifier with it, so verification stays exact
whatever the heads say; they only change how often drafts are accepted.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..rollout.model.eval_mode import eval_mode
from ..rollout.model.runner import model_device_dtype
from .lm_trainer import SequenceSample, drawn_probs, held_out_run, shifted
from .part_trainer import PartTrainer, StopCheck, frozen


class StreamingHeads(nn.Module):
    """``num_heads`` residual blocks ``x + W_j silu(x)`` over the drafter's LM-head input (zero-
    initialised: an untrained head repeats the next-token guess)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if not (isinstance(num_heads, int) and 1 <= num_heads <= 8):
            raise ValueError(f"streaming heads must be an int in [1, 8], got {num_heads!r}")
        self.hidden_size = hidden_size
        self.version = 0  # bumped by every training step (StreamingHeadTrainer)
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)

    def __len__(self) -> int:
        return len(self.blocks)

    def hidden(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """The hidden state head ``j`` hands the LM head."""
        return x + self.blocks[j](nn.functional.silu(x))

    def state_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in self.state_dict().items()}, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, hidden_size: int, num_heads: int, data: bytes) -> StreamingHeads:
        heads = cls(hidden_size, num_heads)
        heads.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))
        return heads


def lm_head_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden states the LM head reads, logits)`` of one plain forward over ``ids`` ``[1, T]``."""
    hidden, logits = batched_lm_head_inputs(model, ids)
    return hidden[0], logits[0]


def batched_lm_head_inputs(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden states the LM head reads [B, T, H], logits [B, T, V])`` of one forward over ``ids``."""
    captured = {}

    def hook(module, args):
        captured["hidden"] = args[0]

    handle = model.get_output_embeddings().register_forward_pre_hook(hook)
    try:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        handle.remove()
    return captured["hidden"], logits


def fit_streaming_heads(
    model: nn.Module,
    heads: StreamingHeads,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int = 200,
    lr: float = 2e-3,
    rows: int = 256,
    seed: int = 0,
) -> list[float]:
    """Train ``heads`` on token sequences (the policy's completions): head ``j`` at position ``t``
    learns token ``t + 2 + j`` (cross-entropy); the drafter model is not changed. Returns the
    mean loss per step."""
    return StreamingHeadTrainer(model, heads, lr=lr, rows=rows, seed=seed).train(sequences, steps)


def streamed_held_out_acceptance(
    model: nn.Module,
    heads: StreamingHeads,
    samples: list[SequenceSample],
    depth: int,
    max_tokens: int = 512,
    *,
    should_stop: StopCheck | None = None,
) -> float | None:
    """:func:`~tailspec.drafter.lm_trainer.held_out_run` of a streamed chain of ``depth``: one
    drafter forward at ``t`` drafts ``t + 1`` (the LM head) and ``t + 2 + j`` (head ``j``), the
    next forward reads the position after the last of them, and so on (how
    ``SmallLMDrafter`` drafts a chain with streaming heads)."""
    block = len(heads) + 1
    head = model.get_output_embeddings()

    def step_probs(ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden, logits = batched_lm_head_inputs(model, ids, mask)
        hidden = hidden[:, :-1]
        drawn = [drawn_probs(logits[:, :-1].float(), targets)]  # the LM head: token t + 1
        for j in range(len(heads)):  # head j: token t + 2 + j, the target j + 1 positions on
            guess = head(heads.hidden(j, hidden).to(head.weight.dtype)).float()
            drawn.append(drawn_probs(guess, shifted(targets, j + 1, fill=-100)))
        return torch.stack([shifted(drawn[k % block], k - k % block) for k in range(depth)], dim=-1)

    return held_out_run(model, samples, step_probs, max_tokens, should_stop)


class StreamingHeadTrainer(PartTrainer):
    """Trains streaming heads on the policy's own token sequences and keeps its optimizer between
    calls: offline once (:func:`fit_streaming_heads`), or online behind the held-out gate (the
    recent completions after every rollout, ``SpecRollout(drafter=..., drafter_train_steps=N)``,
    or spot training on idle Ray workers), so the heads follow the moving policy. The drafter LM
    is not changed."""

    def __init__(self, model: nn.Module, heads: StreamingHeads, *, lr: float = 2e-3, rows: int = 256, seed: int = 0):
        self.model = model
        self.heads = heads
        self.device, _ = model_device_dtype(model)
        heads.to(self.device)
        super().__init__(heads, lr, seed, rows)

    def examples(
        self, sequences: Sequence[Sequence[int]], should_stop: StopCheck | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The drafter's LM-head inputs at every position with a label for each head, and the labels."""
        if not sequences:
            raise ValueError("streaming heads need at least one sequence to train on")
        n_heads = len(self.heads)
        inputs, labels = [], [[] for _ in range(n_heads)]
        with eval_mode(self.model), torch.no_grad():
            for tokens in sequences:
                if should_stop is not None and should_stop():
                    return None
                ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
                n = len(tokens) - 1 - n_heads
                if n <= 0:
                    continue
                hidden, _ = lm_head_inputs(self.model, ids)
                inputs.append(hidden[:n].float())
                for j in range(n_heads):
                    labels[j].append(ids[0, 2 + j : 2 + j + n])
        if not inputs:
            raise ValueError(f"streaming heads need sequences longer than {n_heads + 2} tokens")
        return torch.cat(inputs), [torch.cat(label) for label in labels]

    @contextmanager
    def fitting(self) -> Iterator[None]:
        was_training = self.heads.training
        self.heads.train()
        try:
            with frozen(self.model.get_output_embeddings()):
                yield
        finally:
            self.heads.train(was_training)

    def loss(self, examples: tuple[torch.Tensor, list[torch.Tensor]]) -> torch.Tensor:
        """Cross entropy of every head's guess, averaged over the heads."""
        x, ys = examples
        head = self.model.get_output_embeddings()
        pick = self.rows(x.shape[0], self.batch_rows).to(self.device)
        return sum(
            nn.functional.cross_entropy(head(self.heads.hidden(j, x[pick]).to(head.weight.dtype)).float(), ys[j][pick])
            for j in range(len(self.heads))
        ) / len(self.heads)
