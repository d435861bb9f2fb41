"""The request ledger alone: a dead worker's finished requests are kept, only the unfinished wait
again (first in line), every request finishes exactly once, and attempts are bounded."""

import pytest

from tailspec.workers.ledger import RequestLedger


def ledger(max_attempts=3):
    return RequestLedger(6, [[0, 1, 2], [3, 4, 5]], max_attempts)


def test_a_dead_worker_costs_only_its_unfinished_requests():
    book = ledger()
    a, b = book.next_shard(0), book.next_shard(1)
    book.finished(0, [1], ["r1"])
    book.finished(1, [3, 4, 5], ["r3", "r4", "r5"])
    book.shard_done(1, b)
    (rerun,) = book.worker_lost(0)
    assert rerun.indices == [0, 2] and rerun.attempt == 2 and book.rerun_count == 2
    assert book.results[1] == "r1"  # kept
    assert book.next_shard(1) is rerun
    book.finished(1, [2, 0], ["r2", "r0"])
    book.shard_done(1, rerun)
    assert book.done and book.results == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert a.indices == [0, 1, 2]


def test_a_worker_lost_after_its_last_request_re_runs_nothing():
    book = ledger()
    book.next_shard(0)
    book.finished(0, [0, 1, 2], ["x", "y", "z"])
    assert book.worker_lost(0) == [] and book.rerun_count == 0


def test_re_runs_go_first_and_shards_not_yet_sent_keep_their_place():
    book = RequestLedger(4, [[0], [1], [2, 3]], 3)
    book.next_shard(0)
    book.worker_lost(0)
    assert [s.indices for s in book.waiting] == [[0], [1], [2, 3]]
    assert book.waiting[0].attempt == 2


def test_every_request_finishes_once_and_only_where_it_was_sent():
    book = ledger()
    book.next_shard(0)
    book.finished(0, [0], ["r0"])
    with pytest.raises(RuntimeError, match="finished twice"):
        book.finished(0, [0], ["again"])
    with pytest.raises(RuntimeError, match="not given"):
        book.finished(0, [4], ["r4"])
    with pytest.raises(RuntimeError, match="unfinished"):
        book.shard_done(0, book.out[0][0])


def test_attempts_are_bounded():
    book = ledger(max_attempts=2)
    book.next_shard(0)
    book.worker_lost(0)
    book.next_shard(1)  # the re-run (attempt 2)
    with pytest.raises(RuntimeError, match="failed on 2 workers"):
        book.worker_lost(1)


def test_shards_must_cover_every_request_once():
    with pytest.raises(ValueError, match="exactly once"):
        RequestLedger(3, [[0, 1], [1, 2]], 3)
