import math

import pytest
import torch

import tailspec
from tailspec.trainer_hooks import SpecRollout
from tailspec.trainer_hooks.importance import ImportanceStats, importance_sampling_ratio

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.1, -3.0]])
SAMPLING = torch.tensor([[-1.5, -1.0, float("nan")], [-0.2, -0.4, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_ratios_truncate_and_mask():
    # log ratios: [0.5, -1.0, nan -> 0], [0, 0.3, masked -> 0]
    expected = torch.exp(torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.3, 0.0]]))
    truncated = importance_sampling_ratio(TRAINER, SAMPLING, MASK, "token_truncate", None, 1.5)
    assert torch.allclose(truncated, expected.clamp(max=1.5))
    masked = importance_sampling_ratio(TRAINER, SAMPLING, MASK, "token_mask", 0.5, 1.5)
    assert torch.allclose(masked, expected.masked_fill((expected < 0.5) | (expected > 1.5), 0.0))
    assert masked[0, 0] == 0 and masked[0, 1] == 0 and masked[1, 1] == pytest.approx(math.exp(0.3))


def test_sequence_ratios_sum_the_log_ratios():
    truncated = importance_sampling_ratio(TRAINER, SAMPLING, MASK, "sequence_truncate", None, 3.0)
    assert truncated.shape == (2, 1)
    assert truncated[:, 0].tolist() == pytest.approx([math.exp(-0.5), math.exp(0.3)])
    masked = importance_sampling_ratio(TRAINER, SAMPLING, MASK, "sequence_mask", None, 1.2)
    assert masked[:, 0].tolist() == pytest.approx([math.exp(-0.5), 0.0])


def test_unknown_mode_names_the_field():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        importance_sampling_ratio(TRAINER, SAMPLING, MASK, "per_token", None, None)


def test_stats_skip_unscored_and_masked_tokens():
    ratio = importance_sampling_ratio(TRAINER, SAMPLING, MASK, "token_truncate", None, None)
    stats = ImportanceStats.of(TRAINER, SAMPLING, MASK, ratio, sequence_level=False)
    assert stats.logp_difference_max == pytest.approx(1.0)
    assert stats.logp_difference_mean == pytest.approx((0.5 + 1.0 + 0.0 + 0.3) / 4)
    assert stats.ratio_max == pytest.approx(math.exp(0.5)) and stats.ratio_min == pytest.approx(math.exp(-1.0))
    assert set(stats.as_metrics()) == {
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max",
    }


class SkewedRollout:
    """SpecRollout whose reported logprobs are off by +-0.2 per token, so that the correction has
    something to correct (ratios away from 1, some clipped)."""

    def __init__(self) -> None:
        self.inner = SpecRollout()

    def __call__(self, prompts, trainer):
        out = self.inner(prompts, trainer)
        out["logprobs"] = [[lp + (0.2 if i % 2 else -0.2) for i, lp in enumerate(lps)] for lps in out["logprobs"]]
        return out


def _train(common, make_policy, fuse: bool, mode: str, eval_dataset=None, **overrides):
    model = make_policy()
    args = common["args"]
    args.vllm_importance_sampling_mode = mode
    args.vllm_importance_sampling_clip_max = 1.1
    if overrides:
        for key, value in overrides.items():
            setattr(args, key, value)
        args.generation_batch_size = None
        args.__post_init__()  # TRL derives generation_batch_size from steps_per_generation
    trainer = tailspec.GRPOTrainer(
        **{**common, "model": model},
        rollout=SkewedRollout(),
        fuse_importance_forward=fuse,
        eval_dataset=eval_dataset,
    )
    forwards = []  # the trainer's policy forwards (the rollout engine's are not counted), with grad or not
    original = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        forwards.append(torch.is_grad_enabled()) or original(*a, **k)
    )
    trainer.train()
    return trainer, model, forwards


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_fused_ratio_trains_exactly_like_trls_extra_forward(common, make_policy, mode):
    """The same weights, seeds and skewed rollout logprobs, with TRL's no-grad logprob forward and
    with the ratio taken from the loss forward: the same updates and the same logged ratios, and
    one policy forward per step instead of two."""
    trl_path, trl_model, trl_forwards = _train(common, make_policy, fuse=False, mode=mode)
    fused, fused_model, fused_forwards = _train(common, make_policy, fuse=True, mode=mode)
    assert fused.fused_importance_forward and not trl_path.fused_importance_forward
    assert trl_forwards == [False, True, False, True]  # TRL: a no-grad forward after each generation
    assert fused_forwards == [True, True]
    for key, value in trl_model.state_dict().items():
        assert torch.allclose(value, fused_model.state_dict()[key], atol=1e-6), key

    def ratios(trainer):
        keys = [f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")]
        keys.append("sampling/sampling_logp_difference/mean")
        return [h[k] for h in trainer.state.log_history if keys[0] in h for k in keys]

    assert len(ratios(fused)) == 2 * 4
    assert ratios(fused) == pytest.approx(ratios(trl_path), abs=1e-5)
    assert ratios(fused)[3] == pytest.approx(0.2, abs=1e-4)  # the skew is what the ratio sees
    assert ratios(fused)[0] != pytest.approx(1.0)


def test_fused_with_accumulation_over_a_generation_and_eval(common, make_policy, grpo_dataset):
    """steps_per_generation = gradient_accumulation_steps = 2: one generation feeds both micro-batches
    of an optimizer step (still on-policy, so fused); eval batches go through the fused ratio too."""
    runs = [
        _train(
            common,
            make_policy,
            fuse=fuse,
            mode="token_mask",
            eval_dataset=grpo_dataset.select(range(4)),
            steps_per_generation=2,
            gradient_accumulation_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=8,
        )
        for fuse in (False, True)
    ]
    (trl_path, trl_model, trl_forwards), (fused, fused_model, fused_forwards) = runs
    assert fused.fused_importance_forward
    # per generation TRL adds a no-grad forward; fused, only the loss forwards remain (eval's run without grad)
    assert trl_forwards == [False, True, True] * 2 + [False, False] * 2
    assert fused_forwards == [True, True] * 2 + [False] * 2
    for key, value in trl_model.state_dict().items():
        assert torch.allclose(value, fused_model.state_dict()[key], atol=1e-6), key
    evals = [h for h in fused.state.log_history if "eval_sampling/importance_sampling_ratio/mean" in h]
    trl_evals = [h for h in trl_path.state.log_history if "eval_sampling/importance_sampling_ratio/mean" in h]
    assert len(evals) == len(trl_evals) == 1
    assert evals[0]["eval_sampling/sampling_logp_difference/mean"] == pytest.approx(0.2, abs=1e-4)
    assert evals[0]["eval_loss"] == pytest.approx(trl_evals[0]["eval_loss"], abs=1e-6)


def test_fusion_stays_off_when_weights_move_between_generation_and_loss(common):
    args = common["args"]
    args.num_iterations = 2
    trainer = tailspec.GRPOTrainer(**common, rollout=SpecRollout())
    assert not trainer.fused_importance_forward  # TRL needs its old-logprob forward anyway
    off = tailspec.GRPOTrainer(**{**common, "args": args}, rollout=SpecRollout(), importance_sampling=False)
    assert not off.fused_importance_forward
