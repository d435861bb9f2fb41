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
from collections.abc import Sequence

import torch
from torch import nn

from ..rollout.model_runner import model_device_dtype
from .fitting import PartTrainer, frozen


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
        heads.load_state_dict(torch.load(io.BytesIO(data)))
        return heads


def lm_head_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden states the LM head reads, logits)`` of one plain forward over ``ids`` ``[1, T]``."""
    captured = {}

    def hook(module, args):
        captured["hidden"] = args[0]

    handle = model.get_output_embeddings().register_forward_pre_hook(hook)
    try:
        logits = model(input_ids=ids).logits
    finally:
        handle.remove()
    return captured["hidden"][0], logits[0]


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


class StreamingHeadTrainer(PartTrainer):
    """Trains streaming heads on the policy's own token sequences and keeps its optimizer between
    calls: offline once (:func:`fit_streaming_heads`), or online, a few steps after every rollout
    on the recent ones (``SpecRollout(drafter=..., drafter_train_steps=N)``), so the heads follow
    the moving policy. Every step bumps ``heads.version`` (the selector then re-measures the
    drafter's arms; a draft process re-ships the weights)."""

    def __init__(self, model: nn.Module, heads: StreamingHeads, *, lr: float = 2e-3, rows: int = 256, seed: int = 0):
        if not (isinstance(rows, int) and rows >= 1):
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        self.model = model
        self.heads = heads
        self.batch_rows = rows
        self.device, _ = model_device_dtype(model)
        heads.to(self.device)
        super().__init__(heads, lr, seed)

    def examples(self, sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The drafter's LM-head inputs at every position with a label for each head, and the labels."""
        if not sequences:
            raise ValueError("streaming heads need at least one sequence to train on")
        n_heads = len(self.heads)
        inputs, labels = [], [[] for _ in range(n_heads)]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for tokens in sequences:
                    ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
                    n = len(tokens) - 1 - n_heads
                    if n <= 0:
                        continue
                    hidden, _ = lm_head_inputs(self.model, ids)
                    inputs.append(hidden[:n].float())
                    for j in range(n_heads):
                        labels[j].append(ids[0, 2 + j : 2 + j + n])
        finally:
            self.model.train(was_training)
        if not inputs:
            raise ValueError(f"streaming heads need sequences longer than {n_heads + 2} tokens")
        return torch.cat(inputs), [torch.cat(label) for label in labels]

    def train(self, sequences: Sequence[Sequence[int]], steps: int) -> list[float]:
        """``steps`` optimizer steps on rows drawn from ``sequences``; the mean loss of each."""
        x, ys = self.examples(sequences)
        head = self.model.get_output_embeddings()
        was_training = self.heads.training
        self.heads.train()
        losses = []
        try:
            with frozen(head):
                for _ in range(steps):
                    pick = self.rows(x.shape[0], self.batch_rows).to(self.device)
                    loss = sum(
                        nn.functional.cross_entropy(
                            head(self.heads.hidden(j, x[pick]).to(head.weight.dtype)).float(), ys[j][pick]
                        )
                        for j in range(len(self.heads))
                    ) / len(self.heads)
                    losses.append(self.step(loss))
        finally:
            self.heads.train(was_training)
        return losses
