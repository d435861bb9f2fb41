"""tailspec.GRPOTrainer under the shipped ZeRO-2 / ZeRO-3 configs, on DeepSpeed's CPU accelerator
(skipped where DeepSpeed is not installed). Under ZeRO-3 the rollout must generate with the
gathered parameters: the importance-sampling ratio of ~1 shows the rollout's logprobs are the
trainer's (a partitioned or stale model would give garbage or fail)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

JOB = Path(__file__).with_name("deepspeed_grpo_job.py")


def test_grpo_trains_under_zero2_and_zero3_with_tailspec_rollouts(tmp_path):
    """Both stages in one job process (DeepSpeed's and the trainer stack's imports paid once)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(JOB), "zero2,zero3", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("deepspeed-grpo ")]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage, line in zip((2, 3), lines):
        result = json.loads(line.split(" ", 1)[1])
        assert result["zero_stage"] == stage
        assert result["global_step"] == 3 and result["syncs"] == [0, 1, 2]  # one weight sync per optimizer step
        assert result["rollout_calls"] == 3 and result["completion_tokens"] > 0
        assert len(result["is_ratio_mean"]) == 3
        for key in ("is_ratio_mean", "is_ratio_min", "is_ratio_max"):
            assert all(abs(r - 1) < 1e-3 for r in result[key]), result
        assert result["shapes_ok"] and result["moved"] > 1e-4  # the optimizer really stepped the policy
        # an EAGLE-3 head trained from the trainer's loss forwards (gathered embeddings / LM head under ZeRO-3)
        assert result["drafter_samples"] == 3 * 8 and result["drafter_version"] == 3 * 2
        assert len(result["drafter_losses"]) == 3 and all(
            loss == loss and loss > 0 for loss in result["drafter_losses"]
        )
