import os

import pytest
from datasets import Dataset

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="module")
def task_tokenizer():
    from tailspec.tasks.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def make_policy(task_tokenizer):
    """A fresh tiny Qwen2 policy for the task tokenizer, the same weights at every call."""
    from tailspec.testing import tiny_task_policy

    return lambda: tiny_task_policy(task_tokenizer)


@pytest.fixture
def tiny_policy(make_policy):
    return make_policy()


@pytest.fixture
def grpo_dataset():
    rows = [
        {"prompt": [{"role": "user", "content": f"add {i % 10} {(3 * i) % 10}"}], "answer": (i % 10) + (3 * i) % 10}
        for i in range(16)
    ]
    return Dataset.from_list(rows)


@pytest.fixture
def grpo_args(tmp_path):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default bf16 autocast: slow on CPUs without bf16, and not what the rollout ran
        save_strategy="no",
        seed=0,
    )


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) / 10.0 for c in completions]


@pytest.fixture
def common(task_tokenizer, tiny_policy, grpo_dataset, grpo_args):
    """The GRPO trainer arguments the trainer tests share."""
    return dict(
        model=tiny_policy,
        reward_funcs=length_reward,
        args=grpo_args,
        train_dataset=grpo_dataset,
        processing_class=task_tokenizer,
    )


@pytest.fixture
def varied_length_rollout():
    """SpecRollout's completions cut to very different lengths, as a long-tail rollout returns them."""
    from tailspec.trainer_hooks.spec_rollout import SpecRollout

    class VariedLengthRollout:
        def __init__(self) -> None:
            self.inner = SpecRollout()

        def __call__(self, prompts, trainer):
            out = self.inner(prompts, trainer)
            cut = [1 + (3 * i) % 12 for i in range(len(out["completion_ids"]))]
            out["completion_ids"] = [c[:n] for c, n in zip(out["completion_ids"], cut)]
            out["logprobs"] = [lp[:n] for lp, n in zip(out["logprobs"], cut)]
            return out

    return VariedLengthRollout
