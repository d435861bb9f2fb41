"""RolloutConfig(dtype=...): the engine decodes on a copy of the model in that dtype (the trainer's
fp32 weights under bf16 autocast), which decodes as the model cast to that dtype does, follows the
trainer's weight changes, keeps tied weights tied and buffers in their dtype, and leaves the model
as it was."""

import copy

import pytest
import torch
from rollout_helpers import cached_model, random_prompts
from test_spec_greedy import assert_same, good_drafter

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import tiny_random_model

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model with its parameters (not its buffers) in ``dtype``: what the copy must compute."""
    out = copy.deepcopy(model)
    for param in out.parameters():
        param.data = param.data.to(dtype)
    return out


def plain(model, prompts, params=PARAMS):
    return RolloutEngine(model, RolloutConfig(graph_backend="eager")).generate(prompts, params)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_bf16_copy_decodes_as_the_model_in_bf16(arch):
    model, prompts = cached_model(arch), random_prompts(3, seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", dtype="bfloat16"))
    assert_same(engine.generate(prompts, PARAMS), plain(cast_parameters(model, torch.bfloat16), prompts))
    assert engine.model is not model and engine.runner.cache.k[0].dtype == torch.bfloat16
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    rotary = [b for name, b in engine.model.named_buffers() if name.endswith("inv_freq")]
    assert rotary and all(b.dtype == torch.float32 for b in rotary)  # RoPE's frequencies keep fp32
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)


def test_the_copy_follows_weights_the_trainer_changed():
    model, prompts = copy.deepcopy(cached_model("llama")), random_prompts(3, seed=5)
    engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", dtype="bfloat16"))
    engine.generate(prompts, PARAMS)
    captured = engine.runner.graph_pool.keys()
    noise = torch.Generator().manual_seed(3)
    with torch.no_grad():  # an optimizer step: in place
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.05)
    assert_same(engine.generate(prompts, PARAMS), plain(cast_parameters(model, torch.bfloat16), prompts))
    # the copy's tensors never moved: its graphs stay (the new weights may end a sequence sooner and
    # run a batch size the first call did not, which captures one more)
    assert set(captured) <= set(engine.runner.graph_pool.keys())


def test_the_copy_runs_its_own_forward_not_the_trainer_s_wrappers_or_hooks():
    """accelerate replaces a prepared model's ``forward`` with a wrapper closing over the original
    one, and trainers hook modules: the copy must run neither (it would run the source model)."""
    model, prompts = copy.deepcopy(cached_model("llama")), random_prompts(3, seed=7)
    calls = []
    wrapped = model.forward
    model.forward = lambda *args, **kwargs: calls.append("forward") or wrapped(*args, **kwargs)
    model.model.layers[0].register_forward_hook(lambda *args: calls.append("hook"))
    engine = RolloutEngine(model, RolloutConfig(graph_backend="eager", dtype="bfloat16"))
    got = engine.generate(prompts, PARAMS)
    assert calls == []
    del model.forward
    assert_same(got, plain(cast_parameters(model, torch.bfloat16), prompts))


def test_speculation_drafts_on_a_bf16_copy():
    model, prompts = cached_model("llama"), random_prompts(3, seed=6)
    config = RolloutConfig(graph_backend="eager", dtype="bfloat16", strategy="chain:3")
    engine = RolloutEngine(model, config, drafter=good_drafter("llama"))
    outputs = engine.generate(prompts, PARAMS)
    assert all(len(o.completion_ids) == PARAMS.max_new_tokens for o in outputs)
    assert engine.stats.accepted_tokens > 0


def test_tied_weights_stay_tied_in_the_copy():
    model = tiny_random_model("qwen2", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    engine = RolloutEngine(model, RolloutConfig(dtype="float16"))
    copied = engine.model
    assert copied.get_output_embeddings().weight is copied.get_input_embeddings().weight
    assert engine.runner.cast.nbytes == 2 * sum(p.numel() for p in model.parameters())


def test_no_copy_for_auto_or_the_model_s_own_dtype():
    model = cached_model("llama")
    for dtype in ("auto", "float32"):
        engine = RolloutEngine(model, RolloutConfig(dtype=dtype))
        assert engine.model is model and engine.runner.cast is None


def test_a_model_that_cannot_be_copied_gets_a_clear_error():
    import threading

    model = copy.deepcopy(cached_model("llama"))
    model.lock = threading.Lock()  # what a wrapper may hold
    with pytest.raises(ValueError, match="dtype='bfloat16': cannot copy LlamaForCausalLM"):
        RolloutEngine(model, RolloutConfig(dtype="bfloat16"))


def test_dtype_names_its_choices():
    with pytest.raises(ValueError, match="dtype must be 'auto', 'bfloat16', 'float16' or 'float32'"):
        RolloutConfig(dtype="bf16")
