"""RolloutConfig(compile=True): the decoder layers' own ops compiled (paged attention left out)
give plain decoding's tokens and logprobs, for every architecture and speculation, and
the compiled forwards exist only while the engine runs the model. The tests trace with dynamo
alone (backend ``eager``): Inductor's C++ code generation costs half a minute of CPU on a cold
cache, and the CPU rehearsal of the GPU check (``make gpu-rehearse``, in CI) compiles with Inductor
and checks that its stage ``fast_path`` decodes as the eager layers do."""

import pytest
from rollout_helpers import cached_model, random_prompts
from test_spec_greedy import assert_same, good_drafter, mistral

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.layer_taps import decoder_layers
from tailspec.testing import perturbed_copy

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture
def traced_only(monkeypatch):
    from tailspec.rollout.model import compiled

    monkeypatch.setattr(compiled, "BACKEND", "eager")


@pytest.mark.parametrize(("arch", "strategy"), [("llama", "mirror:chain:3,k=2"), ("qwen3", "none")])
def test_compiled_layers_decode_as_plain_decoding(arch, strategy, traced_only):
    model, prompts = cached_model(arch), random_prompts(3, seed=3)
    want = RolloutEngine(model, RolloutConfig(graph_backend="eager")).generate(prompts, PARAMS)
    drafter = None if strategy == "none" else good_drafter(arch)
    config = RolloutConfig(graph_backend="eager", strategy=strategy, compile=True)
    assert_same(RolloutEngine(model, config, drafter=drafter).generate(prompts, PARAMS), want)
    assert all("forward" not in vars(layer) for layer in decoder_layers(model))  # outside the engine: as it was


def test_compiled_mistral_layers_keep_the_sliding_window(traced_only):
    model, prompts = mistral(16), random_prompts(3, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)  # past the 16-token window
    want = RolloutEngine(model, RolloutConfig(graph_backend="eager")).generate(prompts, params)
    config = RolloutConfig(graph_backend="eager", strategy="chain:3", compile=True, merge_projections=True)
    drafter = perturbed_copy(model, noise=0.3, seed=7)
    assert_same(RolloutEngine(model, config, drafter=drafter).generate(prompts, params), want)


def test_the_trainer_never_runs_the_compiled_layers(traced_only):
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(compile=True))
    engine.generate(random_prompts(2, seed=4), PARAMS)
    layer = decoder_layers(model)[0]
    assert "forward" not in vars(layer) and engine.runner.compiled is not None
    with engine.inference():
        assert vars(layer)["forward"] is not None  # swapped in for the engine's forwards only
    assert "forward" not in vars(layer)


@pytest.mark.parametrize("merge", [False, True])
def test_each_layer_traces_as_two_graphs_without_the_kv_scatter_and_the_attention(monkeypatch, merge):
    """What Inductor gets to fuse: the region before attention ends with the new K/V rows (their
    layout change beside RoPE), their scatter into the cache and the attention are in no graph
    (traced, the scatter copied a layer's whole cache on CUDA: GPU run 12), and one trace serves
    every layer (the graphs do not grow with the depth: no per-layer specialisation). With merged
    projections a layer runs 4 GEMMs instead of 7 (QKV as one, gate-up as one)."""
    import torch

    from tailspec.rollout.model import compiled
    from tailspec.testing import tiny_random_model

    graphs = []

    def recording(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method")])
        return gm.forward

    monkeypatch.setattr(compiled, "BACKEND", recording)
    counts = []
    for layers in (2, 4):
        torch._dynamo.reset()
        graphs.clear()
        model, prompts = tiny_random_model("qwen3", seed=1, num_layers=layers), random_prompts(2, seed=6)
        params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)  # the same shapes at each depth
        want = RolloutEngine(model, RolloutConfig(graph_backend="eager")).generate(prompts, params)
        config = RolloutConfig(graph_backend="eager", compile=True, merge_projections=merge)
        got = RolloutEngine(model, config).generate(prompts, params)
        assert_same(got, want)
        counts.append(len(graphs))
        ops = [op for g in graphs for op in g]
        assert not any("index_copy" in op or "scaled_dot_product_attention" in op for op in ops)
        assert any(any("cat" in op for op in g) and any("transpose" in op for op in g) for g in graphs)  # RoPE, rows
        gemms = {sum("linear" in op for op in g) for g in graphs}
        assert gemms == ({1, 3} if merge else {3, 4}), gemms  # before attention, after it
    assert counts[0] == counts[1], counts
    torch._dynamo.reset()


def test_a_model_drafting_for_itself_writes_its_drafts_into_its_own_cache(traced_only):
    """The same modules run by the engine and by the drafter (its own cache): the drafter's K/V
    must not land in the engine's cache. A perfect drafter, every
    draft accepted, and plain decoding's tokens."""
    model, prompts = cached_model("qwen2"), random_prompts(3, seed=7)
    want = RolloutEngine(model, RolloutConfig(graph_backend="eager")).generate(prompts, PARAMS)
    config = RolloutConfig(graph_backend="eager", strategy="chain:3", compile=True, merge_projections=True)
    engine = RolloutEngine(model, config, drafter=model)
    assert_same(engine.generate(prompts, PARAMS), want)
    assert engine.stats.accepted_tokens == engine.stats.drafted_tokens > 0


def test_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="compile must be True or False"):
        RolloutConfig(compile="yes")


def test_a_model_torch_compile_cannot_compile_runs_eagerly_and_says_so(monkeypatch, caplog):
    from torch._dynamo.exc import Unsupported

    def cannot(fn, **options):
        def raising(*args, **kwargs):
            raise Unsupported("a layer dynamo cannot trace")

        return raising

    monkeypatch.setattr("torch.compile", cannot)
    model, prompts = cached_model("qwen2"), random_prompts(3, seed=5)
    want = RolloutEngine(model, RolloutConfig()).generate(prompts, PARAMS)
    engine = RolloutEngine(model, RolloutConfig(compile=True))
    with caplog.at_level("WARNING", logger="tailspec.rollout.model.compiled"):
        got = engine.generate(prompts, PARAMS)
    assert_same(got, want)
    assert "a layer dynamo cannot trace" in engine.runner.compiled.failed
    assert sum("run eagerly" in r.getMessage() for r in caplog.records) == 1  # said once


def test_drafters_that_read_the_targets_layers_draft_as_before(traced_only):
    """An EAGLE-3 head (its feature taps are hooks around the compiled layers) and ``self:L`` (it
    runs the target's own first layers) accept what they accepted with eager layers, on the
    shipped Qwen2 policy."""
    from tailspec.benchmarks.policies import task_prompts
    from tailspec.tasks.sft import load_shipped_eagle3, load_tiny

    model, tokenizer = load_tiny("policy")
    prompts, params = task_prompts(tokenizer, 1, 0), SamplingParams(temperature=0.0, max_new_tokens=12)
    for strategy, drafter in (("chain:3", load_shipped_eagle3("tiny")), ("mirror:chain:2,k=1", "self:2")):
        runs = []
        for compile in (False, True):
            config = RolloutConfig(graph_backend="eager", strategy=strategy, compile=compile)
            engine = RolloutEngine(model, config, tokenizer=tokenizer, drafter=drafter)
            runs.append(([o.completion_ids for o in engine.generate(prompts, params)], engine.stats.mean_accept_length))
        assert runs[0] == runs[1], strategy
