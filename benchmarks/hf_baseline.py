"""The baseline TRL uses without vLLM: one batched Hugging Face ``generate`` call per batch.

Mirrors ``trl.GRPOTrainer._generate_single_turn``'s transformers path: left-padded prompts, a
``GenerationConfig`` built from the sampling parameters, completions cut after the first EOS.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from ..rollout.params import SamplingParams


def hf_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_token_ids: list[int],
    pad_token_id: int,
) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        do_sample=not params.greedy,
        temperature=params.temperature if not params.greedy else None,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p or None,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids,
        disable_compile=True,
    )
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    completions = []
    eos = set(eos_token_ids)
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        completions.append(row[:cut])
    return completions
