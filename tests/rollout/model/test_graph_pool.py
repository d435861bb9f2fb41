"""The graph pool: bucket choice, LRU and budget with the eager backend on CPU; the padded forward
it replays is exact; CUDA-graph capture on a GPU (``gpu`` marker)."""

import pytest
import torch
from rollout_helpers import cached_model, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.graph_pool import EagerBackend, GraphKey, GraphPool, uncaptured_runs
from tailspec.testing import perturbed_copy, tiny_random_model


def _pool(budget=10_000):
    return GraphPool(
        EagerBackend(),
        batch_buckets=(1, 2, 4, 8),
        token_buckets=(1, 4),
        context_buckets=(16, 64),
        table_context_buckets=(64,),
        memory_budget=budget,
    )


def _inputs(key: GraphKey, width: int = 10):
    return {"x": torch.zeros(key.batch * key.tokens, width)}  # 4 bytes x batch x tokens x width


def test_bucket_choice_rounds_up_and_refuses_what_is_too_large():
    pool = _pool()
    assert pool.key_for(3, 1, 10) == GraphKey(4, 1, 16)
    assert pool.key_for(1, 2, 17) == GraphKey(1, 4, 64)
    assert pool.key_for(8, 4, 64) == GraphKey(8, 4, 64)
    assert pool.key_for(9, 1, 10) is None and pool.key_for(1, 5, 10) is None and pool.key_for(1, 1, 65) is None
    # a forward whose attention reads block tables pads its context to the coarse buckets
    assert pool.key_for(3, 1, 10, reads_tables=True) == GraphKey(4, 1, 64)
    assert pool.key_for(1, 1, 65, reads_tables=True) is None
    with pytest.raises(ValueError, match="table_context_buckets must be increasing"):
        GraphPool(table_context_buckets=(64, 16))


def test_capture_once_then_hit_and_evict_least_recently_used():
    pool = _pool(budget=1000)
    calls = []

    def make(tag):
        def make_fn():
            calls.append(tag)
            return lambda x: x["x"].sum()

        return make_fn

    a, b, c = GraphKey(1, 1, 16), GraphKey(2, 1, 16), GraphKey(4, 1, 16)  # 40, 80, 160 bytes of inputs
    for key in (a, b, a, a):
        pool.run(key, make(key), _inputs(key))
    assert pool.stats.captures == 2 and pool.stats.hits == 2 and calls == [a, b]
    assert pool.keys() == [b, a]  # least recently used first
    pool.memory_budget = 250
    pool.run(c, make(c), _inputs(c))  # 40 + 80 + 160 > 250: b (the LRU) goes
    assert pool.keys() == [a, c] and pool.stats.evictions == 1 and pool.stats.bytes == 200 <= pool.memory_budget
    assert pool.replay(a) and pool.keys() == [a, c] and not pool.replay(b)  # a replay moves nothing in the LRU
    big = GraphKey(8, 4, 64)
    out = pool.run(big, make(big), _inputs(big))  # larger than the whole budget: run, not kept
    assert float(out) == 0.0 and big not in pool and pool.stats.bytes <= pool.memory_budget
    before = uncaptured_runs()
    pool.run(None, make("eager"), _inputs(a))
    assert pool.stats.uncaptured == 1 and uncaptured_runs() == before + 1  # counted process-wide too


def test_only_the_owner_thread_captures_others_replay_or_run_eagerly():
    """A draft executor's thread shares the drafter's pool: it replays what the owner captured and runs
    new shapes uncaptured, so no capture overlaps another thread's work (which invalidates the capture on CUDA)."""
    import threading

    pool = _pool()
    a, b = GraphKey(1, 1, 16), GraphKey(2, 1, 16)
    fn = lambda x: x["x"].sum()  # noqa: E731
    pool.run(a, lambda: fn, _inputs(a))
    before = uncaptured_runs()
    worker = threading.Thread(target=lambda: [pool.run(k, lambda: fn, _inputs(k)) for k in (a, b)])
    worker.start()
    worker.join()
    assert pool.keys() == [a] and pool.stats.captures == 1 and pool.stats.hits == 1 and pool.stats.uncaptured == 1
    assert uncaptured_runs() == before + 1  # what the speed stage reports of a timed run
    assert list(pool.stats.capture_s) == [a] and pool.replay(a) and not pool.replay(b)


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError, match="batch_buckets"):
        GraphPool(batch_buckets=(4, 2))
    with pytest.raises(ValueError, match="memory_budget"):
        GraphPool(memory_budget=0)
    with pytest.raises(ValueError, match="graph_backend"):
        RolloutConfig(graph_backend="tensorrt")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            RolloutEngine(cached_model("llama"), RolloutConfig(graph_backend="cuda_graph"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("strategy", ["none", "chain:3", "tree:3,2,6"])
def test_padded_bucketed_forward_is_exact(arch, strategy):
    model = cached_model(arch)
    drafter = perturbed_copy(model, noise=0.3, seed=7)
    prompts = random_prompts(6, seed=3)
    params = [SamplingParams(max_new_tokens=10 + 5 * i, temperature=0.0) for i in range(6)]  # ragged batches
    want = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
    engine = RolloutEngine(model, RolloutConfig(strategy=strategy, graph_backend="eager"), drafter=drafter)
    got = engine.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    stats = engine.runner.graph_pool.stats
    assert stats.captures >= 2 and stats.hits > stats.captures
    # the engine counts the seconds its decode steps spent capturing (what a rollout's log reports)
    assert 0 < engine.stats.capture_time_s <= engine.stats.decode_time_s


def _small_pool() -> GraphPool:
    """Eager buckets of contexts up to 32: the Triton interpreter's time follows the padded shapes."""
    return GraphPool(EagerBackend(), context_buckets=(16, 32), table_context_buckets=(32,), memory_budget=1 << 30)


@pytest.mark.parametrize("strategy", ["none", "tree:3,2,6"])
def test_padded_forward_through_the_triton_kernels_is_exact(strategy):
    """Captured forwards read block tables, lengths and masks from static buffers when the Triton
    attention kernel is on; with the eager backend (and the interpreter without CUDA) that path
    decodes exactly like the dense torch path."""
    pytest.importorskip("triton")
    model = cached_model("qwen2")
    prompts = random_prompts(3, seed=5, max_len=10)
    params = [SamplingParams(max_new_tokens=4 + 2 * i, temperature=0.0) for i in range(3)]  # ends differ
    want = RolloutEngine(model, RolloutConfig(kernels="torch")).generate(prompts, params)
    drafter = perturbed_copy(model, noise=0.3, seed=7)
    config = RolloutConfig(strategy=strategy, graph_backend="eager", kernels="triton")
    engine = RolloutEngine(model, config, drafter=drafter)
    for runner in (engine.runner, engine.drafter.runner):  # tables padded to 32, not 2k (the interpreter)
        runner.graph_pool = _small_pool()
    got = engine.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert engine.runner.graph_pool.stats.hits > 0


def test_split_kv_graphs_serve_every_context_up_to_their_coarse_bucket():
    """The split-KV kernel reads block tables and does each sequence's own context's work, so its
    captured forwards are keyed by coarse context buckets: a rollout crossing fine buckets captures
    each batch and width once, and still decodes exactly; the gathering path keeps fine buckets."""
    pytest.importorskip("triton")
    model = cached_model("qwen2")
    prompts = random_prompts(2, seed=6, max_len=10)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)  # contexts past 16
    want = RolloutEngine(model, RolloutConfig(kernels="torch")).generate(prompts, params)
    captured = {}
    for kernels in ("triton", "torch"):
        engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", kernels=kernels))
        engine.runner.graph_pool = _small_pool()
        got = engine.generate(prompts, params)
        assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
        for a, b in zip(got, want):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        captured[kernels] = {key.context for key in engine.runner.graph_pool.keys()}
    assert captured == {"triton": {32}, "torch": {16, 32}}


def _move_weights(model, scale: float) -> None:
    """Every parameter replaced by a new tensor of new values (as ZeRO-3's gather, ``model.to`` or
    ``load_state_dict(assign=True)`` replace them)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * scale


@pytest.mark.parametrize("merge", [False, True])
def test_graphs_are_captured_again_when_the_weights_move(merge):
    """Changed in place (an optimizer step), the weights stay where the pool's graphs read them;
    moved to new tensors, the graphs are dropped and captured again (a CUDA graph would read the
    old addresses), and the rollout decodes with the new weights."""
    model = tiny_random_model("qwen2", seed=8)
    prompts = random_prompts(3, seed=3)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)  # the same shapes every time
    engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", merge_projections=merge))
    engine.generate(prompts, params)
    pool = engine.runner.graph_pool
    captured = pool.stats.captures
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # in place
    engine.generate(prompts, params)
    assert pool.stats.captures == captured
    _move_weights(model, 0.5)
    want = RolloutEngine(model, RolloutConfig(graph_backend="none")).generate(prompts, params)
    got = engine.generate(prompts, params)
    assert pool.stats.captures > captured
    for a, b in zip(got, want):
        assert a.completion_ids == b.completion_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_follow_weights_that_moved():
    model = tiny_random_model("qwen2", seed=8).to("cuda")
    prompts, params = random_prompts(3, seed=3), SamplingParams(max_new_tokens=12, temperature=0.0)
    engine = RolloutEngine(model, RolloutConfig(graph_backend="cuda_graph"))
    engine.generate(prompts, params)
    _move_weights(model, 1.7)
    want = RolloutEngine(model, RolloutConfig(graph_backend="none")).generate(prompts, params)
    for a, b in zip(engine.generate(prompts, params), want):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["none", "chain:3", "tree:3,2,6"])
def test_cuda_graph_decode_and_verification_equal_eager(strategy):
    model = cached_model("qwen2").to("cuda")
    drafter = perturbed_copy(model, noise=0.3, seed=7).to("cuda")
    prompts = random_prompts(6, seed=3)
    params = [SamplingParams(max_new_tokens=10 + 5 * i, temperature=0.0) for i in range(6)]
    want = RolloutEngine(model, RolloutConfig(graph_backend="none"), drafter=drafter).generate(prompts, params)
    engine = RolloutEngine(model, RolloutConfig(strategy=strategy, graph_backend="cuda_graph"), drafter=drafter)
    got = engine.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    assert engine.runner.graph_pool.stats.hits > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_pool_stays_under_its_budget():
    model = cached_model("llama").to("cuda")
    engine = RolloutEngine(model, RolloutConfig(graph_backend="cuda_graph", graph_memory_mb=8))
    prompts = random_prompts(32, seed=5)
    engine.generate(prompts, [SamplingParams(max_new_tokens=4 + i, temperature=0.0) for i in range(32)])
    pool = engine.runner.graph_pool
    assert pool.stats.captures > 0
    assert pool.stats.bytes <= pool.memory_budget


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_that_return_an_eagle3_head_s_features_draft_as_eager():
    """The features an EAGLE-3 head reads are an output of the captured forward: the replayed
    engine emits what the uncaptured one does, at the accept length it has (fp32; the padded
    forward's products may round apart, so a near-tied draft may flip)."""
    from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head

    model = cached_model("qwen2").to("cuda")
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(model.config)).to("cuda").eval()
    prompts = random_prompts(6, seed=3)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    runs = []
    for graphs in ("none", "cuda_graph"):
        config = RolloutConfig(strategy="chain:3", graph_backend=graphs)
        engine = RolloutEngine(model, config, drafter=Eagle3Drafter(head, model))
        outputs = engine.generate(prompts, params)
        runs.append(([o.completion_ids for o in outputs], engine.stats.mean_accept_length))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] == pytest.approx(runs[0][1], rel=0.1)
    assert any(key.taps for key in engine.runner.graph_pool.keys()) and engine.runner.graph_pool.stats.hits > 0
