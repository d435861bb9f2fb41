"""Hybrid models (Gated DeltaNet beside attention: Qwen3.5 dense and MoE, Qwen3-Next): each running
sequence's recurrent state in a slot of its own, exact against transformers' own no-cache forward
under continuous batching, preemption, prompt groups, MIXED steps, abort and hand-over; what the
state cannot serve yet is refused by name."""

import copy

import pytest
import torch

from tailspec.draft_contract import (
    Drafter,
    DraftTree,
    draft_from_text,
    draft_on_device_else_text,
    static_tree_nodes,
)
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.delta_rule_rows import ROW_VERIFIED
from tailspec.rollout.model.graph_pool import EagerBackend
from tailspec.rollout.model.recurrent_state import RecurrentStates, recurrent_mixers
from tailspec.testing import chi_square_pvalue, perturbed_copy, random_prompts
from tailspec.testing.families import (
    no_cache_greedy,
    oracle_logprobs,
    second_and_third_token_joint,
    tiny_family_model,
)

HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "kimi_linear", "nemotron_h", "falcon_h1"]

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    return tiny_family_model(request.param, seed=1)


def _want(model, prompts, new_tokens=12):
    return [no_cache_greedy(model, p, new_tokens, eos_id=-1) for p in prompts]


def _run(engine, prompts, params=GREEDY, each_step=None):
    ids = [engine.add_request(p, params) for p in prompts]
    step = 0
    while engine.has_unfinished():
        if each_step is not None:
            each_step(step, ids)
        engine.step()
        step += 1
    return [engine.pop_output(i) for i in ids]


def test_continuous_batching_decodes_transformers_tokens_and_logprobs(hybrid):
    """Five prompts of 1-20 tokens through three slots: sequences join as others finish, prefills and
    one-token steps from the state mix in the same forwards."""
    prompts = random_prompts(5, seed=3, min_len=1, max_len=20)
    engine = RolloutEngine(hybrid, RolloutConfig(max_num_seqs=3))
    outs = _run(engine, prompts)
    assert [o.completion_ids for o in outs] == _want(hybrid, prompts)
    for prompt, out in zip(prompts, outs):
        want = oracle_logprobs(hybrid, prompt, out.completion_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
    assert engine.runner.states.num_free == 3  # every slot back
    assert engine.runner.states.bytes_per_slot() > 0


def test_preempted_sequences_recompute_their_state():
    model = tiny_family_model("qwen3_5_text", seed=2)
    prompts = random_prompts(4, seed=5, min_len=6, max_len=10)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=64, max_num_seqs=4))
    outs = _run(engine, prompts, params)
    assert engine.stats.preemptions > 0
    assert [o.completion_ids for o in outs] == _want(model, prompts, 20)


def test_a_prompt_group_s_members_start_from_their_leader_s_state():
    """Members of a group share the leader's prefill: its state is copied into their slots."""
    model = tiny_family_model("qwen3_next", seed=3)
    prompt = random_prompts(1, seed=9, min_len=7, max_len=7)[0]
    engine = RolloutEngine(model, RolloutConfig())
    outs = engine.generate([prompt] * 3, GREEDY)
    assert engine.stats.forked_prefills == 2
    assert all(o.completion_ids == _want(model, [prompt])[0] for o in outs)


def test_mixed_steps_keep_each_sequence_s_state_apart():
    model = tiny_family_model("qwen3_5_text", seed=4)
    prompts = random_prompts(5, seed=6, min_len=2, max_len=15)
    engine = RolloutEngine(model, RolloutConfig(mixed_batches=True))
    ids = []
    for prompt in prompts:  # one arrives each step: its prefill joins the running sequences' next token
        ids.append(engine.add_request(prompt, GREEDY))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.mixed_steps > 0
    assert [engine.pop_output(i).completion_ids for i in ids] == _want(model, prompts)


def test_a_released_request_resumes_exactly_on_another_engine():
    model = tiny_family_model("qwen3_5_moe_text", seed=5)
    prompts = random_prompts(3, seed=7, min_len=3, max_len=9)
    first = RolloutEngine(model, RolloutConfig())
    ids = [first.add_request(p, GREEDY) for p in prompts]
    for _ in range(5):
        first.step()
    released = [first.release(i) for i in ids]
    assert first.runner.states.num_free == first.runner.states.num_slots - 1  # released: slots back
    second = RolloutEngine(model, RolloutConfig())
    again = [second.add_request(p, GREEDY, resume=r) for p, r in zip(prompts, released)]
    while second.has_unfinished():
        second.step()
    assert [second.pop_output(i).completion_ids for i in again] == _want(model, prompts)


def test_an_aborted_request_frees_its_slot_and_the_others_stay_exact():
    model = tiny_family_model("qwen3_5_text", seed=6)
    prompts = random_prompts(3, seed=8, min_len=3, max_len=9)
    engine = RolloutEngine(model, RolloutConfig(max_num_seqs=2))

    def abort_first(step, ids):
        if step == 3:
            engine.abort(ids[0])

    outs = _run(engine, prompts, each_step=abort_first)
    assert [o.completion_ids for o in outs[1:]] == _want(model, prompts[1:])
    assert engine.runner.states.num_free == 2


def test_what_the_state_cannot_serve_yet_is_refused_by_name():
    model = tiny_family_model("qwen3_5_text")
    with pytest.raises(
        ValueError, match=r"prefix_caching: the model.s recurrent layers \(Gated DeltaNet, KDA, Mamba-2\) keep"
    ):
        RolloutEngine(model, RolloutConfig(prefix_caching=True))
    with pytest.raises(ValueError, match="its Qwen3_5GatedDeltaNet layers keep a recurrent state.*policy only"):
        RolloutEngine(model, RolloutConfig(strategy="chain:2"), drafter="self:2")  # its own layers as a drafter LM


def test_the_slot_pool_keeps_scratch_and_refuses_what_it_does_not_hold():
    states = RecurrentStates(3)
    held = [states.allocate(), states.allocate()]
    assert sorted(held) == [1, 2] and states.num_free == 0
    with pytest.raises(RuntimeError, match="no recurrent state slot free"):
        states.allocate()
    states.free(held[0])
    for bad in (0, held[0], 3):
        with pytest.raises(ValueError, match="not held"):
            states.free(bad)
    with pytest.raises(ValueError, match="at least 2 slots"):
        RecurrentStates(1)


# -- speculation over the state: every row's state held, the kept row's committed -----------------


class _Oracle(Drafter):
    """Drafts the target's own greedy continuation (``want``: each prompt's whole sequence), wrong at
    every position ``p`` with ``p % wrong == 0`` so verification keeps part of a draft and rolls the
    rest back; from the device's state (chains and static trees, as a model drafter does) when
    ``on_device``, else from the host's text."""

    name = "oracle"

    def __init__(self, want: dict[tuple, list[int]], wrong: int, on_device: bool) -> None:
        self.want, self.wrong, self.on_device = want, wrong, on_device

    def _token(self, seq, position: int) -> int:
        full = self.want[tuple(seq.prompt_ids)]
        token = full[position] if position < len(full) else 3
        return (token + 1) % 96 if position % self.wrong == 0 else token

    def propose(self, requests, shape):
        out = []
        for r in requests:
            start = r.seq.num_tokens
            tokens = [self._token(r.seq, start + j) for j in range(r.max_depth)]
            tree = DraftTree.chain(tokens)
            if not shape.is_chain and tokens:  # a wrong sibling beside the first draft
                tree = DraftTree([*tokens, (tokens[0] + 7) % 96], [*tree.parents, -1])
            out.append(tree)
        return out

    def draft(self, step):
        if not self.on_device:
            return draft_from_text(self, step)
        return draft_on_device_else_text(step, lambda *_: True, self._chain, self._tree, self.propose)

    def _chain(self, inputs, depth):
        cached = inputs.cached.tolist()  # a test drafter on CPU may look; a real one never reads
        rows = [[self._token(s, c + 1 + j) for j in range(depth)] for s, c in zip(inputs.seqs, cached)]
        return torch.tensor(rows), None

    def _tree(self, inputs, shape):
        n = static_tree_nodes(shape)
        chain, _ = self._chain(inputs, shape.depth)
        extra = n - shape.depth  # wrong leaves under the root and the first node
        tokens = torch.cat([chain, (chain[:, :1] + 7 + torch.arange(extra)) % 96], dim=1)
        parents = torch.tensor([*range(-1, shape.depth - 1), *([-1, 0] * extra)[:extra]]).expand(len(chain), -1)
        return tokens, parents


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("strategy", ["chain:4", "tree:3,2,6"])
def test_speculation_keeps_the_state_of_the_kept_tokens_only(hybrid, strategy, on_device):
    prompts = random_prompts(4, seed=11, min_len=2, max_len=9)
    want = _want(hybrid, prompts, 20)
    oracle = _Oracle({tuple(p): p + w for p, w in zip(prompts, want)}, wrong=3, on_device=on_device)
    engine = RolloutEngine(hybrid, RolloutConfig(strategy=strategy, max_num_seqs=3), drafter=oracle)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    outs = _run(engine, prompts, params)
    assert [o.completion_ids for o in outs] == want
    stats = engine.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # drafts kept in part: the rest rolled back
    assert engine.runner.states.rows == {}  # every verification's rows consumed by its keep
    assert (engine.stats.overlapped_steps > 0) == on_device  # launched from the device's state, chained


class _ArgmaxContinuation(Drafter):
    """Drafts, from the host's text, the target's own argmax continuation (deterministic drafts,
    verified as one-hot): at T = 1 a sampled row keeps some of it and rolls the rest back."""

    name = "argmax"

    def __init__(self, model) -> None:
        self.model, self.memo = model, {}

    def draft(self, step):
        return draft_from_text(self, step)

    def propose(self, requests, shape):
        out = []
        for r in requests:
            context = tuple(r.seq.prompt_ids + r.seq.output_ids)
            if context not in self.memo:
                self.memo[context] = no_cache_greedy(self.model, list(context), shape.depth, eos_id=-1)
            out.append(DraftTree.chain(self.memo[context][: r.max_depth]))
        return out


def test_sampled_speculation_over_the_state_follows_the_target_exactly():
    """Chi-square of tokens 2-3 at T = 1 against transformers' own processed joint: the state of
    every rejected draft is rolled back, whatever was drawn."""
    model = tiny_family_model("qwen3_5_text")
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3)
    n, prompt = 3000, [5, 9, 17, 33, 3]
    config = RolloutConfig(strategy="chain:3", max_num_seqs=n, block_size=4, kv_cache_tokens=n * 12)
    oracle = _ArgmaxContinuation(copy.deepcopy(model))  # its own copy: the engine's runs paged attention
    engine = RolloutEngine(model, config, eos_token_ids=[], drafter=oracle)
    outs = engine.generate([prompt] * n, params)
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
    vocab = model.config.get_text_config().vocab_size
    pairs = torch.tensor([o.completion_ids[1] * vocab + o.completion_ids[2] for o in outs])
    expected = second_and_third_token_joint(model, prompt, params)
    assert chi_square_pvalue(torch.bincount(pairs, minlength=vocab * vocab), expected) > 1e-3


def _drafter_for(kind: str, target):
    if kind == "lm":  # a drafter LM of an attention-only family
        return tiny_family_model("llama", seed=11)
    from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(5)  # an EAGLE-3 head reading features tapped from the hybrid stack
    head = Eagle3Head(Eagle3Config.for_target(target.config))
    head.reset_parameters(std=0.05)
    return head


@pytest.mark.parametrize(
    "strategy, drafter",
    [
        ("suffix", None),
        ("chain:3", "lm"),
        ("tree:3,2,6", "lm"),
        ("hybrid:3,2,8", "lm"),
        ("mirror:chain:2,k=1", "lm"),
        ("adaptive", "lm"),
        ("chain:3", "eagle3"),
        ("tree:3,2,6", "eagle3"),
    ],
)
def test_every_hybrid_family_decodes_every_strategy_exactly(hybrid, strategy, drafter):
    """Greedy, on each hybrid family: ``suffix`` (drafts from the sequences' own repeats), chains and
    trees drafted by a drafter LM of another family or by an EAGLE-3 head tapping the hybrid stack,
    hybrid, mirror and ``adaptive``, each equal to transformers' no-cache tokens."""
    prompts = [p * 3 for p in random_prompts(3, seed=4, min_len=2, max_len=6)]
    config = RolloutConfig(strategy=strategy, max_num_seqs=2, mirror={"executor": "inline"})
    engine = RolloutEngine(hybrid, config, drafter=_drafter_for(drafter, hybrid) if drafter else None)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.completion_ids for o in engine.generate(prompts, params)] == _want(hybrid, prompts, 16)
    assert engine.stats.counts().spec_steps > 0
    engine.close()


@pytest.mark.parametrize("strategy", ["none", "chain:3"])
def test_a_weight_update_mid_run_keeps_each_sequence_s_state_as_stepwise_commits_do(strategy):
    """New weights loaded while a step is in flight: the state each sequence carries on (written by
    the old weights, as its K/V is) and every later step run with the new weights are what a run
    that commits every step before the next gives; a run without the update differs."""
    base = tiny_family_model("qwen3_5_text", seed=6)
    new_weights = perturbed_copy(base, 0.3, 9).state_dict()
    prompts = random_prompts(3, seed=52, min_len=3, max_len=10)

    def run(committed: bool, update: bool = True) -> list[list[int]]:
        model = copy.deepcopy(base)
        drafter = tiny_family_model("llama", seed=11) if strategy != "none" else None
        engine = RolloutEngine(model, RolloutConfig(strategy=strategy, max_num_seqs=3), drafter=drafter)
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        step = 0
        while engine.has_unfinished():
            if step == 3 and update:
                with torch.no_grad():
                    model.load_state_dict(new_weights)
                engine.weights_changed()
            engine.step()
            if committed:
                engine.sync()
            step += 1
        return [engine.pop_output(i).completion_ids for i in ids]

    got = run(committed=False)
    assert got == run(committed=True)
    assert got != run(committed=False, update=False)


@pytest.mark.parametrize("strategy, drafter", [("suffix", None), ("chain:3", "lm")])
def test_every_hybrid_family_samples_its_own_distribution_under_speculation(hybrid, strategy, drafter):
    """Chi-square of tokens 2-3 at T = 1 against transformers' processed joint, on each hybrid family:
    ``suffix`` drafting from earlier completions of the prompt and a chain from a drafter LM of another family, each
    rolling back the states of what it rejects."""
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3)
    n, prompt = 2000, [5, 9, 17, 33, 3]
    config = RolloutConfig(strategy=strategy, max_num_seqs=n, block_size=4, kv_cache_tokens=n * 20)
    engine = RolloutEngine(hybrid, config, eos_token_ids=[], drafter=_drafter_for(drafter, hybrid) if drafter else None)
    engine.generate([prompt] * 64, params)  # the suffix drafter's history: earlier completions of the prompt
    drafted = engine.stats.drafted_tokens
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.drafted_tokens > drafted
    vocab = hybrid.config.get_text_config().vocab_size
    pairs = torch.tensor([o.completion_ids[1] * vocab + o.completion_ids[2] for o in outs])
    expected = second_and_third_token_joint(hybrid, prompt, params)
    assert chi_square_pvalue(torch.bincount(pairs, minlength=vocab * vocab), expected) > 1e-3


class _GraphLikeBackend(EagerBackend):
    """The eager backend made to behave as CUDA graphs do where it matters to a recurrent state: a
    capture runs the forward twice more (CUDA's warm-up), and a replay leaves no Python-side record
    (what the forward stored in ``states.rows`` is forgotten after each run: a CUDA replay runs the
    kernels alone, so the runner must find the rows in the bucket's buffers)."""

    def __init__(self, device, states) -> None:
        super().__init__(device)
        self.states = states

    def capture(self, fn, example):
        entry = super().capture(fn, example)
        for _ in range(2):
            entry.run(example)
        run = entry.run

        def replay(inputs):
            out = run(inputs)
            self.states.rows.clear()
            return out

        entry.run = replay
        return entry


@pytest.mark.parametrize("strategy, drafter", [("none", None), ("chain:3", "lm"), ("tree:3,2,6", "lm")])
def test_captured_steps_advance_each_state_once(hybrid, strategy, drafter):
    """Under a graph pool a hybrid's one-token steps are padded to buckets (each row's slot an input,
    padding rows the scratch slot) and replayed, and so are verifications through Gated DeltaNet
    layers (each row's parent an input, its rows' states in the bucket's buffers); prefills, and
    verifications through other mixers, run uncaptured. Greedy tokens equal transformers', under
    captures that run the forward beside the replay and replays that leave no Python-side record."""
    prompts = random_prompts(4, seed=21, min_len=2, max_len=9)
    config = RolloutConfig(strategy=strategy, max_num_seqs=3, graph_backend="eager")
    engine = RolloutEngine(hybrid, config, drafter=_drafter_for(drafter, hybrid) if drafter else None)
    pool, states = engine.runner.graph_pool, engine.runner.states
    pool.backend = _GraphLikeBackend(pool.backend.device, states)
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    assert [o.completion_ids for o in engine.generate(prompts, params)] == _want(hybrid, prompts, 14)
    if strategy == "none" or states.verifications_replayable:
        assert pool.stats.captures > 0 and pool.stats.hits > pool.stats.captures
    assert states.verifications_replayable == (type(recurrent_mixers(hybrid)[0]).__name__ in ROW_VERIFIED)
    engine.close()
