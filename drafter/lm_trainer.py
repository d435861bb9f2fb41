"""The drafter LM learns the moving policy: distilled on the policy's recent completions.

A rollout's completions are draws from the policy's processed distribution, so next-token cross
entropy on them is, in expectation, the forward KL from that distribution to the drafter's: the
distillation objective, without the target forward that soft labels would need (the engine returns
only each emitted token's logprob). Loss counts completion tokens only (what the drafter drafts);
the prompt is context.

:class:`DraftLMTrainer` mirrors the EAGLE-3 head's ``DrafterTrainer`` (a step at a time from a
buffer, ``lr_scale`` for catch-up, ``should_stop`` between steps), and :func:`lm_held_out_acceptance`
its ``held_out_acceptance``: accepted draft tokens per greedy chain, read off one teacher-forced
forward per sequence, so the spot-training gate compares drafter LMs as it compares heads.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config_tree import require
from ..rollout.model.eval_mode import eval_mode
from .eagle3.data import FeatureBuffer
from .eagle3.train import TrainStepResult

logger = logging.getLogger(__name__)


@dataclass
class SequenceSample:
    """A prompt + completion the policy wrote: what a drafter LM trains on."""

    tokens: torch.Tensor  # [T] int32
    prompt_len: int

    @classmethod
    def of(cls, prompt: Sequence[int], completion: Sequence[int]) -> SequenceSample:
        return cls(torch.tensor([*prompt, *completion], dtype=torch.int32), len(prompt))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def nbytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size()


def sequence_samples(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[SequenceSample]:
    """The samples of a rollout's requests that completed at least one token."""
    return [SequenceSample.of(p, c) for p, c in zip(prompts, completions) if c]


class VersionedLM(nn.Module):
    """A drafter LM as a trained part: the model, and a ``version`` every training step bumps (the
    engine's selector re-measures its arms, workers know which weights they draft with). One per
    model: :func:`versioned_lm`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.version = 0


_PART = "_tailspec_versioned_lm"


def versioned_lm(model: nn.Module) -> VersionedLM:
    """The :class:`VersionedLM` of ``model``, made at the first call: every drafter built on the model
    and every trainer of it share one version (a user hands the rollout the bare LM, and each
    engine builds its own drafter on it). Kept in the model's ``__dict__``, outside its modules, so
    it travels with the model through pickling and copies and never enters its ``state_dict``."""
    part = model.__dict__.get(_PART)
    if part is None:
        part = VersionedLM(model)
        object.__setattr__(model, _PART, part)
    return part


@dataclass
class DraftLMTrainingConfig:
    """TRL-style configuration of :class:`DraftLMTrainer`."""

    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    # a spot chunk yields between steps, so a step is the longest it holds a worker up: 4 sequences
    # of at most 256 tokens is ~0.2-0.3 s for the shipped 3M-parameter drafter LM on one CPU core
    batch_size: int = 4  # sequences per step
    max_tokens: int = 256  # longer sequences train on a random window of this many tokens
    max_grad_norm: float = 1.0
    # steps draw from the newest this many sequences (the buffer keeps more): what the policy writes
    # now, not a uniform draw over every rollout since the start (96: the last 4 RL steps of 24)
    recent: int = 96
    depth: int = 4  # the chain depth the held-out gate scores
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("learning_rate", self.learning_rate > 0, "a float > 0"),
            ("weight_decay", self.weight_decay >= 0, "a float >= 0"),
            ("batch_size", isinstance(self.batch_size, int) and 1 <= self.batch_size <= 4096, "an int in [1, 4096]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 2, "an int >= 2"),
            ("max_grad_norm", self.max_grad_norm > 0, "a float > 0"),
            ("recent", isinstance(self.recent, int) and self.recent >= 1, "an int >= 1"),
            ("depth", isinstance(self.depth, int) and 1 <= self.depth <= 16, "an int in [1, 16]"),
        ]
        for name, ok, allowed in checks:
            require(ok, name, allowed, getattr(self, name))


def window(sample: SequenceSample, max_tokens: int, rng: random.Random) -> tuple[int, int]:
    """[start, end) of the tokens to train on: all, or a random window holding completion tokens."""
    n = sample.num_tokens
    if n <= max_tokens:
        return 0, n
    start = rng.randint(max(0, min(sample.prompt_len - 1, n - max_tokens)), n - max_tokens)
    return start, start + max_tokens


def _batch(samples: list[SequenceSample], max_tokens: int, rng: random.Random, device: torch.device):
    """(input ids [B, T], attention mask [B, T], target ids [B, T - 1] with -100 where no
    completion token is predicted)."""
    windows = [window(s, max_tokens, rng) for s in samples]
    width = max(end - start for start, end in windows)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    targets = torch.full((len(samples), width - 1), -100, dtype=torch.long)
    for row, (s, (start, end)) in enumerate(zip(samples, windows)):
        tokens = s.tokens[start:end].long()
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
        first = max(s.prompt_len - start, 1)  # the first completion token's index in the window
        targets[row, first - 1 : len(tokens) - 1] = tokens[first:]
    return ids.to(device), mask.to(device), targets.to(device)


def _logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()


def shifted(x: torch.Tensor, k: int, fill: float = 0) -> torch.Tensor:
    """``x[:, t + k]`` at every ``t`` of ``x`` ``[B, T]``, ``fill`` past the end."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - k] = x[:, k:]
    return out


def drawn_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the probability ``logits`` give each target token, 0 where there is none (-100)."""
    valid = targets != -100
    probs = torch.softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return probs * valid


# step_probs(ids, mask, targets) -> [B, T - 1, depth]: at each position t, the chance that the k-th
# draft token from t is the emitted one (teacher-forced), 0 past the end
StepProbs = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def held_out_run(
    model: nn.Module,
    samples: list[SequenceSample],
    step_probs: StepProbs,
    max_tokens: int,
    should_stop: Callable[[], bool] | None = None,
) -> float | None:
    """Draft tokens a chain is expected to get accepted per round on ``samples``, from every
    completion position: the sum over ``k`` of the chance that the drafter, sampling, draws the
    next ``k`` emitted tokens in a row (the product of ``step_probs``' first ``k``). That is the
    exact expectation where the target's token is certain (greedy), and it rewards a drafter that
    puts more mass where the policy writes, so it tells two close drafters apart where counting
    top-1 matches ties. ``model`` is put in eval mode meanwhile; ``should_stop()`` is checked
    before each batch of 8: None when it said stop."""
    if not samples:
        raise ValueError("a held-out score needs at least one sample")
    device = next(model.parameters()).device
    with eval_mode(model):
        accepted, positions = 0.0, 0
        for i in range(0, len(samples), 8):
            if should_stop is not None and should_stop():
                return None
            ids, mask, targets = _batch(samples[i : i + 8], max_tokens, random.Random(0), device)
            run = (targets != -100).float()
            steps = step_probs(ids, mask, targets)
            for k in range(steps.shape[-1]):
                run = run * steps[..., k]
                accepted += float(run.sum())
            positions += int((targets != -100).sum())
        return accepted / max(positions, 1)


def lm_held_out_acceptance(
    model: nn.Module,
    samples: list[SequenceSample],
    depth: int,
    max_tokens: int = 512,
    *,
    should_stop: Callable[[], bool] | None = None,
) -> float | None:
    """:func:`held_out_run` of a drafter LM's chains of ``depth``: the ``k``-th draft token from
    ``t`` is the LM's guess at ``t + k``, after the ``k`` tokens before it."""

    def step_probs(ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        drawn = drawn_probs(_logits(model, ids, mask), targets)
        return torch.stack([shifted(drawn, k) for k in range(depth)], dim=-1)

    return held_out_run(model, samples, step_probs, max_tokens, should_stop)


class DraftLMTrainer:
    """Trains a :class:`VersionedLM` from a buffer of :class:`SequenceSample` s, a step at a time.

    Each step is whole or not at all (gradients cleared first, the optimizer steps last), so an
    exception leaves the previous step's weights and optimizer state."""

    def __init__(self, part: VersionedLM, buffer: FeatureBuffer, config: DraftLMTrainingConfig | None = None) -> None:
        self.part = part
        self.buffer = buffer
        self.config = c = config or DraftLMTrainingConfig()
        self.optimizer = torch.optim.AdamW(part.parameters(), lr=c.learning_rate, weight_decay=c.weight_decay)
        self.rng = random.Random(c.seed)
        self.step_count = 0
        self.lr_scale = 1.0  # catch-up (drafter/catch_up.py); set on every step

    def train_step(self) -> TrainStepResult:
        start = time.perf_counter()
        c, model = self.config, self.part.model
        newest = self.buffer.samples()[-c.recent :]
        if not newest:
            raise ValueError("the drafter LM's buffer is empty; it trains on the policy's completions")
        drawn = [newest[self.rng.randrange(len(newest))] for _ in range(c.batch_size)]
        ids, mask, targets = _batch(drawn, c.max_tokens, self.rng, next(model.parameters()).device)
        for group in self.optimizer.param_groups:
            group["lr"] = c.learning_rate * self.lr_scale
        was_training = model.training
        model.train()
        self.optimizer.zero_grad()
        try:
            logits = _logits(model, ids, mask)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            count = int((targets != -100).sum())
            accuracy = float(((logits.argmax(-1) == targets) & (targets != -100)).sum()) / max(count, 1)
            if count:
                loss.backward()
                nn.utils.clip_grad_norm_(self.part.parameters(), c.max_grad_norm)
                self.optimizer.step()
                self.step_count += 1
                self.part.version += 1
        finally:
            self.optimizer.zero_grad()
            model.train(was_training)
        return TrainStepResult(self.step_count, float(loss.detach()), [accuracy], time.perf_counter() - start)

    def train(self, num_steps: int, *, should_stop: Callable[[], bool] | None = None) -> list[TrainStepResult]:
        """Up to ``num_steps`` steps; ``should_stop()`` is checked before each one (yield to rollouts)."""
        require(isinstance(num_steps, int) and num_steps >= 0, "num_steps", "an int >= 0", num_steps)
        results = []
        for _ in range(num_steps):
            if should_stop is not None and should_stop():
                break
            results.append(self.train_step())
        if results:
            logger.info("drafter LM: %d steps, loss %.3f -> %.3f", len(results), results[0].loss, results[-1].loss)
        return results
