"""EAGLE-3 checkpoints and SGLang / vLLM export: round trips, refusals, the loaders' field list."""

import json

import pytest
import torch
import torch.nn.functional as F
from eagle3_helpers import random_head, random_prompts, target
from transformers import Qwen2Config

from tailspec.drafter.eagle3 import Eagle3Drafter, Eagle3Head
from tailspec.drafter.eagle3.checkpoint import (
    export_checkpoint,
    head_from_export,
    load_checkpoint,
    read_exported,
    save_checkpoint,
)
from tailspec.drafter.eagle3.model import vocab_from_counts
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams

# What the engines' EAGLE-3 loaders read (shared/REFERENCE_NOTES.md, from SGLang
# python/sglang/srt/models/llama_eagle3.py LlamaForCausalLMEagle3.__init__/load_weights and vLLM
# vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.__init__/load_weights):
# config fields, and weight names (vLLM renames midlayer. -> layers.0. and d2t ->
# draft_id_to_target_id and raises on unknown names; SGLang maps d2t to hot_token_id and
# ignores t2d). Embeddings are omitted: both engines take the target's.
LOADER_CONFIG_FIELDS = {
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "hidden_act",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "tie_word_embeddings",
    "eagle_config",
}
LOADER_WEIGHTS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def dense_outputs(head: Eagle3Head, seed: int = 0, grad: bool = False):
    """(hidden out, logits) of a causal dense forward on fixed random inputs."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(2, 7, head.config.hidden_size, generator=g)
    features = torch.randn(2, 7, head.config.feature_size, generator=g)
    positions = torch.arange(7).expand(2, -1)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    with torch.set_grad_enabled(grad):
        return head(embeds, head.project(features), positions, attend)


def test_save_load_round_trip_with_optimizer(tmp_path):
    model = target("qwen2")
    head = random_head(model, std=0.05)
    head.version = 7
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        dense_outputs(head, grad=True)[1].pow(2).sum().backward()
        opt.step()
    path = save_checkpoint(
        tmp_path / "ck", head, step=2, version=7, optimizer_state=opt.state_dict(), metadata={"note": "x"}
    )
    ckpt = load_checkpoint(path, target_config=model.config)
    assert (ckpt.step, ckpt.version, ckpt.metadata) == (2, 7, {"note": "x"})
    for key, value in head.state_dict().items():
        assert torch.equal(ckpt.head.state_dict()[key], value), key
    for a, b in zip(dense_outputs(head), dense_outputs(ckpt.head)):
        assert torch.equal(a, b)
    # continuing from the loaded optimizer gives the same weights as never having saved
    restored = torch.optim.AdamW(ckpt.head.parameters(), lr=1e-2)
    restored.load_state_dict(ckpt.optimizer_state)
    x = torch.randn(3, 64)
    for h, o in ((head, opt), (ckpt.head, restored)):
        o.zero_grad()
        h.lm_head(x).pow(2).sum().backward()
        o.step()
    assert torch.equal(head.lm_head.weight, ckpt.head.lm_head.weight)


def test_trainer_save_and_load_resume_exactly(tmp_path):
    from eagle3_helpers import collect

    from tailspec.drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig

    model = target("qwen2")
    head = random_head(model, std=0.02)
    _, _, buffer = collect(model, head, random_prompts(6, seed=2), SamplingParams(max_new_tokens=12, temperature=1.0))
    trainer = DrafterTrainer(head, model.get_input_embeddings(), buffer, DrafterTrainingConfig(batch_size=2))
    trainer.train(2)
    trainer.save(tmp_path / "ck")
    other = DrafterTrainer(random_head(model, seed=9), model.get_input_embeddings(), buffer, DrafterTrainingConfig())
    other.load(tmp_path / "ck", target_config=model.config)
    assert other.step_count == 2 and other.head.version == 2
    for key, value in head.state_dict().items():
        assert torch.equal(other.head.state_dict()[key], value)


def test_bad_checkpoints_are_refused(tmp_path):
    model = target("qwen2")
    head = random_head(model)
    path = save_checkpoint(tmp_path / "ck", head)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    # made for another target
    with pytest.raises(ValueError, match="hidden size"):
        load_checkpoint(path, target_config=Qwen2Config(hidden_size=128, vocab_size=96, num_hidden_layers=2))
    with pytest.raises(ValueError, match="vocabulary size"):
        load_checkpoint(path, target_config=Qwen2Config(hidden_size=64, vocab_size=100, num_hidden_layers=2))
    with pytest.raises(ValueError, match="number of layers"):
        load_checkpoint(path, target_config=Qwen2Config(hidden_size=64, vocab_size=96, num_hidden_layers=4))
    # corrupted weights
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupted"):
        load_checkpoint(path)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupted"):
        load_checkpoint(path)
    # not JSON, not ours, too new
    path = save_checkpoint(tmp_path / "ck2", head)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**config, "format": "other"}))
    with pytest.raises(ValueError, match="not a tailspec EAGLE-3 checkpoint"):
        load_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**config, "checkpoint_version": 99}))
    with pytest.raises(ValueError, match="checkpoint_version"):
        load_checkpoint(path)


@pytest.mark.parametrize("change", ["missing", "extra", "shape"])
def test_mis_keyed_weights_are_refused(tmp_path, change):
    from safetensors.torch import load_file, save_file

    head = random_head(target("qwen2"))
    path = save_checkpoint(tmp_path / "ck", head)
    tensors = load_file(str(path / "model.safetensors"))
    if change == "missing":
        del tensors["midlayer.hidden_norm.weight"]
        match = "missing keys \\['midlayer.hidden_norm.weight'\\]"
    elif change == "extra":
        tensors["embed_tokens.weight"] = torch.zeros(96, 64)
        match = "unexpected keys \\['embed_tokens.weight'\\]"
    else:
        tensors["fc.weight"] = torch.zeros(64, 10)
        match = "fc.weight has shape \\[64, 10\\], expected \\[64, 192\\]"
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_export_matches_the_loaders_and_reloads_to_identical_drafts(tmp_path, fmt):
    model = target("llama", num_layers=4)
    head = random_head(model, aux_layer_ids=(1, 2, 3))
    out = export_checkpoint(head, tmp_path / fmt, format=fmt)
    config, tensors = read_exported(out)
    assert LOADER_CONFIG_FIELDS <= set(config)
    assert set(tensors) == LOADER_WEIGHTS
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 96 and config["draft_vocab_size"] == 96 and config["target_hidden_size"] == 64
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == ([0, 1, 2] if fmt == "sglang" else [1, 2, 3])  # SGLang adds 1; vLLM uses ids as-is
    assert config["eagle_config"]["use_aux_hidden_state"] is True

    reloaded = head_from_export(out, format=fmt)
    assert reloaded.config.aux_layer_ids == (1, 2, 3)
    prompts = random_prompts(4, seed=6)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3)
    runs = []
    for h in (head, reloaded):
        engine = RolloutEngine(model, RolloutConfig(strategy="chain:3", seed=1), drafter=Eagle3Drafter(h, model))
        runs.append(
            (
                [o.completion_ids for o in engine.generate(prompts, params)],
                engine.stats.drafted_tokens,
                engine.stats.accepted_tokens,
            )
        )
    assert runs[0] == runs[1]


def test_export_refusals(tmp_path):
    model = target("llama", num_layers=4)
    with pytest.raises(ValueError, match="SGLang cannot tap the embeddings"):
        export_checkpoint(random_head(model, aux_layer_ids=(0, 2, 3)), tmp_path / "a", format="sglang")
    head = random_head(model)
    with pytest.raises(ValueError, match="format must be one of"):
        export_checkpoint(head, tmp_path / "b", format="trt")
    with torch.no_grad():
        head.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        export_checkpoint(head, tmp_path / "c", format="vllm")
    assert not (tmp_path / "c").exists()  # nothing half-written


def test_reduced_draft_vocabulary_survives_export(tmp_path):
    model = target("qwen2")
    head = random_head(model, draft_vocab_size=32)
    head.set_vocab_map(vocab_from_counts(torch.arange(96) % 7, 32, always=[1]))
    out = export_checkpoint(head, tmp_path / "v", format="vllm")
    _, tensors = read_exported(out)
    assert torch.equal(tensors["d2t"], head.d2t) and torch.equal(tensors["t2d"], head.t2d)
    assert int(tensors["t2d"].sum()) == 32 and bool(tensors["t2d"][1])
    assert torch.equal(torch.arange(32) + tensors["d2t"], head.draft_to_target_ids())
    reloaded = head_from_export(out, format="vllm")
    for a, b in zip(dense_outputs(head), dense_outputs(reloaded)):
        assert torch.equal(a, b)
