"""The training stage: ``tailspec.GRPOTrainer`` with ``SpecRollout`` on the GPU.

The demo's GRPO run (``demo.run_demo_with_rollout``, in-process: Ray cannot travel to the device)
on the shipped deep policy grown to 1.0B parameters (``speed.grow``; the drafters keep their real
acceptance on it), the trainer's fp32 master weights under bf16 autocast on CUDA (the engines decoding a
bf16 copy, ``RolloutConfig.dtype``: run 10 decoded the fp32 weights), a plain-decoding
twin rolling out the same prompts on the same weights at every step. For each drafter (the
drafter LM trained online, and the self-speculative ``self:L``), per step: the rollout time
against the twin's, the accept length, the strategy mix, the drafter's version and loss, the
reward, graph capture seconds, how many completions the two emitted alike, and GPU memory (peak allocated, reserved,
free). The trained drafter LM is exported as a Hugging Face checkpoint, loaded back, and must draft
at the accept length it had.

trl, datasets, dill and multiprocess are not on the image: ``make gpu-wheels`` downloads them into
``.whl/`` (about 1.7 MB), which the device call carries (``carry: [".whl"]``), and the stage
installs them into a temporary site-packages (``--no-deps``: everything else they need is on the
image). Without them the stage says so and is skipped. The EAGLE-3 head runs last, 3 steps of
``chain:4``: the shipped head reads the deep policy's 256-wide features and the grown policy's
are 1,792 wide, so the stage starts a fresh head for it, which must draft and train online on the
device (its accept length is not judged: a warm-up of its own does not fit the stage).
"""

from __future__ import annotations

import importlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ...rollout.engine import RolloutEngine
from ...rollout.params import RolloutConfig, SamplingParams
from ...tasks.sft import load_shipped
from .common import Stage, device
from .models import task_prompts
from .speed import grow

WHEELS = Path(__file__).resolve().parents[2] / ".whl"  # the checkout's (make gpu-wheels)
SITE = Path(tempfile.gettempdir()) / "tailspec-training-site"
STACK = ("trl", "datasets", "dill", "multiprocess")


def trainer_stack(stage: Stage) -> bool:
    """Whether trl imports here, after installing the carried wheels when it does not."""
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    if importlib.util.find_spec("trl") is None and wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--target", str(SITE), *map(str, wheels)], check=True)
        sys.path.insert(0, str(SITE))
        importlib.invalidate_caches()
    versions: dict[str, str | None] = {}
    for name in (*STACK, "pyarrow", "accelerate", "pandas"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception as e:  # missing, or too old a dependency on the image
            versions[name] = None
            stage.record(f"import {name}", f"{type(e).__name__}: {e}")
    stage.record("trainer_stack", {"wheels": [w.name for w in wheels], "versions": versions})
    missing = [n for n in STACK if versions.get(n) is None]
    if missing:
        stage.skip("training", f"no {', '.join(missing)}: run `make gpu-wheels` here and carry .whl")
    return not missing


def memory_callback():
    """A trainer callback recording GPU memory after every optimizer step (nothing on a CPU)."""
    from transformers import TrainerCallback

    class MemoryLog(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                free, total = torch.cuda.mem_get_info()
                gib = 2**30
                self.rows.append(
                    {
                        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
                        "reserved_gib": round(torch.cuda.memory_reserved() / gib, 2),
                        "free_gib": round(free / gib, 2),
                        "total_gib": round(total / gib, 2),
                    }
                )
                torch.cuda.reset_peak_memory_stats()

    return MemoryLog()


def demo_config(stage: Stage, policy_dir: Path, drafter: str, out: Path):
    """The demo's GRPO run at this stage's size, on the grown policy, in-process, with its twin."""
    from ...demo import DemoConfig

    full = stage.size.name == "full"
    fresh_head = drafter == "eagle3"  # a head for the grown policy, learning from nothing: 3 steps of chain:4
    return DemoConfig(
        policy="deep",
        policy_dir=str(policy_dir),
        device=device().type,
        max_steps=(3 if fresh_head else 6) if full else 2,
        num_generations=8 if full else 2,
        prompts_per_step=4 if full else 2,
        max_completion_length=512 if full else 24,
        learning_rate=5e-6,
        num_train_prompts=64,
        drafter=drafter,
        baseline=True,
        wandb=False,
        export="vllm" if drafter == "small_lm" else None,
        output_dir=str(out),
    ).with_overrides(
        **{
            "rollout.workers.num_workers": 0,
            # each step launched before the last is read, chains from state on the device (the twin's too)
            "rollout.engine.overlap": True,
            "rollout.training.drafter_train_steps": 4,
            # position-keyed sampling: the twin must emit the very same completions (lossless, per step)
            "rollout.position_noise": True,
            # self:L trains its exit adapter online (the drafter LM trains itself)
            **({"rollout.training.self_adapter_rank": 8} if drafter.startswith("self:") else {}),
            # a fresh head's arms would never be picked by adaptive: a fixed chain makes it draft
            **({"rollout.engine.strategy": "chain:4"} if fresh_head else {}),
        }
    )


def per_step(summary: dict[str, Any], rollout: Any, memory: list[dict[str, float]]) -> list[dict[str, Any]]:
    ratios = summary.get("rollout_ratio_per_step", [])
    rows = []
    for i, stats in enumerate(rollout.history):
        rows.append(
            {
                "step": i + 1,
                "reward": summary["reward_per_step"][i],
                "rollout_s": round(stats.time_s, 3),
                "vs_plain": round(ratios[i], 3) if i < len(ratios) and ratios[i] == ratios[i] else None,
                "accept_length": round(stats.mean_accept_length, 3),
                "capture_s": round(stats.capture_time_s, 3),
                "strategy_steps": stats.strategy_steps,
                "drafter_version": stats.drafter_version,
                "drafter_loss": stats.drafter_loss,
                **(memory[i] if i < len(memory) else {}),
            }
        )
    return rows


IDENTICAL_SHARE = 0.9  # on a GPU, of the completions, those the plain twin must emit alike (below)


def judge(stage: Stage, drafter: str, summary: dict[str, Any], rows: list[dict[str, Any]], steps: int) -> None:
    """The issue's targets, and the lossless check: on a CPU (fp32) every completion is the plain
    twin's; on a GPU the two run kernels of other shapes (decode against verification widths),
    whose rounding differs, so a near-tied draw can flip and a completion diverge from there (run
    10: 2 and 3 of 6 steps wholly alike): there it asks for 90% of the completions alike, which
    weights or KV of the wrong step (every completion diverges) would fail."""
    stage.check(f"{drafter}: every GRPO step completes", len(rows) == steps, f"{len(rows)} of {steps}")
    same = summary.get("same_completions", "0 of 0")
    equal, total = (int(x) for x in same.split(" of "))
    detail = f"{same} completions, {summary.get('same_completions_steps', '')} steps wholly alike"
    if torch.cuda.is_available():
        share = f"{IDENTICAL_SHARE:.0%}"
        ok = total > 0 and equal >= IDENTICAL_SHARE * total
        stage.check(f"{drafter}: at least {share} of the completions the same as plain decoding's", ok, detail)
    else:
        stage.check(f"{drafter}: the same completions as plain decoding", total > 0 and equal == total, detail)
    later = [r["vs_plain"] for r in rows[1:] if r["vs_plain"] is not None]
    if drafter == "small_lm" and later:
        ratio = statistics.median(later)
        stage.target(
            f"{drafter}: rollout at least 1.5x plain decoding from step 2 (median)", ratio >= 1.5, f"{ratio:.2f}"
        )
    if drafter == "eagle3":  # a fresh head: it must draft and learn on the device, not accept much yet
        versions, drafted = [r["drafter_version"] for r in rows], [r["accept_length"] for r in rows]
        stage.check(
            "eagle3: a fresh head drafts and trains online on the device",
            bool(versions) and (versions[-1] or 0) > 0,
            f"versions {versions}, accept lengths {drafted}",
        )
        return
    accept = [r["accept_length"] for r in rows]
    if len(accept) >= 2:
        k = max(1, len(accept) // 2)
        first, last = statistics.mean(accept[:k]), statistics.mean(accept[-k:])
        stage.target(
            f"{drafter}: accept length of the last steps at least 0.97x the first",
            last >= 0.97 * first,
            f"{first:.2f} -> {last:.2f}",
        )


def fresh_eagle3_head(policy_dir: Path):
    """An EAGLE-3 head for the grown policy (the shipped one reads the deep policy's 256-wide
    features, the grown policy's are wider), initialised at random: it learns online from step 1."""
    from transformers import AutoConfig

    from ...drafter.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    return Eagle3Head(Eagle3Config.for_target(AutoConfig.from_pretrained(policy_dir)))


def reload_drafts_alike(stage: Stage, exported: Path, trained: torch.nn.Module, policy_dir: Path, tokenizer) -> None:
    """The exported drafter LM, loaded back, drafts at the accept length the trained one had (on
    the policy as it was before training: the two drafters are compared on the same target)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).to(device()).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).to(device())
    prompts = task_prompts(tokenizer, 8, seed=77)
    params = SamplingParams(temperature=0.0, max_new_tokens=64 if stage.size.name == "full" else 16)
    accept = {}
    for name, drafter in (("trained", trained), ("reloaded", reloaded)):
        engine = RolloutEngine(policy, RolloutConfig(strategy="chain:4"), tokenizer=tokenizer, drafter=drafter)
        engine.generate(prompts, params)
        accept[name] = round(engine.stats.mean_accept_length, 3)
    stage.record("exported drafter LM", {"path": str(exported), "accept_length": accept})
    stage.check(
        "the exported drafter LM reloads and drafts as it did",
        accept["reloaded"] >= 0.97 * accept["trained"],
        str(accept),
    )


def run(stage: Stage) -> None:
    if not trainer_stack(stage):
        return
    with tempfile.TemporaryDirectory(prefix="tailspec-training-") as work:  # the grown policy (166 MB tiny)
        grpo_runs(stage, Path(work))


def grpo_runs(stage: Stage, work: Path) -> None:
    """The grown policy saved in ``work``, then a short GRPO run with each drafter kind, its
    exported drafter reloaded."""
    from ...demo import run_demo_with_rollout

    _, tokenizer = load_shipped("deep", "drafter")
    with stage.part("grow", 30) as ok:
        if not ok:
            return
        policy = grow(stage, device(), torch.float32, task_prompts(tokenizer, 4, seed=3))
        policy.save_pretrained(work / "policy")
        del policy
    layers = max(1, stage.size.grown_layers // 4)
    for drafter in ("small_lm", f"self:{layers}", "eagle3"):
        with stage.part(f"GRPO with {drafter}", 60 if stage.size.name == "full" else 20) as ok:
            if not ok:
                continue
            cfg = demo_config(stage, work / "policy", drafter, work / drafter.replace(":", "_"))
            memory = memory_callback()
            start = fresh_eagle3_head(work / "policy") if drafter == "eagle3" else None
            summary, rollout = run_demo_with_rollout(cfg, callbacks=[memory], start=start)
            rows = per_step(summary, rollout, memory.rows)
            stage.record(
                f"GRPO with {drafter}",
                {"summary": _plain(summary), "steps": rows, "kv_cache_tokens": cfg.rollout.engine.kv_cache_tokens},
            )
            judge(stage, drafter, summary, rows, cfg.max_steps)
            if "exported_drafter" in summary:
                exported = Path(summary["exported_drafter"])
                reload_drafts_alike(stage, exported, rollout.drafter, work / "policy", tokenizer)


def _plain(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with every value JSON can hold."""
    return {k: v if isinstance(v, (int, float, str, list, type(None))) else str(v) for k, v in summary.items()}
