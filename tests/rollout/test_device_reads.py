"""How often a step reads from the device. On CUDA each read (``tolist``, ``item``, ``float`` of a
tensor) waits for every kernel queued before it, so the host stops preparing the next forward
(GPU run 13: 24.5 waits in a batch-1 ``chain:4`` step that kept the device busy 5 ms of 15).
Every step reads once, at its commit, after the next step is launched: a plain step, a chain or
tree launched from the device's state; a step drafted from the host's text also reads its verdicts.
The count is taken on CPU, where the same code runs: every read of a tensor is counted."""

import collections

import pytest
import torch
from rollout_helpers import cached_model, random_prompts, with_growth

from tailspec.kernels.dispatch import kernel_backend
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import perturbed_copy, with_synchronizations

READS = ("tolist", "item", "__float__", "__int__", "__bool__")
STEP_COUNTERS = ("prefill_steps", "decode_steps", "spec_steps")


def generate_counting_reads(monkeypatch, engine: RolloutEngine, prompts, params, counters=STEP_COUNTERS):
    """The reads of tensors one warmed ``generate`` makes, and how much each of ``counters`` (engine
    statistics) grew in it."""
    engine.generate(prompts, params)  # warm: the reads of a first call (calibration, tables) aside
    counts: collections.Counter = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    _, grown = with_growth(engine, counters, lambda: engine.generate(prompts, params))
    monkeypatch.undo()
    return sum(counts.values()), grown


@pytest.mark.parametrize("graph_backend", ["none", "eager"])
def test_a_plain_step_reads_once(monkeypatch, graph_backend):
    engine = RolloutEngine(cached_model("llama"), RolloutConfig(graph_backend=graph_backend))
    reads, (prefills, decodes, _) = generate_counting_reads(
        monkeypatch, engine, random_prompts(3, seed=1), SamplingParams(max_new_tokens=12, temperature=0.0)
    )
    assert decodes > 0 and reads == prefills + decodes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sampled_plain_step_reads_once(monkeypatch, temperature):
    engine = RolloutEngine(cached_model("qwen2"), RolloutConfig())
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=20, top_p=0.9, seed=3)
    reads, (prefills, decodes, _) = generate_counting_reads(monkeypatch, engine, random_prompts(3, seed=2), params)
    assert decodes > 0 and reads == prefills + decodes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_suffix_step_reads_once(monkeypatch, temperature):
    """A suffix step commits the step before it (that step's one read), drafts from the host's text
    and reads its verdicts with their tokens and logprobs in one read: greedy, the rows' argmax;
    sampled, every shape group's verdicts together (``verify._verify_shared_shapes``)."""
    engine = RolloutEngine(cached_model("llama"), RolloutConfig(strategy="suffix"))
    prompts = [p * 4 for p in random_prompts(3, seed=4, max_len=6)]  # repeating text: the suffix drafter drafts
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=3)
    reads, (prefills, decodes, specs) = generate_counting_reads(monkeypatch, engine, prompts, params)
    assert specs > 4 and reads == prefills + decodes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_hybrid_step_reads_its_model_tree_once_and_its_verdicts_once(monkeypatch, temperature):
    """A hybrid step drafts from the host's text: the drafter LM grows its static tree from the
    host's state with no read between its levels and reads it once, the suffix drafter adds its
    branches, and the verdicts come back in one read (with the commit of the step before)."""
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="hybrid"), drafter=perturbed_copy(model, noise=0.05, seed=7))
    prompts = [p * 4 for p in random_prompts(3, seed=4, max_len=6)]
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=3)
    reads, (prefills, decodes, specs) = generate_counting_reads(monkeypatch, engine, prompts, params)
    assert specs == decodes > 4 and decodes < reads <= prefills + 2 * decodes


@pytest.mark.parametrize(
    ("strategy", "graph_backend", "heads"),
    [("chain:4", "none", 0), ("chain:4", "eager", 0), ("tree:3,2,6", "eager", 0), ("chain:4", "eager", 2)],
)
def test_a_greedy_speculative_step_reads_once(monkeypatch, strategy, graph_backend, heads):
    """A greedy chain or tree step launched from state on the device drafts, verifies and leaves
    the next step's state without a read; its one read (what it emitted) is its commit, after the
    next step's launch. The first step after a prefill is launched from the host's state (the
    prefill committed first) and reads once too. With streaming ``heads`` the drafter LM streams
    its chains."""
    from tailspec.drafter.small_lm import SmallLMDrafter
    from tailspec.drafter.streaming import StreamingHeads

    model = cached_model("llama")
    drafter = perturbed_copy(model, noise=0.05, seed=7)
    if heads:
        drafter = SmallLMDrafter(drafter, streaming_heads=StreamingHeads(model.config.hidden_size, heads))
    config = RolloutConfig(strategy=strategy, graph_backend=graph_backend)
    engine = RolloutEngine(model, config, drafter=drafter)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    counters = (*STEP_COUNTERS, "overlapped_steps")
    reads, (prefills, decodes, specs, overlapped) = generate_counting_reads(
        monkeypatch, engine, random_prompts(3, seed=4), params, counters
    )
    assert specs == decodes > 4 and overlapped == specs - 1
    assert reads == prefills + decodes


def test_adaptive_reads_at_most_once_a_step_between_plain_chain_and_tree_steps(monkeypatch):
    """``adaptive`` moving between ``none``, ``chain:2``, ``chain:4`` and its tree arm of the drafter
    LM: a chain or a tree after one is launched from the state on the device, a step after another
    kind commits it first and starts from the host's; every step reads once, at its commit."""
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, noise=0.05, seed=7))
    by_name = {str(arm): arm for arm in engine.selector.arms}
    tree = next(name for name in by_name if name.startswith("tree:"))
    cycle, plans = ["none", "chain:4", tree, "chain:2", tree, "none", "chain:2"], iter(range(10**6))
    engine.selector.choose = lambda n, remaining, lag, context: by_name[cycle[next(plans) % len(cycle)]]
    counters = (*STEP_COUNTERS, "overlapped_steps")
    reads, (prefills, decodes, specs, overlapped) = generate_counting_reads(
        monkeypatch, engine, random_prompts(3, seed=4), SamplingParams(max_new_tokens=40, temperature=0.0), counters
    )
    assert specs > 4 and 0 < overlapped < decodes
    assert reads == prefills + decodes


def test_a_position_keyed_chain_step_reads_as_a_greedy_one(monkeypatch):
    """Position-keyed rows verify as greedy ones on their perturbed scores: the drafts, then each
    row's argmax with its logprob in one read (GPU run 14's long tail was keyed: its drafting cost
    2.3x the greedy batches', and every keyed forward then waited for the device twice)."""
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:4"), drafter=perturbed_copy(model, noise=0.3, seed=7))
    params = [SamplingParams(max_new_tokens=24, noise="position", seed=i) for i in range(3)]
    reads, (prefills, decodes, specs) = generate_counting_reads(monkeypatch, engine, random_prompts(3, seed=4), params)
    assert specs > 0 and reads <= prefills + (decodes - specs) + specs * 2


def test_a_sampled_chain_step_reads_its_drafts_and_its_verdicts_with_their_logprobs(monkeypatch):
    """Sampled rows verify in the fused kernel (the backend a GPU picks; Triton's interpreter
    here): its verdicts and the emitted tokens' logprobs come back in one read, so accepting
    reads nothing more (three reads a step before 2026-11-28)."""
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:4"), drafter=perturbed_copy(model, noise=0.3, seed=7))
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
    with kernel_backend("triton", kernels=("verify",)):
        reads, (prefills, decodes, specs) = generate_counting_reads(
            monkeypatch, engine, random_prompts(3, seed=4), params
        )
    assert specs > 0 and reads <= prefills + (decodes - specs) + specs * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("strategy", "sampling", "waits_per_spec_step"),
    [("none", "greedy", 0), ("chain:4", "greedy", 2), ("chain:4", "keyed", 2), ("chain:4", "sampled", 2)],
)
def test_on_cuda_a_step_waits_for_the_device_only_where_it_reads(strategy, sampling, waits_per_spec_step):
    """torch's sync debug mode flags every call that waits for the device (a pageable copy to it,
    a read back): a warmed step makes no more than the reads counted above, greedy, position-keyed
    (whose noise keys reach the device in one queued copy) or sampled."""
    from tailspec.testing import tiny_random_model

    model = tiny_random_model("llama", seed=1).cuda()
    drafter = perturbed_copy(model, noise=0.3, seed=7) if strategy != "none" else None
    engine = RolloutEngine(model, RolloutConfig(strategy=strategy), drafter=drafter)
    prompts, params = random_prompts(3, seed=4), SamplingParams(max_new_tokens=24, temperature=0.0)
    if sampling == "keyed":
        params = [params.with_updates(temperature=1.0, noise="position", seed=i) for i in range(len(prompts))]
    elif sampling == "sampled":
        params = params.with_updates(temperature=1.0, seed=3)
    engine.generate(prompts, params)  # captures every graph the measured call replays
    (_, waits), (prefills, decodes, specs) = with_growth(
        engine, STEP_COUNTERS, lambda: with_synchronizations(lambda: engine.generate(prompts, params))
    )
    assert decodes > 0 and waits <= prefills + (decodes - specs) + specs * waits_per_spec_step, waits
