"""The mirror section's tables and plot from a result (no model runs here)."""

from tailspec.benchmarks.mirror import (
    MIRROR_ARMS,
    SERIAL_ARMS,
    ArmResult,
    MirrorBenchConfig,
    MirrorResult,
    mirror_section,
    plot_mirror,
    steps_by_batch,
)
from tailspec.rollout.stats import StepRecord


def _result() -> MirrorResult:
    cfg = MirrorBenchConfig(batch_sizes=(1, 4), passes=2)
    arms = []
    for batch in cfg.batch_sizes:
        for i, arm in enumerate((*SERIAL_ARMS, *MIRROR_ARMS)):
            r = ArmResult(
                arm, batch, seconds=[2.0, 2.2], tokens=[400 + i, 420 + i], ratios=[1.0 + i / 50, 1.1 + i / 50]
            )
            r.draft_share = 0.3
            if arm.startswith(("mirror", "eagle3 mirror", "streaming mirror")):
                r.mirror = {"reuse": 0.75, "serial_ms": 3.0, "wait_ms": 1.0, "branches": 1.0}
            arms.append(r)
    tail = [ArmResult("adaptive", 24, [5.0], [900], [1.0]), ArmResult("adaptive + mirror", 24, [4.0], [900], [1.25])]
    tail[0].by_batch = {1: [2.0, 100.0, 0.0], 32: [3.0, 800.0, 0.0]}
    tail[1].by_batch = {1: [1.0, 100.0, 0.5], 32: [3.0, 800.0, 0.0]}
    agreement = {layer: {1: 0.5 + layer / 100, 2: 0.7, 4: 0.9} for layer in range(1, 24)}
    return MirrorResult(cfg, "a test policy", agreement, arms, tail, {"process": 0.02, "ray": 0.8}, (3.0, 1.0))


def test_the_section_reports_every_arm_its_same_pass_ratio_and_the_draft_hosts(tmp_path):
    result = _result()
    text = mirror_section(result, "bench_mirror_deep.png")
    for arm in (*SERIAL_ARMS, *MIRROR_ARMS, "adaptive + mirror"):
        assert f"| {arm} |" in text
    assert "| 1 | mirror:chain:4,k=0 |" in text and "75%" in text
    assert "process 0.02 ms, ray 0.80 ms" in text and "3.00 -> 1.00" in text
    assert "layer 7" in text  # the configured exit layer is always shown
    plot_mirror(result, tmp_path / "mirror.png")
    assert (tmp_path / "mirror.png").stat().st_size > 0


def test_the_tail_profile_sums_steps_by_active_sequences_and_compares_the_engines():
    steps = [
        StepRecord(24, "chain:4", 100, 2.0, False),
        StepRecord(3, "mirror:chain:6,k=0", 12, 0.5, True),
        StepRecord(4, "chain:4", 10, 0.5, True),
        StepRecord(1, "none", 1, 0.1, True),
    ]
    assert steps_by_batch(steps) == {1: [0.1, 1.0, 0.0], 4: [1.0, 22.0, 0.5], 32: [2.0, 100.0, 0.0]}
    text = mirror_section(_result(), "bench_mirror_deep.png")
    assert "| 1-1 | 40% | 50 | 100 | 2.00x | 50% |" in text
    assert "| 2-32 | 60% | 267 | 267 | 1.00x | 0% |" in text
