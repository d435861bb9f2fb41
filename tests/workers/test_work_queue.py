"""The work queue alone: static shards go whole, divided work goes in chunks in predicted order
(one probe per unknown prompt first, then longest first), returned work goes first and moved work to
the worker it was moved for."""

import pytest

from tailspec.rollout.handoff import PartialRequest
from tailspec.rollout.params import SamplingParams
from tailspec.workers.work_queue import Task, WorkQueue

PROMPTS = [[1]] * 4 + [[2]] * 4 + [[3]] * 2


def test_static_deals_whole_shards_and_returned_work_first():
    q = WorkQueue(PROMPTS, schedule="static", order="fifo", shards=[[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]])
    assert [t.index for t in q.pull(0, 1)] == [0, 1, 2, 3]  # whole, whatever the room
    q.push_front([Task(2, attempt=2)])
    assert [(t.index, t.attempt) for t in q.pull(1, 4)] == [(2, 2)]
    assert [t.index for t in q.pull(1, 4)] == [4, 5, 6, 7, 8, 9]
    assert len(q) == 0 and q.pull(0, 4) == []


def test_divided_fifo_splits_groups_into_chunks():
    q = WorkQueue(PROMPTS, schedule="divided", order="fifo")
    assert [t.index for t in q.pull(0, 3)] == [0, 1, 2]
    assert [t.index for t in q.pull(1, 3)] == [3, 4, 5]
    assert q.waiting_for(0) == 4


def test_predicted_order_probes_unknown_prompts_then_goes_longest_first():
    lengths = {(1,): None, (2,): None, (3,): None}
    q = WorkQueue(PROMPTS, schedule="divided", order="predicted", predict=lambda i: lengths[tuple(PROMPTS[i])])
    assert [t.index for t in q.pull(0, 2)] == [0, 4]  # one probe each for the first two prompts
    lengths.update({(1,): 10.0, (2,): 300.0})  # the probes told us
    assert [t.index for t in q.pull(1, 3)] == [8, 5, 6]  # the last probe, then the long group
    assert [t.index for t in q.pull(1, 4)] == [7, 9, 1, 2]  # unknown ranks at the mean of the known


def test_moved_work_waits_for_its_worker():
    q = WorkQueue(PROMPTS, schedule="divided", order="fifo")
    q.pull(0, 10)
    partial = PartialRequest([1], SamplingParams(), [5, 6], [-0.1, -0.2])
    q.push_front([Task(3, partial, for_worker=1), Task(7)])
    assert q.waiting_for(0) == 1 and q.waiting_for(1) == 2
    assert [t.index for t in q.pull(0, 4)] == [7]
    (moved,) = q.pull(1, 4)
    assert moved.index == 3 and moved.resume is partial
    q.push_front([Task(2, for_worker=5)])
    q.release_moved_for(5)
    assert [t.index for t in q.pull(0, 1)] == [2]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="schedule"):
        WorkQueue(PROMPTS, schedule="greedy", order="fifo")
    with pytest.raises(ValueError, match="order"):
        WorkQueue(PROMPTS, schedule="divided", order="random")
    with pytest.raises(ValueError, match="shards"):
        WorkQueue(PROMPTS, schedule="static", order="fifo")
