"""The mirror section's tables and plot from a result (no model runs here)."""

from tailspec.benchmarks.mirror import (
    MIRROR_ARMS,
    SERIAL_ARMS,
    ArmResult,
    MirrorBenchConfig,
    MirrorResult,
    mirror_section,
    plot_mirror,
)


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
