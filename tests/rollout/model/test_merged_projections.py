"""RolloutConfig(merge_projections=True): QKV and gate-up as one GEMM each over merged copies of
their weights give plain decoding's tokens, follow the trainer's weight changes, exist only while
the engine runs the model, and leave the model's parameters as they were."""

import logging

import pytest
import torch
from rollout_helpers import cached_model, random_prompts
from test_spec_greedy import assert_same, good_drafter

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.layer_taps import decoder_layers
from tailspec.testing import ARCHITECTURES, perturbed_copy, tiny_random_model

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8)


def plain(model, prompts, params=PARAMS):
    return RolloutEngine(model, RolloutConfig(graph_backend="eager")).generate(prompts, params)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_merged_projections_decode_as_plain_decoding(arch):
    model, prompts = cached_model(arch), random_prompts(3, seed=8)
    want = plain(model, prompts)
    config = RolloutConfig(graph_backend="eager", strategy="chain:3", merge_projections=True)
    engine = RolloutEngine(model, config, drafter=good_drafter(arch))
    assert_same(engine.generate(prompts, PARAMS), want)
    assert len(engine.runner.merged.groups) == 2 * model.config.num_hidden_layers
    layer = decoder_layers(model)[0]
    assert "forward" not in vars(layer.self_attn.q_proj) and "forward" not in vars(layer.mlp.up_proj)


def test_the_merged_weights_follow_the_trainers_changes_in_place():
    """An optimizer step changes the parameters in place; the next rollout decodes with the new
    weights (the merged copies are refreshed, in place: a captured graph reads the same memory)."""
    model = tiny_random_model("qwen2", seed=4)
    prompts = random_prompts(3, seed=9)
    engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", merge_projections=True))
    assert_same(engine.generate(prompts, PARAMS), plain(model, prompts))
    merged_at = [g.weight.data_ptr() for g in engine.runner.merged.groups]
    moved = perturbed_copy(model, noise=0.5, seed=3)
    with torch.no_grad():
        for p, q in zip(model.parameters(), moved.parameters()):
            p.copy_(q)  # in place, as an optimizer step
    assert_same(engine.generate(prompts, PARAMS), plain(moved, prompts))
    assert [g.weight.data_ptr() for g in engine.runner.merged.groups] == merged_at
    model.load_state_dict(tiny_random_model("qwen2", seed=4).state_dict())  # back, by load_state_dict
    assert_same(engine.generate(prompts, PARAMS), plain(model, prompts))


def test_the_models_parameters_are_untouched_and_share_no_storage(tmp_path):
    """The trainer's module keeps its own parameters: an optimizer, DeepSpeed and save_pretrained
    see the model they had (no parameter aliases the merged copies)."""
    model = tiny_random_model("llama", seed=5)
    before = {name: (p.data_ptr(), p.clone()) for name, p in model.named_parameters()}
    engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", merge_projections=True))
    engine.generate(random_prompts(2, seed=1), PARAMS)
    merged = {g.weight.data_ptr() for g in engine.runner.merged.groups}
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][0] and torch.equal(p, before[name][1]), name
        assert p.data_ptr() not in merged
    model.save_pretrained(tmp_path / "saved")  # safetensors refuses shared tensors
    assert (tmp_path / "saved" / "model.safetensors").is_file()


def test_a_projection_with_a_hook_is_left_as_it_is_and_the_log_says_so(caplog):
    model = tiny_random_model("qwen3", seed=6)
    calls = []
    decoder_layers(model)[1].mlp.up_proj.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    prompts = random_prompts(2, seed=2)
    want = plain(model, prompts)
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="tailspec.rollout.model.merged_projections"):
        engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", merge_projections=True))
    assert_same(engine.generate(prompts, PARAMS), want)
    assert len(engine.runner.merged.groups) == 2 * model.config.num_hidden_layers - 1
    assert calls  # the hook still fires on its layer
    assert sum("not merged" in r.getMessage() for r in caplog.records) == 1


def test_merge_projections_must_be_a_bool():
    with pytest.raises(ValueError, match="merge_projections must be True or False"):
        RolloutConfig(merge_projections=1)
