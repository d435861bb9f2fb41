"""The GPU training stage's arithmetic, on made-up rollouts: each drafter's rollout and whole GRPO
step against the twin's, the tail's share, the targets judged on the steps run, the budget's stop."""

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tailspec.benchmarks.gpu.common import CheckSize, Stage
from tailspec.benchmarks.gpu.training import TrainingSize, judge, per_step, step_log, workload_prompts
from tailspec.tasks.chain_sum import ChainSumProblem
from tailspec.tasks.sft import load_shipped


@dataclass
class Stats:
    time_s: float
    tail_time_s: float = 0.0
    mean_accept_length: float = 1.0
    drafter_version: int | None = None
    drafter_loss: float | None = None
    strategy_steps: dict = field(default_factory=dict)
    capture_time_s: float = 0.0
    calibration_time_s: float = 0.0
    drafter_train_s: float = 0.0


def _paired(twin, main, head):
    return SimpleNamespace(
        main=SimpleNamespace(history=main),
        twin=SimpleNamespace(history=twin),
        beside={"eagle3": SimpleNamespace(history=head)},
        identical_completions=[(64, 64)] * len(main),
        identical_beside={"eagle3": [(60, 64)] * len(head)},
    )


def test_a_step_is_the_training_less_every_rollout_plus_ones_own():
    twin = [Stats(10.0, tail_time_s=6.0), Stats(8.0, tail_time_s=5.0)]
    steps = {"chain:4": 9, "none": 1}
    main = [Stats(5.0, tail_time_s=2.0, mean_accept_length=3.5, strategy_steps=steps, drafter_train_s=0.5)] * 2
    head = [Stats(4.0, mean_accept_length=4.0, drafter_train_s=1.0)] * 2
    log = SimpleNamespace(step_s=[23.5, 20.5], memory=[{"free_gib": 80.0}, {}])
    rows = per_step(_paired(twin, main, head), log)
    first = rows["small_lm"][0]
    # step 1: 23.5 s of wall, 19 s of rollouts and 1.5 s of drafter training after them: 3 s of scoring
    # and update; a step with one rollout is that, the rollout and its drafter's training
    assert (first["step_s"], first["twin_step_s"]) == (8.5, 13.0) and first["step_vs_plain"] == round(13 / 8.5, 3)
    assert first["rollout_vs_plain"] == 2.0 and first["tail_share"] == 0.4 and first["twin_tail_share"] == 0.6
    assert first["strategies"] == "chain:4 90% none 10%" and first["free_gib"] == 80.0
    assert rows["eagle3"][1]["step_s"] == 20.5 - 18.5 + 5.0 and rows["eagle3"][1]["same_completions"] == "60 of 64"


def test_the_targets_are_judged_on_the_steps_run(tmp_path):
    stage = Stage("training", CheckSize.of("full"), 100, tmp_path)
    size = TrainingSize.of("full")
    rows = {
        "small_lm": [{"rollout_vs_plain": 1.0, "step_vs_plain": 1.0, "accept_length": 4.0, "step": s + 1,
                      "same_completions": "64 of 64"} for s in range(3)],
    }  # fmt: skip
    rows["small_lm"][1:] = [dict(r, rollout_vs_plain=2.0, step_vs_plain=1.3) for r in rows["small_lm"][1:]]
    lengths = {"median": 200, "p90": 1600, "p99": 1900, "max": 1950, "p99_over_median": 9.5}
    judge(stage, size, rows, lengths, SimpleNamespace(step_s=[1.0] * 3, stopped_early=True))
    checks = {c["name"]: c["passed"] for c in json.loads((tmp_path / "training.json").read_text())["checks"]}
    assert checks["the GRPO run takes its 8 steps within the stage's budget"] is False
    assert checks["small_lm: every GRPO step completes"] is True
    assert checks["small_lm: rollout at least 1.8x plain decoding from step 2 (median)"] is True
    assert checks["small_lm: the whole GRPO step at least 1.4x the twin's from step 2 (median)"] is False
    assert checks["the workload's completions: p99 at least 8x the median"] is True


def test_the_run_stops_after_a_step_when_the_next_would_not_fit(monkeypatch):
    stage = SimpleNamespace(left=lambda: 30.0)
    log = step_log(stage, reserve_s=15.0)
    control = SimpleNamespace(should_training_stop=False)
    clock = iter([0.0, 10.0, 20.0, 40.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    log.on_step_begin(None, None, control)
    log.on_step_end(None, None, control)  # a 10 s step: 30 s left holds another and the reserve
    assert not control.should_training_stop
    log.on_step_begin(None, None, control)
    log.on_step_end(None, None, control)  # a 20 s step: 30 s left do not hold another and 15 s
    assert control.should_training_stop and log.stopped_early


def test_the_rehearsal_trains_on_shorter_problems_a_step_holding_one_long_one():
    _, tokenizer = load_shipped("deep", "drafter")
    size = TrainingSize.of("tiny")
    prompts = workload_prompts(size, tokenizer, 4, seed=1)
    questions = [tokenizer.decode(p) for p in prompts]
    terms = [len(ChainSumProblem.from_question(q.split("<|user|>")[1].split("<|")[0]).terms) for q in questions]
    assert len(prompts) == 4 and max(terms) <= size.extend.max_terms
    with pytest.raises(ValueError, match="size must be"):
        TrainingSize.of("huge")
