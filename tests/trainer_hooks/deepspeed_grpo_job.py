"""GRPO under shipped DeepSpeed ZeRO configs on CPU, one process (run by test_deepspeed_grpo.py in a
subprocess, so DeepSpeed's global state and distributed environment stay out of the test process).
Each stage named on the command line trains in turn in that process (its imports, most of its
seconds, paid once); Accelerate's and transformers' DeepSpeed state is reset between them.

Prints one JSON line per stage: the importance-sampling ratios TRL logged, weight syncs vs
optimizer steps, how far the (gathered) weights moved, and whether rollouts produced valid token ids.
"""

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ["WANDB_MODE"] = "disabled"


def main(stages: list[str], out_dir: str) -> None:
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from tailspec.trainer_hooks.deepspeed import single_process_deepspeed

    single_process_deepspeed()
    for stage in stages:
        train(stage, f"{out_dir}/{stage}")
        AcceleratorState._reset_state(reset_partial_state=True)
        unset_hf_deepspeed_config()


def train(stage: str, out_dir: str) -> None:
    import deepspeed
    from datasets import Dataset
    from trl import GRPOConfig

    from tailspec import DrafterFromTrainer, GRPOTrainer, SpecRollout
    from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
    from tailspec.tasks.tokenizer import build_tokenizer
    from tailspec.testing import tiny_random_model
    from tailspec.trainer_hooks.deepspeed import deepspeed_config

    tok = build_tokenizer()
    model = tiny_random_model(
        "qwen2", seed=3, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.05,
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = [{"prompt": [{"role": "user", "content": f"add {i % 10} {(3 * i) % 10}"}]} for i in range(16)]

    def length_reward(completions, **kwargs):  # varies within a group, so the loss has a gradient
        return [float(len(c[-1]["content"])) / 12.0 for c in completions]

    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
        max_steps=3, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", seed=0, deepspeed=deepspeed_config(stage),
    )  # fmt: skip
    rollout = SpecRollout(strategy="none")
    trainer = GRPOTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tok, rollout=rollout,
    )  # fmt: skip
    head = Eagle3Head(Eagle3Config.for_target(model.config))
    tap = DrafterFromTrainer(head, trainer, train_steps=2)  # reads partitioned parameters under ZeRO-3
    trainer.train()
    engine = trainer.model_wrapped
    params = list(trainer.model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        moved = max((p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters())
        shapes_ok = all(p.shape == before[n].shape for n, p in trainer.model.named_parameters())
    logs = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    print(
        "deepspeed-grpo "
        + json.dumps(
            {
                "zero_stage": engine.zero_optimization_stage(),
                "is_ratio_mean": [h["sampling/importance_sampling_ratio/mean"] for h in logs],
                "is_ratio_min": [h["sampling/importance_sampling_ratio/min"] for h in logs],
                "is_ratio_max": [h["sampling/importance_sampling_ratio/max"] for h in logs],
                "syncs": trainer.weight_sync.synced_steps,
                "global_step": trainer.state.global_step,
                "moved": moved,
                "shapes_ok": shapes_ok,
                "completion_tokens": sum(s.completion_tokens for s in rollout.history),
                "rollout_calls": len(rollout.history),
                "drafter_samples": tap.samples_recorded,
                "drafter_version": head.version,
                "drafter_losses": [h["drafter/loss"] for h in trainer.state.log_history if "drafter/loss" in h],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2])
