"""GRPO on the tiny chain-sum task with tailspec rollouts, written out with the public API.

    python examples/grpo_tiny_task.py --steps 10

`tailspec demo` runs the same job from configs/demo_cpu.yaml; this file shows the few lines a
user writes in their own training script.
"""

import argparse
import os

from trl import GRPOConfig

import tailspec
from tailspec.tasks.chain_sum import chain_sum_reward, make_grpo_dataset
from tailspec.tasks.sft import load_tiny


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output-dir", default="outputs/grpo_tiny_task")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")

    model, tokenizer = load_tiny("policy")
    trainer = tailspec.GRPOTrainer(
        model=model,
        reward_funcs=chain_sum_reward,
        args=GRPOConfig(
            output_dir=args.output_dir,
            per_device_train_batch_size=32,
            num_generations=8,
            max_completion_length=384,
            learning_rate=2e-5,
            beta=0.0,
            max_steps=args.steps,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
        ),
        train_dataset=make_grpo_dataset(1000, seed=0),
        processing_class=tokenizer,
        rollout=tailspec.SpecRollout(block_size=16, kv_cache_tokens=32768),
    )
    trainer.train()


if __name__ == "__main__":
    main()
