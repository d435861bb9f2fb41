"""RolloutEngine.weights_changed: after an optimizer step that bumps no version counter (torch's fused
AdamW, transformers' default optimizer), what the engine derived from the weights (a cast copy, merged
projections, cached prefixes) is made again, and the engine decodes the new weights."""

import copy

import pytest
import torch
from rollout_helpers import cached_model, random_prompts
from test_cast_copy import cast_parameters
from test_spec_greedy import assert_same

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.mark.parametrize("settings", [{"dtype": "bfloat16"}, {"merge_projections": True}, {"prefix_caching": True}])
def test_a_fused_optimizer_step_reaches_the_engine_once_it_is_told(settings):
    model, prompts = copy.deepcopy(cached_model("llama")), random_prompts(3, seed=9)
    engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", **settings))
    engine.generate(prompts, PARAMS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    versions = [p._version for p in model.parameters()]
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions  # torch bumps none: the engine cannot see it
    engine.weights_changed()
    reference = cast_parameters(model, torch.bfloat16) if "dtype" in settings else model
    want = RolloutEngine(reference, RolloutConfig(graph_backend="eager")).generate(prompts, PARAMS)
    assert_same(engine.generate(prompts, PARAMS), want)
