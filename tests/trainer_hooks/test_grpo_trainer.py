import pytest
import trl

import tailspec
from tailspec.trainer_hooks import SpecRollout


def params_snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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


def test_multiple_iterations_and_steps_per_generation(common, grpo_dataset):
    """num_iterations = 2 and steps_per_generation = 2: TRL generates once per 4 optimizer steps
    (a batch of 2 x 8 completions, reused for 2 iterations); the rollout runs once per generation,
    weights are synced before each generation whose weights changed, the IS ratio stays ~1, and
    eval generation goes through the rollout too."""
    args = common["args"]
    args.num_iterations = 2
    args.steps_per_generation = 2
    args.generation_batch_size = None
    args.max_steps = 4
    args.eval_strategy = "steps"
    args.eval_steps = 4
    args.per_device_eval_batch_size = 8
    args.__post_init__()  # TRL derives generation_batch_size from steps_per_generation
    rollout = SpecRollout()
    trainer = tailspec.GRPOTrainer(**common, rollout=rollout, eval_dataset=grpo_dataset.select(range(4)))
    trainer.train()
    assert trainer.state.global_step == 4
    # one generation batch of 2 x 8 serves all 4 training steps; eval (4 prompts x 4) in batches of 8
    assert [h.num_prompts for h in rollout.history] == [16, 8, 8]
    assert trainer.weight_sync.synced_steps == [0, 4]  # before each generation whose weights changed
    logged = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    assert logged and all(abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4 for h in logged)
    assert any("eval_rollout/time_s" in h for h in trainer.state.log_history)


def test_a_bf16_rollout_copy_follows_training(common, tiny_policy, task_tokenizer):
    """With ``dtype="bfloat16"`` the engine decodes a bf16 copy of the trainer's fp32 policy (the
    module accelerate prepared: its own forward wrapper and all), refreshed after every optimizer
    step: after training it decodes as the trained policy cast to bf16 does."""
    import copy

    import torch

    from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams

    rollout = SpecRollout(dtype="bfloat16")
    trainer = tailspec.GRPOTrainer(**common, rollout=rollout)
    trainer.train()
    live = trainer.accelerator.unwrap_model(trainer.model)
    assert rollout.engine.model is not live and next(rollout.engine.model.parameters()).dtype == torch.bfloat16
    texts = [f"add {a} {b}" for a, b in ((1, 2), (3, 4), (5, 6))]
    reference = type(live)(copy.deepcopy(live.config)).eval()  # not a deep copy: that keeps accelerate's wrapper
    reference.load_state_dict(live.state_dict())
    for param in reference.parameters():
        param.data = param.data.to(torch.bfloat16)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=trainer.args.max_completion_length)
    want = RolloutEngine(reference, RolloutConfig()).generate([task_tokenizer(t)["input_ids"] for t in texts], greedy)
    # the last optimizer step came after the last rollout: the next rollout must see it (transformers'
    # default optimizer, fused AdamW, bumps no version counter)
    trainer.args.generation_kwargs = {"do_sample": False}
    got = rollout(texts, trainer)["completion_ids"]
    assert got == [o.completion_ids for o in want]
