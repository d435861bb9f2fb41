"""drafter/online.py: one object trains whichever drafter part a rollout has, and carries it through
a checkpoint: the weights at once, the optimizer when its trainer exists."""

import pytest
import torch
from test_streaming import random_heads

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from tailspec.drafter.online import (
    STREAMING_LR,
    DrafterState,
    DraftLMTraining,
    ExitAdapterTraining,
    HeadTraining,
    StreamingHeadsTraining,
    online_training,
)
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
    assert isinstance(online_training(streaming, 4, 1 << 20, None), StreamingHeadsTraining)
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


def test_sequence_trained_parts_train_on_the_recent_sequences_at_the_catch_up_rate(policy):
    lm = tiny_random_model("llama", seed=2, num_layers=1)
    online = StreamingHeadsTraining(SmallLMDrafter(lm, streaming_heads=random_heads(lm, 2)))
    assert online.train(2, 1.0) == [] and online.trainer is not None  # nothing long enough seen yet
    online.observe([[3, 4, 5], [1]], [[6, 7, 8, 9, 10], [2]])
    assert len(online.train(2, lr_scale=5.0)) == 2
    assert online.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5 * STREAMING_LR)
    state = online.state()
    assert isinstance(state, DrafterState) and state.version == online.part.version == 2 and state.step == 2
