"""examples/grpo_hf_model.py end to end on CPU with a local tiny model and a local GSM8K-style file
(the real configs need a model hub and a GPU)."""

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("WANDB_MODE", "disabled")


@functools.cache
def _example():
    spec = importlib.util.spec_from_file_location("grpo_hf_model", ROOT / "examples" / "grpo_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_reward_reads_gsm8k_answers():
    example = _example()
    completions = [[{"content": "2 + 3 = 5 #### 5"}], [{"content": "so 1,200"}], [{"content": "no idea"}]]
    assert example.number_reward(completions, ["... #### 5", "#### 1200", "#### 3"]) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("name", ["grpo_hf_single_gpu.yaml", "grpo_hf_ray_multi_gpu.yaml"])
def test_shipped_configs_load(name):
    cfg = _example().HFGRPOConfig.from_yaml(ROOT / "configs" / name)
    assert cfg.strategy == "adaptive" and cfg.drafter == "eagle3"


def test_bad_config_is_refused(tmp_path):
    example = _example()
    path = tmp_path / "c.yaml"
    path.write_text("strategy: chain:2\ndrafter: none\n")
    with pytest.raises(ValueError, match="drafts with a model"):
        example.HFGRPOConfig.from_yaml(path)
    path.write_text("drafter_data: tensorboard\n")
    with pytest.raises(ValueError, match="drafter_data"):
        example.HFGRPOConfig.from_yaml(path)
    path.write_text("max_stepz: 3\n")
    with pytest.raises(ValueError, match="max_stepz is not a field of HFGRPOConfig or of any config below it"):
        example.HFGRPOConfig.from_yaml(path)


@pytest.mark.parametrize("drafter_data", ["rollout", "trainer"])
def test_example_runs_with_a_local_model_and_dataset(tmp_path, drafter_data):
    from tailspec.tasks.tokenizer import build_tokenizer
    from tailspec.testing import tiny_random_model

    tok = build_tokenizer()
    model = tiny_random_model(
        "qwen2", seed=2, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.05, max_position_embeddings=256,
    )  # fmt: skip
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [{"question": f"add {i} {i + 1}", "answer": f"{i}+{i + 1}={2 * i + 1} #### {2 * i + 1}"} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = {
        "model": str(tmp_path / "model"),
        "dataset": str(tmp_path / "data.jsonl"),
        "system_prompt": "",
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "num_generations": 2,
        "prompts_per_step": 2,
        "max_completion_length": 16,
        "strategy": "chain:2",
        "drafter": "eagle3",
        "warmup_prompts": 4,
        "warmup_steps": 2,
        "drafter_train_steps": 1,
        "drafter_data": drafter_data,
        "kv_cache_tokens": 4096,
        "wandb": False,
        "bf16": False,
        "export": "vllm",  # a 2-layer model's default taps include the embeddings, which SGLang cannot load
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _example().main(["--config", str(path), "--set", "learning_rate=1e-3"])
    assert result["steps"] == 2 and len(result["rewards"]) == 2
    assert result["config"]["learning_rate"] == 1e-3
    assert result["drafter_version"] == 2 + 2  # warm-up steps, then one online step per RL step
    assert (tmp_path / "out" / "drafter_vllm" / "config.json").is_file()
