import pytest
import trl

import tailspec
from tailspec.trainer_hooks import SpecRollout


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) / 10.0 for c in completions]


def params_snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def common(task_tokenizer, tiny_policy, grpo_dataset, grpo_args):
    """The trainer arguments every test here shares."""
    return dict(
        model=tiny_policy,
        reward_funcs=length_reward,
        args=grpo_args,
        train_dataset=grpo_dataset,
        processing_class=task_tokenizer,
    )


def _changed(before, model):
    after = model.state_dict()
    return any(not (before[k] == after[k]).all() for k in before)


def test_tailspec_grpo_trainer_two_steps(common, tiny_policy):
    rollout = SpecRollout()
    trainer = tailspec.GRPOTrainer(
        **common,
        rollout=rollout,
    )
    before = params_snapshot(tiny_policy)
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(rollout.history) == 2  # one rollout per generation batch
    # colocated: the engine drives the trainer's live module, no copy
    assert rollout.engine.model is trainer.accelerator.unwrap_model(trainer.model)
    logged = [h for h in trainer.state.log_history if "rollout/tokens_per_s" in h]
    assert len(logged) == 2 and all(h["rollout/tokens_per_s"] > 0 for h in logged)
    assert _changed(before, tiny_policy)


def test_stock_trl_trainer_accepts_spec_rollout(common):
    rollout = SpecRollout()
    trainer = trl.GRPOTrainer(
        **common,
        rollout_func=rollout,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(rollout.history) == 2


def test_default_rollout_and_argument_checks(common):
    trainer = tailspec.GRPOTrainer(
        **common,
    )
    assert isinstance(trainer.rollout, SpecRollout)
    with pytest.raises(ValueError, match="not both"):
        tailspec.GRPOTrainer(
            **common,
            rollout=SpecRollout(),
            rollout_func=SpecRollout(),
        )
    with pytest.raises(ValueError, match="callable"):
        tailspec.GRPOTrainer(
            **common,
            rollout=42,
        )


def test_importance_sampling_correction_is_on_with_a_ratio_of_one(common):
    """TRL's correction runs on the rollout's processed logprobs; rollout and trainer use the same
    fp32 model (the fixture turns TRL's default bf16 autocast off), so the ratio is 1 up to rounding. Weights are
    synced once per optimizer step."""
    trainer = tailspec.GRPOTrainer(
        **common,
        rollout=SpecRollout(),
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    assert len(logged) == 2
    for h in logged:
        for stat in ("min", "mean", "max"):
            assert h[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1.0, abs=1e-4)
        assert h["sampling/sampling_logp_difference/max"] < 1e-4
    assert trainer.weight_sync.synced_steps == list(range(trainer.state.global_step)) == [0, 1]


def test_importance_sampling_can_be_turned_off(common):
    trainer = tailspec.GRPOTrainer(
        **common,
        importance_sampling=False,
    )
    trainer.train()
    assert not trainer.use_vllm
    assert not any("sampling/importance_sampling_ratio/mean" in h for h in trainer.state.log_history)
