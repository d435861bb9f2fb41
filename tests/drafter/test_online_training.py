"""drafter/online_training.py: one object trains whichever drafter part a rollout has, and carries it through
a checkpoint: the weights at once, the optimizer when its trainer exists."""

import pytest
import torch
from test_streaming import random_heads

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from tailspec.drafter.online_training import (
    DrafterState,
    DraftLMTraining,
    ExitAdapterTraining,
    HeadTraining,
    online_training,
)
from tailspec.drafter.part_learning import STREAMING_LR, ExitAdapterLearner, StreamingHeadsLearner
from tailspec.drafter.part_trainer import PartFitConfig
from tailspec.drafter.small_lm import SmallLMDrafter
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import tiny_random_model


@pytest.fixture(scope="module")
def policy():
    return tiny_random_model("qwen2", seed=1, num_layers=4)


def test_the_kind_follows_the_drafter_and_nothing_trains_without_steps(policy):
    head = Eagle3Head(Eagle3Config.for_target(policy.config))
    lm = tiny_random_model("llama", seed=2, num_layers=1)
    streaming = SmallLMDrafter(lm, streaming_heads=random_heads(lm, 2))
    assert isinstance(online_training(head, 4, 1 << 20, None), HeadTraining)
    heads_training = online_training(streaming, 4, 1 << 20, None)
    assert isinstance(heads_training, DraftLMTraining) and heads_training.part is streaming.heads
    assert isinstance(heads_training.learning.learner, StreamingHeadsLearner)
    assert isinstance(online_training("self:2", 0, 1 << 20, 8), ExitAdapterTraining)  # drafts through its adapter
    assert online_training(head, 0, 1 << 20, None) is None
    assert isinstance(online_training(lm, 4, 1 << 20, None), DraftLMTraining)  # the bare LM: its own weights
    with pytest.raises(ValueError, match="drafter_train_steps > 0 needs an EAGLE-3 head"):
        online_training("self:2", 4, 1 << 20, None)
    with pytest.raises(ValueError, match="self_adapter_rank is for drafter='self:L'"):
        online_training(head, 4, 1 << 20, 8)


def test_an_eagle3_head_trains_on_what_its_engine_recorded_and_resumes_with_its_optimizer(policy):
    torch.manual_seed(0)
    online = HeadTraining(Eagle3Head(Eagle3Config.for_target(policy.config)), 1 << 22)
    config = RolloutConfig(strategy="chain:2")
    drafter = online.engine_drafter(policy, config)
    assert isinstance(drafter, Eagle3Drafter) and drafter.buffer is online.buffer
    engine = RolloutEngine(policy, config, drafter=drafter)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(online.buffer) == 2
    losses = online.train(3, lr_scale=2.0)
    assert len(losses) == 3 and online.part.version == 3 and online.trainer.lr_scale == 2.0
    saved = online.state()
    assert saved.step == 3 and saved.optimizer is not None and saved.version == 3

    resumed = HeadTraining(Eagle3Head(Eagle3Config.for_target(policy.config)), 1 << 22)
    resumed.load(saved)  # before any engine: the weights now, the optimizer with the trainer
    assert resumed.part.version == 3 and resumed.trainer is None
    resumed.engine_drafter(policy, config)
    assert resumed.trainer.step_count == 3
    assert resumed.trainer.optimizer.state_dict()["state"] == online.trainer.optimizer.state_dict()["state"]


def test_streaming_heads_train_a_copy_at_the_catch_up_rate_and_ship_past_the_gate(policy):
    lm = tiny_random_model("llama", seed=2, num_layers=1)
    drafter = SmallLMDrafter(lm, streaming_heads=random_heads(lm, 2))
    online = DraftLMTraining(drafter, 1 << 20, PartFitConfig(rows=64), holdout_every=0)
    online.observe([[3, 4, 5], [1]], [[6], [2]])
    assert online.train(2, 1.0) == []  # nothing long enough to train two heads on
    online.observe([[3, 4, 5], [1]], [[6, 7, 8, 9, 10], [2]])
    assert len(online.train(2, lr_scale=5.0)) == 2
    assert online.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5 * STREAMING_LR)
    assert online.shipped == 1 and drafter.heads.version == 2  # nothing held out: every copy ships
    torch.testing.assert_close(drafter.heads.blocks[0].weight, online.learning.train_part.blocks[0].weight)
    state = online.state()
    assert isinstance(state, DrafterState) and state.version == 2 and state.step == 2

    gated = DraftLMTraining(drafter, 1 << 20, PartFitConfig(rows=64), holdout_every=2, min_gain=100.0)
    gated.observe([[3, 4, 5]] * 4, [[6, 7, 8, 9, 10, 11]] * 4)
    before = drafter.heads.blocks[0].weight.clone()
    assert len(gated.train(3, 1.0)) == 3 and gated.shipped == 0  # no copy wins by 100 tokens
    assert gated.last_held_out is not None and drafter.heads.version == 2
    torch.testing.assert_close(drafter.heads.blocks[0].weight, before)  # the drafting heads stay as they were


def test_the_exit_adapter_learns_the_current_policy_behind_the_gate(policy):
    online = ExitAdapterTraining(1, 8, 1 << 20, PartFitConfig(rows=64), holdout_every=3)
    assert online.part is None and online.state() is None  # made with the first engine
    config = RolloutConfig(strategy="chain:2")
    online.engine_drafter(policy, config)
    assert isinstance(online.learning.learner, ExitAdapterLearner) and online.learning.learner.policy is policy
    online.observe([[3, 4, 5, 6]] * 6, [[7, 8, 9, 10, 11]] * 6)
    losses = online.train(6, 1.0)
    assert len(losses) == 6 and losses[-1] < losses[0]  # towards the policy's own distributions
    drafting, trained = online.last_held_out
    assert trained > drafting and online.shipped == 1 and online.adapter.version == 6
    twin = tiny_random_model("qwen2", seed=1, num_layers=4)
    online.engine_drafter(twin, config)  # a new policy object: the trainer's teacher follows it
    assert online.learning.trainer.fit.target is twin and online.learning.learner.policy is twin

    resumed = ExitAdapterTraining(1, 8, 1 << 20, PartFitConfig(rows=64))
    resumed.load(online.state())  # before any engine: the adapter and optimizer wait for it
    resumed.engine_drafter(policy, config)
    torch.testing.assert_close(resumed.adapter.up.weight, online.adapter.up.weight)
    resumed.observe([[3, 4, 5, 6]], [[7, 8, 9]])
    resumed.train(1, 1.0)
    assert resumed.trainer.step_count == 7
    with pytest.raises(ValueError, match="drafter_training for an exit adapter must be a PartFitConfig"):
        ExitAdapterTraining(1, 8, 1 << 20, training=DrafterState({}, 0))
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        PartFitConfig(rows=0)
