"""The drift benchmark's pieces: the policy-movement probe sees a moved policy and not an unmoved
one, the table compares arms, and the demo refuses DrafterFromTrainer without an EAGLE-3 head."""

import pytest

from tailspec.benchmarks.drift import DriftRun, PolicyDrift, drift_table, plot_drift, shift_table, spot_cost_table
from tailspec.demo import DemoConfig
from tailspec.testing import perturbed_copy, tiny_random_model


def test_policy_drift_sees_only_a_moved_policy():
    model = tiny_random_model("llama", seed=3, initializer_range=0.2)
    drift = PolicyDrift([[5, 6, 7], [8, 9]], eos=[1], max_new_tokens=12)
    drift.on_train_begin(None, None, None, model=model)
    drift.on_step_end(None, None, None, model=model)
    assert drift.greedy_changed == [0.0] and drift.tokens_changed == [0.0]
    drift.on_step_end(None, None, None, model=perturbed_copy(model, noise=2.0, seed=1))
    assert drift.greedy_changed[-1] > 0 and 0 < drift.tokens_changed[-1] <= 1


def test_table_and_plot(tmp_path):
    runs = [
        DriftRun("frozen", [3.0, 2.8, 2.6, 2.4], [1.0, 1.0, 1.0, 1.0], [100] * 4, [0] * 4, [0.0, 0.5], [0.0, 0.2]),
        DriftRun("spot training", [3.0, 3.0, 3.1, 3.0], [1.0, 1.1, 1.0, 1.0], [100] * 4, [0, 4, 4, 4], [0.5], [0.2]),
    ]
    table = drift_table(runs)
    assert "| frozen | 2.80 | 2.60 | 0.93 | 10.00 (1.00x) | 0 | 50% | 20% | - |" in table
    assert "(1.03x)" in table and "| 12 |" in table
    plot_drift(runs, tmp_path / "drift.png")
    assert (tmp_path / "drift.png").stat().st_size > 0


def test_demo_config_checks_drafter_from_trainer():
    with pytest.raises(ValueError, match="drafter_from_trainer"):
        DemoConfig(drafter_from_trainer=-1)


def test_the_format_shift_table_and_panel(tmp_path):
    frozen = DriftRun("frozen", [3.0, 3.0, 3.0], [1.0] * 3, [100] * 3, [0] * 3)
    frozen.shift_accept_length = [1.5, 1.5, 1.6, 1.5, 1.5, 1.6]
    online = DriftRun("spot training", [3.0, 3.0, 3.0], [1.0] * 3, [100] * 3, [0] * 3)
    online.shift_accept_length = [1.5, 2.0, 2.5, 2.7, 2.9, 3.0]
    table = shift_table([frozen, online])
    assert "| frozen | 3.00 | 1.50 | 1.50 | 0.50 | not in 6 |" in table
    assert "| spot training | 3.00 | 1.50 | 2.90 | 0.97 | 3 |" in table  # 2.5 >= 0.8 x 3.0 at step 3
    plot_drift([frozen, online], tmp_path / "drift.png")
    assert (tmp_path / "drift.png").stat().st_size > 0


def test_demo_config_checks_policy_dir(tmp_path):
    with pytest.raises(ValueError, match="policy_dir"):
        DemoConfig(policy_dir=str(tmp_path))  # no config.json


def test_spot_cost_compares_only_steps_with_the_same_rollouts():
    frozen = DriftRun("frozen", [3.0] * 4, [9.0, 2.0, 2.0, 4.0], [100] * 4, [0] * 4, digests=["a", "b", "c", "d"])
    frozen.idle_worker_s = frozen.spot_busy_s = [0.0] * 4
    spot = DriftRun("spot training", [3.0] * 4, [9.0, 2.2, 2.0, 9.0], [100] * 4, [0, 4, 4, 4])
    spot.digests = ["a", "b", "c", "x"]  # step 4 generated other completions: not compared
    spot.idle_worker_s, spot.spot_busy_s = [0.0, 1.0, 3.0, 5.0], [0.0, 0.5, 1.5, 5.0]
    frozen.step_s, spot.step_s = [20.0, 10.0, 10.0, 10.0], [20.0, 11.0, 12.0, 30.0]
    table = spot_cost_table([frozen, spot])
    # steps 2-3: rollout 4.2 / 4.0 s, whole RL steps 23 / 20 s
    assert "| spot training | 2 | 1.050x | 1.050x | 1.150x | 2.00 | 50% | 4.0 |" in table
    assert "| frozen |" not in table  # the reference, and it trains nothing
    assert "| spot training | 2 of 4 |" not in drift_table([frozen, spot])
    assert "| 3 of 4 |" in drift_table([frozen, spot])


def test_each_arm_is_saved_as_it_ends(tmp_path):
    import dataclasses
    import json

    from tailspec.benchmarks.drift import _save_run

    run = DriftRun("spot, never shipped", [3.0, 2.5], [1.0, 1.1], [100, 90], [0, 4], digests=["a", "b"])
    _save_run(run, str(tmp_path))
    saved = json.loads((tmp_path / "drift_spot_never_shipped.json").read_text())
    assert saved == json.loads(json.dumps(dataclasses.asdict(run)))
