"""GRPO with tailspec rollouts on a real Hugging Face model and dataset (needs a model hub or local copies).

    # one GPU: a small instruct model on GSM8K, an EAGLE-3 head warmed up on the model first
    python examples/grpo_hf_model.py --config configs/grpo_hf_single_gpu.yaml
    # a multi-GPU Ray cluster: one rollout engine per GPU, the head trained on GPUs the tail leaves idle
    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python examples/grpo_hf_model.py --config configs/grpo_hf_ray_multi_gpu.yaml

Any config field can be overridden: ``--set max_steps=10 --set strategy=suffix``, and any field of
the rollout by its dotted path: ``--set rollout.engine.length_budget=0.5``. ``model`` and
``dataset`` accept hub names or local paths (a local dataset is a JSON/JSONL file with ``question``
and ``answer`` fields; a GSM8K-style answer ends with ``#### <number>``). The reward is 1 when the
last number in the completion equals the reference number.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from tailspec.config_tree import apply_overrides, coerce_subtrees, parse_assignments, require
from tailspec.trainer_hooks.config import SpecRolloutConfig, WithRollout


@dataclass
class HFGRPOConfig(WithRollout):
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    dataset: str = "openai/gsm8k"
    dataset_config: str | None = "main"
    split: str = "train"
    system_prompt: str = "Reason step by step, then give the final answer as a number after '####'."
    output_dir: str = "outputs/grpo_hf"
    max_steps: int = 200
    num_generations: int = 8
    prompts_per_step: int = 8
    max_completion_length: int = 1024
    learning_rate: float = 1e-6
    beta: float = 0.0
    temperature: float = 1.0
    bf16: bool = True
    gradient_checkpointing: bool = True
    drafter: str = "eagle3"  # eagle3: a head warmed up on the model's rollouts before RL | none
    warmup_prompts: int = 256
    warmup_steps: int = 400
    drafter_train_steps: int = 8  # online head training steps after every rollout / optimizer step
    # where the online head's training data comes from: "rollout" (features the engine records while
    # generating) | "trainer" (the trainer's own loss forward, tailspec.DrafterFromTrainer; with Ray
    # workers, each new version is sent to them and they do no spot training of their own)
    drafter_data: str = "rollout"
    export: str | None = "sglang"  # export the trained head for sglang | vllm | null
    deepspeed: str | None = None  # zero2 | zero3 | a DeepSpeed JSON path
    wandb: bool = True
    wandb_mode: str = "offline"
    seed: int = 0
    # the rollout (tailspec.SpecRolloutConfig), nested under `rollout:` in YAML: the strategy
    # (engine.strategy), the KV pool, Ray workers (workers.num_workers: one per GPU on a cluster; 0 =
    # the colocated engine) and every other engine or worker field
    rollout: SpecRolloutConfig = field(
        default_factory=lambda: SpecRolloutConfig().with_overrides(strategy="adaptive", kv_cache_tokens=262144)
    )

    def __post_init__(self) -> None:
        coerce_subtrees(self)
        require(self.export in (None, "sglang", "vllm"), "export", "null, 'sglang' or 'vllm'", self.export)
        require(self.drafter in ("eagle3", "none"), "drafter", "'eagle3' or 'none'", self.drafter)
        require(
            self.drafter_data in ("rollout", "trainer"), "drafter_data", "'rollout' or 'trainer'", self.drafter_data
        )
        for name, low in (
            ("max_steps", 1),
            ("num_generations", 2),
            ("prompts_per_step", 1),
            ("max_completion_length", 1),
        ):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= low, name, f"an int >= {low}", value)
        from tailspec.rollout.strategy import parse_strategy

        require(
            self.drafter != "none" or not parse_strategy(self.strategy).uses_model_drafter,
            "rollout.engine.strategy",
            "one without a model drafter when drafter is 'none' (set drafter: eagle3, or strategy: suffix); it "
            "drafts with a model",
            self.strategy,
        )

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> HFGRPOConfig:
        """The config a YAML file describes, then ``--set`` assignments; a key is a field of this
        config, a dotted path into ``rollout`` (``rollout.engine.length_budget``) or a name only one
        rollout field has (``strategy``, ``kv_cache_tokens``, ``num_workers``)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        return apply_overrides(cls(), {**data, **parse_assignments(overrides or [])})


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reference_number(answer: str) -> float | None:
    """The number after ``####`` (GSM8K), else the last number in the answer."""
    return last_number(answer.split("####")[-1])


def number_reward(completions, answer, **kwargs) -> list[float]:
    rewards = []
    for completion, ref in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        got, want = last_number(text), reference_number(str(ref))
        rewards.append(1.0 if got is not None and want is not None and abs(got - want) < 1e-6 else 0.0)
    return rewards


def load_prompts(cfg: HFGRPOConfig):
    from datasets import load_dataset

    local = Path(cfg.dataset)
    if local.is_file():
        data = load_dataset("json", data_files=str(local), split="train")
    else:
        data = load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split)

    def to_prompt(row):
        messages = [{"role": "user", "content": row["question"]}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        return {"prompt": messages, "answer": row["answer"]}

    return data.map(to_prompt, remove_columns=[c for c in data.column_names if c != "answer"])


def warm_up_head(cfg: HFGRPOConfig, model, tokenizer, dataset):
    """A fresh EAGLE-3 head trained on the model's own rollouts of ``warmup_prompts`` prompts."""
    from tailspec.drafter.eagle3.train import DrafterTrainingConfig
    from tailspec.drafter.eagle3_warmup import WarmupConfig, warmup_head
    from tailspec.trainer_hooks.spec_rollout import SpecRollout

    rows = dataset.select(range(min(cfg.warmup_prompts, len(dataset))))
    prompts = SpecRollout.tokenize_prompts(list(rows["prompt"]), tokenizer)
    warm = WarmupConfig(
        rounds=2,
        steps_per_round=max(1, cfg.warmup_steps // 2),
        max_new_tokens=cfg.max_completion_length,
        training=DrafterTrainingConfig(batch_size=8, seed=cfg.seed),
        seed=cfg.seed,
    )
    head, _, rounds = warmup_head(model, prompts, warm, eos_token_ids=None)
    for r in rounds:
        print(
            f"warm-up round {r.round}: accept length {r.accept_length:.2f}, "
            f"loss {r.loss_first:.3f} -> {r.loss_last:.3f}"
        )
    return head


def grpo_config(cfg: HFGRPOConfig, cuda: bool):
    """TRL's GRPOConfig for this run (bf16 and gradient checkpointing only on a GPU)."""
    from trl import GRPOConfig

    from tailspec.trainer_hooks.config import grpo_args

    return GRPOConfig(
        **grpo_args(cfg, cfg.output_dir),
        bf16=cfg.bf16 and cuda,
        use_cpu=not cuda,
        gradient_checkpointing=cfg.gradient_checkpointing and cuda,
        seed=cfg.seed,
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/grpo_hf_single_gpu.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    cfg = HFGRPOConfig.from_yaml(args.config, args.set)
    if cfg.wandb:
        os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from transformers import AutoTokenizer

    import tailspec
    from tailspec.safe_files import load_causal_lm

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if (cfg.bf16 and cuda) else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = load_causal_lm(cfg.model, dtype=dtype)
    if cuda and cfg.num_workers == 0 and cfg.deepspeed is None:
        model = model.to("cuda")
    dataset = load_prompts(cfg)
    head = warm_up_head(cfg, model, tokenizer, dataset) if cfg.drafter == "eagle3" and cfg.strategy != "none" else None
    training = grpo_config(cfg, cuda)
    online = head is not None and cfg.num_workers == 0 and cfg.drafter_data == "rollout"
    rollout = tailspec.SpecRollout(
        config=cfg.rollout,
        drafter=head,
        drafter_train_steps=cfg.drafter_train_steps if online else 0,
        spot_training=cfg.drafter_data == "rollout",  # on workers: the head trains on idle ones
    )
    trainer = tailspec.GRPOTrainer(
        model=model,
        reward_funcs=number_reward,
        args=training,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout=rollout,
    )
    if head is not None and cfg.drafter_data == "trainer":
        tailspec.DrafterFromTrainer(head, trainer, train_steps=cfg.drafter_train_steps)
    print(f"GRPO on {cfg.model} / {cfg.dataset}: {asdict(cfg)}", flush=True)
    trainer.train()
    rollout.close()
    if head is not None and cfg.export:
        from tailspec.drafter.eagle3.checkpoint import export_checkpoint

        out = Path(cfg.output_dir) / f"drafter_{cfg.export}"
        print(f"exported drafter: {export_checkpoint(rollout.drafter, out, format=cfg.export)}")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "steps": trainer.state.global_step,
        "rewards": rewards,
        "drafter_version": head.version if head is not None else None,
        "config": asdict(cfg),
    }


if __name__ == "__main__":
    main()
