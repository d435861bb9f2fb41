"""The training stage: GRPO with ``SpecRollout(adaptive)`` on a long-tailed RL workload, on the GPU.

What users buy tailspec for is a faster RL step, and speculation pays in a rollout's long tail,
where a few long completions decode at small batch while the rest of the step waits. The stage:

1. **makes the long-tailed policy** (:mod:`tasks.long_tail`): the shipped deep policy fine-tuned
   on chain sums of 12-200 terms, and its drafter LM distilled onto it, on the device (the
   shipped policy answers in at most about 370 tokens: no tail to shorten);
2. **grows it to 1.0B parameters** (``speed.grow``: the same function at a realistic cost);
3. **warms a fresh EAGLE-3 head** on the grown policy's rollouts of the workload (the grown
   policy's features are 1,792 wide, the shipped head's 256);
4. **runs GRPO** (``tailspec.GRPOTrainer``, the demo's run in-process: Ray does not travel to the
   device) for ``TrainingSize.steps`` steps of the workload: 8 prompts of 8 completions a step,
   one long problem in each step's prompts, T = 1, position-keyed sampling, ``adaptive``, each
   step launched before the last is read. Every step's prompts are rolled out on the same weights
   by the drafter LM (trained online; the trainer trains on its completions), the EAGLE-3 head
   (trained online), ``self:L`` (its exit adapter trained online) and a plain-decoding twin
   (``PairedRollout``: ``DemoConfig.compare_drafters``), their order rotating from step to step;
5. **exports the trained drafter LM**, loads it back, and checks that it drafts as it did.

Per step and drafter: the rollout's seconds against the twin's; the whole GRPO step's against the
twin's step (the step's wall time less every rollout in it, which is the scoring and the update,
plus one rollout); the tail's share of the rollout (decode time with at most 10% of the
completions still running: ``tail_fraction``); the drafter's version, loss and accept length; the
strategy mix; graph capture and calibration seconds; completions alike with the twin's; GPU memory
after the step. The workload's completion lengths (median, p90, p99, max) are the twin's.

The stage stops the GRPO run after a step when the next one would not fit its budget (the steps
run are judged; the steps planned are a check of their own).

trl, datasets, dill and multiprocess are not on the image: ``make gpu-wheels`` downloads them into
``.whl/`` (about 1.7 MB), which the device call carries (``carry: [".whl"]``), and the stage
installs them into a temporary site-packages (``--no-deps``: everything else they need is on the
image). Without them the stage says so and is skipped.
"""

from __future__ import annotations

import gc
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...rollout.engine import RolloutEngine
from ...rollout.params import RolloutConfig, SamplingParams
from ...tasks.long_tail import (
    ExtendRecipe,
    distill_drafter,
    extend_policy,
    length_fidelity,
    length_summary,
    long_tail_problems,
)
from ...tasks.sft import load_shipped
from ...tasks.tokenizer import chat_ids
from .common import Stage, device
from .models import task_prompts
from .speed import grow

WHEELS = Path(__file__).resolve().parents[2] / ".whl"  # the checkout's (make gpu-wheels)
SITE = Path(tempfile.gettempdir()) / "tailspec-training-site"
STACK = ("trl", "datasets", "dill", "multiprocess")
MAIN = "small_lm"  # the drafter whose rollouts the trainer trains on; the others roll out beside it
SPEED_DRAFTERS = ("small_lm", "eagle3")  # the drafters with speed targets (self:L is judged as it is)
IDENTICAL_SHARE = 0.9  # on a GPU, of the completions, those the plain twin must emit alike (judge)
TAIL_FRACTION = 0.1  # a decode step is the tail's when at most this share of the completions still runs


@dataclass(frozen=True)
class TrainingSize:
    """How much the stage trains at a size: ``full`` on a lent GPU, ``tiny`` in the CPU rehearsal
    (every path taken, on short problems and completions)."""

    steps: int  # GRPO steps
    prompts_per_step: int
    generations: int  # completions a prompt
    max_completion: int  # tokens; the workload's longest reference response is 1,970
    extend: ExtendRecipe
    warmup_rounds: int  # the EAGLE-3 head's warm-up: rounds of rollouts, each then trained on ...
    warmup_steps: int  # ... for this many steps
    warmup_prompts: int  # prompts a round
    needs_s: dict[str, float]  # each part's seconds at least (the stage's budget skips what will not fit)
    fidelity_terms: tuple[int, ...]  # the extended policy's greedy completions of problems this long, checked

    @classmethod
    def of(cls, name: str) -> TrainingSize:
        if name == "full":
            parts = {"policy": 60, "grow": 20, "head": 40, "grpo": 120, "reload": 15}
            return cls(8, 8, 8, 2048, ExtendRecipe(), 2, 150, 24, parts, (40, 80, 120, 160, 180, 200))
        if name == "tiny":
            recipe = ExtendRecipe(policy_steps=2, drafter_steps=2, batch_size=2, max_terms=16)
            parts = {"policy": 5, "grow": 5, "head": 5, "grpo": 20, "reload": 5}
            return cls(2, 2, 2, 24, recipe, 1, 2, 2, parts, (14, 16))
        raise ValueError(f"size must be 'full' or 'tiny', got {name!r}")


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


def step_log(stage: Stage, reserve_s: float):
    """A trainer callback: each optimizer step's wall seconds (``drift.StepClock``) and GPU memory
    after it; it stops the run after a step when the next one (as long as the longest so far) would
    leave the stage less than ``reserve_s`` of its budget."""
    from ..drift import StepClock

    class StepLog(StepClock):
        def __init__(self) -> None:
            super().__init__()
            self.memory: list[dict[str, float]] = []
            self.longest_s = 0.0
            self.stopped_early = False

        def on_step_end(self, args, state, control, **kwargs):
            self.longest_s = max(self.longest_s, time.perf_counter() - self.begins[-1])
            self.memory.append(_memory())
            if not control.should_training_stop and stage.left() < reserve_s + self.longest_s:
                control.should_training_stop = self.stopped_early = True

    return StepLog()


def _memory() -> dict[str, float]:
    """GPU memory now (nothing on a CPU); the peak counter starts again."""
    if not torch.cuda.is_available():
        return {}
    gib = 2**30
    free, total = torch.cuda.mem_get_info()
    row = {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
        "reserved_gib": round(torch.cuda.memory_reserved() / gib, 2),
        "free_gib": round(free / gib, 2),
        "total_gib": round(total / gib, 2),
    }
    torch.cuda.reset_peak_memory_stats()
    return row


def self_drafter(stage: Stage) -> str:
    """``self:L`` with a quarter of the grown policy's layers."""
    return f"self:{max(1, stage.size.grown_layers // 4)}"


def demo_config(stage: Stage, size: TrainingSize, policy_dir: Path, out: Path):
    """The demo's GRPO run on the workload, with its twin and the drafters compared beside it."""
    from ...demo import DemoConfig

    problems = long_tail_problems(size.steps, size.prompts_per_step, seed=65, task=size.extend.task())
    return DemoConfig(
        policy="deep",
        policy_dir=str(policy_dir),
        device=device().type,
        max_steps=size.steps,
        num_generations=size.generations,
        prompts_per_step=size.prompts_per_step,
        max_completion_length=size.max_completion,
        learning_rate=5e-6,
        problems=problems,
        drafter=MAIN,
        compare_drafters=["eagle3", self_drafter(stage)],
        baseline=True,
        wandb=False,
        export="vllm",
        output_dir=str(out),
    ).with_overrides(
        **{
            "rollout.engine.strategy": "adaptive",
            "rollout.workers.num_workers": 0,
            "rollout.engine.tail_fraction": TAIL_FRACTION,
            "rollout.training.drafter_train_steps": 4,
            # position-keyed sampling: every rollout of a step must emit the very same completions
            "rollout.position_noise": True,
            # self:L trains its exit adapter online (the drafter LM and the head train themselves)
            "rollout.training.self_adapter_rank": 8,
        }
    )


def per_step(paired: Any, log: Any) -> dict[str, list[dict[str, Any]]]:
    """Each drafter's rows, a row a step: its rollout and its whole GRPO step against the twin's."""
    from ...demo import strategy_mix

    rollouts = {MAIN: paired.main, **paired.beside}
    alike = {MAIN: paired.identical_completions, **paired.identical_beside}
    twin = paired.twin.history
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in rollouts}
    for i, wall in enumerate(log.step_s):
        if i >= len(twin) or any(i >= len(r.history) for r in rollouts.values()):
            break
        # the step less every rollout in it and the drafter training after each: the scoring and the
        # update, the same whichever rollout ran
        rest = wall - _own(twin[i]) - sum(_own(r.history[i]) for r in rollouts.values())
        for name, rollout in rollouts.items():
            ours = rollout.history[i]
            rows[name].append(
                {
                    "step": i + 1,
                    "rollout_s": round(ours.time_s, 3),
                    "twin_rollout_s": round(twin[i].time_s, 3),
                    "rollout_vs_plain": _ratio(twin[i].time_s, ours.time_s),
                    "step_s": round(rest + _own(ours), 3),
                    "twin_step_s": round(rest + _own(twin[i]), 3),
                    "step_vs_plain": _ratio(rest + _own(twin[i]), rest + _own(ours)),
                    "tail_share": _ratio(ours.tail_time_s, ours.time_s),
                    "twin_tail_share": _ratio(twin[i].tail_time_s, twin[i].time_s),
                    "accept_length": round(ours.mean_accept_length, 3),
                    "drafter_version": ours.drafter_version,
                    "drafter_loss": ours.drafter_loss,
                    "strategies": strategy_mix(ours.strategy_steps, top=4),
                    "capture_s": round(ours.capture_time_s, 3),
                    "calibration_s": round(ours.calibration_time_s, 3),
                    "same_completions": "{} of {}".format(*alike[name][i]),
                    **(log.memory[i] if i < len(log.memory) else {}),
                }
            )
    return rows


def _own(stats: Any) -> float:
    """What a rollout adds to a GRPO step: the rollout, and its drafter's training after it."""
    return stats.time_s + stats.drafter_train_s


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def judge(stage: Stage, size: TrainingSize, rows: dict[str, list[dict[str, Any]]], lengths: dict, log: Any) -> None:
    """The issue's targets on the steps run; on a CPU (fp32) every completion must be the twin's, on
    a GPU at least 90% (kernels of other shapes round differently there: a near-tied draw can flip
    and a completion diverge from there; weights or KV of the wrong step would fail every one)."""
    steps = len(log.step_s)
    stage.check(
        f"the GRPO run takes its {size.steps} steps within the stage's budget",
        steps == size.steps and not log.stopped_early,
        f"{steps} steps run",
    )
    for name, ours in rows.items():
        stage.check(f"{name}: every GRPO step completes", len(ours) == steps, f"{len(ours)} of {steps}")
        equal, total = (sum(int(r["same_completions"].split(" of ")[k]) for r in ours) for k in (0, 1))
        if torch.cuda.is_available():
            ok = total > 0 and equal >= IDENTICAL_SHARE * total
            stage.check(
                f"{name}: at least {IDENTICAL_SHARE:.0%} of the completions the twin's", ok, f"{equal} of {total}"
            )
        else:
            stage.check(
                f"{name}: the same completions as plain decoding", total > 0 and equal == total, f"{equal} of {total}"
            )
        later = ours[1:]
        if name in SPEED_DRAFTERS and later:
            rollout, step = _median(later, "rollout_vs_plain"), _median(later, "step_vs_plain")
            stage.target(
                f"{name}: rollout at least 1.8x plain decoding from step 2 (median)", rollout >= 1.8, f"{rollout:.2f}x"
            )
            stage.target(
                f"{name}: the whole GRPO step at least 1.4x the twin's from step 2 (median)",
                step >= 1.4,
                f"{step:.2f}x",
            )
        if len(ours) >= 2:
            first, last = ours[1]["accept_length"], ours[-1]["accept_length"]
            stage.target(
                f"{name}: accept length at the last step at least 0.95x step 2's",
                last >= 0.95 * first,
                f"{first:.2f} -> {last:.2f} (step {ours[-1]['step']})",
            )
    if lengths:
        stage.target(
            "the workload's completions: p99 at least 8x the median",
            lengths["p99_over_median"] >= 8,
            f"median {lengths['median']}, p90 {lengths['p90']}, p99 {lengths['p99']}, max {lengths['max']}",
        )


def run(stage: Stage) -> None:
    if not trainer_stack(stage):
        return
    with tempfile.TemporaryDirectory(prefix="tailspec-training-") as work:  # the grown policy (4 GB full)
        grpo_on_the_long_tail(stage, TrainingSize.of(stage.size.name), Path(work))


def grpo_on_the_long_tail(stage: Stage, size: TrainingSize, work: Path) -> None:
    """Parts 1-5 of the module docstring, each skipped (and named) when the budget cannot hold it."""
    _, tokenizer = load_shipped("deep", "drafter")
    with stage.part("long-tailed policy and its drafter LM", size.needs_s["policy"]) as ok:
        if not ok:
            return
        policy, drafter = long_tailed_models(stage, size, tokenizer)
    with stage.part("grow", size.needs_s["grow"]) as ok:
        if not ok:
            return
        grown = grow(stage, device(), torch.float32, task_prompts(tokenizer, 4, seed=3), source=policy)
        grown.save_pretrained(work / "policy")
        del policy
    with stage.part("EAGLE-3 head warmed on the grown policy", size.needs_s["head"]) as ok:
        head = warm_head(stage, size, grown, tokenizer) if ok else None
    del grown
    _release_memory()  # the grown policy and the warm-up's KV: the GRPO run loads its own
    if head is None:
        return
    with stage.part("GRPO on the long tail", size.needs_s["grpo"]) as ok:
        if not ok:
            return
        trained = grpo(stage, size, work, drafter, head)
    with stage.part("the exported drafter LM", size.needs_s["reload"]) as ok:
        if ok and trained is not None:
            reload_drafts_alike(stage, *trained, work / "policy", tokenizer)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def long_tailed_models(stage: Stage, size: TrainingSize, tokenizer) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The shipped deep policy and drafter LM, on the device, extended to the long-tailed task."""
    policy = load_shipped("deep", "policy")[0].to(device())
    drafter = load_shipped("deep", "drafter")[0].to(device())
    started = time.perf_counter()
    fitted = extend_policy(policy, tokenizer, size.extend)
    distilled = distill_drafter(drafter, policy, tokenizer, size.extend)
    seconds = time.perf_counter() - started
    fidelity = length_fidelity(policy, tokenizer, size.fidelity_terms)
    stage.record(
        "long-tailed policy",
        {
            "recipe": {k: getattr(size.extend, k) for k in size.extend.__dataclass_fields__},
            "policy": _fit_row(fitted),
            "drafter": _fit_row(distilled),
            "seconds": round(seconds, 1),
            "greedy_lengths": fidelity,
        },
    )
    ratio, ended = fidelity["length_ratio_median"], fidelity["ended"]
    stage.target(
        "the extended policy follows long chains: greedy completions within 20% of their reference's length "
        "(median), every one ended by EOS",
        0.8 <= ratio <= 1.2 and ended == 1.0,
        f"terms {list(size.fidelity_terms)}: length ratio {ratio:.2f}, ended {ended:.0%}, "
        f"right {fidelity['right']:.0%}",
    )
    return policy, drafter


def _fit_row(metrics: dict) -> dict:
    keep = ("steps", "first_loss", "final_loss", "sequence_tokens", "wall_s", "tokens_per_s", "loss_curve")
    return {k: metrics[k] for k in keep if k in metrics}


def workload_prompts(size: TrainingSize, tokenizer, num: int, seed: int) -> list[list[int]]:
    """``num`` prompts of the workload (a step's worth at a time, one long problem in each)."""
    per_step = max(2, min(size.prompts_per_step, num))
    questions = long_tail_problems(-(-num // per_step), per_step, seed=seed, task=size.extend.task())[:num]
    return [chat_ids(tokenizer, [{"role": "user", "content": q}], True) for q in questions]


def warm_head(stage: Stage, size: TrainingSize, grown: torch.nn.Module, tokenizer):
    """A fresh EAGLE-3 head for the grown policy, warmed on its rollouts of the workload's prompts."""
    from ...drafter.eagle3.train import DrafterTrainingConfig
    from ...drafter.eagle3_warmup import WarmupConfig, warmup_head

    prompts = workload_prompts(size, tokenizer, size.warmup_rounds * size.warmup_prompts, seed=66)
    config = WarmupConfig(
        rounds=size.warmup_rounds,
        steps_per_round=size.warmup_steps,
        max_new_tokens=size.max_completion,
        training=DrafterTrainingConfig(batch_size=8, max_tokens=512, seed=0),
        seed=0,
    )
    head, _, rounds = warmup_head(grown, prompts, config, eos_token_ids=[tokenizer.eos_token_id], progress=False)
    stage.record("EAGLE-3 warm-up", [vars(r) for r in rounds])
    return head


def grpo(stage: Stage, size: TrainingSize, work: Path, drafter: torch.nn.Module, head) -> tuple | None:
    """The GRPO run; returns (the exported drafter LM's path, the trained drafter LM), or None when
    nothing was exported."""
    from ...demo import run_demo_with_rollout

    cfg = demo_config(stage, size, work / "policy", work / "grpo")
    log = step_log(stage, reserve_s=size.needs_s["reload"])
    summary, rollout, paired = run_demo_with_rollout(cfg, callbacks=[log], start=drafter, starts={"eagle3": head})
    rows = per_step(paired, log)
    twin_lengths = [n for s in paired.twin.history for n in s.completion_lengths]
    lengths = length_summary(twin_lengths) if twin_lengths else {}
    stage.record(
        "GRPO on the long tail",
        {
            "steps": rows,
            "completion_lengths": lengths,
            "longest_per_step": [s.max_completion_length for s in paired.twin.history],
            "step_wall_s": [round(s, 3) for s in log.step_s],
            "summary": _plain(summary),
            "kv_cache_tokens": cfg.rollout.engine.kv_cache_tokens,
        },
    )
    stage.record("headline", headline(rows, lengths))
    judge(stage, size, rows, lengths, log)
    if "exported_drafter" not in summary:
        return None
    return Path(summary["exported_drafter"]), rollout.drafter


def headline(rows: dict[str, list[dict[str, Any]]], lengths: dict) -> dict[str, str]:
    """The figures the issue's targets are about: per drafter, the medians from step 2."""
    out: dict[str, str] = {}
    if lengths:
        out["completion lengths (twin)"] = (
            f"median {lengths['median']}, p90 {lengths['p90']}, p99 {lengths['p99']}, max {lengths['max']} "
            f"(p99/median {lengths['p99_over_median']})"
        )
    for name, ours in rows.items():
        later = ours[1:] or ours
        if not later:
            continue
        med = {
            key: _median(later, key) for key in ("rollout_vs_plain", "step_vs_plain", "tail_share", "twin_tail_share")
        }
        out[f"{name}: rollout / twin, step / twin's step (median from step 2)"] = (
            f"{med['rollout_vs_plain']:.2f}x, {med['step_vs_plain']:.2f}x"
        )
        out[f"{name}: accept length step 2 -> last; tail share (twin's)"] = (
            f"{later[0]['accept_length']:.2f} -> {later[-1]['accept_length']:.2f}; "
            f"{med['tail_share']:.2f} ({med['twin_tail_share']:.2f})"
        )
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] or 0 for r in rows)


def reload_drafts_alike(stage: Stage, exported: Path, trained: torch.nn.Module, policy_dir: Path, tokenizer) -> None:
    """The exported drafter LM, loaded back, drafts at the accept length the trained one had (on
    the policy as it was before training: the two drafters are compared on the same target)."""
    from ...safe_files import load_causal_lm

    policy = load_causal_lm(policy_dir, dtype=torch.float32).to(device()).eval()
    reloaded = load_causal_lm(exported, dtype=torch.float32).to(device())
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


def _plain(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with every value JSON can hold."""
    return {k: v if isinstance(v, (int, float, str, list, type(None))) else str(v) for k, v in summary.items()}
