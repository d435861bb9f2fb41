"""A resumed run continues warm: the rollout's learned state (EAGLE-3 head weights, optimizer, step
and version; the adaptive selector's measurements and RNG; the suffix drafter's history) is saved
with every trainer checkpoint and restored on resume, so right after resuming the head accepts as
it did and the selector chooses as it would have."""

import copy
from pathlib import Path

import torch

import tailspec
from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.trainer_hooks import SpecRollout
from tailspec.trainer_hooks.rollout_state import FOLDER, load_rollout_state


def _head(policy, seed):
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(policy.config))
    head.reset_parameters(std=0.05)
    return head


def _rollout(head):
    return SpecRollout(strategy="adaptive", drafter=head, drafter_train_steps=2)


def _accept_length(policy, head, tokenizer):
    engine = RolloutEngine(policy, RolloutConfig(strategy="chain:3", kv_cache_tokens=4096), drafter=head)
    prompts = [tokenizer(text=f"add {i} {i + 3}")["input_ids"] for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    return [o.mean_accept_length for o in outs], [o.completion_ids for o in outs]


def test_rollout_state_is_saved_with_checkpoints_and_restored_on_resume(common, make_policy, task_tokenizer):
    args = common["args"]
    args.save_strategy, args.save_steps = "steps", 2
    first = _rollout(_head(common["model"], 0))
    tailspec.GRPOTrainer(**common, rollout=first).train()
    checkpoint = Path(args.output_dir) / "checkpoint-2"
    saved = load_rollout_state(checkpoint)
    assert (checkpoint / FOLDER / "drafter.safetensors").exists()
    assert saved["drafter"].version == first.drafter.version > 0 and saved["drafter"].optimizer is not None
    selector_before = copy.deepcopy(first.engine.selector)
    assert selector_before.acceptance.counts, "the selector should have measured arms in two rollouts"

    policy = make_policy()  # a fresh process: the same starting policy, a different head
    policy.load_state_dict(common["model"].state_dict())
    second = _rollout(_head(policy, 1))
    trainer = tailspec.GRPOTrainer(**{**common, "model": policy}, rollout=second)
    trainer._load_rollout_state(str(checkpoint))
    # the head: the same weights and version, so the same acceptance right after resume
    assert second.drafter.version == first.drafter.version
    resumed = _accept_length(policy, second.drafter, task_tokenizer)
    assert resumed == _accept_length(policy, first.drafter, task_tokenizer)
    # the selector and the suffix history: restored when the engine starts, choosing as before
    engine = second.engine_for(policy, task_tokenizer, seed=0)
    assert engine.selector.state_dict() == selector_before.state_dict()  # all but the forward table, re-timed
    arms = engine.selector.arms
    assert [engine.selector.acceptance.expected(a) for a in arms] == [
        selector_before.acceptance.expected(a) for a in arms
    ]
    assert engine.suffix_drafter.state_dict() == first.engine.suffix_drafter.state_dict()
    assert second.online.trainer.step_count == saved["drafter"].step


def test_resume_from_checkpoint_runs_on_warm(common):
    args = common["args"]
    args.save_strategy, args.save_steps = "steps", 2
    first = _rollout(_head(common["model"], 0))
    tailspec.GRPOTrainer(**common, rollout=first).train()
    version = first.drafter.version
    args.max_steps = 3
    second = _rollout(_head(common["model"], 1))
    trainer = tailspec.GRPOTrainer(**common, rollout=second)
    trainer.train(resume_from_checkpoint=True)  # the last checkpoint of output_dir
    assert trainer.state.global_step == 3 and len(second.history) == 1
    assert second.drafter.version == version + 2  # continued from the saved version, two more steps
    assert sum(c.evidence for c in second.engine.selector.acceptance.counts.values()) > 0


def test_the_checkpoint_keeps_spot_trainings_unshipped_state_and_the_catch_up_rule(tmp_path):
    """Spot training's trained state is apart from the drafting one while it has not shipped; a
    resume from disk continues training from it, not from the shipped head."""
    from tailspec.drafter.online_training import DrafterState
    from tailspec.trainer_hooks.rollout_state import save_rollout_state

    shipped = DrafterState({"w": torch.zeros(3)}, version=4, step=4)
    trained = DrafterState({"w": torch.ones(3)}, version=9, step=9, optimizer={"state": {}, "param_groups": []})
    state = {
        "engines": [{"x": 1}],
        "predictor": None,
        "drafter": shipped,
        "drafter_trained": trained,
        "catch_up": {"reference": 3.2, "lr_scale": 1.0, "rollouts_caught_up": 2},
    }
    save_rollout_state(state, tmp_path)
    loaded = load_rollout_state(tmp_path)
    assert loaded["drafter"].version == 4 and loaded["drafter"].optimizer is None
    assert loaded["drafter_trained"].version == 9 and torch.equal(loaded["drafter_trained"].weights["w"], torch.ones(3))
    assert loaded["drafter_trained"].optimizer == trained.optimizer
    assert loaded["catch_up"] == state["catch_up"] and loaded["engines"] == [{"x": 1}]
