"""``tailspec.GRPOTrainer``: TRL's GRPOTrainer that takes ``rollout=SpecRollout(...)``."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..extras import need
from .importance import ImportanceStats, importance_sampling_ratio
from .length_groups import forward_by_length
from .rollout_state import load_rollout_state, save_rollout_state
from .spec_rollout import SpecRollout

trl = need("trl", "trl", "tailspec.GRPOTrainer")
logger = logging.getLogger(__name__)


class RolloutWeightSync:
    """Stands where TRL keeps its vLLM generation object, so that TRL's own importance-sampling
    path runs for tailspec rollouts: TRL calls :meth:`sync_weights` once per global step before
    generating, and then corrects the loss with the ratio of its recomputed logprobs to the ones
    the rollout returned (``vllm_importance_sampling_*`` settings of ``GRPOConfig``).

    The sync is forwarded to ``rollout.sync_weights(trainer)`` when the rollout has one (Ray
    workers get the new weights); the colocated engine already runs on the live module."""

    def __init__(self, trainer: trl.GRPOTrainer) -> None:
        self.trainer = trainer
        self.synced_steps: list[int] = []

    def sync_weights(self) -> None:
        self.synced_steps.append(int(self.trainer.state.global_step))
        hook = getattr(self.trainer.rollout, "sync_weights", None)
        if hook is not None:
            hook(self.trainer)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with a tailspec rollout.

    ``rollout`` defaults to ``SpecRollout()`` (the trainer's live policy, colocated, zero-copy).
    Any callable with TRL's ``rollout_func`` signature is accepted. ``rollout_func=`` is accepted
    as a synonym, not together with ``rollout=``.

    TRL applies its importance-sampling correction only on its vLLM path; here it is on for the
    rollout's processed logprobs whenever ``GRPOConfig.vllm_importance_sampling_correction`` is
    (TRL's default), with TRL's modes and clipping; ``importance_sampling=False`` turns it off.
    Weights are synced once per global step (:class:`RolloutWeightSync`).

    When training is on-policy (no optimizer step between generating a batch and its loss), the
    ratio's trainer logprobs are taken, detached, from the loss forward instead of TRL's extra
    no-grad forward after generation (see :mod:`tailspec.trainer_hooks.importance`): the same
    numbers, one policy forward per step less. ``fuse_importance_forward=False`` keeps TRL's forward.

    Policy forwards (the loss's, and the no-grad old- and reference-logprob ones) run per group of
    similar completion lengths, each trimmed to its own longest row (see
    :mod:`tailspec.trainer_hooks.length_groups`): a long-tail batch no longer pays for its padding.
    ``length_group_overhead_tokens`` is the fixed cost of one more forward call, in tokens, that the
    grouping weighs against the padding it saves; ``length_grouped_forward=False`` runs TRL's
    padded forward. Multimodal batches and MoE auxiliary losses always take TRL's forward. Under
    ZeRO-3 every forward gathers the partitioned parameters again, so there a group costs far more
    than its launch: raise the overhead (thousands of tokens) or measure with the option off.
    """

    def __init__(
        self,
        *args: Any,
        rollout: Any | None = None,
        rollout_func: Any | None = None,
        importance_sampling: bool = True,
        fuse_importance_forward: bool = True,
        length_grouped_forward: bool = True,
        length_group_overhead_tokens: int = 128,
        **kwargs: Any,
    ):
        if length_group_overhead_tokens < 0:
            raise ValueError(f"length_group_overhead_tokens must be >= 0, got {length_group_overhead_tokens}")
        if rollout is not None and rollout_func is not None:
            raise ValueError("pass rollout= or rollout_func=, not both")
        rollout = rollout if rollout is not None else rollout_func
        if rollout is None:
            rollout = SpecRollout()
        if not callable(rollout):
            raise ValueError(f"rollout must be callable as rollout(prompts, trainer), got {type(rollout).__name__}")
        if kwargs.get("tools"):
            raise ValueError("tailspec.GRPOTrainer does not support tools yet")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*'rollout_func'.*experimental", category=UserWarning)
            super().__init__(*args, rollout_func=rollout, **kwargs)
        self.rollout = rollout
        self.weight_sync = RolloutWeightSync(self)
        if self.use_vllm:
            raise ValueError("tailspec.GRPOTrainer generates with its rollout; set GRPOConfig.use_vllm=False")
        if importance_sampling and self.vllm_importance_sampling_correction:
            # TRL's switch for its correction path; generation itself still goes through rollout_func
            self.use_vllm = True
            self.vllm_generation = self.weight_sync
            self._last_loaded_step = -1
        generate_every = self.args.steps_per_generation * self.num_iterations
        self.fused_importance_forward = (
            fuse_importance_forward and self.use_vllm and self.args.gradient_accumulation_steps % generate_every == 0
        )
        self._ratio_inputs: dict[str, Any] | None = None
        self.length_grouped_forward = length_grouped_forward
        self.length_group_overhead_tokens = length_group_overhead_tokens

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``trl.GRPOTrainer.train``. Resuming from a checkpoint also restores the rollout's learned
        state saved with it (drafter, selector, suffix history, length predictor), so the run
        continues warm. On Ctrl-C the rollout's Ray workers (and the local Ray instance it started)
        are stopped at once before the interrupt goes on."""
        self._load_rollout_state(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except KeyboardInterrupt:
            close = getattr(self.rollout, "close", None)
            if close is not None:
                close(wait=False)
            raise

    # -- the rollout's state beside the trainer's checkpoints ---------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        state_dict = getattr(self.rollout, "state_dict", None)
        if state_dict is None or not self.args.should_save:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        save_rollout_state(state_dict(), folder)

    def _load_rollout_state(self, resume_from_checkpoint: str | bool | None) -> None:
        if not resume_from_checkpoint or not hasattr(self.rollout, "load_state_dict"):
            return
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
            if folder is None:
                return  # the base class raises its own error for this
        state = load_rollout_state(folder)
        if state is None:
            logger.warning("checkpoint %s has no tailspec rollout state; the rollout starts cold", folder)
            return
        self.rollout.load_state_dict(state)
        logger.info("restored the rollout's learned state from %s", folder)

    # -- importance sampling from the loss forward ------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.fused_importance_forward:
            return super()._generate_and_score_completions(inputs)
        # TRL skips its no-grad logprob forward (and the ratio) when the correction is off; the
        # rollout's logprobs still come back as ``sampling_per_token_logps``
        self.vllm_importance_sampling_correction = False
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.vllm_importance_sampling_correction = True

    def _compute_loss(self, model, inputs):
        if self.fused_importance_forward:
            if "sampling_per_token_logps" not in inputs:
                raise ValueError("the rollout returned no logprobs; importance sampling needs them")
            self._ratio_inputs = inputs  # filled in by the loss forward, before TRL's loss reads it
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._ratio_inputs = None

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **extra: Any,
    ):
        def padded(ids: torch.Tensor, mask: torch.Tensor, keep: int):
            return super(GRPOTrainer, self)._get_per_token_logps_and_entropies(
                model, ids, mask, keep, batch_size, compute_entropy, compute_aux_loss, **extra
            )

        # images and MoE auxiliary losses are tied to TRL's row layout: left to TRL's forward
        plain_text = not compute_aux_loss and all(value is None for value in extra.values())
        if self.length_grouped_forward and plain_text:
            logps, entropies = forward_by_length(
                lambda ids, mask, keep: padded(ids, mask, keep)[:2],
                input_ids,
                attention_mask,
                logits_to_keep,
                self.length_group_overhead_tokens,
            )
            out = (logps, entropies, None)
        else:
            out = padded(input_ids, attention_mask, logits_to_keep)
        inputs, self._ratio_inputs = self._ratio_inputs, None
        if inputs is not None:
            self._set_importance_ratio(out[0].detach(), inputs)
        return out

    def _set_importance_ratio(self, trainer_logps: torch.Tensor, inputs: dict[str, Any]) -> None:
        sampling_logps, mask = inputs["sampling_per_token_logps"], inputs["completion_mask"]
        mode = self.vllm_importance_sampling_mode
        ratio = importance_sampling_ratio(
            trainer_logps,
            sampling_logps,
            mask,
            mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        inputs["importance_sampling_ratio"] = ratio
        stats = ImportanceStats.of(trainer_logps, sampling_logps, mask, ratio, mode.startswith("sequence"))
        local = stats.as_metrics()
        gathered = self.accelerator.gather(torch.tensor(list(local.values()), device=trainer_logps.device)[None])
        reduce = {"min": torch.min, "max": torch.max, "mean": torch.mean}  # over processes, by the key's statistic
        metrics = self._metrics["train" if self.model.training else "eval"]
        for column, key in enumerate(local):
            metrics[key].append(float(reduce[key.rsplit("/", 1)[1]](gathered[:, column])))
