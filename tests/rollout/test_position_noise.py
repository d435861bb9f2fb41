"""Position-keyed sampling: exact samples of the target, and the same completion under every
strategy and drafter (``rollout/position_noise.py``)."""

import pytest
import torch
from rollout_helpers import chi_square_pvalue, random_prompts
from test_spec_greedy import DRAFTERS
from test_spec_sampling import PROMPT, V, drafter, exact_joint_of_tokens_2_and_3, target

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.params import MirrorConfig
from tailspec.rollout.position_noise import keyed_scores, position_gumbel, position_uniforms
from tailspec.testing import across_architectures

N = 2500  # samples per check, as test_spec_sampling.py's (whose power test shows a wrong rule fails by far)


def keyed(n: int, first_seed: int = 0, **params) -> list[SamplingParams]:
    return [SamplingParams(noise="position", seed=first_seed + i, **params) for i in range(n)]


def test_uniforms_are_a_pure_function_of_seed_index_and_token():
    a = position_uniforms([5, 5, 6, -1], [0, 1, 0, 3], 4096, torch.device("cpu"))
    b = position_uniforms([5, 5, 6, 2**64 - 1], [0, 1, 0, 3], 4096, torch.device("cpu"))
    assert torch.equal(a, b)  # a negative seed is its two's complement
    assert ((a > 0) & (a < 1)).all()
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert abs(a.mean().item() - 0.5) < 0.01 and abs(a.var().item() - 1 / 12) < 0.005
    # neighbouring keys and tokens are uncorrelated
    assert abs(torch.corrcoef(torch.stack([a[0], a[1]]))[0, 1].item()) < 0.05
    assert abs(torch.corrcoef(torch.stack([a[0, :-1], a[0, 1:]]))[0, 1].item()) < 0.05


def test_keyed_scores_perturb_the_keyed_rows_only():
    logprobs = torch.log_softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    params = [
        SamplingParams(noise="position", seed=11),
        SamplingParams(temperature=1.0, seed=2),
        SamplingParams(noise="position", seed=-3),
        SamplingParams(temperature=0.0),
    ]
    scores, mask = keyed_scores(logprobs, params, [0, 4, 2**33 + 7, 1])
    assert mask.tolist() == [True, False, True, False]
    noise = position_gumbel([11, -3], [0, 2**33 + 7], 50, torch.device("cpu"))
    assert torch.equal(scores[[0, 2]], logprobs[[0, 2]] + noise)
    assert torch.equal(scores[[1, 3]], logprobs[[1, 3]])
    assert keyed_scores(logprobs, params[1::2], [0, 1]) is None


def test_gumbel_max_with_the_noise_samples_a_fixed_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02, 0.0])
    logp = probs.log()
    g = position_gumbel(list(range(20000)), [7] * 20000, len(probs), torch.device("cpu"))
    counts = torch.bincount((logp + g).argmax(-1), minlength=len(probs))
    assert counts[-1] == 0
    assert chi_square_pvalue(counts, probs) > 1e-3
    # and along one request's positions
    g = position_gumbel([3] * 20000, list(range(20000)), len(probs), torch.device("cpu"))
    assert chi_square_pvalue(torch.bincount((logp + g).argmax(-1), minlength=len(probs)), probs) > 1e-3


def keyed_joint_counts(strategy: str, kind: str | None, params: SamplingParams) -> torch.Tensor:
    engine = RolloutEngine(
        target(),
        RolloutConfig(strategy=strategy, max_num_seqs=N, block_size=4, kv_cache_tokens=N * 16),
        drafter=drafter(kind) if kind else None,
    )
    per_request = [
        params.with_updates(noise="position", seed=1000 + i, max_new_tokens=4, ignore_eos=True) for i in range(N)
    ]
    outs = engine.generate([PROMPT] * N, per_request)
    if strategy != "none":
        assert engine.stats.drafted_tokens > 0
    pairs = torch.tensor([o.completion_ids[1] * V + o.completion_ids[2] for o in outs])
    return torch.bincount(pairs, minlength=V * V)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)], ids=["T1", "T0.7"]
)
@pytest.mark.parametrize(
    "strategy,kind",
    [("none", None), ("chain:2", "bad"), ("tree:2,3,6", "good"), ("chain:2", "eagle3"), ("suffix:2,2,4", None)],
    ids=["plain", "chain-bad", "tree-good", "chain-eagle3", "suffix"],
)
def test_position_keyed_samples_follow_the_target(strategy, kind, params):
    counts = keyed_joint_counts(strategy, kind, params)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(params)) > 1e-3


STRATEGIES = [
    ("chain:4", "good"),
    ("chain:3", "bad"),
    ("tree:3,2,6", "good"),
    ("suffix", None),
    ("hybrid:3,2,6", "good"),
    ("mirror:chain:3,k=2", "good"),
]


@pytest.mark.parametrize("arch,strategy,kind", across_architectures(STRATEGIES))
def test_every_strategy_emits_the_plain_completion(arch, strategy, kind):
    """The completion is a function of the model, the prompt and the seed: speculation, whatever
    it drafts, emits what plain decoding does, token for token, with the same logprobs."""
    from test_spec_greedy import cached_model

    prompts = random_prompts(8, seed=11)
    params = keyed(len(prompts), first_seed=77, temperature=1.0, max_new_tokens=24, ignore_eos=True)
    want = RolloutEngine(cached_model(arch), RolloutConfig()).generate(prompts, params)
    config = RolloutConfig(strategy=strategy, mirror=MirrorConfig(executor="inline"), seed=123)
    engine = RolloutEngine(cached_model(arch), config, drafter=DRAFTERS[kind](arch) if kind else None)
    got = engine.generate(prompts, params)
    assert engine.stats.drafted_tokens > 0
    for a, b in zip(got, want):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_the_completion_depends_on_the_seed_not_on_the_batch_or_preemption():
    from test_spec_greedy import cached_model

    prompts = random_prompts(10, seed=3, min_len=10, max_len=30)
    params = keyed(len(prompts), temperature=1.0, max_new_tokens=40, ignore_eos=True)
    model = cached_model("llama")
    alone = [RolloutEngine(model, RolloutConfig()).generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:3", block_size=4, num_blocks=40, seed=9), drafter=model)
    crowded = engine.generate(prompts, params)
    assert engine.stats.preemptions > 0
    assert [o.completion_ids for o in crowded] == [o.completion_ids for o in alone]
    other = RolloutEngine(model, RolloutConfig()).generate(prompts, keyed(len(prompts), first_seed=50, **_same(params)))
    assert sum(a.completion_ids != b.completion_ids for a, b in zip(other, alone)) >= 8


def _same(params: list[SamplingParams]) -> dict:
    p = params[0]
    return dict(temperature=p.temperature, max_new_tokens=p.max_new_tokens, ignore_eos=p.ignore_eos)


def test_a_drafter_with_the_same_noise_and_distribution_has_every_draft_accepted():
    """The drafter perturbs its logprobs with the noise the target will use: the target's own
    copy as drafter then proposes exactly the target's draws."""
    from test_spec_greedy import cached_model

    model = cached_model("qwen2")
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:4"), drafter=model)
    prompts = random_prompts(6, seed=5)
    engine.generate(prompts, keyed(len(prompts), temperature=1.0, max_new_tokens=33, ignore_eos=True))
    assert engine.stats.drafted_tokens > 0
    assert engine.stats.accepted_tokens == engine.stats.drafted_tokens


def test_noise_and_seed_are_checked():
    with pytest.raises(ValueError, match="noise"):
        SamplingParams(noise="gumbel")
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(noise="position")
    assert not SamplingParams(noise="position", temperature=0.0).position_keyed  # greedy needs no seed
    assert SamplingParams(noise="position", seed=1).position_keyed
