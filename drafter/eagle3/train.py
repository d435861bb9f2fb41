"""Online training of the EAGLE-3 head on features captured from rollouts.

The loss unrolls the draft the way the engine runs it (*training-time test*, EAGLE-3): index
``t`` of a sequence is "the last position with a real target feature". Step 0 feeds
``(fc(features[t]), token[t + 1])`` at position ``t`` and predicts token ``t + 2``; step ``k``
feeds the head's own step ``k - 1`` output at the same index with token ``t + k + 1`` at position
``t + k`` and predicts token ``t + k + 2``. Step ``k`` attends to step-0 keys at indices ``<= t``
(the cache the real features built) and to steps ``1 .. k`` at index ``t`` (its own draft chain),
exactly the cache the engine's drafter sees. Each step's loss is a cross-entropy against the
target's top-k distribution (soft labels) where recorded, else the token that was emitted,
weighted ``step_decay ** k``; only completion tokens are predicted.

:class:`DrafterTrainer` runs steps on demand, can be stopped between any two steps, bumps the
head's ``version`` after every optimizer step, and saves/restores weights and optimizer state.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...config_tree import require
from ...distributed import single_process_deepspeed
from ...extras import need
from ...progress import progress_bar
from ...rollout.model.eval_mode import eval_mode
from ...safe_files import load_weights_only
from .data import Eagle3Sample, FeatureBuffer
from .model import Eagle3Head

logger = logging.getLogger(__name__)


@dataclass
class DrafterTrainingConfig:
    """TRL-style configuration of :class:`DrafterTrainer`."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    batch_size: int = 8  # sequences per step
    ttt_steps: int = 4  # unrolled draft steps
    step_decay: float = 0.8  # weight of unrolled step k is step_decay ** k
    max_tokens: int = 1024  # longer sequences are cut to a random window of this many tokens
    max_grad_norm: float = 1.0
    soft_labels: bool = True
    # where the head fails: a sample is drawn with probability ~ (its last loss) ** focus (0: uniform);
    # a sample not trained on yet counts at the highest loss seen, so new rollouts come first
    focus: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("learning_rate", self.learning_rate > 0, "a float > 0"),
            ("weight_decay", self.weight_decay >= 0, "a float >= 0"),
            ("adam_beta1", 0 <= self.adam_beta1 < 1, "a float in [0, 1)"),
            ("adam_beta2", 0 <= self.adam_beta2 < 1, "a float in [0, 1)"),
            ("batch_size", isinstance(self.batch_size, int) and 1 <= self.batch_size <= 4096, "an int in [1, 4096]"),
            ("ttt_steps", isinstance(self.ttt_steps, int) and 1 <= self.ttt_steps <= 16, "an int in [1, 16]"),
            ("step_decay", 0 < self.step_decay <= 1, "a float in (0, 1]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 3, "an int >= 3"),
            ("max_grad_norm", self.max_grad_norm > 0, "a float > 0"),
            ("focus", 0 <= self.focus <= 4, "a float in [0, 4]"),
        ]
        for name, ok, allowed in checks:
            require(ok, name, allowed, getattr(self, name))


@dataclass
class TrainStepResult:
    step: int
    loss: float
    accuracy: list[float]  # top-1 agreement with the emitted token, per unrolled step
    time_s: float


@dataclass
class _Batch:
    tokens: torch.Tensor  # [B, T + K + 2] (padded with 0)
    valid: torch.Tensor  # [B, T + K + 2] bool: a completion token that exists
    features: torch.Tensor  # [B, T, F]
    positions: torch.Tensor  # [B, T] absolute position of index t
    soft_ids: torch.Tensor | None = None  # [B, T + K + 2, k] target ids
    soft_probs: torch.Tensor | None = None  # [B, T + K + 2, k] (rows of zeros where none)
    has_soft: torch.Tensor | None = None  # [B, T + K + 2] bool
    lengths: list[int] = field(default_factory=list)


def _window(sample: Eagle3Sample, max_tokens: int, rng: random.Random) -> tuple[int, int]:
    """A random window ``[s, e)`` of at most ``max_tokens`` tokens that holds completion tokens."""
    n = sample.num_tokens
    if n <= max_tokens:
        return 0, n
    first = max(0, sample.prompt_len - max_tokens + 2)  # keep at least two completion tokens
    start = rng.randint(first, n - max_tokens)
    return start, start + max_tokens


def collate(samples: list[Eagle3Sample], ttt_steps: int, max_tokens: int, rng: random.Random) -> _Batch:
    windows = [_window(s, max_tokens, rng) for s in samples]
    lengths = [e - s for s, e in windows]
    rows = max(lengths) - 1
    width = rows + ttt_steps + 2
    b, feat = len(samples), samples[0].features.shape[-1]
    tokens = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    features = torch.zeros(b, rows, feat, dtype=samples[0].features.dtype)
    positions = torch.zeros(b, rows, dtype=torch.long)
    with_soft = all(s.label_ids is not None for s in samples)
    k = samples[0].label_ids.shape[-1] if with_soft else 0
    soft_ids = torch.zeros(b, width, k, dtype=torch.long) if with_soft else None
    soft_probs = torch.zeros(b, width, k) if with_soft else None
    has_soft = torch.zeros(b, width, dtype=torch.bool) if with_soft else None
    for i, (s, (lo, hi)) in enumerate(zip(samples, windows)):
        m = hi - lo
        tokens[i, :m] = s.tokens[lo:hi]
        features[i, : m - 1] = s.features[lo : hi - 1]
        positions[i, : m - 1] = torch.arange(lo, hi - 1)
        first_completion = max(s.prompt_len - lo, 0)
        valid[i, first_completion:m] = True
        if with_soft:
            # label row r is token prompt_len + r; keep those inside the window
            j0 = max(s.prompt_len, lo)
            src = slice(j0 - s.prompt_len, hi - s.prompt_len)
            soft_ids[i, j0 - lo : m] = s.label_ids[src]
            soft_probs[i, j0 - lo : m] = s.label_probs[src].float()
            has_soft[i, j0 - lo : m] = True
    return _Batch(tokens, valid, features, positions, soft_ids, soft_probs, has_soft, lengths)


def ttt_mask(rows: int, step: int, device: torch.device) -> torch.Tensor:
    """``[rows, (step + 1) * rows]`` bool: causal over step-0 keys, the diagonal of every later step."""
    idx = torch.arange(rows, device=device)
    causal = idx.view(-1, 1) >= idx.view(1, -1)
    eye = idx.view(-1, 1) == idx.view(1, -1)
    return torch.cat([causal] + [eye] * step, dim=1)


def unroll(head: Eagle3Head, embed: torch.nn.Module, batch: _Batch, num_steps: int) -> list[torch.Tensor]:
    """Draft-vocabulary logits ``[B, T, draft_vocab]`` of each unrolled step. Step ``k`` at index
    ``t`` reads token ``t + k + 1`` at position ``t + k`` and predicts token ``t + k + 2``."""
    device = head.fc.weight.device
    rows = batch.features.shape[1]
    tokens = batch.tokens.to(device)
    hidden = head.project(batch.features.to(device))
    positions = batch.positions.to(device)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out = []
    for k in range(num_steps):
        mask = ttt_mask(rows, k, device)

        def attend(q, key, value, mask=mask):
            keys.append(key)
            values.append(value)
            att = F.scaled_dot_product_attention(
                q,
                torch.cat(keys, dim=2),
                torch.cat(values, dim=2),
                attn_mask=mask,
                enable_gqa=key.shape[1] != q.shape[1],
            )
            return att.transpose(1, 2)

        embeds = embed(tokens[:, k + 1 : k + 1 + rows]).detach().to(hidden.dtype)
        hidden, logits = head(embeds, hidden, positions + k, attend)
        out.append(logits)
    return out


def step_targets(head: Eagle3Head, batch: _Batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ids of the tokens unrolled step ``step`` predicts ``[B, T]`` (token ``t + step + 2``)
    and where a prediction counts: a completion token inside the sequence and the draft vocabulary."""
    device = head.fc.weight.device
    rows = batch.features.shape[1]
    cols = slice(step + 2, step + 2 + rows)
    target = head.target_to_draft_ids(batch.tokens.to(device)[:, cols])
    row_len = torch.tensor([n - 1 for n in batch.lengths], device=device)
    inside = torch.arange(rows, device=device).view(1, -1) < row_len.view(-1, 1)
    return target, batch.valid.to(device)[:, cols] & (target >= 0) & inside


def unrolled_loss(
    head: Eagle3Head, embed: torch.nn.Module, batch: _Batch, cfg: DrafterTrainingConfig
) -> tuple[torch.Tensor, list[float], int, torch.Tensor]:
    """The training-time-test loss of one batch -> (loss, per-step accuracy, number of
    predictions, each sequence's step-0 loss ``[B]``: where the head fails)."""
    device = head.fc.weight.device
    rows = batch.features.shape[1]
    total = torch.zeros((), device=device)
    weight_sum, accuracy, count = 0.0, [], 0
    per_sample = torch.zeros(batch.features.shape[0])
    for k, logits in enumerate(unroll(head, embed, batch, cfg.ttt_steps)):
        target, ok = step_targets(head, batch, k)
        if not bool(ok.any()):
            break
        logp = torch.log_softmax(logits.float(), dim=-1)[ok]  # [N, draft_vocab]
        per_token = -logp.gather(-1, target[ok].unsqueeze(-1)).squeeze(-1)
        if cfg.soft_labels and batch.has_soft is not None:
            cols = slice(k + 2, k + 2 + rows)
            soft_ok = batch.has_soft.to(device)[:, cols][ok]
            ids = head.target_to_draft_ids(batch.soft_ids.to(device)[:, cols][ok])  # [N, top]
            probs = batch.soft_probs.to(device)[:, cols][ok] * (ids >= 0)
            soft = -(probs * logp.gather(-1, ids.clamp(min=0))).sum(-1)
            per_token = torch.where(soft_ok, soft, per_token)
        if k == 0:
            owner = torch.arange(ok.shape[0], device=device).view(-1, 1).expand_as(ok)[ok]
            sums = torch.zeros(ok.shape[0], device=device).index_add_(0, owner, per_token.detach().float())
            per_sample = (sums / ok.sum(1).clamp(min=1)).cpu()
        w = cfg.step_decay**k
        total = total + w * per_token.mean()
        weight_sum += w
        accuracy.append(float((logp.argmax(-1) == target[ok]).float().mean()))
        count += int(ok.sum())
    return total / max(weight_sum, 1e-12), accuracy, count, per_sample


@torch.no_grad()
def held_out_acceptance(
    head: Eagle3Head,
    embed: torch.nn.Module,
    samples: list[Eagle3Sample],
    depth: int,
    max_tokens: int = 1024,
    *,
    should_stop: Callable[[], bool] | None = None,
) -> float | None:
    """Draft tokens a chain of ``depth`` would get accepted per round on ``samples`` (greedy: the
    head's top-1 must equal the token that was emitted, step after step, from every completion
    position; 0..``depth``). The unroll is the training's, so it reads what the engine's drafter
    reads; comparing two heads on the same held-out samples says which one drafts better.
    ``should_stop()`` is checked before each batch of 8 samples: None when it said stop."""
    if not samples:
        raise ValueError("held_out_acceptance needs at least one sample")
    with eval_mode(head):
        accepted, positions = 0.0, 0
        for i in range(0, len(samples), 8):
            if should_stop is not None and should_stop():
                return None
            batch = collate(samples[i : i + 8], depth, max_tokens, random.Random(0))
            alive: torch.Tensor | None = None
            for k, logits in enumerate(unroll(head, embed, batch, depth)):
                target, ok = step_targets(head, batch, k)
                right = (logits.argmax(-1) == target) & ok
                if alive is None:
                    alive, positions = right, positions + int(ok.sum())
                else:
                    alive = alive & right
                accepted += float(alive.sum())
        return accepted / max(positions, 1)


def _adamw(head: Eagle3Head, c: DrafterTrainingConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        head.parameters(), lr=c.learning_rate, betas=(c.adam_beta1, c.adam_beta2), weight_decay=c.weight_decay
    )


class _TorchStepper:
    """Plain PyTorch: clip, then AdamW."""

    def __init__(self, head: Eagle3Head, c: DrafterTrainingConfig) -> None:
        self.head, self.max_grad_norm = head, c.max_grad_norm
        self.optimizer = _adamw(head, c)

    def backward_and_step(self, loss: torch.Tensor) -> None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.max_grad_norm)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class _DeepSpeedStepper:
    """DeepSpeed (ZeRO stage 0-2) for heads whose optimizer state is worth partitioning (a
    150k-token ``lm_head``): ``deepspeed.initialize`` with our AdamW, its backward and step."""

    def __init__(self, head: Eagle3Head, c: DrafterTrainingConfig, ds_config: dict) -> None:
        deepspeed = need("deepspeed", "deepspeed", "deepspeed_config (DeepSpeed drafter training)")
        ds = dict(ds_config)
        stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        if stage > 2:
            raise ValueError(
                f"deepspeed_config zero_optimization.stage must be 0, 1 or 2 for a drafter head, got {stage}"
            )
        ds.setdefault("train_micro_batch_size_per_gpu", 1)
        ds.setdefault("gradient_accumulation_steps", 1)
        ds.setdefault("gradient_clipping", c.max_grad_norm)
        if not torch.distributed.is_initialized():
            single_process_deepspeed()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=head, optimizer=_adamw(head, c), config=ds)
        self.engine.checkpoint_engine = _WeightsOnlyFiles(self.engine.checkpoint_engine)

    def backward_and_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def save(self, folder: Path, tag: str) -> None:
        self.engine.save_checkpoint(str(folder), tag=tag)

    def load(self, folder: Path) -> None:
        self.engine.load_checkpoint(str(folder))


class _WeightsOnlyFiles:
    """A DeepSpeed checkpoint engine whose reads go through the weights-only loader. DeepSpeed's
    files are pickles; a ZeRO 0-2 file of a head holds nothing beyond tensors, containers and the
    plain data classes allowed here, so a crafted file in a checkpoint folder is refused, never run."""

    def __init__(self, inner: Any) -> None:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        self.inner = inner
        self.allowed = (LossScaler, ZeroStageEnum, fragment_address)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_weights_only(path, allow=self.allowed, map_location=map_location)

    def __getattr__(self, name: str) -> Any:  # saving, commits: DeepSpeed's own
        return getattr(self.inner, name)


class DrafterTrainer:
    """Trains an :class:`Eagle3Head` from a :class:`FeatureBuffer`, a step at a time.

    ``embed`` is the target's input embedding table (frozen). Each step is whole or not at all:
    gradients are cleared first and the optimizer steps last, so an exception (a preempted
    worker) leaves the weights and optimizer state of the previous step. ``deepspeed_config``
    (a DeepSpeed config dict, ZeRO stage <= 2) trains through DeepSpeed instead of plain AdamW.
    """

    def __init__(
        self,
        head: Eagle3Head,
        embed: torch.nn.Module,
        buffer: FeatureBuffer,
        config: DrafterTrainingConfig | None = None,
        *,
        deepspeed_config: dict | None = None,
    ) -> None:
        self.head = head
        self.embed = embed
        self.buffer = buffer
        self.config = config or DrafterTrainingConfig()
        c = self.config
        self.stepper = _DeepSpeedStepper(head, c, deepspeed_config) if deepspeed_config else _TorchStepper(head, c)
        self.rng = random.Random(c.seed)
        self.step_count = 0
        self.history: list[TrainStepResult] = []
        # the learning rate is config.learning_rate times this (catch-up: drafter/catch_up.py); set
        # on every step, so a loaded optimizer state's own rate never overrides it
        self.lr_scale = 1.0

    def train_step(self) -> TrainStepResult:
        start = time.perf_counter()
        c = self.config
        drawn = self.buffer.sample(c.batch_size, self.rng, focus=c.focus)
        batch = collate(drawn, c.ttt_steps, c.max_tokens, self.rng)
        was_training = self.head.training
        self.head.train()
        for group in self.optimizer.param_groups:
            group["lr"] = c.learning_rate * self.lr_scale
        self.stepper.zero_grad()
        try:
            loss, accuracy, count, per_sample = unrolled_loss(self.head, self.embed, batch, c)
            self.buffer.record_losses(drawn, per_sample.tolist())
            if count:
                self.stepper.backward_and_step(loss)
                self.step_count += 1
                self.head.version += 1
        finally:
            self.stepper.zero_grad()
            self.head.train(was_training)
        result = TrainStepResult(self.step_count, float(loss.detach()), accuracy, time.perf_counter() - start)
        self.history.append(result)
        return result

    def train(
        self, num_steps: int, *, should_stop: Callable[[], bool] | None = None, progress: bool = False
    ) -> list[TrainStepResult]:
        """Up to ``num_steps`` steps; ``should_stop()`` is checked before each one (yield to rollouts)."""
        if not (isinstance(num_steps, int) and num_steps >= 0):
            raise ValueError(f"num_steps must be an int >= 0, got {num_steps!r}")
        results = []
        bar = progress_bar(total=num_steps, desc="drafter", unit="step", disable=not progress, leave=False)
        try:
            for _ in range(num_steps):
                if should_stop is not None and should_stop():
                    break
                results.append(self.train_step())
                bar.update(1)
                bar.set_postfix(loss=f"{results[-1].loss:.3f}")
        finally:
            bar.close()
        if results:
            logger.info(
                "drafter: %d steps, loss %.3f -> %.3f, step-0 accuracy %.3f",
                len(results),
                results[0].loss,
                results[-1].loss,
                results[-1].accuracy[0] if results[-1].accuracy else float("nan"),
            )
        return results

    @property
    def optimizer(self):
        return self.stepper.optimizer

    @property
    def uses_deepspeed(self) -> bool:
        return isinstance(self.stepper, _DeepSpeedStepper)

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, path: str | Path, metadata: dict | None = None, *, include_optimizer: bool = True) -> Path:
        """Weights, step, version and (unless ``include_optimizer=False``) optimizer state. Under
        DeepSpeed its (possibly partitioned) optimizer state goes to ``path/deepspeed``."""
        from .checkpoint import save_checkpoint

        out = save_checkpoint(
            path,
            self.head,
            step=self.step_count,
            version=self.head.version,
            optimizer_state=self.optimizer.state_dict() if include_optimizer and not self.uses_deepspeed else None,
            metadata=metadata,
        )
        if self.uses_deepspeed and include_optimizer:
            self.stepper.save(out / "deepspeed", tag=f"step{self.step_count}")
        return out

    def load(self, path: str | Path, target_config=None) -> None:
        """Restore weights, optimizer state, step and version from :meth:`save`'s checkpoint."""
        from .checkpoint import load_checkpoint

        ckpt = load_checkpoint(path, target_config=target_config)
        if ckpt.head.config.to_dict() != self.head.config.to_dict():
            raise ValueError("checkpoint was made for a head of another shape; build the trainer from its config")
        self.head.load_state_dict(ckpt.head.state_dict())
        if self.uses_deepspeed and (Path(path) / "deepspeed").is_dir():
            self.stepper.load(Path(path) / "deepspeed")
        elif ckpt.optimizer_state is not None and not self.uses_deepspeed:
            self.optimizer.load_state_dict(ckpt.optimizer_state)
        self.step_count = ckpt.step
        self.head.version = ckpt.version
