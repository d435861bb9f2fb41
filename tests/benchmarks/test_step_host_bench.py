"""The step-host section: a decode step's host time is its wall time less the forwards, measured
per (arm, batch) over interleaved passes."""

import torch

from tailspec.benchmarks.step_host import ForwardClock, measure, models, step_host_table


def test_the_forward_clock_counts_only_the_hooked_forwards():
    target, _ = models()
    clock = ForwardClock([target])
    target(input_ids=torch.tensor([[3, 4, 5]]))
    once = clock.seconds
    assert once > 0
    torch.zeros(100).sum()  # outside any forward: not counted
    assert clock.seconds == once
    clock.close()
    target(input_ids=torch.tensor([[3, 4, 5]]))
    assert clock.seconds == once  # unhooked


def test_each_arm_and_batch_gets_host_and_forward_times_per_decode_step():
    runs = measure(passes=2, new_tokens=6, batches=(1, 3), arms=("none", "chain:4"))
    assert [(r.arm, r.batch) for r in runs] == [("none", 1), ("chain:4", 1), ("none", 3), ("chain:4", 3)]
    for r in runs:
        assert len(r.host_ms) == 2 and all(h > 0 for h in r.host_ms) and all(f > 0 for f in r.forward_ms)
        if r.arm == "none":
            assert r.tokens_per_step == [1.0, 1.0]
        else:
            assert all(t > 1.0 for t in r.tokens_per_step)  # the near-copy drafter's drafts are accepted
    table = step_host_table(runs)
    assert table.count("\n") == 1 + len(runs) and "| 3 | chain:4 |" in table
