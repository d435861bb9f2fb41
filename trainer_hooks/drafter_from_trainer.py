"""Train an EAGLE-3 head from the hidden states of the trainer's own loss forward.

GRPO's loss forward already runs the policy over every prompt + completion of the batch. Tapping
it (the hidden states entering the head's ``aux_layer_ids`` and the last hidden state, for soft labels) gives
the head's training data for free, whatever generated the completions: tailspec's engine, TRL's
``generate``, or vLLM. That serves users who keep their generation stack and want a drafter of the
final policy to serve, and keeps the head current when the rollout engine records nothing.

    trainer = trl.GRPOTrainer(...)              # or tailspec.GRPOTrainer(rollout=SpecRollout(...))
    DrafterFromTrainer(head, trainer, train_steps=8, save_to="outputs/head")
    trainer.train()

Only training-mode forwards with gradients are tapped (the loss forward; not TRL's no-grad
logprob forward, not eval), and a batch seen before (``num_iterations > 1``) is not recorded
twice. After every optimizer step the head takes ``train_steps`` steps on the buffer (at the learning
rate times a ``SpecRollout``'s ``drafter_lr_scale``: catch-up, ``drafter/catch_up.py``); its loss and
version go into the trainer's logs as ``drafter/*``.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..drafter.eagle3.data import Eagle3Sample, FeatureBuffer, soft_labels
from ..drafter.eagle3.model import Eagle3Head
from ..drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig
from ..rollout.model.layer_taps import capture_layer_inputs
from .deepspeed import gathered

logger = logging.getLogger(__name__)


@contextmanager
def capture_final_hidden(model: torch.nn.Module):
    """Within the block, the decoder's last hidden state (after its final norm: what the LM head
    reads) of every forward, in order. Hooked on the decoder, not the LM head, because TRL's loss
    forward projects through the head in fused tiles and never calls the head module."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if decoder is None:
        raise ValueError(f"cannot find the decoder of {type(model).__name__} to tap its last hidden state")
    outputs: list[torch.Tensor] = []

    def hook(module, args, out):
        outputs.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    handle = decoder.register_forward_hook(hook)
    try:
        yield outputs
    finally:
        handle.remove()


@contextmanager
def capture_model_inputs(model: torch.nn.Module):
    """Within the block, ``(input_ids, attention_mask)`` of every forward of ``model``, in order."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        calls.append((input_ids, torch.ones_like(input_ids) if mask is None else mask))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def samples_from_forward(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    features: torch.Tensor,
    final_hidden: torch.Tensor | None,
    lm_head: torch.nn.Module | None,
    label_topk: int,
    dtype: torch.dtype | None = None,
) -> list[Eagle3Sample]:
    """EAGLE-3 samples from one forward over TRL's batch layout: left-padded prompts, then
    right-padded completions (the last ``completion_width`` columns).

    ``features`` ``[B, L, F]`` are the concatenated layer inputs at every column. With
    ``label_topk``, soft labels come from ``lm_head`` over ``final_hidden`` ``[B, L, H]`` at the
    columns that predict completion tokens (the only extra compute: one LM-head projection of the
    completion, without gradients). Rows whose masks are not in that layout, or with an empty
    prompt or completion, are skipped. Positions differ from an unpadded forward by the left
    padding only, which rotary attention does not see (relative positions)."""
    width = input_ids.shape[1]
    prompt_width = width - completion_width
    label_ids = label_probs = None
    if label_topk:  # one projection of every row's predicting columns; rows take their prefix
        with torch.no_grad():
            logits = lm_head(final_hidden[:, prompt_width - 1 : width - 1].detach())
        label_ids, label_probs = (part.cpu() for part in soft_labels(logits, label_topk))
    # the batch's masks and ids on the host in one transfer each (read per row, each read would wait)
    masks, ids = attention_mask.detach().to("cpu", torch.bool), input_ids.detach().to("cpu", torch.long)
    samples = []
    for b in range(input_ids.shape[0]):
        mask = masks[b]
        p = int(mask[:prompt_width].sum())
        c = int(mask[prompt_width:].sum())
        if p < 1 or c < 1 or not (mask[prompt_width - p : prompt_width + c].all()):
            continue
        start, end = prompt_width - p, prompt_width + c
        # cloned: a view would keep the whole batch's tensors alive in the buffer
        samples.append(
            Eagle3Sample(
                ids[b, start:end].clone(),
                features[b, start : end - 1].detach().to("cpu", dtype or features.dtype).clone(),
                p,
                None if label_ids is None else label_ids[b, :c].clone(),
                None if label_probs is None else label_probs[b, :c].clone(),
            )
        )
    return samples


class DrafterFromTrainer(TrainerCallback):
    """Records EAGLE-3 samples from ``trainer``'s loss forwards and trains ``head`` on them after
    every optimizer step (see the module docstring). Attaches itself to ``trainer``.

    ``save_to``: a directory for a tailspec checkpoint of the head at the end of training
    (``DrafterTrainer.save``; ``tailspec drafter export`` turns it into SGLang/vLLM layout).
    """

    def __init__(
        self,
        head: Eagle3Head,
        trainer: Any,
        *,
        train_steps: int = 8,
        training: DrafterTrainingConfig | None = None,
        buffer_mb: int = 256,
        label_topk: int = 8,
        save_to: str | Path | None = None,
        log_metrics: bool = True,
    ) -> None:
        if not isinstance(head, Eagle3Head):
            raise ValueError(f"head must be an Eagle3Head, got {type(head).__name__}")
        if not (isinstance(train_steps, int) and train_steps >= 0):
            raise ValueError(f"train_steps must be an int >= 0, got {train_steps!r}")
        if not (isinstance(buffer_mb, int) and buffer_mb >= 1):
            raise ValueError(f"buffer_mb must be an int >= 1, got {buffer_mb!r}")
        if not (isinstance(label_topk, int) and 0 <= label_topk <= 1024):
            raise ValueError(f"label_topk must be an int in [0, 1024], got {label_topk!r}")
        policy = trainer.accelerator.unwrap_model(trainer.model)
        head.config.check_target(policy.config)
        self.head = head
        self.trainer = trainer
        self.train_steps = train_steps
        self.label_topk = label_topk
        self.save_to = Path(save_to) if save_to is not None else None
        self.log_metrics = log_metrics
        self.buffer = FeatureBuffer(buffer_mb << 20)
        self.drafter_trainer = DrafterTrainer(head, policy.get_input_embeddings(), self.buffer, training)
        self.samples_recorded = 0
        self._seen: deque[int] = deque(maxlen=256)  # fingerprints of batches already recorded
        self._tapped = trainer._get_per_token_logps_and_entropies
        trainer._get_per_token_logps_and_entropies = self._tap
        trainer.add_callback(self)

    # -- recording -----------------------------------------------------------------------
    def _tap(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if not (torch.is_grad_enabled() and model.training) or self._already_seen(input_ids):
            return self._tapped(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        policy = self.trainer.accelerator.unwrap_model(model)
        layers = tuple(self.head.config.aux_layer_ids)
        with (
            capture_layer_inputs(policy, layers, keep_all=True) as hidden,
            capture_final_hidden(policy) as final,
            capture_model_inputs(policy) as calls,
        ):
            out = self._tapped(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if any(len(hidden[i]) != len(calls) for i in layers) or len(final) != len(calls):
            logger.warning("drafter tap: hidden states do not match the %d forwards; batch skipped", len(calls))
            return out
        # one trainer call may run several forwards (row chunks, length groups): each in its own
        # layout, which keeps the prompt width and trims completions on the right
        prompt_width = input_ids.shape[1] - logits_to_keep
        lm_head = policy.get_output_embeddings()
        with gathered(lm_head):  # ZeRO-3 partitions it between forwards
            for j, (ids, mask) in enumerate(calls):
                # detached: the loss's autograd graph must not grow by these copies
                features = torch.cat([hidden[i][j].detach() for i in layers], dim=-1)
                samples = samples_from_forward(
                    ids, mask, ids.shape[1] - prompt_width, features, final[j].detach(), lm_head, self.label_topk
                )
                for sample in samples:
                    self.samples_recorded += self.buffer.add(sample)
        return out

    def _already_seen(self, input_ids: torch.Tensor) -> bool:
        fingerprint = hash((tuple(input_ids.shape), input_ids.detach().cpu().numpy().tobytes()))
        if fingerprint in self._seen:
            return True
        self._seen.append(fingerprint)
        return False

    # -- training ------------------------------------------------------------------------
    def on_step_end(self, args, state, control, **kwargs):
        if not self.train_steps or not len(self.buffer):
            return
        embed = self.trainer.accelerator.unwrap_model(self.trainer.model).get_input_embeddings()
        self.drafter_trainer.embed = embed
        rollout = getattr(self.trainer, "rollout", None) or getattr(self.trainer, "rollout_func", None)
        # a SpecRollout's catch-up rule: a higher learning rate while its drafts are far behind
        self.drafter_trainer.lr_scale = float(getattr(rollout, "drafter_lr_scale", 1.0))
        with gathered(embed):  # the head reads the policy's embeddings; ZeRO-3 partitions them
            results = self.drafter_trainer.train(self.train_steps)
        publish = getattr(rollout, "publish_drafter", None)
        if results and callable(publish):
            publish(self.head)  # Ray rollout workers get the new version before the next rollout
        metrics = getattr(self.trainer, "_metrics", None)
        if self.log_metrics and metrics is not None and results:
            metrics["train"]["drafter/loss"].append(sum(r.loss for r in results) / len(results))
            metrics["train"]["drafter/version"].append(float(self.head.version))
            metrics["train"]["drafter/samples"].append(float(self.samples_recorded))

    def on_train_end(self, args, state, control, **kwargs):
        if self.save_to is not None:
            path = self.drafter_trainer.save(self.save_to, {"source": "trainer forward"})
            logger.info("drafter trained from the trainer's forwards saved to %s", path)
