"""``SpecRollout(workers=2)``: the same completions as the in-process engine at greedy, policy
weights sent once per global step, metrics in the trainer's store."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.rollout import SamplingParams
from tailspec.tasks.tokenizer import build_tokenizer
from tailspec.testing import tiny_task_policy
from tailspec.trainer_hooks.spec_rollout import SpecRollout


def head_for(policy) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(policy.config))
    head.reset_parameters(std=0.05)
    return head


def test_workers_match_the_in_process_engine_and_sync_once_per_step():
    tokenizer = build_tokenizer()
    policy = tiny_task_policy(tokenizer, initializer_range=0.2)
    prompts = [[{"role": "user", "content": f"add {i} {i + 3}"}] for i in range(4) for _ in range(2)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer = SimpleNamespace(
        args=SimpleNamespace(seed=0),
        processing_class=tokenizer,
        model=policy,
        _metrics=metrics,
        state=SimpleNamespace(global_step=0),
    )
    local = SpecRollout(model=policy, strategy="chain:3", drafter=head_for(policy), sampling=sampling)
    remote = SpecRollout(
        model=policy,
        strategy="chain:3",
        drafter=head_for(policy),
        sampling=sampling,
        workers=2,
        backend="threads",  # the coordinator's logic; Ray's processes: test_cli_and_configs' demo
        spot_steps_per_call=2,
    )
    for step in range(2):
        trainer.state.global_step = step
        if step:  # an "optimizer step": the policy changes in place, as under the trainer
            with torch.no_grad():
                for p in policy.parameters():
                    p.mul_(1.05)
        want = local(prompts, trainer)
        got = remote(prompts, trainer)
        assert got["prompt_ids"] == want["prompt_ids"] and got["completion_ids"] == want["completion_ids"]
        for a, b in zip(got["logprobs"], want["logprobs"]):  # other batch mates: rounding only
            assert a == pytest.approx(b, abs=1e-4)
        again = remote(prompts, trainer)  # same step: no new weights sent
        assert again["completion_ids"] == want["completion_ids"]
    coord = remote.coordinator
    assert sum(e.kind == "policy_sync" for e in coord.events) == 1  # one optimizer step, one sync
    # every worker that served after the sync holds the new weights; one that got no work since
    # (the divided queue may hand both chunks to the other) is synced with its next session
    versions = {i: v[0] for i, v in coord.worker_versions().items()}
    assert versions == {i: coord.pool.held[i][0] for i in versions} and max(versions.values()) == 1
    assert remote.last_stats.policy_version == 1 and remote.last_stats.completion_tokens > 0
    for key in ("rollout/time_s", "rollout/tokens_per_s", "rollout/accept_length", "drafter/version"):
        assert metrics["eval"][key], key  # the policy is in eval mode here
    coord.shutdown()
