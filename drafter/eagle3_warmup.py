"""Offline warm-up of an EAGLE-3 head before RL starts: roll out the policy, train on what it wrote.

Each round generates completions for a slice of the prompts with the engine (features and soft
labels are recorded on the way; the rollouts themselves speculate with the head trained so far),
then runs ``steps_per_round`` training steps over everything buffered.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..config_tree import coerce_subtrees, require
from ..progress import progress_bar
from ..rollout.engine import RolloutEngine
from ..rollout.params import RolloutConfig, SamplingParams
from .eagle3.data import FeatureBuffer
from .eagle3.model import Eagle3Config, Eagle3Head, vocab_from_counts
from .eagle3.train import DrafterTrainer, DrafterTrainingConfig
from .factory import as_drafter

logger = logging.getLogger(__name__)


@dataclass
class WarmupConfig:
    rounds: int = 3
    steps_per_round: int = 200
    max_new_tokens: int = 384
    temperature: float = 1.0
    strategy: str = "chain:4"  # how the rollouts speculate once the head has trained a round
    draft_vocab_size: int | None = None  # None = the target's whole vocabulary
    aux_layer_ids: tuple[int, ...] | None = None
    buffer_bytes: int = 512 << 20
    buffer_policy: str = "recent"
    training: DrafterTrainingConfig = field(default_factory=DrafterTrainingConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        coerce_subtrees(self)
        require(isinstance(self.rounds, int) and self.rounds >= 1, "rounds", "an int >= 1", self.rounds)
        require(
            isinstance(self.steps_per_round, int) and self.steps_per_round >= 0,
            "steps_per_round",
            "an int >= 0",
            self.steps_per_round,
        )


@dataclass
class WarmupRound:
    round: int
    completions: int
    tokens: int
    rollout_s: float
    accept_length: float  # of this round's rollouts (1.0 in a fresh head's first round: not trained yet)
    loss_first: float
    loss_last: float
    train_s: float


def warmup_head(
    model: torch.nn.Module,
    prompts: list[list[int]],
    config: WarmupConfig | None = None,
    *,
    head: Eagle3Head | None = None,
    eos_token_ids=None,
    progress: bool = True,
) -> tuple[Eagle3Head, DrafterTrainer, list[WarmupRound]]:
    """Warm up ``head`` (a fresh one shaped like one target layer if None) on ``model``'s rollouts."""
    cfg = config or WarmupConfig()
    if not prompts:
        raise ValueError("prompts is empty")
    buffer = FeatureBuffer(cfg.buffer_bytes, cfg.buffer_policy, seed=cfg.seed)
    trained = head is not None  # a given head is continued: its rollouts speculate from the first round
    if head is None:
        torch.manual_seed(cfg.seed)
        head_cfg = Eagle3Config.for_target(model.config, aux_layer_ids=cfg.aux_layer_ids)
        weight = next(model.parameters())
        head = Eagle3Head(head_cfg).to(device=weight.device, dtype=weight.dtype)  # beside the model
    head.config.check_target(model.config)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    trainer: DrafterTrainer | None = None
    rounds: list[WarmupRound] = []
    chunks = [prompts[i :: cfg.rounds] for i in range(cfg.rounds)]
    for r, chunk in enumerate(progress_bar(chunks, desc="warm-up", unit="round", disable=not progress)):
        strategy = cfg.strategy if trainer is not None or trained else "none"
        engine_cfg = RolloutConfig(strategy=strategy, seed=cfg.seed + r)
        drafter = as_drafter(head, model, engine_cfg, buffer=buffer)
        engine = RolloutEngine(model, engine_cfg, drafter=drafter, eos_token_ids=eos_token_ids)
        start = time.perf_counter()
        outs = engine.generate(chunk, params)
        rollout_s = time.perf_counter() - start
        if trainer is None:
            head = _with_draft_vocab(head, buffer, cfg.draft_vocab_size, engine.eos_ids)
            trainer = DrafterTrainer(head, model.get_input_embeddings(), buffer, cfg.training)
        start = time.perf_counter()
        results = trainer.train(cfg.steps_per_round, progress=progress)
        rounds.append(
            WarmupRound(
                round=r,
                completions=len(outs),
                tokens=sum(len(o.completion_ids) for o in outs),
                rollout_s=rollout_s,
                accept_length=engine.stats.mean_accept_length,
                loss_first=results[0].loss if results else float("nan"),
                loss_last=results[-1].loss if results else float("nan"),
                train_s=time.perf_counter() - start,
            )
        )
        logger.info("warm-up round %d: %s", r, rounds[-1])
    assert trainer is not None
    return head, trainer, rounds


def _with_draft_vocab(head: Eagle3Head, buffer: FeatureBuffer, size: int | None, keep_ids) -> Eagle3Head:
    """The head, or a fresh one over the ``size`` most frequent tokens of the buffered rollouts."""
    if size is None or size == head.config.vocab_size:
        return head
    cfg = Eagle3Config.from_dict({**head.config.to_dict(), "draft_vocab_size": size})
    reduced = Eagle3Head(cfg).to(device=head.fc.weight.device, dtype=head.fc.weight.dtype)
    reduced.set_vocab_map(vocab_from_counts(buffer.token_counts(cfg.vocab_size), size, always=sorted(keep_ids)))
    return reduced
