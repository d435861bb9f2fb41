"""Tiny random models of every causal-LM family transformers registers, built so that what sets a
family apart decides tokens: attention logits large (q and k projections scaled up), soft caps
low, sinks drawn large, sliding windows shorter than a completion. ``no_cache_greedy`` is the
oracle: greedy decoding that recomputes the whole sequence at every token with transformers'
eager attention and no cache (what HF ``generate`` gives, without trusting any cache).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 128
# size fields as transformers' configs name them, set wherever a family's config has them
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "sliding_window": 6,
    "attention_chunk_size": 8,
    # mixtures of experts
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,  # unlike the keys (qk_nope + qk_rope = 24): MLA caches two sizes
    # soft caps low enough to bind
    "attn_logit_softcapping": 4.0,
    "final_logit_softcapping": 8.0,
    # linear attention and state-space mixers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "state_size": 8,
    "time_step_rank": 8,
    "expand": 2,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB,
    # the names older and encoder-decoder families give the same sizes
    "d_model": 64,
    "n_embd": 64,
    "n_head": 4,
    "n_inner": 96,
    "n_positions": 512,
    "ffn_dim": 96,
    "d_ff": 96,
    "d_kv": 16,
    "num_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 96,
    "encoder_ffn_dim": 96,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "max_seq_len": 512,
    "emb_dim": 64,
    "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": VOCAB,
    "n_layers": 2,
    "n_heads": 4,
}
MAX_LAYERS = 8
Q_K_SCALE = 1.0


def causal_lm_families() -> list[str]:
    """Every model type transformers maps to a causal LM, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrunk(config: PretrainedConfig) -> dict[str, Any]:
    """The size fields ``config`` has, set to :data:`SIZES`; sub-configs shrunk the same way; as
    many layers as the family's default layer pattern needs to show every kind it holds."""
    out: dict[str, Any] = {}
    fields = config.to_dict()
    for name, value in SIZES.items():
        if fields.get(name) is not None:
            out[name] = value
    if any(k in out for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        out["num_experts_per_tok"] = SIZES["num_experts_per_tok"]
        if fields.get("num_experts_per_token") is not None:  # Kimi-Linear's name for it
            out["num_experts_per_token"] = SIZES["num_experts_per_tok"]
    if fields.get("kv_lora_rank") is not None and "num_key_value_heads" in out:  # MLA: one K/V head a query head
        out["num_key_value_heads"] = out["num_attention_heads"]
    if "qk_rope_head_dim" in out:  # MLA: head_dim is the rotary part
        if "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
        if fields.get("qk_head_dim") is not None:
            out["qk_head_dim"] = out["qk_rope_head_dim"] + out["qk_nope_head_dim"]
    if "mamba_n_heads" in out:  # Mamba-2: heads x head size = its inner size (expand x hidden, or Falcon-H1's d_ssm)
        inner = fields.get("mamba_expand", 2) * out["hidden_size"]
        if fields.get("mamba_d_ssm") is not None:
            out["mamba_d_ssm"] = inner
        out["mamba_n_heads"] = inner // out.get("mamba_d_head", 16)
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            out[name] = _rebuilt(value)
    layers = fields.get("num_hidden_layers")
    if isinstance(layers, int):
        pattern = fields.get("layer_types")
        n = min(layers, 2)
        if isinstance(pattern, list) and pattern:
            kinds = set(pattern)
            while n < min(len(pattern), MAX_LAYERS) and set(pattern[:n]) != kinds:
                n += 1
        for name, value in fields.items():  # every per-layer list and table cut to the layers kept
            if isinstance(value, list) and len(value) == layers and name not in out:
                out[name] = list(value[:n])
            elif name == "per_layer_config" and isinstance(value, dict):
                out[name] = {k: v for k, v in value.items() if int(k) < n}
        if isinstance(pattern, list) and pattern:
            out["layer_types"] = list(pattern[:n])
        out["num_hidden_layers"] = n
    return out


def _rebuilt(config: PretrainedConfig) -> PretrainedConfig:
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}
    return type(config)(**{**fields, **_shrunk(config)})


def tiny_family_config(model_type: str) -> PretrainedConfig:
    config = _rebuilt(AutoConfig.for_model(model_type))
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if hasattr(config, name):
            setattr(config, name, {"eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}[name])
    return config


def tiny_family_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A random tiny model of ``model_type`` in fp32, eval mode, eager attention, with its
    attention sharpened so that masks, caps and sinks decide its tokens."""
    config = tiny_family_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")):
                param.mul_(Q_K_SCALE)
            elif name.endswith("sinks"):
                param.normal_(0.0, 2.0)
    return model.eval()


@torch.no_grad()
def no_cache_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The log-probability of each completion token after the tokens before it, from one forward
    over the whole sequence without a cache (``[len(completion)]``, float64)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion, device=device).unsqueeze(-1))[:, 0].cpu()


@torch.no_grad()
def no_cache_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_id: int = 1) -> list[int]:
    """Greedy tokens, each from a full recompute of the sequence so far (no cache), cut after EOS."""
    ids = list(prompt)
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
        if ids[-1] == eos_id:
            break
    return ids[len(prompt) :]


@torch.no_grad()
def second_and_third_token_joint(model: torch.nn.Module, prompt: list[int], params) -> torch.Tensor:
    """The processed joint of completion tokens 2 and 3 (marginalised over token 1) over the
    vocabulary squared, each from a no-cache forward, walking only the tokens ``params``
    (a ``SamplingParams`` with a small ``top_k``) leaves: what a chi-square test of sampled
    completions compares with."""
    from . import processed_probs

    vocab = model.config.get_text_config().vocab_size

    def probs(ctx: list[int]) -> torch.Tensor:
        return processed_probs(model(torch.tensor([ctx])).logits[:, -1], params)[0]

    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    p1 = probs(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            joint[b] += p1[a] * p2[b] * probs(prompt + [a, b])
    return joint.reshape(-1)


# families whose transformers forward without a cache and with one round differently by more than the
# walk's 1e-4 (Nemotron-H's Mamba-2: its chunked scan against its one-token update, about 1e-3 in a
# token's logprob at tiny size): their oracle is transformers' own cached decode (its ``generate``)
CACHED_ORACLE = frozenset({"nemotron_h"})


@torch.no_grad()
def cached_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The log-probability of each completion token as transformers' own cached decode computes it:
    the prompt in one forward with a cache, then one token a forward (``[len(completion)]``, float64)."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([list(prompt)], device=device), use_cache=True)
    logits, cache, got = out.logits[0, -1], out.past_key_values, []
    for token in completion:
        got.append(logits.double().log_softmax(-1)[token])
        out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
        logits, cache = out.logits[0, -1], out.past_key_values
    return torch.stack(got).cpu()


def oracle_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """What the engine's logprobs are measured against: a no-cache forward, or for the families in
    :data:`CACHED_ORACLE` transformers' cached decode."""
    family = str(getattr(model.config, "model_type", ""))
    return (cached_logprobs if family in CACHED_ORACLE else no_cache_logprobs)(model, prompt, completion)
