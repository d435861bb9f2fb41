"""Mirror speculative decoding is lossless with every executor, and its pieces do what they say."""

import functools

import pytest
import torch
from rollout_helpers import cached_model, chi_square_pvalue, random_prompts
from test_spec_greedy import bad_drafter, good_drafter
from test_spec_sampling import SETTINGS, V, _processed, drafter_model, target
from test_spec_sampling import drafter as eagle3_or_model

from tailspec.draft_contract import BranchView, DraftRequest, DraftShape, DraftTree
from tailspec.drafter.small_lm import SmallLMDrafter
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.mirror.executors import ExecutorError
from tailspec.rollout.mirror.hosted import SeqSnapshot
from tailspec.rollout.mirror.pipeline import agreeing_prefix, plan_branches
from tailspec.rollout.mirror.process_executor import ProcessExecutor
from tailspec.rollout.model.early_exit import EarlyExit, exit_agreement
from tailspec.rollout.params import MirrorConfig
from tailspec.testing import ARCHITECTURES, perturbed_copy

PROMPT = [3, 7, 2, 9, 5]


def mirror_engine(model, strategy: str, drafter, executor: str, **cfg) -> RolloutEngine:
    config = RolloutConfig(strategy=strategy, mirror=MirrorConfig(executor=executor), **cfg)
    return RolloutEngine(model, config, drafter=drafter)


# -- planning ------------------------------------------------------------------------------
def test_plan_trusts_the_draft_then_adds_the_early_exit_rejection():
    chain = DraftTree.chain([10, 11, 12])
    agree = [[10, 5], [11, 5], [12, 5], [40, 41]]  # the early exit agrees with every draft token
    assert plan_branches(chain, agree, 1) == [[10, 11, 12, 40]]
    assert plan_branches(chain, agree, 2) == [[10, 11, 12, 40], [10, 11, 12, 41]]
    doubt = [[10, 5], [20, 11], [12, 5], [40, 41]]  # ... but would reject node 1 and emit 20
    assert plan_branches(chain, doubt, 1) == [[10, 11, 12, 40]]
    assert plan_branches(chain, doubt, 2) == [[10, 11, 12, 40], [10, 20]]
    assert plan_branches(chain, doubt, 3) == [[10, 11, 12, 40], [10, 11, 12, 41], [10, 20]]


def test_plan_follows_a_tree_s_first_listed_path():
    tree = DraftTree([10, 30, 11], [-1, -1, 0])  # root -> 10 -> 11, root -> 30
    topk = [[30, 10], [11, 9], [50, 51], [60, 61]]
    # the early exit prefers the sibling 30 at the root: a sibling is accepted, never a correction
    assert plan_branches(tree, topk, 2) == [[10, 11, 60], [10, 11, 61]]
    assert plan_branches(DraftTree(), [[7, 8]], 2) == [[7], [8]]


def test_agreeing_prefix():
    assert agreeing_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert agreeing_prefix([1, 2], [1, 2, 3]) == 2
    assert agreeing_prefix([], [1]) == 0


def test_branch_view_reads_the_sequence_then_its_assumed_tokens():
    engine = RolloutEngine(cached_model("llama"), RolloutConfig())
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
    seq = engine.requests.seqs[rid]
    view = BranchView(seq, [8, 9])
    assert view.num_tokens == 5 and [view.token_at(i) for i in range(5)] == [5, 6, 7, 8, 9]
    assert view.output_ids == [8, 9] and view.seq_id == rid and view.generator is None


# -- the early exit ---------------------------------------------------------------------------
def test_early_exit_reads_the_same_forward_it_runs_in():
    model = cached_model("qwen2")
    ids = torch.tensor([[4, 9, 17, 3, 22]])
    seen = []
    with torch.no_grad(), EarlyExit(model, 1, 3).tap([2, 4], seen.append):
        model(input_ids=ids)
        model(input_ids=ids)  # fires once per tap
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[1][0]
    want = model.lm_head(model.model.norm(hidden)).topk(3, dim=-1).indices[[2, 4]].tolist()
    assert seen == [want]


def test_exit_agreement_reports_every_layer_and_k():
    model = cached_model("llama")
    rates = exit_agreement(model, [[4, 9, 17, 3, 22, 8, 1]], [3], [1, 2])
    n = model.config.num_hidden_layers
    assert sorted(rates) == list(range(1, n)) and all(0 <= r[1] <= r[2] <= 1 for r in rates.values())


@pytest.mark.parametrize("layer", [0, 4, "2"])
def test_exit_layer_outside_the_model_is_refused(layer):
    with pytest.raises(ValueError, match="mirror.exit_layer must be"):
        RolloutEngine(
            cached_model("llama"),
            RolloutConfig(strategy="mirror:chain:2,k=1", mirror={"exit_layer": layer, "executor": "inline"}),
            drafter=good_drafter("llama"),
        )


def test_mirror_config_errors_name_the_field():
    with pytest.raises(ValueError, match="executor must be one of"):
        MirrorConfig(executor="gpu")
    with pytest.raises(ValueError, match="threads must be None or an int >"):
        MirrorConfig(threads=1, draft_threads=1)
    with pytest.raises(ValueError, match="needs a drafter model"):
        RolloutEngine(cached_model("llama"), RolloutConfig(strategy="mirror:chain:2,k=1"))
    with pytest.raises(ValueError, match="'stream' needs the target on a CUDA device"):
        mirror_engine(cached_model("llama"), "mirror:chain:2,k=1", good_drafter("llama"), "stream")


# -- greedy: token for token ----------------------------------------------------------------
def _plain(arch, prompts, params):
    return RolloutEngine(cached_model(arch), RolloutConfig()).generate(prompts, params)


def _assert_same(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.completion_ids == b.completion_ids, f"request {i} differs"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


# every strategy on both executors, and every architecture on both executors with a chain and
# another strategy: the mirror's logic is the same for each architecture, whose early exit (a
# hook on its decoder layers) every case runs
MIRROR_CASES = [
    (ARCHITECTURES[(i + j) % len(ARCHITECTURES)], strategy, drafter, executor)
    for j, executor in enumerate(["inline", "thread"])
    for i, (strategy, drafter) in enumerate(
        [
            ("mirror:chain:4,k=2", "good"),
            ("mirror:chain:2,k=1", "good"),
            ("mirror:chain:3,k=3", "bad"),
            ("mirror:tree:3,2,6,k=2", "good"),
        ]
    )
]


@pytest.mark.parametrize("arch,strategy,drafter,executor", MIRROR_CASES)
def test_greedy_mirror_matches_plain_decoding(arch, strategy, drafter, executor):
    prompts = random_prompts(5, seed=len(strategy))
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    draft = {"good": good_drafter, "bad": bad_drafter, "self": cached_model}[drafter](arch)
    engine = mirror_engine(cached_model(arch), strategy, draft, executor)
    _assert_same(engine.generate(prompts, params), _plain(arch, prompts, params))
    stats = engine.drafters.mirror.pipeline.stats
    assert stats.early_exits > 0 and stats.branches > 0
    if drafter != "bad" and not strategy.endswith("k=1"):
        assert stats.ready > 0  # some rounds ran on a draft made beside the target
    if drafter == "self":  # the target as its own drafter: every continuation is right
        assert stats.ready_continued == stats.ready > 0 and stats.early_exits == 0
    allocator = engine.drafters.mirror.pipeline.drafter.allocator
    assert allocator.num_free == allocator.num_blocks  # forks freed
    engine.close()


@pytest.mark.parametrize("strategy", ["mirror:chain:4,k=0", "mirror:chain:3,k=2"])
def test_shapes_only_the_draft_thread_met_are_captured_between_steps_and_stay_exact(strategy):
    """A draft thread runs the buckets the engine's thread never captured without a graph (on a
    GPU: eagerly, beside the target); the engine's thread captures them once the branches are in,
    from padding alone, so the same rollout again runs every drafter forward from a bucket."""
    arch = "llama"
    engine = mirror_engine(cached_model(arch), strategy, good_drafter(arch), "thread", graph_backend="eager")
    prompts, params = random_prompts(4, seed=5), SamplingParams(max_new_tokens=24, temperature=0.0)
    want = _plain(arch, prompts, params)
    pool = engine.drafters.mirror.pipeline.drafter.runner.graph_pool
    _assert_same(engine.generate(prompts, params), want)
    missed_first = pool.stats.uncaptured
    assert missed_first > 0  # the draft thread met shapes of its own
    _assert_same(engine.generate(prompts, params), want)
    assert pool.stats.uncaptured == missed_first and pool.take_missed() == {}
    engine.close()


def test_greedy_mirror_in_a_process_matches_plain_decoding_and_follows_weight_changes():
    arch = "qwen3"
    prompts = random_prompts(6, seed=11)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    draft = perturbed_copy(cached_model(arch), noise=0.3, seed=7)
    engine = mirror_engine(cached_model(arch), "mirror:chain:3,k=2", draft, "process")
    _assert_same(engine.generate(prompts, params), _plain(arch, prompts, params))
    assert engine.drafters.mirror.pipeline.stats.ready > 0
    with torch.no_grad():  # the drafter trains in this process: the child must draft with the new weights
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.drafters.mirror.pipeline.executor.refresh()
    request = [DraftRequest(greedy_view(prompts[0], 99), 3)]
    fresh = SmallLMDrafter(draft, kv_cache_tokens=256)
    assert (
        engine.drafters.mirror.pipeline.drafter.propose(request, DraftShape(3))[0].tokens
        == fresh.propose(request, DraftShape(3))[0].tokens
    )
    engine.close()


def _run_alternating(engine: RolloutEngine, prompts, params, strategies) -> list:
    """Generate ``prompts``, switching the strategy before every step (round robin)."""
    ids = [engine.add_request(p, params) for p in prompts]
    step = 0
    while engine.has_unfinished():
        engine.set_strategy(strategies[step % len(strategies)])
        engine.step()
        step += 1
    return [engine.pop_output(i) for i in ids]


def test_serial_steps_draft_on_the_mirror_s_drafter_so_switching_costs_no_second_catch_up():
    """Serial chain steps between mirror steps draft in the draft process too (one drafter state):
    the in-process drafter is never asked, output stays token for token plain decoding's, and a
    drafter whose process died mid-rollout hands over to the in-process one without a loss."""
    arch = "qwen2"
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    # the target as its own drafter: every continuation is right, so mirror steps after mirror
    # steps run on ready drafts
    engine = mirror_engine(cached_model(arch), "mirror:chain:3,k=0", cached_model(arch), "process")
    asked = []
    real_propose = engine.drafter.propose
    engine.drafter.propose = lambda requests, shape: asked.append(len(requests)) or real_propose(requests, shape)
    strategies = ["mirror:chain:3,k=0", "mirror:chain:3,k=0", "chain:3", "chain:2", "tree:2,2,4"]
    _assert_same(_run_alternating(engine, prompts, params, strategies), _plain(arch, prompts, params))
    assert asked == [] and engine.drafters.mirror.pipeline.stats.ready > 0
    assert engine.stats.strategy_steps.get("chain:3", 0) > 0
    executor = engine.drafters.mirror.pipeline.executor
    executor._process.kill()
    executor._process.join()
    _assert_same(_run_alternating(engine, prompts, params, strategies[2:4]), _plain(arch, prompts, params))
    assert engine.drafters.mirror.pipeline.failed and asked  # the in-process drafter took over
    engine.close()


def test_a_dead_draft_process_falls_back_to_serial_drafting_and_loses_nothing():
    arch = "llama"
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    engine = mirror_engine(cached_model(arch), "mirror:chain:3,k=1", good_drafter(arch), "process")
    executor = engine.drafters.mirror.pipeline.executor
    assert isinstance(executor, ProcessExecutor)
    executor._process.kill()
    executor._process.join()
    _assert_same(engine.generate(prompts, params), _plain(arch, prompts, params))
    assert engine.drafters.mirror.pipeline.failed and engine.drafters.mirror.pipeline.stats.executor_failures == 1
    assert engine.stats.spec_steps > 0  # it went on speculating serially
    engine.close()


def test_two_large_branch_calls_in_flight_do_not_deadlock_the_draft_process():
    """Both a mirror step's branch calls can be large at large batch: the parent sends the second
    while the child answers the first. Neither side may block on a full pipe."""
    import threading

    # 1000 sequences: each call's requests (~200 KB pickled) and drafts with their distributions
    # (~1.2 MB) are far beyond a pipe's buffer (64 KB)
    drafter = SmallLMDrafter(good_drafter("llama"), kv_cache_tokens=1000 * 64)
    executor = ProcessExecutor(drafter.rebuild(), source=drafter)
    prompts = random_prompts(1000, seed=2, max_len=40)
    sampled = SamplingParams(temperature=1.0)  # drafts carry their distributions: large answers
    views = [SeqSnapshot(i, list(p), [], None, frozenset(), sampled) for i, p in enumerate(prompts)]
    requests = [DraftRequest(BranchView(view, [1, 2]), 3) for view in views]
    done = []
    executor.start(requests, DraftShape(3))
    sender = threading.Thread(
        target=lambda: (executor.start(requests, DraftShape(3)), done.append(executor.finish())), daemon=True
    )
    sender.start()
    sender.join(timeout=120)
    assert done and len(done[0]) == 2 * len(requests), "the parent and the draft process blocked each other"
    executor.close()


def test_a_process_that_cannot_start_says_why():
    """The child's traceback comes back (building a drafter over no model fails there)."""
    with pytest.raises(ExecutorError, match="the draft process failed:(.|\n)*Traceback"):
        ProcessExecutor(functools.partial(SmallLMDrafter, None))


# -- sampled: exactly the target's distribution ---------------------------------------------
@functools.cache
def exact_joint_of_tokens_3_and_4(params: SamplingParams) -> torch.Tensor:
    """The target's processed joint of completion tokens 3 and 4, marginalised over tokens 1-2."""
    model = target()
    with torch.no_grad():
        p1 = _processed(model(torch.tensor([PROMPT])).logits[:, -1], params)[0]
        p2 = _processed(model(torch.tensor([PROMPT + [a] for a in range(V)])).logits[:, -1], params)
        ctx3 = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p3 = _processed(model(ctx3).logits[:, -1], params).view(V, V, V)
        ctx4 = torch.tensor([PROMPT + [a, b, c] for a in range(V) for b in range(V) for c in range(V)])
        p4 = _processed(model(ctx4).logits[:, -1], params).view(V, V, V, V)
    joint = p1.view(V, 1, 1, 1) * p2.view(V, V, 1, 1) * p3.view(V, V, V, 1) * p4
    return joint.sum((0, 1)).reshape(-1)


def eagle3_drafter():
    return eagle3_or_model("eagle3")


def mirror_joint_counts(strategy: str, kind: str, params: SamplingParams, executor: str, n: int = 2000):
    engine = RolloutEngine(
        target(),
        RolloutConfig(
            strategy=strategy,
            mirror=MirrorConfig(exit_layer=1, executor=executor),
            max_num_seqs=n,
            block_size=4,
            kv_cache_tokens=n * 16,
        ),
        drafter={"target": target, "eagle3": eagle3_drafter}.get(kind, functools.partial(drafter_model, kind))(),
    )
    outs = engine.generate([PROMPT] * n, params.with_updates(max_new_tokens=5, ignore_eos=True))
    assert engine.drafters.mirror.pipeline.stats.ready > 0  # tokens 3-4 often came from a draft made beside the target
    engine.close()
    pairs = torch.tensor([o.completion_ids[2] * V + o.completion_ids[3] for o in outs])
    return torch.bincount(pairs, minlength=V * V)


# each executor once at least (a draft made on a thread: eagle3-thread; in a process:
# continuation-process); the drafters and sampling settings across the inline cases
@pytest.mark.parametrize(
    "strategy,kind,params,executor",
    [
        ("mirror:chain:1,k=2", "good", SETTINGS[0], "inline"),
        ("mirror:chain:1,k=2", "bad", SETTINGS[1], "inline"),
        ("mirror:chain:2,k=3", "bad", SETTINGS[2], "inline"),
        ("mirror:tree:2,2,3,k=2", "good", SETTINGS[3], "inline"),
        ("mirror:chain:1,k=0", "target", SETTINGS[0], "inline"),
        ("mirror:chain:1,k=0", "good", SETTINGS[3], "inline"),
        ("mirror:chain:1,k=0", "target", SETTINGS[1], "process"),
        ("mirror:chain:1,k=1", "eagle3", SETTINGS[0], "thread"),
        ("mirror:chain:1,k=0", "eagle3", SETTINGS[2], "inline"),
    ],
    ids=[
        "chain-good-T1",
        "chain-bad-T0.7",
        "chain-bad-topk",
        "tree-good-minp",
        "continuation-self-T1",
        "continuation-good-minp",
        "continuation-process",
        "eagle3-thread",
        "eagle3-continuation",
    ],
)
def test_mirror_samples_follow_the_target(strategy, kind, params, executor):
    counts = mirror_joint_counts(strategy, kind, params, executor)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_3_and_4(params)) > 1e-3


def test_the_check_rejects_a_wrong_residual_on_the_mirror_path(monkeypatch):
    """Any draft chosen independently of the verification's draws is verified exactly, so what can
    break a mirror step is the verification it feeds; resampling from the target instead of the
    residual after a rejection biases the output, and the check above catches it."""
    from tailspec.rollout.spec import verdicts as verdicts_module
    from tailspec.rollout.spec import verify as verify_module

    monkeypatch.setattr(verify_module, "residual", lambda p, q, token: p)
    monkeypatch.setattr(verdicts_module, "chain_residual", lambda p, q: p)
    params = SETTINGS[0]
    counts = mirror_joint_counts("mirror:chain:1,k=2", "bad", params, "inline")
    assert chi_square_pvalue(counts, exact_joint_of_tokens_3_and_4(params)) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("executor", ["stream", "device"])
def test_greedy_mirror_on_cuda_matches_plain_decoding(executor):
    if executor == "device" and torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    arch = "llama"
    model = perturbed_copy(cached_model(arch), noise=0.0).cuda()
    draft = perturbed_copy(cached_model(arch), noise=0.3, seed=7).to("cuda:1" if executor == "device" else "cuda")
    prompts = random_prompts(5, seed=2)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    want = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
    engine = mirror_engine(model, "mirror:chain:4,k=2", draft, executor)
    _assert_same(engine.generate(prompts, params), want)
    assert engine.drafters.mirror.pipeline.stats.ready > 0
    engine.close()


def test_greedy_mirror_through_a_ray_actor_matches_plain_decoding(ray_local):
    """The draft host as a Ray actor (a finished worker's CPU or GPU elsewhere in the cluster)."""
    from tailspec.rollout.mirror.hosted import RayExecutor, round_trip_s

    arch = "llama"
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    draft = perturbed_copy(cached_model(arch), noise=0.3, seed=7)
    engine = mirror_engine(cached_model(arch), "mirror:chain:3,k=1", draft, "ray")
    assert isinstance(engine.drafters.mirror.pipeline.executor, RayExecutor)
    _assert_same(engine.generate(prompts, params), _plain(arch, prompts, params))
    assert engine.drafters.mirror.pipeline.stats.branches > 0 and not engine.drafters.mirror.pipeline.failed
    assert 0 < round_trip_s(engine.drafters.mirror.pipeline.executor, repeats=5) < 5
    engine.close()


def test_the_ray_executor_needs_a_running_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="executor 'ray' needs a running Ray"):
        mirror_engine(cached_model("llama"), "mirror:chain:3,k=1", good_drafter("llama"), "ray")


def test_the_spare_core_goes_to_the_draft_on_mirror_steps_and_to_the_target_otherwise(monkeypatch):
    """``MirrorConfig.threads``: per step, mirror arms leave ``draft_threads`` to the draft host."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    config = RolloutConfig(
        strategy="adaptive",
        selector={"arms": ["none", "mirror:chain:2,k=0"]},
        mirror=MirrorConfig(executor="inline", threads=2, draft_threads=1),
    )
    engine = RolloutEngine(cached_model("llama"), config, drafter=good_drafter("llama"))
    arms, steps = engine.selector.arms, iter(range(10**6))
    engine.selector.choose = lambda n, remaining, lag, context: arms[next(steps) % 2]  # both arms, in turn
    engine.generate(random_prompts(3, seed=4), SamplingParams(max_new_tokens=12, temperature=0.0))
    by_strategy = {}
    for record, threads in zip(engine.stats.step_log, calls):
        by_strategy.setdefault(record.strategy, set()).add(threads)
    assert by_strategy == {"none": {2}, "mirror:chain:2,k=0": {1}}


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_mirror_under_kv_pressure_preempts_and_stays_exact(executor):
    """Sequences preempted and recomputed between mirror steps: their ready drafts and the
    drafter's state are checked against the real tokens, never trusted."""
    arch = "qwen2"
    prompts = random_prompts(8, seed=21, min_len=10)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    engine = mirror_engine(
        cached_model(arch), "mirror:chain:3,k=1", good_drafter(arch), executor, kv_cache_tokens=160, block_size=4
    )
    _assert_same(engine.generate(prompts, params), _plain(arch, prompts, params))
    assert engine.stats.preemptions > 0
    engine.close()


def test_aborting_and_releasing_mirror_requests_forgets_their_drafts():
    arch = "llama"
    engine = mirror_engine(cached_model(arch), "mirror:chain:3,k=0", cached_model(arch), "inline")
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    prompts = random_prompts(3, seed=2, min_len=4)
    keep, drop, move = (engine.add_request(p, params) for p in prompts)
    for _ in range(4):
        engine.step()
    assert engine.drafters.mirror.pipeline._ready  # the target as its own drafter: continuations are always right
    engine.abort(drop)
    partial = engine.release(move)
    assert drop not in engine.drafters.mirror.pipeline._ready and move not in engine.drafters.mirror.pipeline._ready
    assert drop not in engine.drafters.mirror.pipeline._held and move not in engine.drafters.mirror.pipeline._held
    while engine.has_unfinished():
        engine.step()
    other = mirror_engine(cached_model(arch), "mirror:chain:3,k=0", cached_model(arch), "inline")
    rid = other.add_request(partial.prompt_ids, params, resume=partial)
    while other.has_unfinished():
        other.step()
    plain = _plain(arch, [partial.prompt_ids], params)[0].completion_ids
    assert other.pop_output(rid).completion_ids == plain
    assert engine.pop_output(keep).completion_ids == _plain(arch, prompts[:1], params)[0].completion_ids


def greedy_view(prompt, seq_id=0):
    """A bare greedy sequence of ``prompt`` as drafters see one."""
    return SeqSnapshot(seq_id, list(prompt), [], None, frozenset(), SamplingParams(temperature=0.0))
