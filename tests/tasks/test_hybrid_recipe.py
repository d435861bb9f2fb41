"""The hybrid policy's recipe (tasks/hybrid.py): a Qwen3.5 that starts near the attention policy it is cut from."""

import pytest
import torch

from tailspec.rollout.model.recurrent_state import recurrent_mixers
from tailspec.tasks.hybrid import HybridRecipe, hybrid_config, hybrid_from_deep, task_texts
from tailspec.tasks.sft import load_shipped


@pytest.fixture(scope="module")
def tiny():
    return load_shipped("tiny", "policy")


def _task_text(tokenizer) -> list[torch.Tensor]:
    return task_texts(tokenizer, 4, seed=77)


@torch.no_grad()
def _kl_and_agreement(teacher, student, texts) -> tuple[float, float]:
    kls, agree = [], []
    for ids in texts:
        a, b = teacher(input_ids=ids).logits.log_softmax(-1), student(input_ids=ids).logits.log_softmax(-1)
        kls.append(float((a.exp() * (a - b)).sum(-1).mean()))
        agree.append(float((a.argmax(-1) == b.argmax(-1)).float().mean()))
    return sum(kls) / len(kls), sum(agree) / len(agree)


def test_every_layer_kept_as_attention_computes_nearly_the_policy(tiny):
    """All four layers attention: only Qwen3.5's per-head q/k norms differ from the Qwen2 policy, and
    calibrated to the policy's query and key sizes they cost far less than left at one."""
    model, tokenizer = tiny
    student = hybrid_from_deep(model, tokenizer, attention_layers=(0, 1, 2, 3)).eval()
    kl, agree = _kl_and_agreement(model, student, _task_text(tokenizer))
    assert kl < 0.4 and agree > 0.9  # 0.26 and 94.5% when measured
    uncalibrated = hybrid_from_deep(model, tokenizer, attention_layers=(0, 1, 2, 3)).eval()
    with torch.no_grad():
        for layer in uncalibrated.model.layers:  # q/k norms left at one: attention far softer than the policy's
            layer.self_attn.q_norm.weight.zero_()
            layer.self_attn.k_norm.weight.zero_()
    assert _kl_and_agreement(model, uncalibrated, _task_text(tokenizer))[0] > 3 * kl  # 1.68 when measured


def test_the_gated_deltanet_layers_start_silent_and_the_rest_is_copied(tiny):
    model, tokenizer = tiny
    student = hybrid_from_deep(model, tokenizer, attention_layers=(0, 2))
    assert student.config.layer_types == ["full_attention", "linear_attention"] * 2
    mixers = recurrent_mixers(student)
    assert len(mixers) == 2 and all(float(m.out_proj.weight.abs().max()) == 0 for m in mixers)
    for layer, source in zip(student.model.layers, model.model.layers):
        torch.testing.assert_close(layer.input_layernorm.weight + 1, source.input_layernorm.weight)
        torch.testing.assert_close(layer.mlp.down_proj.weight, source.mlp.down_proj.weight)
    attention, original = student.model.layers[2].self_attn, model.model.layers[2].self_attn
    head = student.config.head_dim
    query_and_gate = attention.q_proj.weight.view(-1, 2, head, original.q_proj.in_features)
    torch.testing.assert_close(query_and_gate[:, 0].reshape(-1, original.q_proj.in_features), original.q_proj.weight)
    assert float(query_and_gate[:, 1].abs().max()) == 0  # the output gate: one half for every input
    torch.testing.assert_close(attention.o_proj.weight, 2 * original.o_proj.weight)


def test_bad_settings_are_refused_by_name(tiny):
    with pytest.raises(ValueError, match="attention_layers must be within 0..3"):
        hybrid_config(tiny[0].config, (0, 4))
    with pytest.raises(ValueError, match="distill_lr must be > 0"):
        HybridRecipe(distill_lr=0)
    with pytest.raises(ValueError, match="drafter_steps must be >= 0"):
        HybridRecipe(drafter_steps=-1)


def test_a_run_names_what_it_cannot_do_before_training(tmp_path):
    from tailspec.tasks.hybrid import run_hybrid_recipe

    with pytest.raises(ValueError, match=r"stages must be a non-empty subset of \('policy', 'drafter', 'eval'\)"):
        run_hybrid_recipe(HybridRecipe(), tmp_path, ("policy", "head"))
    with pytest.raises(FileNotFoundError, match="policy is missing: run `tailspec train-hybrid`"):
        run_hybrid_recipe(HybridRecipe(), tmp_path, ("drafter",))  # nothing saved a policy there
