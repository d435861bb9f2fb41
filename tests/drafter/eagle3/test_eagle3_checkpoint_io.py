"""EAGLE-3 checkpoints (save / load / optimizer state / refusals) and the SGLang / vLLM export layout.

Tiny heads built straight from an :class:`Eagle3Config` (no target model), so this runs in seconds.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen2Config

from tailspec.drafter.eagle3.checkpoint import (
    CHECKPOINT_VERSION,
    Eagle3Checkpoint,
    expected_shapes,
    export_checkpoint,
    head_from_export,
    load_checkpoint,
    read_exported,
    save_checkpoint,
)
from tailspec.drafter.eagle3.model import Eagle3Config, Eagle3Head, vocab_from_counts

# -- what the engines' loaders read --------------------------------------------------------
# Config fields, from reading the loaders:
# * SGLang python/sglang/srt/models/llama_eagle3.py: LlamaModel.__init__ (vocab_size, hidden_size,
#   target_hidden_size -> fc input 3x, num_hidden_layers, rms_norm_eps; `bias` would add an fc bias),
#   LlamaForCausalLMEagle3.__init__ (tie_word_embeddings, draft_vocab_size); the attention / MLP come
#   from python/sglang/srt/models/llama.py LlamaDecoderLayer (num_attention_heads, num_key_value_heads,
#   head_dim, rope_theta, max_position_embeddings, intermediate_size, hidden_act). The tapped ids come
#   from python/sglang/srt/model_executor/model_runner.py: eagle_config["eagle_aux_hidden_state_layer_ids"]
#   and eagle_config.get("use_aux_hidden_state"), passed to llama.py set_eagle3_layers_to_capture,
#   which stores [val + 1 for val in layer_ids] in layers_to_capture; LlamaModel.forward appends
#   hidden_states + residual *before* running layer i for i in layers_to_capture.
# * vLLM vllm/model_executor/models/llama_eagle3.py: LlamaModel.__init__ (eagle_config
#   ["use_aux_hidden_state"], target_hidden_size, num_hidden_layers, rms_norm_eps),
#   Eagle3LlamaForCausalLM.__init__ (draft_vocab_size, vocab_size), the LlamaDecoderLayer override
#   (hidden_size, intermediate_size, hidden_act, head counts, max_position_embeddings); the tapped ids
#   from vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config
#   (top-level eagle_aux_hidden_state_layer_ids; older gpu_model_runner.py
#   _get_eagle3_aux_layers_from_config fell back to eagle_config's), applied as-is by
#   vllm/model_executor/models/llama.py LlamaForCausalLM.set_aux_hidden_state_layers /
#   LlamaModel.forward (appends hidden_states + residual before running layer idx).
LOADER_CONFIG_FIELDS = {
    "architectures",
    "model_type",
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
VLLM_ONLY_FIELDS = {"eagle_aux_hidden_state_layer_ids"}
DTYPE_FIELDS = {"torch_dtype", "dtype", "rope_parameters"}  # transformers 4 / 5 spellings
# Weight names: both engines' load_weights (SGLang LlamaForCausalLMEagle3.load_weights,
# vLLM Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights). Embeddings are omitted:
# both engines take the target's.
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
_STACKED = [(".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj")]
_STACKED += [(".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")]
_LAYER_PARAMS = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
]
# the parameters the engines' LlamaForCausalLMEagle3 modules own (besides the shared embeddings)
SGLANG_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight"} | {
    f"model.midlayer.{p}" for p in _LAYER_PARAMS
}
VLLM_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}
VLLM_PARAMS |= {f"model.layers.0.{p}" for p in _LAYER_PARAMS}


def sglang_param_name(name: str) -> str | None:
    """SGLang LlamaForCausalLMEagle3.load_weights: d2t -> hot_token_id, t2d skipped, stacked
    q/k/v and gate/up, else ``name`` or ``model.{name}`` (unknown names are silently skipped)."""
    if "d2t" in name or "t2d" in name:
        return None
    for shard, fused in _STACKED:
        if shard in name:
            name = name.replace(shard, fused)
            break
    return name if name in SGLANG_PARAMS else f"model.{name}"


def vllm_param_name(name: str) -> str | None:
    """vLLM Eagle3LlamaForCausalLM.load_weights (t2d skipped, d2t renamed, ``model.`` prefix except
    lm_head) then LlamaModel.load_weights (midlayer. -> layers.0., stacked q/k/v and gate/up;
    unknown names raise KeyError)."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in name:
        name = "model." + name.replace("midlayer.", "layers.0.")
    for shard, fused in _STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


# -- fixtures ----------------------------------------------------------------------------
def tiny_config(**overrides) -> Eagle3Config:
    values = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        draft_vocab_size=50,
        target_hidden_size=24,  # != hidden_size: fc is [32, 3 * 24]
        target_num_layers=6,
        aux_layer_ids=(1, 3, 5),
        rope_theta=5000.0,
        max_position_embeddings=256,
    )
    values.update(overrides)
    return Eagle3Config(**values)


def tiny_head(seed: int = 0, **overrides) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(tiny_config(**overrides))
    head.reset_parameters(std=0.2)
    with torch.no_grad():  # norms away from all-ones so a mixed-up norm would show
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return head


def matching_target(**overrides) -> Qwen2Config:
    values = dict(hidden_size=24, vocab_size=50, num_hidden_layers=6, num_attention_heads=4, intermediate_size=64)
    values.update(overrides)
    return Qwen2Config(**values)


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


def outputs(head: Eagle3Head, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden out, draft logits) of a dense causal forward on fixed random inputs."""
    g = torch.Generator().manual_seed(seed)
    dtype = head.fc.weight.dtype
    embeds = torch.randn(2, 5, head.config.hidden_size, generator=g).to(dtype)
    features = torch.randn(2, 5, head.config.feature_size, generator=g).to(dtype)
    positions = torch.arange(5).expand(2, -1)
    with torch.no_grad():
        return head(embeds, head.project(features), positions, attend)


def assert_same_state(a: Eagle3Head, b: Eagle3Head) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def assert_same_tree(a, b, where: str = "") -> None:
    """Exact equality of nested optimizer state, types included (tuple stays tuple, 0-d tensors keep dtype)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


def train_steps(head: Eagle3Head, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(seed + i)
        embeds = torch.randn(2, 5, head.config.hidden_size, generator=g)
        features = torch.randn(2, 5, head.config.feature_size, generator=g)
        _, logits = head(embeds, head.project(features), torch.arange(5).expand(2, -1), attend)
        logits.float().logsumexp(-1).mean().backward()
        opt.step()


# -- expected shapes ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"draft_vocab_size": 20}, {"num_key_value_heads": 4, "head_dim": 4}])
def test_expected_shapes_describe_the_heads_state_dict(overrides):
    head = tiny_head(**overrides)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == expected_shapes(head.config)
    assert set(expected_shapes(head.config)) == LOADER_WEIGHTS


# -- save / load -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip(tmp_path, dtype):
    head = tiny_head().to(dtype)
    path = save_checkpoint(tmp_path / "ck", head, step=12, version=3, metadata={"run": "a", "n": [1, 2]})
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "tailspec-eagle3" and config["checkpoint_version"] == CHECKPOINT_VERSION == 1
    assert config["eagle3_config"] == head.config.to_dict() and "optimizer" not in config
    ckpt = load_checkpoint(path, target_config=matching_target())
    assert isinstance(ckpt, Eagle3Checkpoint)
    assert (ckpt.step, ckpt.version, ckpt.metadata, ckpt.optimizer_state) == (12, 3, {"run": "a", "n": [1, 2]}, None)
    assert ckpt.head.version == 3 and ckpt.head.config == head.config
    assert_same_state(head, ckpt.head)
    for a, b in zip(outputs(head), outputs(ckpt.head)):
        assert torch.equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary directories left behind


def test_optimizer_state_round_trips_and_training_continues_identically(tmp_path):
    head = tiny_head(draft_vocab_size=20)
    head.set_vocab_map(vocab_from_counts(torch.arange(50) % 9, 20))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    train_steps(head, opt, 2, seed=0)
    path = save_checkpoint(tmp_path / "ck", head, step=2, optimizer_state=opt.state_dict())

    config = json.loads((path / "config.json").read_text())
    assert config["optimizer"]["state"]["0"]["step"] == {"__scalar__": 2.0, "dtype": "float32"}  # a number in JSON
    assert config["optimizer"]["param_groups"][0]["lr"] == 1e-2
    n_params = len(list(head.parameters()))
    names = {f"state.{i}.{n}" for i in range(n_params) for n in ("exp_avg", "exp_avg_sq")}
    assert set(load_file(str(path / "optimizer.safetensors"))) == names

    ckpt = load_checkpoint(path)
    assert_same_tree(ckpt.optimizer_state, opt.state_dict())
    restored = torch.optim.AdamW(ckpt.head.parameters(), lr=1.0)  # hyper-parameters come from the state
    restored.load_state_dict(ckpt.optimizer_state)
    assert_same_tree(restored.state_dict(), opt.state_dict())

    train_steps(head, opt, 3, seed=100)
    train_steps(ckpt.head, restored, 3, seed=100)
    assert_same_state(head, ckpt.head)
    assert_same_tree(restored.state_dict(), opt.state_dict())


def test_overwrite_replaces_whole_checkpoints_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    import tailspec.drafter.eagle3.checkpoint as checkpoint

    first, second = tiny_head(seed=1), tiny_head(seed=2)
    opt = torch.optim.AdamW(first.parameters())
    train_steps(first, opt, 1, seed=0)
    path = save_checkpoint(tmp_path / "ck", first, step=1, optimizer_state=opt.state_dict())
    save_checkpoint(path, second, step=2)  # replaces everything, the optimizer file included
    assert not (path / "optimizer.safetensors").exists()
    assert_same_state(load_checkpoint(path).head, second)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, first, step=3)
    monkeypatch.undo()
    ckpt = load_checkpoint(path)
    assert ckpt.step == 2
    assert_same_state(ckpt.head, second)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]

    other = tmp_path / "not_a_checkpoint"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to replace"):
        save_checkpoint(other, first)
    with pytest.raises(ValueError, match="refusing to replace"):
        export_checkpoint(first, other, format="vllm")
    assert (other / "notes.txt").read_text() == "keep me"


def test_unreadable_checkpoints_are_refused(tmp_path):
    head = tiny_head()
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    path = save_checkpoint(tmp_path / "ck", head)
    config_text = (path / "config.json").read_text()
    config = json.loads(config_text)
    weights = (path / "model.safetensors").read_bytes()

    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_checkpoint(path)
    for bad, match in [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({**config, "format": "other"}), "not a tailspec EAGLE-3 checkpoint"),
        (json.dumps({k: v for k, v in config.items() if k != "format"}), "not a tailspec EAGLE-3 checkpoint"),
        (json.dumps({**config, "checkpoint_version": CHECKPOINT_VERSION + 1}), "checkpoint_version 2"),
        (json.dumps({**config, "checkpoint_version": "1"}), "checkpoint_version"),
        (json.dumps({k: v for k, v in config.items() if k != "eagle3_config"}), "eagle3_config"),
        (json.dumps({**config, "optimizer": {"state": {}, "param_groups": []}}), "optimizer.safetensors is missing"),
    ]:
        (path / "config.json").write_text(bad)
        with pytest.raises(ValueError, match=match):
            load_checkpoint(path)
    (path / "config.json").write_text(config_text)

    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        load_checkpoint(path)
    for corrupt in (weights[: len(weights) // 2], weights[:6], b"\x00" * 64, b"\xff" * 16 + weights[16:]):
        (path / "model.safetensors").write_bytes(corrupt)
        with pytest.raises(ValueError, match="model.safetensors is corrupted"):
            load_checkpoint(path)


@pytest.mark.parametrize(
    "change, match",
    [
        ("missing", r"missing keys \['midlayer.hidden_norm.weight'\], unexpected keys \[\]"),
        ("extra", r"missing keys \[\], unexpected keys \['embed_tokens.weight'\]"),
        ("shape", r"fc.weight has shape \[32, 10\], expected \[32, 72\]"),
        ("vocab_shape", r"lm_head.weight has shape \[49, 32\], expected \[50, 32\]"),
        ("d2t_dtype", "d2t must be an integer tensor"),
        ("t2d_dtype", "t2d must be bool"),
        ("d2t_range", "d2t maps draft ids outside the target vocabulary"),
        ("nan", "norm.weight holds NaN or inf"),
    ],
)
def test_mis_keyed_or_mis_shaped_weights_are_refused(tmp_path, change, match):
    path = save_checkpoint(tmp_path / "ck", tiny_head())
    tensors = load_file(str(path / "model.safetensors"))
    if change == "missing":
        del tensors["midlayer.hidden_norm.weight"]
    elif change == "extra":
        tensors["embed_tokens.weight"] = torch.zeros(50, 32)
    elif change == "shape":
        tensors["fc.weight"] = torch.zeros(32, 10)
    elif change == "vocab_shape":
        tensors["lm_head.weight"] = torch.zeros(49, 32)
    elif change == "d2t_dtype":
        tensors["d2t"] = tensors["d2t"].float()
    elif change == "t2d_dtype":
        tensors["t2d"] = tensors["t2d"].long()
    elif change == "d2t_range":
        tensors["d2t"][-1] = 1
    else:
        tensors["norm.weight"][3] = float("nan")
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path)


def test_checkpoints_for_another_target_are_refused(tmp_path):
    path = save_checkpoint(tmp_path / "ck", tiny_head())
    load_checkpoint(path, target_config=matching_target())
    for overrides, match in [
        ({"hidden_size": 32}, "hidden size 24, this target has 32"),
        ({"vocab_size": 64}, "vocabulary size 50, this target has 64"),
        ({"num_hidden_layers": 8}, "number of layers 6, this target has 8"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_checkpoint(path, target_config=matching_target(**overrides))


def test_save_refuses_what_it_could_not_load(tmp_path):
    head = tiny_head()
    with pytest.raises(ValueError, match="JSON-serializable"):
        save_checkpoint(tmp_path / "a", head, metadata={"t": torch.zeros(1)})
    with pytest.raises(ValueError, match="optimizer_state must be"):
        save_checkpoint(tmp_path / "b", head, optimizer_state={"weights": 1})
    with torch.no_grad():
        head.fc.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="fc.weight holds NaN or inf"):
        save_checkpoint(tmp_path / "c", head)
    assert list(tmp_path.iterdir()) == []


# -- export ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_export_matches_what_the_engines_load(tmp_path, fmt):
    head = tiny_head()
    out = export_checkpoint(head, tmp_path / fmt, format=fmt)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tailspec_export.json"]
    config, tensors = read_exported(out)

    extra = VLLM_ONLY_FIELDS if fmt == "vllm" else set()
    assert set(config) == LOADER_CONFIG_FIELDS | DTYPE_FIELDS | extra  # nothing else (e.g. no `bias`)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["hidden_act"] == "silu"
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (50, 50, 24)
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (32, 48, 8)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["rope_theta"], config["max_position_embeddings"], config["rms_norm_eps"]) == (5000.0, 256, 1e-6)
    assert config["torch_dtype"] == "float32"
    engine_ids = [0, 2, 4] if fmt == "sglang" else [1, 3, 5]  # ours are (1, 3, 5): SGLang adds 1, vLLM doesn't
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": engine_ids, "use_aux_hidden_state": True}
    if fmt == "vllm":
        assert config["eagle_aux_hidden_state_layer_ids"] == engine_ids
    ours = json.loads((out / "tailspec_export.json").read_text())
    assert ours["aux_layer_ids"] == [1, 3, 5] and ours["export_format"] == fmt

    assert set(tensors) == LOADER_WEIGHTS
    for key, shape in expected_shapes(head.config).items():
        assert tuple(tensors[key].shape) == shape, key
    assert tensors["fc.weight"].shape == (32, 3 * 24)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * 32)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool

    # every weight lands on a parameter of the engine's module (vLLM raises on unknown names, SGLang
    # silently skips them), and every parameter but the shared embeddings is loaded
    rename, params = (sglang_param_name, SGLANG_PARAMS) if fmt == "sglang" else (vllm_param_name, VLLM_PARAMS)
    loaded = {rename(name) for name in tensors} - {None}
    assert loaded == params

    # the config parses as the engines parse it (transformers AutoConfig)
    hf = AutoConfig.from_pretrained(out)
    assert type(hf).__name__ == "LlamaConfig" and hf.num_hidden_layers == 1 and hf.head_dim == 8
    assert hf.draft_vocab_size == 50 and hf.target_hidden_size == 24
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == engine_ids
    assert hf.rope_parameters["rope_theta"] == 5000.0


def test_export_casts_to_the_requested_dtype(tmp_path):
    head = tiny_head(draft_vocab_size=20)
    head.set_vocab_map(vocab_from_counts(torch.arange(50) % 5, 20))
    out = export_checkpoint(head, tmp_path / "bf16", format="vllm", dtype=torch.bfloat16)
    config, tensors = read_exported(out)
    assert config["torch_dtype"] == "bfloat16"
    assert all(tensors[k].dtype == torch.bfloat16 for k in LOADER_WEIGHTS - {"d2t", "t2d"})
    assert torch.equal(tensors["fc.weight"], head.fc.weight.detach().to(torch.bfloat16))
    assert torch.equal(tensors["d2t"], head.d2t) and torch.equal(tensors["t2d"], head.t2d)
    assert head_from_export(out, format="vllm").fc.weight.dtype == torch.bfloat16
    export_checkpoint(head, tmp_path / "named", format="sglang", dtype="float16")
    with pytest.raises(ValueError, match="floating-point dtype"):
        export_checkpoint(head, tmp_path / "int", format="sglang", dtype=torch.int32)


def test_layer_id_conventions_and_refusals(tmp_path, caplog):
    head = tiny_head(aux_layer_ids=(0, 2, 5))
    with pytest.raises(ValueError, match="SGLang cannot tap the embeddings"):
        export_checkpoint(head, tmp_path / "sglang", format="sglang")
    assert not (tmp_path / "sglang").exists()
    with caplog.at_level(logging.WARNING, logger="tailspec.drafter.eagle3.checkpoint"):
        out = export_checkpoint(head, tmp_path / "vllm", format="vllm")
    assert "aux layer id 0" in caplog.text
    assert read_exported(out)[0]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert head_from_export(out, format="vllm").config.aux_layer_ids == (0, 2, 5)

    for fmt in ("trt", "SGLang", ""):
        with pytest.raises(ValueError, match=r"format must be one of \('sglang', 'vllm'\)"):
            export_checkpoint(tiny_head(), tmp_path / "x", format=fmt)
    with pytest.raises(ValueError, match="format must be one of"):
        head_from_export(out, format="hf")
    with pytest.raises(ValueError, match="exported for vllm, not sglang"):
        head_from_export(out, format="sglang")


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_export_then_reload_gives_identical_drafts(tmp_path, fmt):
    head = tiny_head(seed=3, aux_layer_ids=(2, 3, 4))
    head.version = 5
    out = export_checkpoint(head, tmp_path / fmt, format=fmt)
    reloaded = head_from_export(out, format=fmt)
    assert reloaded.config == head.config and reloaded.version == 5
    assert reloaded.config.aux_layer_ids == (2, 3, 4)  # SGLang's -1 undone
    assert_same_state(head, reloaded)
    for seed in range(3):
        for a, b in zip(outputs(head, seed), outputs(reloaded, seed)):
            assert torch.equal(a, b)

    # through a tailspec checkpoint first: save -> load -> export -> reload
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "ck", head))
    again = head_from_export(export_checkpoint(ckpt.head, tmp_path / f"{fmt}2", format=fmt), format=fmt)
    assert_same_state(head, again)


def test_reduced_draft_vocabulary_survives_export(tmp_path):
    head = tiny_head(draft_vocab_size=16)
    ids = vocab_from_counts(torch.arange(50) % 7, 16, always=[1, 49])
    head.set_vocab_map(ids)
    for fmt in ("sglang", "vllm"):
        out = export_checkpoint(head, tmp_path / fmt, format=fmt)
        config, tensors = read_exported(out)
        assert (config["vocab_size"], config["draft_vocab_size"]) == (50, 16)
        assert tensors["lm_head.weight"].shape == (16, 32)
        assert torch.equal(tensors["d2t"], head.d2t) and torch.equal(tensors["t2d"], head.t2d)
        assert int(tensors["t2d"].sum()) == 16 and bool(tensors["t2d"][1]) and bool(tensors["t2d"][49])
        # SGLang's hot_token_id and vLLM's logits scatter both use arange(draft) + d2t
        assert torch.equal(torch.arange(16) + tensors["d2t"], ids)
        reloaded = head_from_export(out, format=fmt)
        assert_same_state(head, reloaded)
        logits, reloaded_logits = outputs(head)[1], outputs(reloaded)[1]
        assert torch.equal(head.target_logits(logits), reloaded.target_logits(reloaded_logits))
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "ck", head))
    assert torch.equal(ckpt.head.d2t, head.d2t) and torch.equal(ckpt.head.t2d, head.t2d)


def test_export_refuses_bad_weights_and_vocabulary_maps(tmp_path):
    def refused(head: Eagle3Head, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            export_checkpoint(head, tmp_path / "out", format="vllm")
        assert not (tmp_path / "out").exists()  # nothing half-written

    head = tiny_head()
    with torch.no_grad():
        head.midlayer.mlp.up_proj.weight[1, 2] = float("nan")
    refused(head, r"midlayer.mlp.up_proj.weight holds NaN or inf")
    head = tiny_head()
    with torch.no_grad():
        head.lm_head.weight[0, 0] = float("-inf")
    refused(head, "lm_head.weight holds NaN or inf")
    head = tiny_head()
    with torch.no_grad():
        head.norm.weight[0] = 1e6  # finite in float32, inf in float16
    with pytest.raises(ValueError, match="NaN or inf"):
        export_checkpoint(head, tmp_path / "out", format="vllm", dtype=torch.float16)

    head = tiny_head(draft_vocab_size=16)  # vocabulary map never set: every draft id -> target 0..15 ok,
    refused(head, "t2d does not mark exactly")  # but t2d is all False
    head.set_vocab_map(torch.arange(16) * 3)
    head.d2t[-1] = 50 - 15  # draft id 15 -> target 50: outside the vocabulary
    refused(head, "outside the target vocabulary")
    head.set_vocab_map(torch.arange(16) * 3)
    head.d2t[-1] = head.d2t[-2] - 1  # two draft ids -> one target id
    refused(head, "same target id")

    head = tiny_head()
    head.register_buffer("extra", torch.zeros(1))
    refused(head, r"unexpected keys \['extra'\]")
    head = tiny_head()
    del head.midlayer.hidden_norm
    refused(head, r"missing keys \['midlayer.hidden_norm.weight'\]")
    head = tiny_head()
    head.norm.weight = torch.nn.Parameter(torch.ones(33))
    refused(head, r"norm.weight has shape \[33\], expected \[32\]")


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_a_crafted_file_in_a_checkpoint_or_export_is_refused_and_never_runs(name, tmp_path, crafted):
    head = tiny_head()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    train_steps(head, opt, 1, seed=0)
    path = save_checkpoint(tmp_path / "ck", head, step=1, optimizer_state=opt.state_dict())
    crafted.pickle_file(path / name)
    with pytest.raises(ValueError, match=f"{name} is corrupted or not a safetensors file"):
        load_checkpoint(path)
    out = export_checkpoint(tiny_head(), tmp_path / "export", format="vllm")
    crafted.pickle_file(out / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors is corrupted or not a safetensors file"):
        head_from_export(out, format="vllm")
    assert not crafted.ran
