"""The request ledger alone: a dead worker's finished requests are kept, only the unfinished wait
again, every request finishes exactly once and only where it was sent, moves are no new attempt,
and attempts are bounded."""

import pytest

from tailspec.workers.ledger import RequestLedger


def test_a_dead_worker_costs_only_its_unfinished_requests():
    book = RequestLedger(6, max_attempts=3)
    book.assign(0, [0, 1, 2])
    book.assign(1, [3, 4, 5])
    book.finished(0, [1], ["r1"])
    book.finished(1, [3, 4, 5], ["r3", "r4", "r5"])
    assert book.worker_lost(0) == [(0, 2), (2, 2)] and book.rerun_count == 2
    assert book.results[1] == "r1"  # kept
    book.assign(1, [2, 0])
    book.finished(1, [2, 0], ["r2", "r0"])
    assert book.done and book.results == ["r0", "r1", "r2", "r3", "r4", "r5"]


def test_a_worker_lost_after_its_last_request_re_runs_nothing():
    book = RequestLedger(3, max_attempts=3)
    book.assign(0, [0, 1, 2])
    book.finished(0, [0, 1, 2], ["x", "y", "z"])
    assert book.worker_lost(0) == [] and book.rerun_count == 0


def test_every_request_finishes_once_and_only_where_it_was_sent():
    book = RequestLedger(6, max_attempts=3)
    book.assign(0, [0, 1])
    book.finished(0, [0], ["r0"])
    with pytest.raises(RuntimeError, match="finished twice"):
        book.finished(0, [0], ["again"])
    with pytest.raises(RuntimeError, match="not given"):
        book.finished(0, [4], ["r4"])
    with pytest.raises(RuntimeError, match="already out"):
        book.assign(1, [1])
    with pytest.raises(RuntimeError, match="already finished"):
        book.assign(1, [0])


def test_a_move_is_no_new_attempt_and_a_released_request_finishes_where_it_went():
    book = RequestLedger(2, max_attempts=1)
    book.assign(0, [0, 1])
    book.released(0, [1])
    assert book.on(0) == [0] and book.moved_count == 1
    with pytest.raises(RuntimeError, match="not given"):
        book.finished(0, [1], ["from the donor"])
    book.assign(1, [1])
    book.finished(1, [1], ["r1"])
    with pytest.raises(RuntimeError, match="released request 0"):
        book.released(1, [0])


def test_attempts_are_bounded():
    book = RequestLedger(2, max_attempts=2)
    book.assign(0, [0, 1])
    book.worker_lost(0)
    book.assign(1, [0, 1])  # the re-runs (attempt 2)
    with pytest.raises(RuntimeError, match="failed on 2 workers"):
        book.worker_lost(1)
