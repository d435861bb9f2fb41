"""Faults cost only what they must (2 workers): a worker killed before, during or after its last
request has only its unfinished requests re-run, every request is counted once and the results come
back in order; the next rollout does not wait for a training chunk still running. One schedule's
kills end Ray worker processes; the rest kill thread actors (the coordinator sees the same death)."""

import time

import pytest
from rollout_cases import coordinator, kinds, long_tail_batch, policy, single_engine

from tailspec.testing import perturbed_copy
from tailspec.workers import DrafterState
from tailspec.workers.spot import Chunk
from tailspec.workers.worker import TrainResult


def finished_once(coord, start, n):
    """Every request of the rollout that began at event ``start`` was received exactly once."""
    return sum(e.detail["requests"] for e in kinds(coord.events[start:], "finished")) == n


def kill_when(box, predicate):
    """An on_event hook that kills the event's worker the first time ``predicate(event)`` holds."""

    def hook(event):
        if not box["killed"] and predicate(event):
            box["killed"].append(event.worker)
            box["left"] = event.detail.get("left")
            coord = box["coord"]
            coord.actors.kill(coord.workers[event.worker])

    return hook


BEFORE = ("before its first request", lambda e: e.kind == "shard")
DURING = ("during its requests", lambda e: e.kind == "finished" and e.detail["left"] > 0)
AFTER = ("after its last request", lambda e: e.kind == "finished" and e.detail["left"] == 0)


def rollout_with_a_kill(coord, kill, prompts, params, want) -> None:
    """One rollout in which the first worker ``kill``'s predicate picks is killed at ``kill``'s
    point: the completions are the plain ones, every request is counted once, and only what the
    dead worker had not finished is generated again."""
    point, predicate = kill
    box = {"killed": [], "coord": coord}
    coord.on_event = kill_when(box, predicate)
    start = len(coord.events)
    report = coord.generate(prompts, params)
    coord.on_event = None
    events = coord.events[start:]
    assert box["killed"], point
    assert [o.completion_ids for o in report.outputs] == want, point
    assert [o.prompt_ids for o in report.outputs] == prompts
    assert finished_once(coord, start, len(prompts))
    reruns = kinds(events, "rerun")
    assert report.requests_rerun == sum(e.detail["requests"] for e in reruns)
    if kill is not AFTER:  # noticed within this rollout
        assert report.workers_died == 1 and [e.worker for e in kinds(events, "worker_died")] == box["killed"]
    if kill is BEFORE:  # everything it had been dealt (divided: it may have had more)
        dealt = [e for e in events if e.kind in ("shard", "submit") and e.worker == box["killed"][0]]
        assert report.requests_rerun == sum(e.detail["requests"] for e in dealt if e.seq < reruns[0].seq)
    elif kill is DURING:  # at most what was left when it was killed
        assert 0 < report.requests_rerun <= box["left"]
    else:  # nothing of it is generated again (its death may only be noticed next rollout)
        assert report.requests_rerun == 0


# each kill point once, and the mid-rollout death (the one that re-runs work) under both schedules:
# the schedules differ in how the dead worker's requests were dealt, not in what its death puts back.
# One coordinator a schedule takes its kills in successive rollouts, each dead worker replaced. The
# static schedule's worker dies as a Ray actor process does (each start of one costs seconds).
@pytest.mark.parametrize(
    "schedule, kills, backend",
    [("divided", (BEFORE, DURING, AFTER), "threads"), ("static", (DURING,), "ray")],
    ids=["divided", "static"],
)
def test_a_killed_worker_costs_only_its_unfinished_requests(request, schedule, kills, backend):
    if backend == "ray":
        request.getfixturevalue("ray_local")
    prompts, params = long_tail_batch()
    want = [o.completion_ids for o in single_engine(prompts, params)]
    coord = coordinator(spot_training=False, schedule=schedule, backend=backend)
    for kill in kills:
        rollout_with_a_kill(coord, kill, prompts, params, want)
    start = len(coord.events)
    again = coord.generate(prompts, params)  # the last dead worker is replaced (before or during this rollout)
    assert [o.completion_ids for o in again.outputs] == want
    assert finished_once(coord, start, len(prompts))
    assert len(kinds(coord.events, "spawn")) == 2 + len(kills) and len(coord.workers) == 2
    coord.shutdown()


class GatedChunk:
    """A training chunk that returns only once the gate file exists."""

    def run(self, gate, result):
        while not gate.exists():
            time.sleep(0.05)
        return result


def test_neither_a_policy_sync_nor_the_next_rollout_waits_long_for_a_training_chunk(tmp_path, monkeypatch):
    """A chunk still running (it returns only when the test lets it): the sync goes on at once, the
    rollout after a brief wait (``STOPPED_CHUNK_WAIT_S``), with the other worker; once the chunk is
    in, its state is kept and the trainer catches up on the weights it missed with its next shard."""
    import tailspec.workers.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "STOPPED_CHUNK_WAIT_S", 0.2)
    prompts, params = long_tail_batch()
    new_policy = perturbed_copy(policy(), noise=0.5, seed=3)
    want = [o.completion_ids for o in single_engine(prompts, params, model=new_policy)]
    coord = coordinator(spot_training=False)
    trainer = min(coord.workers)
    newer = DrafterState(coord.drafter_state.weights, coord.drafter_state.version + 5)
    gate = tmp_path / "chunk_may_return"

    gated = coord.actors.spawn(GatedChunk, num_cpus=0, num_gpus=0, max_concurrency=1)
    ref = coord.actors.call(gated, "run", gate, TrainResult(trainer, newer, [0.1] * 5, stopped=True))
    chunk = Chunk(ref, trainer, number=0, stop_sent=True)
    coord.spot.running = chunk
    assert coord.sync_policy(new_policy, version=1)
    report = coord.generate(prompts, params)
    assert [o.completion_ids for o in report.outputs] == want
    assert {e.worker for e in kinds(coord.events, "shard")} == {max(coord.workers)}
    assert not kinds(coord.events, "spot_done") and coord.spot.running is chunk
    (awaited,) = kinds(coord.events, "chunk_awaited")
    assert not awaited.detail["back"] and awaited.detail["seconds"] < 5
    gate.touch()
    coord.actors.wait([chunk.ref], timeout=60)
    again = coord.generate(prompts, params)  # collects the chunk first; the trainer gets weights with its shard
    assert [o.completion_ids for o in again.outputs] == want
    assert kinds(coord.events, "spot_done")[0].seq < kinds(coord.events, "rollout_end")[-1].seq
    assert trainer in {e.worker for e in kinds(coord.events, "shard")}
    assert again.spot_steps == 5 and coord.drafter_state.version == newer.version
    assert set(coord.worker_versions().values()) == {(1, newer.version)}
    coord.shutdown()
