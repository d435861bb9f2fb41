"""PairedRollout: the twin runs on every call, in alternating order; ratios and the run's comparison."""

import math
from dataclasses import dataclass, field

import pytest

from tailspec.trainer_hooks.paired_rollout import PairedRollout


@dataclass
class Stats:
    time_s: float
    completion_tokens: int
    completions_digest: str
    completion_digests: tuple = ()

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.time_s if self.time_s else 0.0


@dataclass
class FakeRollout:
    """Each call takes the next (seconds, tokens, digest) and logs who ran when."""

    name: str
    script: list
    log: list
    coordinator: object = None
    history: list = field(default_factory=list)
    synced: int = 0

    def __call__(self, prompts, trainer):
        self.log.append(self.name)
        self.history.append(Stats(*self.script[len(self.history)]))
        return {"completion_ids": [[1]] * len(prompts)} if self.name == "main" else {"twin": True}

    @property
    def last_stats(self):
        return self.history[-1]

    def sync_weights(self, trainer):
        self.synced += 1


def test_the_twin_alternates_and_the_trainer_sees_only_the_main_rollout():
    log = []
    main = FakeRollout(
        "main", [(1.0, 100, "a", ("p", "q")), (2.0, 100, "b", ("p", "q")), (1.0, 50, "c", ("p", "q"))], log
    )
    twin = FakeRollout(
        "twin", [(2.0, 100, "a", ("p", "q")), (2.0, 100, "x", ("p", "x")), (0.0, 0, "c", ("p", "q"))], log
    )
    paired = PairedRollout(main, twin)
    outs = [paired(["p", "q"], trainer=None) for _ in range(3)]
    assert log == ["twin", "main", "main", "twin", "twin", "main"]
    assert all(out == {"completion_ids": [[1], [1]]} for out in outs)
    assert paired.same_completions == [True, False, True]
    ratios = paired.step_ratios()
    assert ratios[:2] == [2.0, 1.0] and math.isnan(ratios[2])  # the twin emitted nothing at step 3
    paired.sync_weights(trainer=None)
    assert (main.synced, twin.synced) == (1, 1)

    run = paired.compare(wall_s=20.0)
    assert run["rollout_ratio_median_per_step"] == pytest.approx(1.5)
    assert run["baseline_rollout_time_s"] == 4.0 and run["baseline_rollout_tokens_per_s"] == 50.0
    assert run["rollout_throughput_vs_none"] == pytest.approx((250 / 4.0) / 50.0)
    assert (run["run_wall_s_speculative"], run["run_wall_s_plain"]) == (16.0, 16.0)
    assert run["run_speedup"] == 1.0 and run["same_completions_steps"] == "2 of 3"
    assert run["same_completions"] == "5 of 6"  # step 2 differed in one completion of two


def test_rollouts_beside_run_on_every_call_in_rotating_order_and_are_compared_with_the_twin():
    log = []
    main = FakeRollout("main", [(1.0, 100, "a", ("p", "q"))] * 3, log)
    twin = FakeRollout("twin", [(2.0, 100, "a", ("p", "q"))] * 3, log)
    head = FakeRollout("head", [(4.0, 100, "a", ("p", "x"))] * 3, log)  # slower than the twin, one completion off
    paired = PairedRollout(main, twin, beside={"head": head})
    outs = [paired(["p", "q"], trainer=None) for _ in range(3)]
    assert log == ["twin", "main", "head", "main", "head", "twin", "head", "twin", "main"]
    assert all(out == {"completion_ids": [[1], [1]]} for out in outs)  # only the main rollout's outputs
    paired.sync_weights(trainer=None)
    assert head.synced == 1
    assert paired.step_ratios(head) == [0.5, 0.5, 0.5]
    run = paired.compare(wall_s=30.0)
    assert run["beside"] == {
        "head": {
            "rollout_ratio_median_per_step": 0.5,
            "rollout_ratio_per_step": [0.5] * 3,
            "same_completions": "3 of 6",
        }
    }
    # either rollout alone: the training's time is what is left after all three rollouts
    assert (run["run_wall_s_speculative"], run["run_wall_s_plain"]) == (30.0 - 6.0 - 12.0, 30.0 - 3.0 - 12.0)
