"""A rollout beside a plain-decoding twin: what speculation bought at each RL step, and the proof
that it changed nothing (the demo's ``baseline``; any ``SpecRollout`` pair works)."""

from __future__ import annotations

import statistics
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
    rollout besides (sync, close, state, a drafter trained beside it) goes to the main one."""

    def __init__(self, main: Any, twin: Any) -> None:
        self.main, self.twin = main, twin
        self.identical_completions: list[tuple[int, int]] = []  # per call: (completions equal to the twin's, of)

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        if len(self.identical_completions) % 2 == 0:
            self._run_twin(prompts, trainer)
            out = self.main(prompts, trainer)
        else:
            out = self.main(prompts, trainer)
            self._run_twin(prompts, trainer)
        main, twin = self.main.last_stats, self.twin.last_stats
        equal = sum(a == b for a, b in zip(main.completion_digests, twin.completion_digests))
        self.identical_completions.append((equal, len(main.completion_digests)))
        return out

    @property
    def same_completions(self) -> list[bool]:
        """Per call: whether the twin emitted every completion the main rollout did."""
        return [equal == total for equal, total in self.identical_completions]

    def _run_twin(self, prompts: list, trainer: Any) -> None:
        if self.main.coordinator is not None:
            self.main.coordinator.settle(wait=True)  # no drafter training beside the twin's rollout
        self.twin(prompts, trainer)

    def sync_weights(self, trainer: Any) -> None:
        self.main.sync_weights(trainer)
        self.twin.sync_weights(trainer)

    def close(self, *, wait: bool = True) -> None:
        self.twin.close(wait=wait)
        self.main.close(wait=wait)

    def state_dict(self) -> dict[str, Any]:
        return self.main.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state)

    def publish_drafter(self, head: Any) -> bool:
        return self.main.publish_drafter(head)

    @property
    def drafter_lr_scale(self) -> float:  # read by DrafterFromTrainer
        return self.main.drafter_lr_scale

    def step_ratios(self) -> list[float]:
        """Per call, the main rollout's tokens/s over the twin's (a ratio of times where the
        completions are the same); nan where the twin emitted nothing."""
        return [
            main.tokens_per_s / twin.tokens_per_s if twin.tokens_per_s else float("nan")
            for main, twin in zip(self.main.history, self.twin.history)
        ]

    def compare(self, wall_s: float) -> dict[str, Any]:
        """Over the run so far (``wall_s`` seconds of training, both rollouts included): the twin's
        rollout time and throughput, the main one's against it, the per-step ratios and their
        median, the run's wall time with either rollout alone, and at how many steps (and in how many
        completions) the two emitted the same tokens."""
        main, twin = self.main.history, self.twin.history
        main_time, main_tokens = sum(s.time_s for s in main), sum(s.completion_tokens for s in main)
        twin_time, twin_tokens = sum(s.time_s for s in twin), sum(s.completion_tokens for s in twin)
        out: dict[str, Any] = {}
        per_step = self.step_ratios()
        ratios = [r for r in per_step if r == r]
        if ratios:
            out["rollout_ratio_median_per_step"] = statistics.median(ratios)
            out["rollout_ratio_per_step"] = per_step
        out["baseline_rollout_time_s"] = twin_time
        out["baseline_rollout_tokens_per_s"] = twin_tokens / twin_time if twin_time else 0.0
        if out["baseline_rollout_tokens_per_s"] and main_time:
            out["rollout_throughput_vs_none"] = (main_tokens / main_time) / out["baseline_rollout_tokens_per_s"]
        # the whole run's wall time with either rollout alone: the same training, one rollout per step
        out["run_wall_s_speculative"] = wall_s - twin_time
        out["run_wall_s_plain"] = wall_s - main_time
        out["run_speedup"] = out["run_wall_s_plain"] / out["run_wall_s_speculative"]
        out["same_completions_steps"] = f"{sum(self.same_completions)} of {len(self.same_completions)}"
        equal, total = (sum(col) for col in zip(*self.identical_completions)) if self.identical_completions else (0, 0)
        out["same_completions"] = f"{equal} of {total}"
        return out
