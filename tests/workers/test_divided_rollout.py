"""Divided rollout over 2 Ray workers (local Ray): requests dealt from a global queue in chunks,
moved from a busy worker to one that ran dry, and none of it visible in the results: greedy
completions equal one engine's, seeded samples equal one engine's, each request exactly once.
And workers that cannot be placed fail in bounded time, naming what was asked and what is free."""

import time

import pytest
from rollout_cases import CONFIG, EOS, coordinator, fresh_head, kinds, policy, single_engine

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.workers import PlacementError, RolloutCoordinator, WorkersConfig


def one_long_chunk_batch(temperature=0.0, seed=None):
    """A chunk of four long requests first, then short ones: FIFO dealing gives the long chunk to one
    worker, so the other runs dry and rebalancing must move long ones to it."""
    prompts, params = [], []
    for i in range(4):
        prompts.append([5, 6, 7, 8])
        params.append(
            SamplingParams(temperature=temperature, max_new_tokens=120, ignore_eos=True, seed=seed and seed + i)
        )
    for i in range(8):
        prompts.append([9 + i, 3])
        params.append(
            SamplingParams(temperature=temperature, max_new_tokens=4, ignore_eos=True, seed=seed and seed + 10 + i)
        )
    return prompts, params


def test_rebalancing_moves_long_requests_to_the_dry_worker_and_changes_no_token():
    prompts, params = one_long_chunk_batch()
    want = [o.completion_ids for o in single_engine(prompts, params)]
    coord = coordinator(spot_training=False, order="fifo", rebalance_min_tokens=0)
    report = coord.generate(prompts, params)
    assert [o.completion_ids for o in report.outputs] == want
    assert report.requests_moved >= 1
    asked, released = kinds(coord.events, "move_asked")[0], kinds(coord.events, "released")[0]
    assert released.worker == asked.worker != asked.detail["to"] and released.detail["generated"] > 0
    finished = kinds(coord.events, "finished")
    assert sum(e.detail["requests"] for e in finished) == len(prompts)
    assert {e.worker for e in finished if e.seq > released.seq} == {0, 1}  # both finish long ones
    coord.shutdown()


def test_seeded_samples_are_the_same_whatever_the_schedule():
    """Without speculation a seeded request draws one uniform per token from its own generator,
    which moves with it. (A speculative step draws a uniform per verified token, a re-prefill one:
    a move then gives other draws from the same distribution, as a preemption does.)"""
    prompts, params = one_long_chunk_batch(temperature=1.0, seed=100)
    plain = RolloutConfig(kv_cache_tokens=8192)
    want = [o.completion_ids for o in RolloutEngine(policy(), plain, eos_token_ids=[EOS]).generate(prompts, params)]
    for schedule, rebalance in (("static", False), ("divided", True)):
        config = WorkersConfig(
            num_workers=2,
            backend="threads",
            spot_training=False,
            schedule=schedule,
            order="fifo",
            rebalance=rebalance,
            rebalance_min_tokens=0,
        )
        coord = RolloutCoordinator(policy(), plain, [EOS], config=config)
        report = coord.generate(prompts, params)
        assert [o.completion_ids for o in report.outputs] == want, schedule
        assert (report.requests_moved > 0) == rebalance
        coord.shutdown()


def test_position_keyed_samples_are_plain_decodings_even_speculated_and_moved():
    """With noise="position" a sampled completion depends on the seed alone: speculative workers
    (the EAGLE-3 head, chain:3) that move requests between them emit what one plain engine does."""
    prompts, params = one_long_chunk_batch(temperature=1.0, seed=300)
    params = [p.with_updates(noise="position") for p in params]
    plain = RolloutConfig(kv_cache_tokens=8192)
    want = [o.completion_ids for o in RolloutEngine(policy(), plain, eos_token_ids=[EOS]).generate(prompts, params)]
    coord = coordinator(spot_training=False, order="fifo", rebalance_min_tokens=0)
    report = coord.generate(prompts, params)
    assert [o.completion_ids for o in report.outputs] == want
    assert report.requests_moved > 0 and report.counts.drafted_tokens > 0
    coord.shutdown()


def test_predicted_order_learns_lengths_across_rollouts():
    prompts, params = one_long_chunk_batch()
    coord = coordinator(spot_training=False)
    first = coord.generate(prompts, params)
    second = coord.generate(prompts, params)
    assert [o.completion_ids for o in second.outputs] == [o.completion_ids for o in first.outputs]
    assert second.length_error == pytest.approx(0.0)  # greedy, same lengths as last time
    shards = [e for e in coord.events if e.kind in ("shard", "submit")]
    second_start = kinds(coord.events, "rollout_end")[0].seq
    dealt_first = [e for e in shards if e.seq > second_start][:2]
    assert {e.worker for e in dealt_first} == {0, 1}  # the long group is spread over both workers
    coord.shutdown()


def test_workers_that_cannot_be_placed_fail_in_bounded_time(ray_local):
    @ray_local.remote(num_cpus=2)
    class Holder:  # holds both CPUs of the local instance (no model to load: it starts in a second)
        def ping(self):
            return True

    holder = Holder.remote()
    ray_local.get(holder.ping.remote())
    start = time.perf_counter()
    with pytest.raises(
        PlacementError, match=r"asked for CPU 2, GPU 0; the cluster has CPU 0, GPU 0 free of CPU 2, GPU 0"
    ):
        RolloutCoordinator(
            policy(), CONFIG, [EOS], drafter=fresh_head(), config=WorkersConfig(num_workers=2, placement_timeout_s=2)
        )
    assert time.perf_counter() - start < 30
    ray_local.kill(holder)
    deadline = time.monotonic() + 20  # freed resources show up asynchronously
    while ray_local.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("CPU") == 2  # the refused actors were killed, not left pending


def test_schedule_settings_are_validated():
    with pytest.raises(ValueError, match="schedule must be one of"):
        WorkersConfig(schedule="round-robin")
    with pytest.raises(ValueError, match="placement_timeout_s must be"):
        WorkersConfig(placement_timeout_s=0)
    with pytest.raises(ValueError, match="inflight_per_worker must be"):
        WorkersConfig(inflight_per_worker=0)
