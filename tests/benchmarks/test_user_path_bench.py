"""The user-path bench (``tailspec bench --section user_path``): the user's policy and the head
``tailspec drafter warmup`` warms on it, as a user makes them (the Ray rollouts are the bench's)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailspec.benchmarks.grpo_path import PathRun
from tailspec.benchmarks.user_path import UserPathConfig, make_user_policy, user_path_section, warm_up_head
from tailspec.tasks.sft import load_shipped


def test_the_users_policy_is_moved_from_the_shipped_one_and_its_head_warmed_by_the_cli(tmp_path):
    cfg = UserPathConfig(
        workdir=str(tmp_path),
        base_policy="tiny",
        warmup_args=("--num-prompts", "4", "--rounds", "1", "--steps", "2", "--max-new-tokens", "16"),
    )
    policy_dir = make_user_policy(cfg)
    moved = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    shipped, _ = load_shipped("tiny", "policy")
    diffs = [(a - b).abs().max().item() for a, b in zip(moved.parameters(), shipped.parameters())]
    assert max(diffs) > 0 and make_user_policy(cfg) == policy_dir  # made once
    head_dir, seconds, rounds = warm_up_head(cfg, policy_dir)
    assert seconds > 0 and len(rounds) == 1 and rounds[0].startswith("round 0: 4 completions")
    saved = json.loads((head_dir / "config.json").read_text())["eagle3_config"]
    assert saved["target_num_layers"] == moved.config.num_hidden_layers
    assert warm_up_head(cfg, policy_dir) == (head_dir, 0.0, [])  # reused
    none, adaptive = (
        PathRun("none", 2, [1.0, 1.0], [100, 100], [1.0, 1.0], [{"none": 9}] * 2),
        PathRun("adaptive", 2, [0.5, 0.5], [100, 100], [3.0, 3.2], [{"chain:4": 3}] * 2),
    )
    text = user_path_section([none, adaptive], cfg, seconds, rounds, "plot.png")
    assert "round 0: 4 completions" in text and "| 2 Ray workers | `adaptive` | 2.00x" in text


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="policy_noise"):
        UserPathConfig(policy_noise=0)
    with pytest.raises(ValueError, match="workers"):
        UserPathConfig(workers=0)
    with pytest.raises(ValueError, match="strategies"):
        UserPathConfig(strategies=("adaptive",))
