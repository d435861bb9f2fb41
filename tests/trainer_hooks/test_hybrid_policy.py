"""A hybrid policy (Qwen3.5's Gated DeltaNet beside attention) where users train: SpecRollout's
rollouts stay its plain decoding's while an EAGLE-3 head tapping the hybrid stack and a drafter LM
train online between them, and the trained head exports to what SGLang and vLLM load."""

import torch
from trainer_stand_in import greedy_trainer
from transformers import AutoModelForCausalLM

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.drafter.eagle3.checkpoint import export_checkpoint, head_from_export
from tailspec.drafter.eagle3.train import DrafterTrainingConfig
from tailspec.testing import tiny_task_policy
from tailspec.testing.families import tiny_family_config
from tailspec.trainer_hooks import SpecRollout


def _hybrid_policy(tokenizer):
    config = tiny_family_config("qwen3_5_text")
    config.vocab_size, config.eos_token_id, config.pad_token_id = len(tokenizer), tokenizer.eos_token_id, 0
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


PROMPTS = [[{"role": "user", "content": f"add {i} {i + 2} {i + 1}"}] for i in range(3) for _ in range(2)]


def test_an_eagle3_head_on_a_hybrid_policy_trains_online_and_exports(task_tokenizer, tmp_path):
    policy = _hybrid_policy(task_tokenizer)
    trainer, metrics = greedy_trainer(task_tokenizer, policy)
    plain = SpecRollout(model=policy)(PROMPTS, trainer)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(policy.config))
    rollout = SpecRollout(
        model=policy,
        strategy="chain:3",
        drafter=head,
        drafter_train_steps=2,
        drafter_training=DrafterTrainingConfig(batch_size=2),
    )
    for call in range(2):
        assert rollout(PROMPTS, trainer)["completion_ids"] == plain["completion_ids"]
        assert rollout.last_stats.drafter_version == 2 * (call + 1)
    assert len(metrics["eval"]["drafter/loss"]) == 2
    for fmt in ("sglang", "vllm"):
        out = export_checkpoint(head, tmp_path / fmt, format=fmt)
        torch.testing.assert_close(head_from_export(out, format=fmt).fc.weight, head.fc.weight)


def test_a_drafter_lm_is_distilled_online_on_a_hybrid_policy(task_tokenizer):
    policy = _hybrid_policy(task_tokenizer)
    trainer, metrics = greedy_trainer(task_tokenizer, policy)
    plain = SpecRollout(model=policy)(PROMPTS, trainer)
    rollout = SpecRollout(
        model=policy, strategy="chain:3", drafter=tiny_task_policy(task_tokenizer), drafter_train_steps=2
    )
    rollout.online.min_gain = -10.0  # every trained copy ships: the drafting LM follows training
    for _ in range(2):
        assert rollout(PROMPTS, trainer)["completion_ids"] == plain["completion_ids"]
    assert rollout.online.shipped == 2 and len(metrics["eval"]["drafter/loss"]) == 2
