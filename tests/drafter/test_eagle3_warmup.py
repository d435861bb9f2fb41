"""The offline warm-up recipe: a fresh head's first round cannot speculate; a continued head does."""

import pytest
import torch

from tailspec.drafter.eagle3.train import DrafterTrainingConfig
from tailspec.drafter.eagle3_warmup import WarmupConfig, warmup_head
from tailspec.tasks.chain_sum import ChainSumConfig, sample_problems
from tailspec.tasks.sft import load_shipped, load_shipped_eagle3
from tailspec.tasks.tokenizer import chat_ids


def _setup():
    model, tokenizer = load_shipped("tiny")
    problems = sample_problems(4, seed=11, cfg=ChainSumConfig())
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p.question}], True) for p in problems]
    cfg = WarmupConfig(
        rounds=1, steps_per_round=1, max_new_tokens=24, training=DrafterTrainingConfig(batch_size=2), seed=0
    )
    return model, tokenizer, prompts, cfg


def test_a_fresh_head_first_rolls_out_without_drafts():
    model, tokenizer, prompts, cfg = _setup()
    head, trainer, rounds = warmup_head(model, prompts, cfg, eos_token_ids=[tokenizer.eos_token_id], progress=False)
    assert rounds[0].accept_length == 1.0 and rounds[0].completions == 4
    assert trainer.step_count == 1


def test_a_continued_head_speculates_from_its_first_round():
    model, tokenizer, prompts, cfg = _setup()
    shipped = load_shipped_eagle3("tiny")
    before = {k: v.clone() for k, v in shipped.state_dict().items()}
    head, _, rounds = warmup_head(
        model, prompts, cfg, head=shipped, eos_token_ids=[tokenizer.eos_token_id], progress=False
    )
    assert rounds[0].accept_length > 1.5  # the shipped head drafts, and its drafts are accepted
    assert any(not torch.equal(before[k], v) for k, v in head.state_dict().items())  # and it trained


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_fresh_head_is_made_beside_its_target():
    model, tokenizer, prompts, cfg = _setup()
    head, _, rounds = warmup_head(model.cuda(), prompts, cfg, eos_token_ids=[tokenizer.eos_token_id], progress=False)
    assert next(head.parameters()).device.type == "cuda" and rounds[0].completions == 4
