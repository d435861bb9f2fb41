"""The models and prompts the GPU check runs on, loaded without the trainer stack."""

from __future__ import annotations

import torch

from ...tasks.chain_sum import ChainSumConfig, sample_problems
from ...tasks.sft import load_shipped
from ...tasks.tokenizer import chat_ids


def deep_policy(dtype: torch.dtype, device: torch.device):
    """(policy, drafter LM, tokenizer): the shipped deep policy (24 x 256) and its distilled drafter."""
    policy, tokenizer = load_shipped("deep", "policy", dtype=dtype)
    drafter, _ = load_shipped("deep", "drafter", dtype=dtype)
    return policy.to(device), drafter.to(device), tokenizer


def task_prompts(tokenizer, num: int, seed: int) -> list[list[int]]:
    """Chain-sum questions rendered by the chat template with the generation prompt, as the demo asks."""
    problems = sample_problems(num, seed=seed, cfg=ChainSumConfig())
    return [chat_ids(tokenizer, [{"role": "user", "content": p.question}], True) for p in problems]
