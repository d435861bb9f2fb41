"""The GRPO-path bench (``tailspec bench --section grpo_path``) on the tiny policy, in-process."""

import pytest

from tailspec.benchmarks.grpo_path import (
    GRPOPathConfig,
    grpo_path_section,
    grpo_path_steps,
    grpo_path_table,
    measure_grpo_path,
)


def test_contenders_run_interleaved_per_rl_step_and_emit_the_same_tokens():
    cfg = GRPOPathConfig(
        policy="tiny",
        strategies=("none", "chain:4", "adaptive"),
        workers=(0,),
        steps=2,
        num_generations=2,
        max_completion_length=48,
    )
    runs = measure_grpo_path(cfg)
    assert [r.strategy for r in runs] == ["none", "chain:4", "adaptive"]
    for run in runs:
        assert len(run.seconds) == len(run.tokens) == len(run.strategy_steps) == 2 and min(run.seconds) > 0
    # position-keyed sampling: every strategy emits the same completions, so the same token count
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert runs[1].accept_length[-1] > 1.5 and sum(runs[2].strategy_steps[-1].values()) > 0
    table, steps = grpo_path_table(runs), grpo_path_steps(runs)
    assert "| in-process | `adaptive` |" in table and "vs best fixed arm" in table
    assert "| 2 |" in steps and "`adaptive` mix" in steps
    assert "position-keyed" in grpo_path_section(runs, cfg, "plot.png")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="strategies"):
        GRPOPathConfig(strategies=("chain:4", "adaptive"))
    with pytest.raises(ValueError, match="steps"):
        GRPOPathConfig(steps=1)
