"""A rollout round's bookkeeping apart from Ray: how it clocks the idle time of the tail."""

from types import SimpleNamespace

from tailspec.workers.ledger import RequestLedger
from tailspec.workers.rollout_round import RolloutRound, RoundResult


def test_a_round_charges_waits_to_idle_workers_only_while_another_generates():
    ledger = RequestLedger(4, max_attempts=3)
    ledger.assign(0, [0, 1])
    ledger.assign(1, [2])
    round_ = SimpleNamespace(
        pool=SimpleNamespace(workers={0: "a", 1: "b", 2: "c"}), ledger=ledger, result=RoundResult([])
    )
    RolloutRound._clock_idle(round_, 2.0, training=False)  # worker 2 idle
    assert (round_.result.idle_worker_s, round_.result.spot_busy_s) == (2.0, 0.0)
    ledger.finished(1, [2], ["r2"])
    RolloutRound._clock_idle(round_, 1.0, training=True)  # workers 1 and 2 idle, one of them trains
    assert (round_.result.idle_worker_s, round_.result.spot_busy_s) == (4.0, 1.0)
    ledger.finished(0, [0, 1], ["r0", "r1"])
    RolloutRound._clock_idle(round_, 5.0, training=True)  # nobody generates: not the tail's idle time
    assert (round_.result.idle_worker_s, round_.result.spot_busy_s) == (4.0, 1.0)


def test_a_session_is_told_the_batch_it_grows_to():
    """What ``adaptive`` on the worker calibrates for before the session's first step."""
    items = [object()] * 4  # one chunk opens the session

    def batch(schedule: str, prompts: int, workers: int, inflight: int, opened_with: list = items) -> int:
        round_ = SimpleNamespace(
            plan=SimpleNamespace(schedule=schedule),
            prompts=[[1]] * prompts,
            pool=SimpleNamespace(workers=dict.fromkeys(range(workers))),
            inflight=inflight,
        )
        return RolloutRound._session_batch(round_, opened_with)

    assert batch("divided", prompts=56, workers=2, inflight=256) == 28  # its share of the rollout
    assert batch("divided", prompts=56, workers=2, inflight=16) == 16  # the in-flight limit
    assert batch("divided", prompts=3, workers=2, inflight=16) == 4  # never fewer than it opened with
    assert batch("static", prompts=56, workers=2, inflight=56, opened_with=[object()] * 30) == 30  # a whole shard
