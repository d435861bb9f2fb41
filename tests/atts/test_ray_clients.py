"""Draft and target engines as Ray actors: same samples as in-process, bad requests refused in the driver."""

import pytest
import torch

from tailspec.atts import ATTSConfig, ATTSRunner, RayEngineClient
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import tiny_random_model


def test_ray_engines_give_the_in_process_samples_and_a_killed_one_loses_no_request(ray_local):
    """Remote engines calibrate and run as in-process ones do; then the target's actor is killed
    mid-run: a new one is started, in-flight requests are resubmitted, and the run returns the
    same samples as an undisturbed one. (One pair of actors for both: each start costs seconds.)"""
    target = tiny_random_model("qwen3", seed=3)
    draft = tiny_random_model("llama", seed=4)
    rollout = RolloutConfig(block_size=8, kv_cache_tokens=8192)
    config = ATTSConfig(alpha=0.3, num_samples=2, chunk_tokens=4, max_new_tokens=16, temperature=0.0, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (5,), generator=g).tolist() for _ in range(3)]
    calibration_prompts = [torch.randint(2, 96, (6,), generator=g).tolist() for _ in range(3)]

    local = ATTSRunner(RolloutEngine(draft, rollout), RolloutEngine(target, rollout), config)
    calibration = local.calibrate(calibration_prompts)
    expected = local.run(prompts, calibration)

    remote_draft = RayEngineClient(draft, rollout, name="draft", num_threads=1)
    remote_target = RayEngineClient(target, rollout, name="target", num_threads=1)
    try:
        remote = ATTSRunner(remote_draft, remote_target, config)
        assert remote.calibrate(calibration_prompts).scores == pytest.approx(calibration.scores, abs=1e-5)
        got = remote.run(prompts, calibration)
        assert [s.completion_ids for s in got.samples] == [s.completion_ids for s in expected.samples]
        assert [[t.author for t in s.turns] for s in got.samples] == [
            [t.author for t in s.turns] for s in expected.samples
        ]
        with pytest.raises(ValueError, match="vocabulary"):
            remote_draft.submit([1, 200], SamplingParams())
        assert remote_target.stats["prefill_steps"] > 0

        state = {"polls": 0, "killed": False}
        original_poll = remote_target.poll

        def poll_and_kill_once():
            """Kill the actor once, at the first poll after the third that has requests in flight."""
            state["polls"] += 1
            if not state["killed"] and state["polls"] > 3 and remote_target.num_pending():
                ray_local.kill(remote_target.actor)
                state["killed"] = True
            return original_poll()

        remote_target.poll = poll_and_kill_once
        again = ATTSRunner(remote_draft, remote_target, config).run(prompts, calibration)
        assert state["killed"] and remote_target.restarts == 1
        assert [s.completion_ids for s in again.samples] == [s.completion_ids for s in expected.samples]
    finally:
        remote_draft.close()
        remote_target.close()
