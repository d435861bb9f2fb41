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
