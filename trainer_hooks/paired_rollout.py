"""A rollout beside a plain-decoding twin: what speculation bought at each RL step, and the proof
that it changed nothing (the demo's ``baseline``; any ``SpecRollout`` pair works). Other drafters'
rollouts may run beside the two on the same prompts and weights (the demo's ``compare_drafters``):
which drafter pays on this workload, measured step by step on one policy trajectory."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any


class PairedRollout:
    """A rollout (``main``) with a plain-decoding twin: per RL step, its speedup and the lossless check.

    At every call the twin rolls out the same prompts on the same policy weights, the two in
    alternating order, so each RL step gets a same-step ratio (the twin's workers idle while the
    main one's run, and the main one's drafter training through the update gap is stopped before
    the twin starts). With position-keyed sampling the two must emit the same completions, which
    is checked at every step, completion by completion: the lossless claim, per RL step. (On a GPU
    the two run kernels of other shapes, whose rounding differs: a near-tied draw can flip and a
    completion diverge from there.) The trainer trains on the main
    rollout's outputs and sees nothing of the twin (it logs no metrics); what the trainer asks of a
    rollout besides (sync, close, state, a drafter trained beside it) goes to the main one.

    ``beside``: more rollouts by name (other drafters), each run on the same prompts and weights
    at every call and checked against the twin as the main one is; the trainer sees none of their
    outputs. Their order and the main one's and the twin's rotate from call to call, so no
    rollout always runs first (or right after the same other one)."""

    def __init__(self, main: Any, twin: Any, beside: Mapping[str, Any] | None = None) -> None:
        self.main, self.twin = main, twin
        self.beside = dict(beside or {})
        self.identical_completions: list[tuple[int, int]] = []  # per call: (completions equal to the twin's, of)
        # per call and rollout of ``beside``: (completions equal to the twin's, of)
        self.identical_beside: dict[str, list[tuple[int, int]]] = {name: [] for name in self.beside}

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        order = ["twin", "main", *self.beside]
        shift = len(self.identical_completions) % len(order)
        out: dict[str, list] = {}
        named = {"twin": self.twin, "main": self.main, **self.beside}
        for name in order[shift:] + order[:shift]:
            self._settle(but=named[name])  # no drafter training beside another rollout's
            result = named[name](prompts, trainer)
            out = result if name == "main" else out
        twin = self.twin.last_stats.completion_digests
        self.identical_completions.append(_alike(self.main.last_stats.completion_digests, twin))
        for name, rollout in self.beside.items():
            self.identical_beside[name].append(_alike(rollout.last_stats.completion_digests, twin))
        return out

    @property
    def same_completions(self) -> list[bool]:
        """Per call: whether the twin emitted every completion the main rollout did."""
        return [equal == total for equal, total in self.identical_completions]

    def _rollouts(self) -> list[Any]:
        return [self.main, self.twin, *self.beside.values()]

    def _settle(self, but: Any) -> None:
        """Every other rollout's drafter training stopped and collected before ``but`` runs (``but``'s
        own is its rollout's to handle, as it would be without the others)."""
        for rollout in self._rollouts():
            if rollout is not but and rollout.coordinator is not None:
                rollout.coordinator.settle(wait=True)

    def sync_weights(self, trainer: Any) -> None:
        for rollout in self._rollouts():
            rollout.sync_weights(trainer)

    def close(self, *, wait: bool = True) -> None:
        for rollout in reversed(self._rollouts()):
            rollout.close(wait=wait)

    def state_dict(self) -> dict[str, Any]:
        return self.main.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state)

    def publish_drafter(self, head: Any) -> bool:
        return self.main.publish_drafter(head)

    @property
    def drafter_lr_scale(self) -> float:  # read by DrafterFromTrainer
        return self.main.drafter_lr_scale

    def step_ratios(self, rollout: Any = None) -> list[float]:
        """Per call, ``rollout``'s (the main one's by default) tokens/s over the twin's (a ratio of
        times where the completions are the same); nan where the twin emitted nothing."""
        history = (rollout or self.main).history
        return [
            ours.tokens_per_s / twin.tokens_per_s if twin.tokens_per_s else float("nan")
            for ours, twin in zip(history, self.twin.history)
        ]

    def compare(self, wall_s: float) -> dict[str, Any]:
        """Over the run so far (``wall_s`` seconds of training, every rollout included): the twin's
        rollout time and throughput, the main one's against it, the per-step ratios and their
        median, the run's wall time with either rollout alone, and at how many steps (and in how many
        completions) the two emitted the same tokens; under ``beside``, the ratios and alike
        completions of each rollout beside them."""
        main, twin = self.main.history, self.twin.history
        beside_time = sum(s.time_s for rollout in self.beside.values() for s in rollout.history)
        main_time, main_tokens = sum(s.time_s for s in main), sum(s.completion_tokens for s in main)
        twin_time, twin_tokens = sum(s.time_s for s in twin), sum(s.completion_tokens for s in twin)
        out: dict[str, Any] = _ratios(self.step_ratios())
        out["baseline_rollout_time_s"] = twin_time
        out["baseline_rollout_tokens_per_s"] = twin_tokens / twin_time if twin_time else 0.0
        if out["baseline_rollout_tokens_per_s"] and main_time:
            out["rollout_throughput_vs_none"] = (main_tokens / main_time) / out["baseline_rollout_tokens_per_s"]
        # the whole run's wall time with either rollout alone: the same training, one rollout per step
        out["run_wall_s_speculative"] = wall_s - twin_time - beside_time
        out["run_wall_s_plain"] = wall_s - main_time - beside_time
        out["run_speedup"] = out["run_wall_s_plain"] / out["run_wall_s_speculative"]
        out["same_completions_steps"] = f"{sum(self.same_completions)} of {len(self.same_completions)}"
        out["same_completions"] = _alike_total(self.identical_completions)
        if self.beside:
            out["beside"] = {
                name: {
                    **_ratios(self.step_ratios(rollout)),
                    "same_completions": _alike_total(self.identical_beside[name]),
                }
                for name, rollout in self.beside.items()
            }
        return out


def _alike(ours: tuple[str, ...], twins: tuple[str, ...]) -> tuple[int, int]:
    return sum(a == b for a, b in zip(ours, twins)), len(ours)


def _alike_total(per_call: list[tuple[int, int]]) -> str:
    equal, total = (sum(col) for col in zip(*per_call)) if per_call else (0, 0)
    return f"{equal} of {total}"


def _ratios(per_step: list[float]) -> dict[str, Any]:
    ratios = [r for r in per_step if r == r]
    return (
        {"rollout_ratio_median_per_step": statistics.median(ratios), "rollout_ratio_per_step": per_step}
        if ratios
        else {}
    )
