"""Speculative steps launched from state on the device (rollout/spec/device_step.py): a ``chain:k``
or ``tree:d,k,n`` step of a drafter that drafts there is launched before the one before it is
committed. Its tokens are plain decoding's; what changes is when the host learns them."""

import numpy as np
import pytest
import torch
from rollout_helpers import (
    EOS,
    cached_model,
    generate_committing_each_step,
    plain_greedy_outputs,
    random_prompts,
    serve_handing_one_over,
    with_growth,
)

from tailspec.draft_contract import DraftTree
from tailspec.kernels.dispatch import kernel_backend
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.attention import SequenceSlice
from tailspec.rollout.model.device_inputs import BlockTables, device_inputs
from tailspec.rollout.model.runner import ModelRunner
from tailspec.rollout.spec.device_step import DeviceSteps
from tailspec.rollout.spec.device_tree import tree_rows
from tailspec.testing import across_architectures, perturbed_copy, stopping_params

DRAFTERS = {"agreeing": 0.05, "disagreeing": 0.3}  # perturbation of the target's weights


def _engine(model, drafter, **config) -> RolloutEngine:
    config = {"block_size": 4, "kv_cache_tokens": 4096, "strategy": "chain:3", **config}
    return RolloutEngine(model, RolloutConfig(**config), drafter=drafter, eos_token_ids=[EOS])


def _generate(model, drafter, prompts, params, committed: bool = False, **config):
    """Outputs and engine (``committed``: every step committed before the next, each launched from
    the host's state)."""
    engine = _engine(model, drafter, **config)
    outs = generate_committing_each_step(engine, prompts, params) if committed else engine.generate(prompts, params)
    assert not engine.has_unfinished() and engine.in_flight is None
    return outs, engine


@pytest.mark.parametrize(
    ("arch", "drafter", "graph_backend", "strategy"),
    across_architectures(
        [
            ("agreeing", "none", "chain:3"),
            ("disagreeing", "none", "chain:3"),
            ("agreeing", "eager", "chain:3"),
            ("disagreeing", "eager", "chain:3"),
            ("agreeing", "none", "tree:3,2,6"),
            ("disagreeing", "eager", "tree:4,3,10"),
        ]
    ),
)
def test_greedy_steps_on_the_device_equal_plain_decoding(arch, drafter, graph_backend, strategy):
    """Sequences stopping at different steps, each for its own reason (a stop token, max_new_tokens):
    the tokens past a stop that a step computed are dropped, and every completion, finish reason
    and logprob is plain decoding's; padded to a captured bucket (eager graphs) too. A tree's
    accepted nodes, wherever they were written, are where the next step reads them."""
    model = cached_model(arch)
    draft = perturbed_copy(model, noise=DRAFTERS[drafter], seed=7)
    prompts = random_prompts(7, seed=31, min_len=2, max_len=14)
    params = stopping_params(model, prompts, n=22)
    want = plain_greedy_outputs(model, prompts, params)
    got, engine = _generate(model, draft, prompts, params, graph_backend=graph_backend, strategy=strategy)
    assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    stats = engine.stats
    assert stats.overlapped_steps > stats.spec_steps // 2 and stats.dropped_rows > 0
    assert stats.generated_tokens == sum(len(o.completion_ids) for o in got)
    assert sum(o.num_accepted for o in got) > 0 if drafter == "agreeing" else True
    # every block comes back (but a captured forward's scratch block), those reserved for rejected drafts too
    allocator = engine.runner.cache.allocator
    assert allocator.num_free == allocator.num_blocks - (engine.runner.scratch_slot >= 0)


def test_each_step_is_read_after_the_next_is_launched(monkeypatch):
    """What the device state is for: step N is waited for only once step N + 1 is queued. Every read
    of a chain step follows a later launch, except the reads that end a call (nothing left to launch)."""
    model = cached_model("llama")
    events: list[tuple[str, object]] = []
    launch, read = DeviceSteps.launch, DeviceSteps.read

    def logged_launch(self, *args):
        launched = launch(self, *args)
        events.append(("launch", launched))
        return launched

    def logged_read(self, launched):
        events.append(("read", launched))
        return read(self, launched)

    monkeypatch.setattr(DeviceSteps, "launch", logged_launch)
    monkeypatch.setattr(DeviceSteps, "read", logged_read)
    prompts = random_prompts(3, seed=34, min_len=4, max_len=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    _generate(model, perturbed_copy(model, noise=0.05, seed=7), prompts, params)
    launches = [step for kind, step in events if kind == "launch"]
    reads = [(i, step) for i, (kind, step) in enumerate(events) if kind == "read"]
    assert len(launches) >= 4 and [step for _, step in reads] == launches  # each read once, in order
    for i, step in reads[:-1]:
        assert events[i - 1][0] == "launch" and events[i - 1][1] is launches[launches.index(step) + 1]


def test_preemption_admission_and_the_context_limit_under_the_loop_stay_exact():
    """Fewer slots than prompts (admissions mid-run), a pool too small for all of them (preemptions)
    and a context limit a full acceptance could pass: each commits the step in flight first (and a
    step past the limit is drafted from the host's text), and the tokens do not change."""
    model = cached_model("qwen3")
    draft = perturbed_copy(model, noise=0.05, seed=7)
    prompts = random_prompts(8, seed=32, min_len=3, max_len=12)
    params = stopping_params(model, prompts, n=24)
    small = {"max_num_seqs": 3, "num_blocks": 18, "max_model_len": 36}
    want, plain = _generate(model, draft, prompts, params, committed=True, **small)
    got, engine = _generate(model, draft, prompts, params, **small)
    assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
    assert plain.stats.preemptions > 0 and engine.stats.preemptions > 0
    assert 0 < engine.stats.overlapped_steps < engine.stats.spec_steps


def test_release_abort_and_handoff_commit_the_step_in_flight_first():
    model = cached_model("llama")
    draft = perturbed_copy(model, noise=0.05, seed=7)
    prompts = random_prompts(3, seed=35, min_len=3, max_len=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    want = RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=4096)).generate(prompts, params)
    engine = _engine(model, draft)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(5):
        assert engine.step() == []
    assert engine.in_flight is not None and engine.stats.overlapped_steps > 0
    partial = engine.release(ids[0])  # what the step in flight emitted belongs to what is handed over
    assert 5 < len(partial.output_ids) < 30 and partial.output_ids == want[0].completion_ids[: len(partial.output_ids)]
    engine.abort(ids[1])
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished == [ids[2]] and engine.pop_output(ids[2]).completion_ids == want[2].completion_ids
    aborted = engine.pop_output(ids[1])
    assert (
        aborted.finish_reason == "abort"
        and aborted.completion_ids == want[1].completion_ids[: len(aborted.completion_ids)]
    )
    resumed = _engine(model, draft)
    rid = resumed.add_request(prompts[0], params, resume=partial)
    while resumed.has_unfinished():
        resumed.step()
    assert resumed.pop_output(rid).completion_ids == want[0].completion_ids
    for e in (engine, resumed):
        assert e.runner.cache.allocator.num_free == e.runner.cache.allocator.num_blocks


def test_adaptive_moves_between_chains_trees_and_plain_steps_and_stays_exact():
    """``adaptive`` planning ``none``, ``chain:2``, ``chain:4`` and its tree in turn: a chain or a
    tree is launched from the step in flight whatever its shape (the host reserves for the one in
    flight's; the drafter catches up on a tree's emitted tokens), a plain step commits the one in
    flight first; the tokens are plain decoding's."""
    model = cached_model("qwen2")
    draft = perturbed_copy(model, noise=0.05, seed=7)
    prompts = random_prompts(6, seed=37, min_len=2, max_len=12)
    params = stopping_params(model, prompts, n=26)
    want = plain_greedy_outputs(model, prompts, params)
    config = RolloutConfig(strategy="adaptive", block_size=4, kv_cache_tokens=4096)
    engine = RolloutEngine(model, config, drafter=draft, eos_token_ids=[EOS])
    by_name = {str(arm): arm for arm in engine.selector.arms}
    tree = next(name for name in by_name if name.startswith("tree:"))
    cycle, plans = ["chain:4", tree, "chain:2", tree, tree, "none", "chain:2", "chain:4", "none"], iter(range(10**6))
    engine.selector.choose = lambda n, remaining, lag, context: by_name[cycle[next(plans) % len(cycle)]]
    got = engine.generate(prompts, params)
    assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
    stats = engine.stats
    assert stats.overlapped_steps > stats.spec_steps // 2 and stats.spec_steps > stats.decode_steps // 2
    assert stats.accepted_tokens > 0


def test_serving_an_inbox_with_chains_on_the_device_matches_plain_decoding():
    """``serve`` (what a Ray worker runs) with chains on the device: requests joining the running
    batch (their prefill launched beside the chain in flight), one handed back mid-run and finished
    by another engine; every completion is plain decoding's and every block is free at the end."""
    model = cached_model("llama")
    draft = perturbed_copy(model, noise=0.05, seed=7)
    prompts = random_prompts(8, seed=40, min_len=2, max_len=12)
    params = stopping_params(model, prompts, n=22)
    want = plain_greedy_outputs(model, prompts, params)
    engine, other = _engine(model, draft), _engine(model, draft)
    got = serve_handing_one_over(engine, other, prompts, params, [len(o.completion_ids) for o in want])
    assert engine.stats.overlapped_steps > 0
    assert [got[i].completion_ids for i in range(len(prompts))] == [o.completion_ids for o in want]
    for e in (engine, other):
        allocator = e.runner.cache.allocator
        assert allocator.num_free == allocator.num_blocks
        assert e.drafter.allocator.num_free == e.drafter.allocator.num_blocks


def test_position_keyed_samples_are_plain_decodings_on_the_device():
    """A position-keyed row's token is the argmax of its scores perturbed by noise keyed on its
    completion index, which a step on the device computes from the lengths there: every token is
    the one plain decoding draws, whatever was drafted."""
    model = cached_model("qwen2")
    draft = perturbed_copy(model, noise=0.05, seed=7)
    prompts = random_prompts(4, seed=36, min_len=3, max_len=9)
    params = [SamplingParams(temperature=0.8, seed=i, noise="position", max_new_tokens=24) for i in range(4)]
    want = plain_greedy_outputs(model, prompts, params)
    got, engine = _generate(model, draft, prompts, params)
    assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert engine.stats.overlapped_steps > engine.stats.spec_steps // 2 and engine.stats.accepted_tokens > 0


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["chain", "tree"])
def test_device_inputs_equal_the_hosts_padded_inputs_for_the_same_lengths(kernels, layout):
    """The inputs a replay reads are the same whether the lengths were known on the host
    (``padded_inputs``) or only on the device (``device_inputs``), for a chain's rows and for
    draft trees' (positions by depth, each row seeing its ancestors)."""
    model = cached_model("llama")
    runner = ModelRunner(model, num_blocks=64, block_size=4, graph_pool=None)
    runner.scratch_slot = 63 * 4
    tables = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    cached, new, shape = [9, 6, 15], 3, (4, 4, 24)
    trees = [DraftTree([1, 2], [-1, -1]), DraftTree([1, 2], [-1, 0]), DraftTree([3, 4], [-1, -1])]
    tree = None
    if layout == "tree":
        parents = torch.tensor([t.parents for t in trees])
        tree = tree_rows(parents, depth=2)
        slices = [SequenceSlice(tb, c, new, t.ancestor_mask()) for tb, c, t in zip(tables, cached, trees)]
        positions = [c + d for c, t in zip(cached, trees) for d in (0, *t.depths)]
    else:
        slices = [SequenceSlice(t, c, new) for t, c in zip(tables, cached)]
        positions = [c + r for c in cached for r in range(new)]
    ids = np.arange(len(positions)) + 1
    with kernel_backend(kernels, ("attention",)):
        from tailspec.rollout.model.graph_pool import GraphKey

        host, _, _ = runner.padded_inputs(slices, ids.tolist(), positions, GraphKey(*shape))
        use_plan = "plan.block_tables" in host
        device, _ = device_inputs(
            runner.cache,
            BlockTables(tables),
            torch.tensor(cached),
            torch.from_numpy(ids),
            new,
            shape,
            63,
            use_plan,
            tree,
        )
    assert use_plan == (kernels == "triton") and sorted(device) == sorted(host)
    for name, tensor in host.items():
        assert device[name].shape == tensor.shape and device[name].dtype == tensor.dtype, name
        if name == "gather_slots" and tensor.numel():  # keys no row sees: masked, whatever slot they name
            visible = host["mask"][:, 0].any(dim=1)
            assert torch.equal(device[name][visible], tensor[visible])
            continue
        assert torch.equal(device[name], tensor), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("strategy", "temperature"), [("chain:4", 0.0), ("chain:4", 1.0), ("tree:4,2,8", 1.0)])
def test_on_cuda_a_step_launched_on_the_device_does_not_wait_for_it(strategy, temperature):
    """torch's sync debug mode flags every call that waits for the device: a warmed chain
    or tree step (captured graphs) waits for none (its read of the step before is an event's wait);
    only prefills and the first, host-read step after them do (a tree's, once a level and to verify).
    Greedy, its tokens are plain decoding's."""
    from tailspec.testing import tiny_random_model, with_synchronizations

    model = tiny_random_model("llama", seed=1).cuda()
    drafter = perturbed_copy(model, noise=0.05, seed=7)
    engine = RolloutEngine(model, RolloutConfig(strategy=strategy), drafter=drafter)
    prompts, params = random_prompts(3, seed=4), SamplingParams(max_new_tokens=40, temperature=temperature, seed=3)
    engine.generate(prompts, params)  # captures every graph the measured call replays
    counters = ("prefill_steps", "spec_steps", "overlapped_steps")
    (outs, waits), (prefills, specs, overlapped) = with_growth(
        engine, counters, lambda: with_synchronizations(lambda: engine.generate(prompts, params))
    )
    host_read_waits = 2 if strategy.startswith("chain") else 1 + int(strategy.split(":")[1].split(",")[0])
    assert overlapped > specs // 2 and waits <= prefills + host_read_waits * (specs - overlapped), waits
    if temperature == 0.0:
        plain = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
        assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
