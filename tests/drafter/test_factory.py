"""``fit_problems``: what keeps a drafter from drafting for a policy as it is at a sync."""

import pytest

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.drafter.factory import as_drafter, fit_problems
from tailspec.rollout import RolloutConfig
from tailspec.testing import tiny_random_model


@pytest.fixture
def policy():
    return tiny_random_model("qwen2", seed=1, num_layers=4)


def test_a_drafter_lm_fits_a_policy_of_its_vocabulary_until_the_policy_is_resized(policy):
    lm = tiny_random_model("llama", seed=2, num_layers=1)
    assert fit_problems(lm, policy) == []
    bound = as_drafter(lm, policy, RolloutConfig())
    assert bound.fit_problems(policy) == []
    policy.resize_token_embeddings(104)  # the user added tokens
    for problems in (fit_problems(lm, policy), fit_problems(bound, policy)):
        assert problems == [
            "drafter vocabulary size 96 does not match the target's 104; pass both tokenizers if the "
            "difference is only padding rows"
        ]


def test_an_eagle3_head_names_every_way_it_does_not_fit(policy):
    head = Eagle3Head(Eagle3Config.for_target(policy.config))
    assert fit_problems(head, policy) == [] and fit_problems(as_drafter(head, policy, RolloutConfig()), policy) == []
    other = tiny_random_model("qwen2", seed=1, num_layers=6, hidden_size=32, vocab_size=100)
    problems = fit_problems(head, other)
    assert len(problems) == 3
    assert "hidden size 64, this target has 32" in problems[0]
    assert "vocabulary size 96, this target has 100" in problems[1]
    assert "number of layers 4, this target has 6 (the head taps the inputs of layers" in problems[2]


def test_a_self_speculative_drafter_needs_fewer_layers_than_the_policy(policy):
    assert fit_problems("self:2", policy) == []
    assert fit_problems(as_drafter("self:3", policy, RolloutConfig()), policy) == []
    shallow = tiny_random_model("qwen2", seed=1, num_layers=2)
    assert "must be an int in [1, 1] for this 2-layer model, got 2" in fit_problems("self:2", shallow)[0]
    assert fit_problems(None, policy) == []


def test_drafters_declare_their_optional_capabilities(policy):
    """Callers check capabilities by type (``draft_contract``'s protocols), not by probing names."""
    from tailspec.draft_contract import Portable, Stateful, Versioned
    from tailspec.drafter.factory import build_drafters

    lm = tiny_random_model("llama", seed=2, num_layers=1)
    for user_drafter in (lm, Eagle3Head(Eagle3Config.for_target(policy.config)), "self:2"):
        drafters = build_drafters(user_drafter, policy, RolloutConfig(), policy.config.vocab_size)
        assert isinstance(drafters.model, Portable) and isinstance(drafters.model, Versioned)
        assert isinstance(drafters.suffix, Stateful) and not isinstance(drafters.suffix, Portable)
        assert not isinstance(drafters.hybrid, (Portable, Versioned))


def test_every_drafter_kind_is_built_by_the_registry_with_the_engines_settings(policy):
    """What a user hands over picks its kind by type; the kind builds it with the engine's KV pool,
    block size and seed, and the parts online training gives it (a recording buffer, an adapter)."""
    from tailspec.drafter.eagle3 import Eagle3Drafter, FeatureBuffer
    from tailspec.drafter.factory import drafter_kind
    from tailspec.drafter.self_spec import ExitAdapter, SelfSpecDrafter
    from tailspec.drafter.small_lm import SmallLMDrafter

    lm = tiny_random_model("llama", seed=2, num_layers=1)
    head = Eagle3Head(Eagle3Config.for_target(policy.config))
    built = as_drafter(lm, policy, RolloutConfig())
    assert [drafter_kind(s).name for s in (built, "self:2", head, lm)] == ["drafter", "self", "eagle3", "small_lm"]
    assert as_drafter(built, policy, RolloutConfig()) is built  # a Drafter is taken as it is
    config = RolloutConfig(block_size=8, kv_cache_tokens=512, draft_kv_cache_tokens=256, seed=7)
    buffer = FeatureBuffer(1 << 20)
    eagle = as_drafter(head, policy, config, buffer=buffer)
    assert isinstance(eagle, Eagle3Drafter) and eagle.buffer is buffer
    adapter = ExitAdapter(policy.config.hidden_size, 2)
    selfish = as_drafter("self:2", policy, config, adapter=adapter, seed=3)
    assert isinstance(selfish, SelfSpecDrafter) and selfish.adapter is adapter
    small = as_drafter(lm, policy, config)
    assert type(small) is SmallLMDrafter and (small.block_size, small.allocator.num_free, small.seed) == (8, 32, 7)
    with pytest.raises(ValueError, match="drafter must be a tailspec Drafter or a torch.nn.Module, got int"):
        as_drafter(3, policy, config)


@pytest.mark.parametrize("kind", ["an EAGLE-3 head", "a drafter LM"])
def test_a_model_drafter_on_another_device_than_its_target_is_a_clear_error(policy, kind):
    """GPU run 12: an EAGLE-3 head left on the CPU beside a policy on CUDA failed in its first
    draft with a mixed-device matmul. (A head on the meta device stands in for the other device.)"""
    if kind == "an EAGLE-3 head":
        drafter = Eagle3Head(Eagle3Config.for_target(policy.config)).to("meta")
    else:
        drafter = tiny_random_model("llama", seed=2, num_layers=1).to("meta")
    with pytest.raises(ValueError, match=rf"drafter \({kind}\) is on meta, the model it drafts for on cpu: move it"):
        as_drafter(drafter, policy, RolloutConfig())
