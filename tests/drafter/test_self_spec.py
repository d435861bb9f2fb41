"""The self-speculative drafter: the policy's own first layers, lossless, moving with the policy."""

import copy
import functools

import pytest
import torch

from tailspec.draft_contract import DraftRequest, DraftShape
from tailspec.drafter.self_spec import ExitAdapter, SelfSpecDrafter, fit_adapter, shallow_model
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.mirror.hosted import SeqSnapshot
from tailspec.rollout.model.early_exit import exit_agreement
from tailspec.testing import ARCHITECTURES, random_prompts, tiny_random_model


@functools.cache
def policy(arch: str):
    return tiny_random_model(arch, seed=2, num_layers=6, initializer_range=0.1)


def _plain(model, prompts, params):
    return RolloutEngine(model, RolloutConfig()).generate(prompts, params)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_shallow_model_is_the_target_s_first_layers(arch):
    model = policy(arch)
    shallow = shallow_model(model, 2)
    assert shallow.model.layers[0] is model.model.layers[0] and shallow.lm_head is model.lm_head
    assert len(shallow.model.layers) == 2
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[2]
        want = model.lm_head(model.model.norm(hidden))
        assert torch.allclose(shallow(input_ids=ids).logits, want, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("strategy", ["chain:3", "tree:3,2,6", "mirror:chain:3,k=0"])
def test_greedy_with_the_self_drafter_matches_plain_decoding(arch, strategy):
    """Chains and trees are launched from state on the device (rollout/spec/device_step.py); mirror
    steps are drafted from the host's text."""
    model = policy(arch)
    prompts = random_prompts(5, seed=9)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    on_device = not strategy.startswith("mirror")
    config = RolloutConfig(strategy=strategy, mirror={"executor": "inline"})
    engine = RolloutEngine(model, config, drafter=SelfSpecDrafter(model, 3))
    got = engine.generate(prompts, params)
    for a, b in zip(got, _plain(model, prompts, params)):
        assert a.completion_ids == b.completion_ids
    assert engine.stats.accepted_tokens > 0
    assert (engine.stats.overlapped_steps > 0) == on_device
    engine.close()


def test_the_drafter_moves_with_the_policy():
    """No copy: a change to the policy's weights (an optimizer step) is the drafter's change."""
    model = copy.deepcopy(policy("llama"))
    drafter = SelfSpecDrafter(model, 3, kv_cache_tokens=256)
    request = [DraftRequest(greedy_view(random_prompts(1, seed=1)[0]), 4)]
    before = drafter.propose(request, DraftShape(4))[0].tokens
    with torch.no_grad():
        for p in model.model.layers[0].parameters():
            p.add_(torch.randn_like(p) * 0.5)
    drafter.release(0)
    after = drafter.propose(request, DraftShape(4))[0].tokens
    fresh = SelfSpecDrafter(model, 3, kv_cache_tokens=256).propose(request, DraftShape(4))[0].tokens
    assert after == fresh and after != before


def test_the_self_drafter_runs_in_a_draft_process_and_follows_policy_updates():
    model = copy.deepcopy(policy("qwen2"))
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    config = RolloutConfig(strategy="mirror:chain:3,k=0", mirror={"executor": "process"})
    engine = RolloutEngine(model, config, drafter=SelfSpecDrafter(model, 3))
    for a, b in zip(engine.generate(prompts, params), _plain(model, prompts, params)):
        assert a.completion_ids == b.completion_ids
    with torch.no_grad():
        for p in model.model.layers[1].parameters():
            p.mul_(1.5)
    engine.drafters.mirror.pipeline.executor.refresh()  # the policy stepped: the child gets its new layers
    request = [DraftRequest(greedy_view(prompts[0], 77), 3)]
    fresh = SelfSpecDrafter(model, 3, kv_cache_tokens=256).propose(request, DraftShape(3))[0].tokens
    assert engine.drafters.mirror.pipeline.drafter.propose(request, DraftShape(3))[0].tokens == fresh
    for a, b in zip(engine.generate(prompts, params), _plain(model, prompts, params)):
        assert a.completion_ids == b.completion_ids
    engine.close()


def test_an_untrained_adapter_is_the_identity_and_fitting_it_raises_agreement():
    model = policy("qwen3")
    prompts = random_prompts(12, seed=5, min_len=8)
    outs = _plain(model, prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    sequences = [p + o.completion_ids for p, o in zip(prompts, outs)]
    adapter = ExitAdapter(model.config.hidden_size, rank=16)
    ids = torch.tensor([sequences[0]])
    with torch.no_grad():
        plain = shallow_model(model, 2)(input_ids=ids).logits
        adapted = shallow_model(model, 2, adapter)(input_ids=ids).logits
    assert torch.equal(plain, adapted)
    before = exit_agreement(model, sequences, [len(p) for p in prompts], [1])[2][1]
    weights = [p.detach().clone() for p in model.parameters()]
    losses = fit_adapter(model, adapter, sequences, 2, steps=60, lr=3e-3)
    assert losses[-1] < losses[0]
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # the policy is untouched
    hits = _adapted_agreement(model, adapter, sequences, [len(p) for p in prompts])
    assert hits > before


def test_an_fp32_adapter_drafts_and_trains_on_a_bf16_policy():
    """The adapter trains in fp32 whatever the policy's dtype (a bf16 policy on a GPU, or the
    engine's bf16 copy of fp32 weights): it reads and returns the policy's hidden dtype."""
    model = copy.deepcopy(policy("llama")).to(torch.bfloat16)
    prompts = random_prompts(4, seed=6, min_len=8)
    adapter = ExitAdapter(model.config.hidden_size, rank=8)
    sequences = [p + [3, 4, 5, 6] for p in prompts]
    losses = fit_adapter(model, adapter, sequences, 2, steps=3, lr=1e-3)
    assert len(losses) == 3 and adapter.down.weight.dtype == torch.float32
    config = RolloutConfig(strategy="chain:3")
    engine = RolloutEngine(model, config, drafter=SelfSpecDrafter(model, 2, adapter=adapter))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert all(len(o.completion_ids) == 8 for o in outputs) and engine.stats.drafted_tokens > 0


def _adapted_agreement(model, adapter, sequences, prompt_lengths) -> float:
    shallow = shallow_model(model, 2, adapter)
    hits = total = 0
    with torch.no_grad():
        for tokens, p in zip(sequences, prompt_lengths):
            ids = torch.tensor([tokens])
            want = model(input_ids=ids).logits[0, p - 1 : -1].argmax(-1)
            got = shallow(input_ids=ids).logits[0, p - 1 : -1].argmax(-1)
            hits += int((got == want).sum())
            total += want.numel()
    return hits / total


@pytest.mark.parametrize("layers", [0, 6])
def test_layers_outside_the_policy_are_refused(layers):
    with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 5\]"):
        SelfSpecDrafter(policy("llama"), layers)


def greedy_view(prompt, seq_id=0):
    """A bare greedy sequence of ``prompt`` as drafters see one."""
    return SeqSnapshot(seq_id, list(prompt), [], None, frozenset(), SamplingParams(temperature=0.0))


def test_the_self_drafter_by_name():
    from tailspec.demo import DemoConfig

    model = policy("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:2"), drafter="self:2")
    assert isinstance(engine.drafter, SelfSpecDrafter) and engine.drafter.num_layers == 2
    assert DemoConfig(drafter="self:7").drafter == "self:7"
    with pytest.raises(ValueError, match="or 'self:L' \\(the policy's own first L layers\\), got 'selfish'"):
        RolloutEngine(model, RolloutConfig(strategy="chain:2"), drafter="selfish")
    with pytest.raises(ValueError, match="drafter must be 'eagle3', 'small_lm' or 'self:L'"):
        DemoConfig(drafter="self:x")
