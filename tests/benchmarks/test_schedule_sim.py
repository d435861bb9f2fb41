"""The rollout-schedule simulator: exact on hand-checkable cases, and the schedules rank as they
must on a long-tail workload (no schedule beats the longest request alone)."""

import pytest

from tailspec.benchmarks.schedule_sim import ARMS, CostModel, SimRequest, scaled_workload, simulate

FLAT = CostModel((1, 64), (1.0, 1.0), prefill_fixed_s=1.0, prefill_per_token_s=0.0)
LINEAR = CostModel((1, 2, 8), (1.0, 1.5, 4.5), prefill_fixed_s=0.5, prefill_per_token_s=0.01)


def test_cost_model_interpolates_and_extrapolates():
    assert (
        LINEAR.decode(1) == 1.0 and LINEAR.decode(4) == pytest.approx(2.5) and LINEAR.decode(16) == pytest.approx(8.5)
    )
    assert LINEAR.prefill(100) == pytest.approx(1.5)


def test_one_worker_one_request_costs_its_steps():
    (r,) = [SimRequest(0, 0, prompt_len=10, length=5)]
    result = simulate([r], 1, "static", FLAT, max_num_seqs=8)
    assert result.makespan == 5.0  # one prefill step (samples token 1) + 4 decode steps
    assert result.idle_share == [0.0]


def test_divided_beats_static_when_one_shard_holds_the_long_group():
    reqs = [SimRequest(i, 0, 4, 100) for i in range(4)] + [SimRequest(4 + i, 1 + i // 4, 4, 5) for i in range(12)]
    predicted = {0: 100.0, 1: 5.0, 2: 5.0, 3: 5.0}
    results = {arm: simulate(reqs, 2, arm, LINEAR, max_num_seqs=4, predicted=predicted) for arm in ARMS}
    bound = simulate([reqs[0]], 1, "static", LINEAR, max_num_seqs=4).makespan
    assert all(r.makespan >= bound for r in results.values())
    assert results["divided+order"].makespan < results["static"].makespan
    assert results["divided+order+rebalance"].makespan <= results["divided+order"].makespan * 1.01
    assert sorted(results["static"].finish_times)[-1] == results["static"].makespan


def test_rebalancing_moves_and_pays_for_the_re_prefill():
    reqs = [SimRequest(i, 0, 4, 60) for i in range(4)] + [SimRequest(4 + i, 1, 4, 2) for i in range(4)]
    plain = simulate(reqs, 2, "divided", LINEAR, max_num_seqs=8, chunk_size=4)
    moved = simulate(reqs, 2, "divided+order+rebalance", LINEAR, max_num_seqs=8, chunk_size=4, predicted={0: 60, 1: 2})
    assert moved.moved == 2 and moved.makespan < plain.makespan


def test_scaled_workload_keeps_group_lengths():
    reqs = scaled_workload([[3, 4], [50, 60, 70]], [7, 9], num_groups=10, seed=1)
    groups = {}
    for r in reqs:
        groups.setdefault(r.group, []).append(r.length)
    assert len(groups) == 10 and all(sorted(g) in ([3, 4], [50, 60, 70]) for g in groups.values())
    with pytest.raises(ValueError, match="arm"):
        simulate(reqs, 2, "random", FLAT, max_num_seqs=4)
