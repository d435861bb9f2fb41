"""Spot-training decisions alone (fake actors, no Ray): when a chunk starts and where, what it is
sent, and what each outcome does to the newest drafter state."""

from dataclasses import dataclass, field

import torch

from tailspec.drafter.eagle3.data import Eagle3Sample
from tailspec.workers import DrafterState
from tailspec.workers.spot import SampleBuffer, SpotTraining
from tailspec.workers.spot_chunk import TrainResult


@dataclass
class FakeMethod:
    calls: list = field(default_factory=list)

    def remote(self, *args):
        self.calls.append(args)
        return f"ref{len(self.calls)}"


@dataclass
class FakeActor:
    train_drafter: FakeMethod = field(default_factory=FakeMethod)
    stop_training: FakeMethod = field(default_factory=FakeMethod)


class FakeActors:
    """Calls go straight to the fake actor's methods."""

    def call(self, actor, method, *args):
        return getattr(actor, method).remote(*args)


def sample(n=4, width=8):
    return Eagle3Sample(torch.arange(n), torch.zeros(n - 1, width), prompt_len=1)


def state(version):
    return DrafterState(weights={}, version=version)


def spot(**overrides):
    events = []
    kwargs = dict(enabled=True, steps_per_chunk=4, max_steps_per_rollout=10, buffer_bytes=1 << 20)
    kwargs.update(overrides)
    s = SpotTraining(
        state(0), actors=FakeActors(), event=lambda kind, worker=None, **d: events.append((kind, worker, d)), **kwargs
    )
    s.start_rollout()
    return s, events


def spot_worker(prompts: int, max_new_tokens: int):
    """A rollout worker (the actor class itself, no Ray) with a fresh EAGLE-3 head, and the samples
    an engine drafting with that head recorded over ``prompts`` random prompts."""
    from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, FeatureBuffer
    from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
    from tailspec.testing import random_prompts, tiny_random_model
    from tailspec.workers.worker import RolloutWorker

    model = tiny_random_model("llama", seed=1)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(model.config)).eval()
    buffer = FeatureBuffer()
    engine = RolloutEngine(model, RolloutConfig(), drafter=Eagle3Drafter(head, model, buffer=buffer))
    engine.generate(random_prompts(prompts, seed=4), SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    worker = RolloutWorker(0, model, RolloutConfig(), eos_token_ids=[0], drafter=head)
    return worker, head, buffer.samples()


def test_a_chunk_starts_only_in_the_tail_with_data():
    s, _ = spot()
    assert not s.should_start(others_generating=True, work_waiting=False)  # no data yet
    s.buffer.add([sample()])
    assert s.should_start(others_generating=True, work_waiting=False)
    assert not s.should_start(others_generating=False, work_waiting=False)  # nobody in the tail
    assert not s.should_start(others_generating=True, work_waiting=True)  # work waits for the worker
    no_head = SpotTraining(
        None, actors=FakeActors(), enabled=True, steps_per_chunk=1, max_steps_per_rollout=1, buffer_bytes=1, event=print
    )
    assert not no_head.enabled


def test_samples_travel_once_and_state_only_when_the_trainer_lacks_it():
    s, events = spot()
    s.buffer.add([sample(), sample()])
    actor = FakeActor()
    s.start(1, actor, busy=[0])
    sent_state, new, steps, *_ = actor.train_drafter.calls[0]
    assert sent_state.version == 0 and len(new) == 2 and steps == 4
    assert events[-1] == ("spot_start", 1, {"version": 0, "busy": [0], "steps": 4})
    s.finished(TrainResult(1, state(4), [0.5] * 4, stopped=False))
    assert s.state.version == 4 and s.running is None
    s.buffer.add([sample()])
    assert s.pick_worker({0, 1}) == 1  # it holds the optimizer state
    s.start(1, actor, busy=[0])
    sent_state, new, steps, *_ = actor.train_drafter.calls[1]
    assert sent_state is None and len(new) == 1  # continues its own trainer; only the new sample
    state_for_other, new_other, _ = s.chunk_args(0)
    assert state_for_other.version == 4 and len(new_other) == 3


def test_the_rollout_step_budget_caps_chunks():
    s, _ = spot(max_steps_per_rollout=6)
    s.buffer.add([sample()])
    s.start(0, FakeActor(), busy=[1])
    s.finished(TrainResult(0, state(4), [0.1] * 4, stopped=False))
    assert s.chunk_args(0)[2] == 2
    s.finished(TrainResult(0, state(6), [0.1] * 2, stopped=False))
    assert not s.should_start(others_generating=True, work_waiting=False)
    s.start_rollout()
    assert s.should_start(others_generating=True, work_waiting=False)
    assert s.take_tally().steps == 6 and s.take_tally().steps == 0


def test_stop_is_sent_once():
    s, events = spot()
    s.buffer.add([sample()])
    actor = FakeActor()
    s.start(0, actor, busy=[1])
    s.stop(actor, rollout_over=False)
    s.stop(actor, rollout_over=True)
    assert len(actor.stop_training.calls) == 1
    assert [e for e in events if e[0] == "spot_stop"] == [("spot_stop", 0, {"rollout_over": False})]
    # the stop names its chunk (the number the chunk's call carries), and later chunks rise
    assert actor.stop_training.calls[0] == (actor.train_drafter.calls[0][-1],)
    s.finished(TrainResult(0, state(1), [0.1], stopped=True))
    s.start(0, actor, busy=[1])
    assert actor.train_drafter.calls[1][-1] > actor.train_drafter.calls[0][-1]


def test_a_lost_chunk_leaves_no_trace_and_a_failed_one_ends_training_for_the_rollout():
    s, _ = spot()
    s.buffer.add([sample()])
    s.start(0, FakeActor(), busy=[1])
    s.lost()
    assert s.state.version == 0 and s.running is None and s.tally.died == 1
    assert s.chunk_args(0)[1]  # the replacement is sent every sample again
    s.start(1, FakeActor(), busy=[0])
    s.failed(RuntimeError("boom"))
    assert not s.should_start(others_generating=True, work_waiting=False)
    s.start_rollout()
    assert s.should_start(others_generating=True, work_waiting=False)


def test_a_published_head_resets_what_trainers_hold():
    s, _ = spot()
    s.buffer.add([sample()])
    s.start(0, FakeActor(), busy=[1])
    s.finished(TrainResult(0, state(3), [0.1] * 3, stopped=False))
    s.publish(state(9))
    assert s.chunk_args(0)[0].version == 9


def test_the_sample_buffer_keeps_the_newest_under_its_cap():
    one = sample().nbytes
    buffer = SampleBuffer(max_bytes=2 * one)
    buffer.add([sample(), sample(), sample()])
    assert len(buffer) == 2 and [i for i, _ in buffer.items] == [1, 2]
    assert len(buffer.newer_than(1)) == 1
    buffer.add([sample(n=64, width=4096)])  # larger than the whole cap: skipped
    assert len(buffer) == 2


def test_a_trained_head_ships_only_when_its_worker_measured_it_better_than_the_shipped_one():
    s, events = spot(holdout_every=8, ship_min_gain=0.05)
    s.buffer.add([sample()])
    actor = FakeActor()
    s.start(1, actor, busy=[0])
    _, _, _, _, holdout, reference, gain, lr_scale, _, _ = actor.train_drafter.calls[0]
    assert (holdout, reference.version, gain, lr_scale) == (8, 0, 0.05, 1.0)  # the copy to beat is sent once
    s.lr_scale = 10.0  # catch-up: the next chunks train at 10x the rate
    s.finished(TrainResult(1, state(4), [0.5] * 4, False, held_out=(2.0, 2.2), held_out_against=0, ship=True))
    assert s.shipped.version == 4 and s.state.version == 4
    assert events[-1][0] == "spot_done" and events[-1][2]["shipped"] is True
    # the worker's copy is now version 4 (it shipped it itself): nothing is sent again
    s.buffer.add([sample()])
    s.start(1, actor, busy=[0])
    assert actor.train_drafter.calls[1][5] is None and actor.train_drafter.calls[1][7] == 10.0
    # no better on held-out samples: training goes on from it, the engines keep version 4
    s.finished(TrainResult(1, state(8), [0.4] * 4, False, held_out=(2.2, 2.24), held_out_against=4, ship=False))
    assert s.state.version == 8 and s.shipped.version == 4
    state_sent, _, _ = s.chunk_args(0)
    assert state_sent.version == 8  # another worker continues the trained state, not the shipped one
    assert s.reference_for(0).version == 4  # and compares with the shipped one
    # compared with a version that is no longer the shipped one (a head published meanwhile)
    s.publish(state(20))
    assert s.state.version == s.shipped.version == 20
    s.buffer.add([sample()])
    s.start(1, actor, busy=[0])
    assert actor.train_drafter.calls[2][5].version == 20
    s.finished(TrainResult(1, state(24), [0.3] * 4, False, held_out=(1.0, 2.9), held_out_against=4, ship=True))
    assert s.state.version == 24 and s.shipped.version == 20
    s.buffer.add([sample()])
    s.start(1, actor, busy=[0])
    assert actor.train_drafter.calls[3][5].version == 20  # its copy moved to 24 unshipped: sent again
    tally = s.take_tally()
    assert (tally.shipped, tally.held) == (1, 2) and tally.held_out[0] == (2.0, 2.2)


def test_a_worker_holds_out_every_nth_sample_and_compares_the_heads_on_them():
    """The worker side of the gate (no Ray: the actor class called directly)."""
    worker, head, samples = spot_worker(prompts=8, max_new_tokens=24)
    start = DrafterState.of(head)
    result = worker.train_drafter(start, samples, 3, 1 << 30, holdout_every=4, shipped=start)
    assert len(worker.spot.learning.held_out) == 2 and len(worker.spot.learning.train_buffer) == 6
    assert len(result.losses) == 3 and result.held_out_against == 0
    shipped_acc, trained_acc = result.held_out
    assert 0.0 <= shipped_acc <= 4.0 and 0.0 <= trained_acc <= 4.0
    assert result.ship == (trained_acc > shipped_acc)
    assert worker.spot.learning.reference.version == (3 if result.ship else 0)
    never = worker.train_drafter(None, [], 2, 1 << 30, holdout_every=4, ship_min_gain=5.0)  # cannot beat by 5
    assert not never.ship and never.held_out is not None
    plain = worker.train_drafter(None, [], 2, 1 << 30)  # nothing held out asked: no comparison, it ships
    assert plain.held_out is None and plain.ship and len(plain.losses) == 2


def test_a_state_whose_comparison_a_stop_cut_short_is_judged_by_the_next_chunk_before_it_trains():
    s, events = spot(holdout_every=8)
    s.buffer.add([sample()])
    actor = FakeActor()
    s.start(1, actor, busy=[0])
    assert actor.train_drafter.calls[0][8] is False  # nothing to judge yet
    # trained 4 steps, then stopped during the comparison: neither shipped nor counted as held back
    s.finished(TrainResult(1, state(4), [0.5] * 4, True, held_out=None, held_out_against=0, ship=False, judged=False))
    assert s.unjudged and s.state.version == 4 and s.shipped.version == 0
    assert s.take_tally().held == 0
    s.buffer.add([sample()])
    s.start(1, actor, busy=[0])
    assert actor.train_drafter.calls[1][8] is True  # judge first
    # stopped again before judging anything: still unjudged
    s.finished(TrainResult(1, state(4), [], True, held_out=None, held_out_against=0, ship=False, judged=False))
    assert s.unjudged and s.shipped.version == 0
    s.start(1, actor, busy=[0])
    # judged first and better: shipped as it is, with no new steps
    s.finished(TrainResult(1, state(4), [], False, held_out=(1.0, 1.5), held_out_against=0, ship=True))
    assert not s.unjudged and s.shipped.version == 4 and s.take_tally().shipped == 1
    s.start(1, actor, busy=[0])
    assert actor.train_drafter.calls[3][8] is False
    # nothing held out: there is never anything to judge first
    plain, _ = spot()
    plain.unjudged = True
    plain.buffer.add([sample()])
    plain.start(0, actor, busy=[1])
    assert actor.train_drafter.calls[4][8] is False


def test_a_stop_during_the_comparison_leaves_the_state_unjudged_and_the_next_chunk_judges_it_first():
    """Worker side (the actor class called directly): the comparison yields to a stop like the
    training steps do, and a later chunk judges the state before it trains."""
    worker, head, samples = spot_worker(prompts=8, max_new_tokens=24)
    start = DrafterState.of(head)
    worker.train_drafter(start, samples, 1, 1 << 30, holdout_every=4, shipped=start, ship_min_gain=5.0)
    train = worker.spot.learning.trainer.train

    def train_then_stop(*args, **kwargs):  # the stop arrives while the last step runs
        results = train(*args, **kwargs)
        worker.stop_training()
        return results

    worker.spot.learning.trainer.train = train_then_stop
    cut = worker.train_drafter(None, [], 2, 1 << 30, holdout_every=4, ship_min_gain=-10.0)
    assert len(cut.losses) == 2 and cut.held_out is None and not cut.judged and not cut.ship
    assert worker.spot.learning.reference.version == 0  # the copy to beat is unchanged
    worker.spot.learning.trainer.train = train
    lost = worker.train_drafter(None, [], 2, 1 << 30, holdout_every=4, ship_min_gain=5.0, judge_first=True)
    assert lost.judged and not lost.ship and len(lost.losses) == 2  # judged first, lost, trained on
    won = worker.train_drafter(None, [], 2, 1 << 30, holdout_every=4, ship_min_gain=-10.0, judge_first=True)
    assert won.judged and won.ship and won.losses == [] and won.held_out is not None  # ships as it is
    assert won.state.version == lost.state.version == worker.spot.learning.reference.version


def test_a_stop_that_overtakes_its_chunk_still_stops_it_and_an_old_stop_stops_no_later_chunk():
    """The actor is threaded and a chunk's call carries its samples: its stop can run first."""
    worker, head, samples = spot_worker(prompts=4, max_new_tokens=16)
    worker.stop_training(7)  # chunk 7's stop, before chunk 7 runs
    early = worker.train_drafter(DrafterState.of(head), samples, 3, 1 << 30, chunk=7)
    assert early.losses == [] and early.stopped
    later = worker.train_drafter(None, [], 3, 1 << 30, chunk=9)  # chunk 7's stop does not reach chunk 9
    assert len(later.losses) == 3 and not later.stopped


def test_a_chunk_in_the_update_gap_gets_the_rollouts_step_budget_left():
    s, events = spot(steps_per_chunk=4, max_steps_per_rollout=10)
    s.buffer.add([sample()])
    actor = FakeActor()
    s.start(0, actor, busy=[1])
    s.finished(TrainResult(0, state(4), [0.1] * 4, stopped=False))
    assert s.can_train() and s.steps_left() == 6
    assert not s.should_start(others_generating=False, work_waiting=False)  # not in a rollout's tail
    s.start(0, actor, busy=[], steps=s.steps_left())  # the rollout ended: train through the update
    assert actor.train_drafter.calls[1][2] == 6 and events[-1][2]["steps"] == 6
    s.finished(TrainResult(0, state(10), [0.1] * 6, stopped=False))
    assert not s.can_train()  # budget spent until the next rollout
    s.start_rollout()
    assert s.can_train()


def test_a_worker_with_a_drafter_lm_records_its_completions_and_trains_a_copy_of_the_lm():
    """The drafter LM on the spot-training path (the actor class called directly, no Ray): the
    session hands over its finished sequences, a chunk trains a copy behind the held-out gate, and
    the drafting LM changes only when the coordinator's broadcast loads a state."""
    from tailspec.drafter.lm_trainer import DraftLMTrainingConfig, SequenceSample
    from tailspec.drafter.small_lm import SmallLMDrafter
    from tailspec.rollout import RolloutConfig, SamplingParams
    from tailspec.rollout.handoff import InboxItem
    from tailspec.testing import random_prompts, tiny_random_model
    from tailspec.workers.worker import RolloutWorker

    model = tiny_random_model("qwen2", seed=1)
    drafter = SmallLMDrafter(tiny_random_model("qwen2", seed=2, num_layers=1))
    training = DraftLMTrainingConfig(learning_rate=1e-3, batch_size=4)
    worker = RolloutWorker(
        0, model, RolloutConfig(strategy="chain:3"), eos_token_ids=[1], drafter=drafter, training_config=training
    )
    assert worker.part is drafter.lm
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    items = [InboxItem(k, p, params) for k, p in enumerate(random_prompts(8, seed=4))]
    *finished, end = list(worker.serve_stream(items, total=len(items)))
    assert all(isinstance(s, SequenceSample) for s in end.samples) and len(end.samples) == 8
    by_key = {k: o for f in finished for k, o in zip(f.indices, f.outputs)}
    assert sorted(s.tokens.tolist() for s in end.samples) == sorted(
        o.prompt_ids + o.completion_ids for o in by_key.values()
    )
    start = DrafterState.of(drafter.lm)
    result = worker.train_drafter(start, end.samples, 3, 1 << 30, holdout_every=4, shipped=start, ship_min_gain=-10.0)
    assert len(result.losses) == 3 and result.ship and result.held_out is not None
    assert result.state.version == 3 and drafter.version == 0  # the drafting LM waits for the broadcast
    worker.set_drafter(result.state)
    assert drafter.version == 3 and worker.versions() == (0, 3)
    trained = result.state.weights
    assert all(torch.equal(v, trained[f"model.{k}"]) for k, v in drafter.model.state_dict().items())
    _, end = list(worker.serve_stream(items[:2], total=2))[-2:]
    assert end.drafter_version == 3 and len(end.samples) == 2


def test_a_worker_with_streaming_heads_trains_a_copy_of_the_heads_and_leaves_the_lm_alone():
    """Streaming heads on the spot-training path: the worker records the finished sequences, a
    chunk trains a copy of the heads (the drafter LM frozen) judged by the streamed chain's
    held-out score, and the drafting heads change only on the broadcast."""
    from tailspec.drafter.part_trainer import PartFitConfig
    from tailspec.drafter.small_lm import SmallLMDrafter
    from tailspec.drafter.streaming import StreamingHeads
    from tailspec.rollout import RolloutConfig, SamplingParams
    from tailspec.rollout.handoff import InboxItem
    from tailspec.testing import random_prompts, tiny_random_model
    from tailspec.workers.worker import RolloutWorker

    model = tiny_random_model("qwen2", seed=1)
    lm = tiny_random_model("qwen2", seed=2, num_layers=1)
    drafter = SmallLMDrafter(lm, streaming_heads=StreamingHeads(lm.config.hidden_size, 2))
    worker = RolloutWorker(
        0, model, RolloutConfig(strategy="chain:3"), eos_token_ids=[1], drafter=drafter, training_config=PartFitConfig()
    )
    assert worker.part is drafter.heads and worker.records_sequences
    lm_before = {k: v.clone() for k, v in lm.state_dict().items()}
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    items = [InboxItem(k, p, params) for k, p in enumerate(random_prompts(8, seed=4))]
    *_, end = list(worker.serve_stream(items, total=len(items)))
    assert len(end.samples) == 8
    start = DrafterState.of(drafter.heads)
    result = worker.train_drafter(start, end.samples, 3, 1 << 30, holdout_every=4, shipped=start, ship_min_gain=-10.0)
    assert len(result.losses) == 3 and result.ship and result.held_out is not None
    assert result.state.version == 3 and drafter.heads.version == 0  # the drafting heads wait for the broadcast
    worker.set_drafter(result.state)
    assert drafter.version == 3 and worker.versions() == (0, 3)
    torch.testing.assert_close(drafter.heads.blocks[0].weight, result.state.weights["blocks.0.weight"])
    assert drafter.heads.blocks[0].weight.abs().sum() > 0  # zero-initialised, trained since
    assert all(torch.equal(v, lm_before[k]) for k, v in lm.state_dict().items())  # the LM is not trained


def test_a_worker_s_eagle3_head_drafts_for_the_engine_s_dtype_copy():
    """With ``RolloutConfig.dtype`` the worker's engine decodes a copy of the policy: the head's
    drafter reads the copy's embeddings (as ``SpecRollout``'s does), losslessly, and still records
    the features it trains on; a policy sync reaches the copy."""
    from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
    from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
    from tailspec.rollout.handoff import InboxItem
    from tailspec.testing import random_prompts, tiny_random_model
    from tailspec.workers.worker import RolloutWorker

    model = tiny_random_model("llama", seed=1)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(model.config)).eval()
    worker = RolloutWorker(0, model, RolloutConfig(strategy="chain:3", dtype="bfloat16"), [0], drafter=head)
    assert worker.eagle_drafter.embed is worker.engine.model.get_input_embeddings()
    assert worker.engine.model is not model and worker.eagle_drafter.embed.weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    prompts = random_prompts(4, seed=4)
    for step in range(2):
        items = [InboxItem(k, p, params) for k, p in enumerate(prompts)]
        *finished, end = list(worker.serve_stream(items, total=len(items)))
        got = {k: o.completion_ids for f in finished for k, o in zip(f.indices, f.outputs)}
        want = RolloutEngine(model, RolloutConfig(dtype="bfloat16")).generate(prompts, params)
        assert [got[k] for k in range(len(prompts))] == [o.completion_ids for o in want]
        assert worker.engine.stats.drafted_tokens > 0 and len(end.samples) > 0
        embed = worker.engine.model.get_input_embeddings().weight  # recast in place after a sync
        assert worker.eagle_drafter.embed.weight is embed
        assert torch.equal(embed, model.get_input_embeddings().weight.to(torch.bfloat16))
        worker.set_policy({k: v * 1.5 for k, v in model.state_dict().items()}, version=step + 1)
