"""Does the drafter keep up with a moving policy? GRPO on the deep policy with the EAGLE-3 head,
five arms with the same seeds: the head frozen, trained by spot training on idle Ray workers,
trained from the trainer's own loss forwards (``DrafterFromTrainer``), both, and no head at all but
the policy's own first layers (a self-speculative drafter, which moves with the policy). Per RL step: the
mean accept length of the rollout, its time, and how far the policy has moved (the share of probe
prompts whose greedy completion differs from the starting policy's, and the share of their
tokens that differ).

Then a *format shift*: the starting policy is fine-tuned to another response layout (a step per
line, spaced operators, ``answer:``; ``ChainSumProblem.solution_in("lines")``) and every arm runs
a few more GRPO steps on that policy with its drafter as the main run left it. A frozen head meets
text it has never seen; an online one must relearn it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..demo import DemoConfig, run_demo_with_rollout
from ..rollout import RolloutConfig, RolloutEngine, SamplingParams
from ..rollout.admission import eos_ids_of
from .policies import prompts_of, task_problems
from .report import plot_panels

logger = logging.getLogger(__name__)

HEAD_ARMS = {
    "frozen": dict(spot_training=False, drafter_from_trainer=0),
    "spot training": dict(spot_training=True, drafter_from_trainer=0),
    # the same training, never shipped: the drafter stays the frozen one, so against the frozen arm
    # (same rollouts, same drafter) its rollout time is exactly what training on idle workers adds
    "spot, never shipped": dict(spot_training=True, drafter_from_trainer=0, spot_ship_min_gain=float("inf")),
    "DrafterFromTrainer": dict(spot_training=False, drafter_from_trainer=4),
    "both": dict(spot_training=True, drafter_from_trainer=4),
    # the policy's own first layers (7 of the deep policy's 24: where its early exit first agrees 70%)
    "self-speculative": dict(spot_training=False, drafter_from_trainer=0, drafter="self:{layers}"),
}
# the drafter LM: frozen, distilled on the policy's completions on idle workers (past the held-out
# gate), the same training never shipped (its cost at equal drafter), and trained in the trainer's
# process with 16 or 32 steps after every rollout (past the same gate): what more steps than the idle
# time gives would buy
LM_ARMS = {
    **{name: HEAD_ARMS[name] for name in ("frozen", "spot training", "spot, never shipped")},
    **{
        f"in-process, {n} steps": dict(spot_training=False, drafter_from_trainer=0, workers=0, drafter_train_steps=n)
        for n in (16, 32)
    },
}
ARMS = {"eagle3": HEAD_ARMS, "small_lm": LM_ARMS}

ARM_TEXT = {
    "frozen": "the drafter *frozen*",
    "spot training": "trained by *spot training* on workers idle in the tail and through the trainer's update "
    "(a trained version ships only when it beats the drafting one on held-out samples)",
    "spot, never shipped": "*spot, never shipped*: the same training with nothing shipped, so its drafter and "
    "rollouts are the frozen arm's and its extra rollout time is what training adds",
    "DrafterFromTrainer": "trained by *DrafterFromTrainer* on the trainer's loss forwards (4 steps after every "
    "optimizer step, published to the workers)",
    "both": "*both*",
    **{
        f"in-process, {n} steps": f"*in-process, {n} steps*: no workers, the drafter trained in the trainer's process "
        f"for {n} steps after every rollout (past the same held-out gate): not bound by idle time"
        for n in (16, 32)
    },
    "self-speculative": "*self-speculative*: no head, the policy's own first layers (7 of 24 on the deep policy; "
    "its final norm and LM head, no adapter) as the drafter, which moves with the policy and is never trained",
}
DRAFTER_TEXT = {
    "eagle3": "the shipped EAGLE-3 head (trained: on the target features it recorded)",
    "small_lm": "the shipped drafter LM (4 layers x 256; trained: all its weights, distilled on the policy's "
    "completions, `drafter/lm_trainer.py`)",
}

NOT_SHIFTED = {"spot, never shipped"}  # its drafter is the frozen arm's: the shift would repeat that arm


@dataclass
class DriftBenchConfig:
    policy: str = "deep"
    steps: int = 30  # enough for the frozen head to fall >= 15% at this learning rate (measured: 21%)
    # 35x the demo's, so that the policy moves within the run (1e-4 moved it little; 5e-4 for 30 steps
    # moved one trajectory 8% of probe tokens and cost a frozen head 10%)
    learning_rate: float = 7e-4
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = 256
    probes: int = 8
    probe_tokens: int = 48
    drafter: str = "eagle3"  # whose arms: the EAGLE-3 head's ("eagle3") or the drafter LM's ("small_lm")
    arms: tuple[str, ...] | None = None  # None: every arm of the drafter's
    seed: int = 0
    # position-keyed sampling: every arm's rollouts, and so its policy trajectory, are the same
    # (checked per step by a digest of the completions); False: each arm samples its own trajectory
    position_noise: bool = True
    # the format shift (None: not run): fine-tune the starting policy to this layout, then this many
    # GRPO steps per arm on it, each arm starting from its drafter as the main run left it
    shift_layout: str | None = "lines"
    shift_sft_steps: int = 120
    shift_lr: float = 1e-3
    shift_steps: int = 6
    output_dir: str = "outputs/bench_drift"

    @classmethod
    def quick(cls) -> DriftBenchConfig:
        return cls(
            policy="tiny", steps=2, prompts_per_step=2, num_generations=4, max_completion_length=48, probes=2,
            shift_sft_steps=2, shift_steps=2,
        )  # fmt: skip


@dataclass
class DriftRun:
    arm: str
    accept_length: list[float]
    rollout_s: list[float]
    tokens: list[int]
    spot_steps: list[int]
    greedy_changed: list[float] = field(default_factory=list)  # share of probes, per step
    tokens_changed: list[float] = field(default_factory=list)  # share of probe tokens, per step
    shift_accept_length: list[float] = field(default_factory=list)  # per GRPO step after the format shift
    shift_spot_steps: list[int] = field(default_factory=list)  # per step after the shift: spot training steps
    shift_lr_scale: list[float] = field(default_factory=list)  # per step after the shift: catch-up's scale
    digests: list[str] = field(default_factory=list)  # of each step's completions
    idle_worker_s: list[float] = field(default_factory=list)  # per step: worker-seconds idle in the tail
    spot_busy_s: list[float] = field(default_factory=list)  # per step: of those, seconds spot training ran
    reward: list[float] = field(default_factory=list)  # per step: the mean reward of the rollout
    step_s: list[float] = field(default_factory=list)  # per step: wall time of the whole RL step


@dataclass
class FormatShift:
    """The fine-tuning that shifts the policy's response format, and how far it took."""

    layout: str
    sft_steps: int
    first_loss: float
    final_loss: float
    in_layout: float  # share of probe prompts whose greedy completion is in the new layout
    accuracy: float  # share of probe prompts whose greedy completion has the right answer
    policy_dir: str


class StepClock(TrainerCallback):
    """Wall time of every RL step (rollout, loss, optimizer step, drafter training on the driver)."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.end: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kwargs):
        self.end = time.perf_counter()

    @property
    def step_s(self) -> list[float]:
        marks = self.begins + ([self.end] if self.end is not None else [])
        return [b - a for a, b in zip(marks, marks[1:])]


class PolicyDrift(TrainerCallback):
    """Greedy completions of fixed probe prompts after every optimizer step, against the starting
    policy's: how far RL has moved the policy."""

    def __init__(self, prompts: list[list[int]], eos: list[int], max_new_tokens: int) -> None:
        self.prompts, self.eos, self.max_new_tokens = prompts, eos, max_new_tokens
        self.start: list[list[int]] | None = None
        self.greedy_changed: list[float] = []
        self.tokens_changed: list[float] = []

    def _greedy(self, model) -> list[list[int]]:
        engine = RolloutEngine(model, RolloutConfig(kv_cache_tokens=8192), eos_token_ids=self.eos)
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        return [o.completion_ids for o in engine.generate(self.prompts, params)]

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start = self._greedy(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = self._greedy(model)
        self.greedy_changed.append(sum(a != b for a, b in zip(now, self.start)) / len(now))
        differ = total = 0
        for a, b in zip(now, self.start):
            n = max(len(a), len(b))
            differ += sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
            total += n
        self.tokens_changed.append(differ / max(total, 1))


def arms_of(cfg: DriftBenchConfig) -> tuple[str, ...]:
    if cfg.drafter not in ARMS:
        raise ValueError(f"drafter must be one of {sorted(ARMS)}, got {cfg.drafter!r}")
    arms = tuple(ARMS[cfg.drafter]) if cfg.arms is None else cfg.arms
    unknown = [a for a in arms if a not in ARMS[cfg.drafter]]
    if unknown:
        raise ValueError(f"arms {unknown} are not arms of drafter {cfg.drafter!r}: {sorted(ARMS[cfg.drafter])}")
    return arms


def _arm_config(base, arm: str, self_layers: int):
    settings = {k: v.format(layers=self_layers) if k == "drafter" else v for k, v in ARMS[base.drafter][arm].items()}
    return base.with_overrides(**settings)


def _trained_drafter(rollout):
    """The rollout's drafter as the run left it (a copy of the head or the drafter LM), or None (a
    drafter named by a string, which holds no weights of its own)."""
    return copy.deepcopy(rollout.drafter) if isinstance(rollout.drafter, torch.nn.Module) else None


def shift_format(cfg: DriftBenchConfig, problems, tokenizer) -> FormatShift:
    """Fine-tune the starting policy to ``cfg.shift_layout`` and save it under ``output_dir``; how
    well it took is read off greedy completions of the probe ``problems``."""
    from ..tasks.chain_sum import extract_answer
    from ..tasks.sft import SFTConfig, fit_model, load_shipped

    model, _ = load_shipped(cfg.policy, "policy")
    sft = SFTConfig(
        steps=cfg.shift_sft_steps,
        batch_size=16,
        lr=cfg.shift_lr,
        warmup_steps=min(10, max(1, cfg.shift_sft_steps // 10)),
        seed=cfg.seed,
        threads=torch.get_num_threads(),
        bf16=False,
        layout=cfg.shift_layout,
        log_every=max(1, cfg.shift_sft_steps // 4),
    )
    out = Path(cfg.output_dir) / f"policy_{cfg.shift_layout}"
    metrics = fit_model(model, sft, tokenizer, out, progress=False, desc="format shift")
    prompts = [list(p) for p in prompts_of(problems, tokenizer)]
    engine = RolloutEngine(model, RolloutConfig(kv_cache_tokens=16384), eos_token_ids=[tokenizer.eos_token_id])
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=cfg.max_completion_length))
    texts = [tokenizer.decode(o.completion_ids, skip_special_tokens=True) for o in outs]
    marker = "answer:" if cfg.shift_layout == "lines" else "answer "
    return FormatShift(
        cfg.shift_layout,
        cfg.shift_sft_steps,
        metrics["first_loss"],
        metrics["final_loss"],
        sum(marker in t for t in texts) / len(texts),
        sum(extract_answer(t) == p.answer for t, p in zip(texts, problems)) / len(texts),
        str(out),
    )


def _base_config(cfg: DriftBenchConfig) -> DemoConfig:
    """The demo's config every arm starts from: a shared GRPO trajectory on 2 workers, no twin."""
    return DemoConfig().with_overrides(
        policy=cfg.policy,
        max_steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step,
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        learning_rate=cfg.learning_rate,
        seed=cfg.seed,
        position_noise=cfg.position_noise,
        # a shared trajectory needs bit-equal GRPO steps: the correction's rollout logprobs differ in
        # their last bits with the drafts packed beside them (measured: arms parted at step 12 with it on)
        importance_sampling=not cfg.position_noise,
        strategy="chain:4",
        drafter=cfg.drafter,
        workers=2,
        drafter_train_steps=0,
        wandb=False,
        warmup_steps=0,
        baseline=False,
        export=None,
        output_dir=cfg.output_dir,
    )


def _drift_run(arm: str, history: list, drift: PolicyDrift, clock: StepClock, summary: dict) -> DriftRun:
    """One arm's per-step record."""
    return DriftRun(
        arm,
        [h.mean_accept_length for h in history],
        [h.time_s for h in history],
        [h.completion_tokens for h in history],
        [h.spot_train_steps for h in history],
        drift.greedy_changed,
        drift.tokens_changed,
        digests=[h.completions_digest for h in history],
        idle_worker_s=[h.idle_worker_s for h in history],
        spot_busy_s=[h.spot_busy_s for h in history],
        reward=list(summary["reward_per_step"]),
        step_s=clock.step_s,
    )


def measure_drift(cfg: DriftBenchConfig) -> tuple[list[DriftRun], FormatShift | None]:
    from ..tasks.sft import load_shipped

    model, tokenizer = load_shipped(cfg.policy, "policy")
    probe_problems = task_problems(cfg.probes, seed=cfg.seed + 4242)
    probes = [list(p) for p in prompts_of(probe_problems, tokenizer)]
    eos = sorted(eos_ids_of(model, tokenizer))
    self_layers = max(1, model.config.num_hidden_layers * 7 // 24)
    del model
    base = _base_config(cfg)
    runs, drafters, catch_ups = [], {}, {}
    for arm in arms_of(cfg):
        drift, clock = PolicyDrift(probes, eos, cfg.probe_tokens), StepClock()
        with torch.random.fork_rng():
            summary, rollout, _ = run_demo_with_rollout(_arm_config(base, arm, self_layers), callbacks=[clock, drift])
        drafters[arm] = _trained_drafter(rollout)
        catch_ups[arm] = rollout.catch_up.state_dict()
        runs.append(_drift_run(arm, rollout.history, drift, clock, summary))
        logger.info("drift arm %s: accept %s", arm, runs[-1].accept_length)
        _save_run(runs[-1], cfg.output_dir)
    if cfg.shift_layout is None:
        return runs, None
    shift = shift_format(cfg, probe_problems, tokenizer)
    logger.info("format shift: %s", shift)
    shifted = dataclasses.replace(base, policy_dir=shift.policy_dir, max_steps=cfg.shift_steps, seed=cfg.seed + 1)
    for run in runs:
        if run.arm in NOT_SHIFTED:
            continue
        with torch.random.fork_rng():
            _, rollout, _ = run_demo_with_rollout(
                _arm_config(shifted, run.arm, self_layers), start=drafters[run.arm], catch_up=catch_ups[run.arm]
            )
        run.shift_accept_length = [h.mean_accept_length for h in rollout.history]
        run.shift_spot_steps = [h.spot_train_steps for h in rollout.history]
        run.shift_lr_scale = [h.drafter_lr_scale for h in rollout.history]
        logger.info("format shift, arm %s: accept %s", run.arm, run.shift_accept_length)
        _save_run(run, cfg.output_dir)
    return runs, shift


def _save_run(run: DriftRun, output_dir: str) -> None:
    """Each arm's measurements on disk as soon as it ends (a run cut short keeps what it measured)."""
    path = Path(output_dir) / f"drift_{run.arm.replace(' ', '_').replace(',', '')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(run)))


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def drift_table(runs: list[DriftRun]) -> str:
    """Per arm: accept length at the start (steps 1-3) and the end (last 3), their ratio, the
    rollout seconds per 1000 tokens (from step 2: step 1 starts the workers) and the policy's move."""
    frozen = next((r for r in runs if r.arm == "frozen"), None)
    lines = [
        "| arm | accept length, steps 1-3 | last 3 steps | end / start | rollout s per 1k tokens (vs frozen) | "
        "drafter steps in the tail | probes with other greedy output at the end | probe tokens changed | "
        "steps with the frozen arm's rollouts |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def per_k(run: DriftRun) -> float:
        return 1000 * sum(run.rollout_s[1:]) / max(sum(run.tokens[1:]), 1)

    for r in runs:
        start, end = _mean(r.accept_length[:3]), _mean(r.accept_length[-3:])
        vs = f" ({per_k(r) / per_k(frozen):.2f}x)" if frozen is not None else ""
        lines.append(
            f"| {r.arm} | {start:.2f} | {end:.2f} | {end / start:.2f} | {per_k(r):.2f}{vs} | {sum(r.spot_steps)} | "
            f"{r.greedy_changed[-1] if r.greedy_changed else float('nan'):.0%} | "
            f"{r.tokens_changed[-1] if r.tokens_changed else float('nan'):.0%} | "
            f"{same_rollouts(r, frozen)} |"
        )
    return "\n".join(lines)


def same_rollouts(run: DriftRun, reference: DriftRun | None) -> str:
    """How many of ``run``'s steps emitted exactly the completions of ``reference``'s same step."""
    if reference is None or not run.digests:
        return "-"
    same = sum(a == b for a, b in zip(run.digests, reference.digests))
    return f"{same} of {len(run.digests)}"


def spot_cost_table(runs: list[DriftRun]) -> str:
    """What spot training costs and uses, per arm that runs it, against the frozen arm on the steps
    whose rollouts are the same (from step 2: step 1 starts the workers): rollout time per step
    (median of the per-step ratios, and the ratio of the sums), the whole RL step's wall time (sum
    vs sum: training through the update gap takes a core from the trainer where they share the
    CPU), the worker-seconds a step leaves idle in the tail, the share of them spot training filled,
    and its drafter steps per RL step (in the tail and the gap)."""
    frozen = next((r for r in runs if r.arm == "frozen"), None)
    lines = [
        "| arm | steps compared | rollout time vs frozen, median per step | sum vs sum | RL step wall time, sum "
        "vs sum | idle worker-s per step in the tail | filled by spot training | drafter steps per RL step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if frozen is None or r is frozen or not any(r.spot_steps):
            continue
        steps = [i for i in range(1, len(r.rollout_s)) if i < len(frozen.digests) and r.digests[i] == frozen.digests[i]]
        if not steps:
            lines.append(f"| {r.arm} | 0 | - | - | - | - | - | - |")
            continue
        ratios = [r.rollout_s[i] / frozen.rollout_s[i] for i in steps]
        total = sum(r.rollout_s[i] for i in steps) / sum(frozen.rollout_s[i] for i in steps)
        timed = [i for i in steps if i < min(len(r.step_s), len(frozen.step_s))]
        wall = f"{sum(r.step_s[i] for i in timed) / sum(frozen.step_s[i] for i in timed):.3f}x" if timed else "-"
        idle = sum(r.idle_worker_s[i] for i in steps)
        busy = sum(r.spot_busy_s[i] for i in steps)
        lines.append(
            f"| {r.arm} | {len(steps)} | {statistics.median(ratios):.3f}x | {total:.3f}x | {wall} | "
            f"{idle / len(steps):.2f} | {busy / idle if idle else float('nan'):.0%} | "
            f"{_mean([r.spot_steps[i] for i in steps]):.1f} |"
        )
    return "\n".join(lines)


def shift_table(runs: list[DriftRun], recover: float = 0.8, within: int = 5) -> str:
    """Per arm after the format shift: the accept length before it (the main run's last 3 steps),
    at the first shifted step and at step ``within``, and the first step back at ``recover`` of it."""
    lines = [
        "| arm | accept length before the shift (last 3 steps) | first step after | "
        f"step {within} after | step {within} / before | first step at >= {recover:.0%} of before | "
        "spot training steps | rollouts followed by catch-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if not r.shift_accept_length:
            continue
        before = _mean(r.accept_length[-3:])
        after = r.shift_accept_length
        at = after[min(within, len(after)) - 1]
        settings = {**HEAD_ARMS, **LM_ARMS}.get(r.arm, {})
        trains = any(settings.get(k) for k in ("spot_training", "drafter_from_trainer", "drafter_train_steps"))
        caught_up = f"{sum(x > 1 for x in r.shift_lr_scale)} of {len(r.shift_lr_scale)}" if trains else "-"
        back = next((i + 1 for i, a in enumerate(after) if a >= recover * before), None)
        lines.append(
            f"| {r.arm} | {before:.2f} | {after[0]:.2f} | {at:.2f} | {at / before:.2f} | "
            f"{back if back is not None else f'not in {len(after)}'} | {sum(r.shift_spot_steps)} | "
            f"{caught_up} |"
        )
    return "\n".join(lines)


def plot_drift(runs: list[DriftRun], path: Path) -> None:
    steps = lambda xs: list(range(1, len(xs) + 1))  # noqa: E731
    panels = [
        (
            "Accept length per RL step",
            "mean accepted length",
            [(r.arm, steps(r.accept_length), r.accept_length) for r in runs],
        ),
        (
            "How far the policy moved",
            "probe tokens changed vs step 0",
            [(r.arm, steps(r.tokens_changed), r.tokens_changed) for r in runs],
        ),
    ]
    if any(r.shift_accept_length for r in runs):
        panels.append(
            (
                "After the format shift",
                "mean accepted length",
                [(r.arm, steps(r.shift_accept_length), r.shift_accept_length) for r in runs if r.shift_accept_length],
            )
        )
    plot_panels(path, panels)


def drift_section(runs: list[DriftRun], cfg: DriftBenchConfig, plot_name: str, shift: FormatShift | None) -> str:
    trajectory = (
        "Sampling is position-keyed (`SpecRolloutConfig.position_noise`): a completion is a function of "
        "the policy, the prompt and its seed, whatever drafts it, so every arm generates the same "
        "rollouts, takes the same GRPO steps and follows one policy trajectory (the last column counts "
        "the steps whose completions hash equal to the frozen arm's); the drafters are compared on the "
        "same text. Acceptance is that of Gumbel-coupled drafts, a little below rejection sampling's."
        if cfg.position_noise
        else "Each arm samples its own RL trajectory (rejection-sampled drafts draw other, equally likely "
        "completions), so the arms' policies move apart."
    )
    frozen = next((r for r in runs if r.arm == "frozen"), None)
    rewards = (
        f" The trajectory's mean reward: {_mean(frozen.reward[:3]):.3f} over steps 1-3, "
        f"{_mean(frozen.reward[-3:]):.3f} over the last 3."
        if frozen is not None and frozen.reward
        else ""
    )
    arms = "; ".join(ARM_TEXT[r.arm] for r in runs)
    text = (
        f"GRPO on the shipped {cfg.policy} policy for {cfg.steps} RL steps ({cfg.prompts_per_step} sampled "
        f"chain-sum prompts x {cfg.num_generations} samples per step, learning rate {cfg.learning_rate:g}, "
        f"at most {cfg.max_completion_length} tokens), 2 Ray workers, `chain:4` drafts from "
        f"{DRAFTER_TEXT[cfg.drafter]}, the same seeds in every arm: {arms}. "
        f"{trajectory}{rewards} The policy's move: the greedy "
        f"completions of {cfg.probes} held-out probe prompts ({cfg.probe_tokens} tokens) after each step against "
        f"the starting policy's.\n\n{drift_table(runs)}\n\n![drift]({plot_name})\n\n"
        "**What spot training costs and uses.** Against the frozen arm, on the steps with the same rollouts "
        "(from step 2). *RL step wall time*: the whole step (rollout, GRPO update, probes); a chunk training "
        "through the update shares the CPU with the trainer here, where Ray runs its workers at nice 15, "
        "so it yields to the trainer. *Idle worker-s*: per rollout, the seconds a worker held no request "
        "while the other still generated (the tail); *filled*: the share of them a training chunk ran in.\n\n"
        f"{spot_cost_table(runs)}"
    )
    if shift is None:
        return text + "\n\nThe format shift was not run."
    return text + (
        f"\n\n**Format shift.** The starting policy fine-tuned for {shift.sft_steps} steps (batch 16, "
        f"learning rate {cfg.shift_lr:g}) to the `{shift.layout}` layout (`3 + 5 = 8` a step per line, "
        f"`answer: 17`; loss {shift.first_loss:.3f} -> {shift.final_loss:.3f}): {shift.in_layout:.0%} of the "
        f"probe prompts' greedy completions are in the new layout, {shift.accuracy:.0%} right. Every arm then "
        f"runs {cfg.shift_steps} GRPO steps on it with its drafter and its catch-up rule as the main run left "
        "them (other seeds than the main run, the same in every arm; the training buffers start empty, so "
        "online heads train on new-layout text only). *Catch-up* (`SpecRolloutConfig.catch_up`, on by "
        "default): after a rollout whose accept length is under 0.8 x the best recent one, drafter "
        f"training runs at 10x its learning rate.\n\n{shift_table(runs)}"
    )
