"""Rollouts over 2 Ray workers (local Ray): the same completions as one engine, spot drafter
training only while a worker idles in the tail, versions equal everywhere afterwards, and no
request lost when a worker is killed mid-rollout or mid-training. Ordering is asserted from
recorded events, never from timing."""

import pytest
import torch
from rollout_cases import CONFIG, EOS, coordinator, fresh_head, kinds, long_tail_batch, policy, single_engine

from tailspec.rollout import RolloutConfig, SamplingParams
from tailspec.testing import perturbed_copy
from tailspec.workers import RolloutCoordinator, WorkersConfig


def test_workers_config_is_validated():
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        WorkersConfig(num_workers=-1)
    with pytest.raises(ValueError, match="spot_steps_per_call must be an int >= 1"):
        WorkersConfig(spot_steps_per_call=0)
    with pytest.raises(ValueError, match="num_workers must be an int >= 1 for a coordinator"):
        RolloutCoordinator(None, RolloutConfig(), [0], config=WorkersConfig(num_workers=0))


def test_results_equal_one_engine_and_spot_training_fills_the_tail():
    prompts, params = long_tail_batch()
    want = single_engine(prompts, params)
    # the long group on one worker: the other idles in the tail; nothing held out, so every chunk ships
    coord = coordinator(schedule="static", spot_holdout_every=0)
    for _ in range(2):
        start = len(coord.events)
        report = coord.generate(prompts, params)
        assert [o.completion_ids for o in report.outputs] == [o.completion_ids for o in want]
        assert [o.prompt_ids for o in report.outputs] == prompts
        events = coord.events[start:]
        end = kinds(events, "rollout_end")[0].seq
        starts = [e for e in kinds(events, "spot_start") if e.seq < end]
        assert starts, "the short shards' worker should have trained while the long one generated"
        for e in starts:  # during the rollout only while another worker is still generating
            assert e.detail["busy"] and e.worker not in e.detail["busy"]
        # after it a chunk trains on through the trainer's update (the gap): the tail's last one goes
        # on, or one starts on the rollout's step budget left
        assert coord.spot.running is not None and not coord.spot.running.stop_sent
        for gap in [e for e in kinds(events, "spot_start") if e.seq > end]:
            assert gap.detail["busy"] == [] and gap.detail["steps"] > 2
        # all workers drafted with one version (training updates a copy, not the drafting head)
        assert len({e.detail["drafter_version"] for e in kinds(events, "shard_done")}) == 1
    coord.settle()  # stops the chunk training through the gap, collects it, then broadcasts
    done = kinds(coord.events, "spot_done")
    broadcasts = kinds(coord.events, "drafter_broadcast")
    assert broadcasts[-1].seq > done[-1].seq and broadcasts[-1].detail["version"] == done[-1].detail["version"]
    for rollout_end in kinds(coord.events, "rollout_end")[:-1]:
        next_shard = next(e for e in coord.events if e.kind == "shard" and e.seq > rollout_end.seq)
        between = [e for e in coord.events if rollout_end.seq < e.seq < next_shard.seq]
        # the gap's chunk is stopped and back, and the newest head broadcast, before the next rollout's work
        assert [e.kind for e in between if e.kind.startswith("spot_")][-2:] == ["spot_stop", "spot_done"]
        assert between[-1].kind == "drafter_broadcast"
    versions = coord.worker_versions()
    assert len({v for _, v in versions.values()}) == 1  # every worker drafts with one version
    (version,) = {v for _, v in versions.values()}
    assert version == coord.part.version == coord.drafter_state.version > 0
    assert sum(e.detail["steps"] for e in done) == version  # the head started at version 0
    recorded = sum(e.detail["samples"] for e in kinds(coord.events, "shard_done"))
    for worker_events in coord.worker_events().values():
        last_broadcast = max(e.seq for e in worker_events if e.kind == "drafter")
        assert all(e.seq < last_broadcast for e in worker_events if e.kind == "train_step")  # none after it
        assert sum(e.detail["new"] for e in worker_events if e.kind == "train_start") <= recorded  # sent once
    coord.shutdown()


def test_without_the_update_gap_training_stops_when_the_rollout_ends():
    prompts, params = long_tail_batch()
    coord = coordinator(schedule="static", spot_in_update_gap=False)
    for _ in range(2):
        coord.generate(prompts, params)
    ends = kinds(coord.events, "rollout_end")
    assert kinds(coord.events, "spot_start")
    assert all(e.seq < ends[0].seq or ends[0].seq < e.seq < ends[1].seq for e in kinds(coord.events, "spot_start"))
    assert all(e.detail["busy"] for e in kinds(coord.events, "spot_start"))
    coord.shutdown()


def test_without_spot_training_requests_heads_and_policy_weights_reach_every_worker():
    """One coordinator with spot training off: a bad request is refused before any work; a rollout
    trains nothing. DrafterFromTrainer publishes the head it trains: trained in place (the very head
    object the coordinator drafts with) and published right after a rollout (a broadcast of the old
    version pending), it must not get the old version loaded back first; trained elsewhere (the
    trainer process), every worker drafts with it from the next rollout on. A new policy version
    reaches every worker once, and the next rollout is the new policy's."""
    prompts, params = long_tail_batch()
    coord = coordinator(spot_training=False)
    with pytest.raises(ValueError, match="request 1"):
        coord.generate([[5, 6], [500]], SamplingParams(max_new_tokens=4))
    assert not kinds(coord.events, "shard")
    report = coord.generate(prompts, params)  # leaves a broadcast pending
    assert report.spot_steps == 0 and not kinds(coord.events, "spot_start")
    assert {v for _, v in coord.worker_versions().values()} == {0}

    head = coord.part
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01)
    head.version = 11
    trained = {k: v.clone() for k, v in head.state_dict().items()}
    coord.publish_drafter(head)
    assert coord.drafter_state.version == 11 and head.version == 11
    for key, value in trained.items():
        assert torch.equal(coord.drafter_state.weights[key], value), key
        assert torch.equal(head.state_dict()[key], value), key
    assert {v[1] for v in coord.worker_versions().values()} == {11}
    elsewhere = fresh_head()
    elsewhere.reset_parameters(std=0.02)
    elsewhere.version = 12
    coord.publish_drafter(elsewhere)
    assert {v[1] for v in coord.worker_versions().values()} == {12}
    assert coord.part.version == 12 and kinds(coord.events, "drafter_published")
    for key, value in elsewhere.state_dict().items():
        assert torch.equal(coord.part.state_dict()[key], value), key
    report = coord.generate(prompts, params)
    assert [o.completion_ids for o in report.outputs] == [o.completion_ids for o in single_engine(prompts, params)]
    assert report.drafter_version == 12

    new_policy = perturbed_copy(policy(), noise=0.5, seed=3)
    assert coord.sync_policy(new_policy, version=1)
    assert not coord.sync_policy(new_policy, version=1)  # already there
    assert {v[0] for v in coord.worker_versions().values()} == {1}
    report = coord.generate(prompts, params)
    want = single_engine(prompts, params, model=new_policy)
    assert [o.completion_ids for o in report.outputs] == [o.completion_ids for o in want]
    assert report.policy_version == 1 and len(kinds(coord.events, "policy_sync")) == 1
    coord.shutdown()


def test_training_lost_with_its_worker_resumes_from_the_last_version():
    prompts, params = long_tail_batch()
    want = single_engine(prompts, params)
    state = {"kill_at": 2, "seen": 0}

    def kill_trainer_at_second_chunk(event):
        if event.kind == "spot_start":
            state["seen"] += 1
            if state["seen"] == state["kill_at"]:
                coord.actors.kill(coord.workers[event.worker])

    # no held-out judgement: every chunk that returns ships, so the drafting version is the last
    # returned chunk's whichever steps the machine's load let each chunk take
    coord = coordinator(on_event=kill_trainer_at_second_chunk, schedule="static", spot_holdout_every=0)
    report = coord.generate(prompts, params)
    assert [o.completion_ids for o in report.outputs] == [o.completion_ids for o in want]
    coord.settle()
    done = kinds(coord.events, "spot_done")
    assert kinds(coord.events, "worker_died") and done
    assert coord.drafter_state.version == done[-1].detail["version"]  # the lost chunk left no trace
    coord.on_event = None
    before = coord.drafter_state.version
    coord.generate(prompts, params)
    resumed = [e for e in kinds(coord.events, "spot_start") if e.seq > done[-1].seq]
    assert resumed and resumed[0].detail["version"] == before
    coord.shutdown()


def test_a_rerun_waits_for_the_training_worker_when_no_other_is_left():
    """The generating worker dies while the other trains: its shard is re-run on the trainer, which
    is told to stop first (and, with respawning off, no new worker comes to help)."""
    prompts, params = long_tail_batch()
    want = single_engine(prompts, params)
    killed = []

    def kill_the_busy_worker_once_training_starts(event):
        if event.kind == "spot_start" and not killed:
            killed.append(event.detail["busy"][0])
            coord.actors.kill(coord.workers[killed[0]])

    coord = coordinator(
        on_event=kill_the_busy_worker_once_training_starts, respawn_dead_workers=False, schedule="static"
    )
    report = coord.generate(prompts, params)
    assert [o.completion_ids for o in report.outputs] == [o.completion_ids for o in want]
    (stop,) = [e for e in kinds(coord.events, "spot_stop") if not e.detail["rollout_over"]]
    rerun = [e for e in kinds(coord.events, "shard") if e.detail["attempt"] == 2]
    assert rerun and rerun[0].seq > stop.seq and rerun[0].worker == stop.worker
    assert len(coord.workers) == 1
    coord.shutdown()


def test_a_trained_head_that_does_not_beat_the_drafting_one_is_not_shipped():
    """With a held-out set and a gain no head can make, spot training trains (its state moves on)
    but ships nothing: every worker keeps drafting with the starting version, and a checkpoint
    keeps both states."""
    prompts, params = long_tail_batch()
    coord = coordinator(schedule="static", spot_holdout_every=2, spot_ship_min_gain=100.0)
    for _ in range(2):
        coord.generate(prompts, params)
    coord.settle()
    done = kinds(coord.events, "spot_done")
    assert done and not any(e.detail["shipped"] for e in done)
    # every chunk that trained was compared, unless a stop cut its comparison short (then the next judges it)
    assert all(e.detail["held_out"] is not None for e in done if e.detail["steps"] and e.detail["judged"])
    assert any(e.detail["held_out"] is not None for e in done)
    assert coord.drafter_state.version == 0 < coord.spot.state.version
    assert {v for _, v in coord.worker_versions().values()} == {0}
    state = coord.state_dict()
    assert state["drafter"].version == 0 and state["drafter_trained"].version == coord.spot.state.version
    coord.shutdown()


@pytest.mark.parametrize("part", ["lm", "streaming heads"])
def test_a_drafter_lm_trains_on_idle_workers_and_ships_to_every_worker(part):
    """The drafter LM on the spot path (its weights, or its streaming heads with the LM frozen):
    trained on the finished completions while a worker idles in the tail, shipped past the gate,
    drafted with by every worker; completions stay the plain ones."""
    from tailspec.drafter.lm_trainer import DraftLMTrainingConfig
    from tailspec.drafter.part_trainer import PartFitConfig
    from tailspec.drafter.small_lm import SmallLMDrafter
    from tailspec.drafter.streaming import StreamingHeads
    from tailspec.testing import tiny_random_model

    prompts, params = long_tail_batch()
    want = single_engine(prompts, params)
    lm = tiny_random_model("qwen2", seed=2, num_layers=1)
    if part == "lm":
        drafter, training = SmallLMDrafter(lm), DraftLMTrainingConfig(batch_size=4, max_tokens=128)
    else:
        drafter = SmallLMDrafter(lm, streaming_heads=StreamingHeads(lm.config.hidden_size, 2))
        training = PartFitConfig(rows=64, max_tokens=128)
    trained = drafter.lm if part == "lm" else drafter.heads
    config = WorkersConfig(
        num_workers=2, backend="threads", spot_steps_per_call=2, schedule="static", spot_holdout_every=0
    )
    coord = RolloutCoordinator(policy(), CONFIG, [EOS], drafter=drafter, config=config, training=training)
    steps = 0
    for _ in range(2):
        report = coord.generate(prompts, params)
        assert [o.completion_ids for o in report.outputs] == [o.completion_ids for o in want]
        steps += report.spot_steps
    coord.settle()
    assert steps > 0 and kinds(coord.events, "spot_done")
    (version,) = {v for _, v in coord.worker_versions().values()}
    assert version == coord.drafter_state.version == coord.part.version == trained.version > 0
    assert sum(e.detail["samples"] for e in kinds(coord.events, "shard_done")) == 2 * len(prompts)
    coord.shutdown()
