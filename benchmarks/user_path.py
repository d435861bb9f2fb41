"""The whole rollout as a user runs it, on a policy no shipped drafter was made for.

The user's policy is a shipped policy (the deep one) with every weight moved by ``x (1 + policy_noise *
noise)`` (seeded): a model the shipped drafter LM and EAGLE-3 head never saw. The user warms up an
EAGLE-3 head on it with ``tailspec drafter warmup`` at the command's default settings (run here as
a subprocess, as a user would), then rolls out with ``SpecRollout(strategy="adaptive",
drafter=head, workers=2)`` at its default settings (spot training of the head on idle workers
included), against ``none`` and fixed ``chain:4`` on their own 2 workers, on the GRPO path of
:mod:`.grpo_path` (the demo's long-tail problem set, the policy moved and synced every RL step,
position-keyed sampling so every contender emits the same tokens).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .grpo_path import GRPOPathConfig, PathRun, grpo_path_steps, grpo_path_table, plot_grpo_path, run_path
from .policies import torch_threads

logger = logging.getLogger(__name__)

USER_PATH_TITLE = "The whole rollout as a user runs it: an EAGLE-3 head warmed on an unseen policy, 2 Ray workers"


@dataclass
class UserPathConfig:
    workdir: str = "outputs/bench/user_path"
    base_policy: str = "deep"  # the shipped policy the user's is moved from
    policy_noise: float = 0.01  # how far the user's policy is from the shipped deep policy (relative, per weight)
    policy_seed: int = 11
    strategies: tuple[str, ...] = ("none", "chain:4", "adaptive")
    workers: int = 2
    steps: int = 4
    warmup_args: tuple[str, ...] = ()  # passed on to `tailspec drafter warmup` (none: its defaults)

    def __post_init__(self) -> None:
        if not self.policy_noise > 0:
            raise ValueError(f"UserPathConfig.policy_noise must be a float > 0, got {self.policy_noise!r}")
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"UserPathConfig.workers must be an int >= 1, got {self.workers!r}")
        GRPOPathConfig(strategies=self.strategies, steps=self.steps)  # validates those two


def make_user_policy(cfg: UserPathConfig) -> Path:
    """The user's policy directory (made once: the deep policy's weights moved, its tokenizer)."""
    from ..tasks.sft import load_shipped
    from ..testing import perturbed_copy

    out = Path(cfg.workdir) / f"policy-{cfg.base_policy}-{cfg.policy_noise:g}-{cfg.policy_seed}"
    if not (out / "config.json").is_file():
        policy, tokenizer = load_shipped(cfg.base_policy, "policy")
        perturbed_copy(policy, noise=cfg.policy_noise, seed=cfg.policy_seed).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def warm_up_head(cfg: UserPathConfig, policy_dir: Path) -> tuple[Path, float, list[str]]:
    """``tailspec drafter warmup`` on the user's policy, as a user runs it; (checkpoint, seconds,
    the command's round lines). A checkpoint already there is reused (0 seconds, no lines)."""
    out = Path(cfg.workdir) / f"head-{policy_dir.name}"
    if (out / "config.json").is_file():
        return out, 0.0, []
    command = [sys.executable, "-m", "tailspec.cli", "drafter", "warmup", "--policy", str(policy_dir)]
    command += [*cfg.warmup_args, "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    rounds = [line for line in done.stdout.splitlines() if line.startswith("round ")]
    return out, time.perf_counter() - start, rounds


def measure_user_path(cfg: UserPathConfig) -> tuple[list[PathRun], float, list[str]]:
    from transformers import AutoTokenizer

    from ..drafter.eagle3.checkpoint import load_checkpoint
    from ..safe_files import load_causal_lm
    from ..trainer_hooks.spec_rollout import SpecRollout

    policy_dir = make_user_policy(cfg)
    head_dir, warmup_s, rounds = warm_up_head(cfg, policy_dir)
    policy = load_causal_lm(policy_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    path = GRPOPathConfig(strategies=cfg.strategies, workers=(cfg.workers,), steps=cfg.steps)
    contenders = {}
    for strategy in cfg.strategies:
        drafter = load_checkpoint(head_dir).head.float().eval() if strategy != "none" else None
        # a contender's workers idle while another's run: no cores reserved for them
        rollout = SpecRollout(
            strategy=strategy, drafter=drafter, workers=cfg.workers, num_cpus_per_worker=0.0, position_noise=True
        )
        contenders[strategy] = rollout
    return run_path(contenders, policy, tokenizer, path, cfg.workers), warmup_s, rounds


def user_path_section(runs: list[PathRun], cfg: UserPathConfig, warmup_s: float, rounds: list[str], plot: str) -> str:
    warm = (
        f"`tailspec drafter warmup --policy <that policy>` at its defaults took {warmup_s:.0f} s:\n\n"
        + "\n".join(f"    {line}" for line in rounds)
        if rounds
        else "The head was warmed by an earlier run of `tailspec drafter warmup` at its defaults (reused)."
    )
    return (
        f"The user's policy: the shipped {cfg.base_policy} policy with every weight x (1 + "
        f"{cfg.policy_noise:g} noise), a model the shipped drafters never saw. " + warm + "\n\n"
        f"Then `SpecRollout(strategy=..., drafter=head, workers={cfg.workers})` at its default settings "
        "(for `adaptive` and `chain:4`: spot training of the head on idle workers), "
        f"{cfg.steps} RL steps of the GRPO path above (the demo's long-tail problems x 8, the policy moved and "
        "synced every step, position-keyed sampling: every contender emits the same completions).\n\n"
        f"{grpo_path_table(runs)}\n\n{grpo_path_steps(runs)}\n![per RL step]({plot})\n"
    )


def run_user_path_section(out: Path, quick: bool = False) -> str:
    from .report import replace_section

    cfg = UserPathConfig(steps=2 if quick else 4)
    plot = "bench_user_path.png"
    command = "tailspec bench --section user_path" + (" --quick" if quick else "")
    with torch_threads(1):  # the section's machine line then names the threads it was measured with
        runs, warmup_s, rounds = measure_user_path(cfg)
        plot_grpo_path(runs, out.parent / plot)
        replace_section(out, USER_PATH_TITLE, user_path_section(runs, cfg, warmup_s, rounds, plot), command)
    return grpo_path_table(runs)
