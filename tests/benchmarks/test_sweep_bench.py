"""The batch-size sweep: interleaved passes, same-pass ratios, the step split."""

import pytest

from tailspec.benchmarks.sweep import Arm, best_ratio, measure_sweep, sweep_table
from tailspec.rollout.params import SamplingParams
from tailspec.testing import perturbed_copy, tiny_random_model


def test_sweep_measures_every_arm_against_none():
    model = tiny_random_model("qwen2")
    drafter = perturbed_copy(model, 0.01)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    arms = [Arm("none", "none"), Arm("chain:2 LM", "chain:2", "lm"), Arm("suffix", "suffix")]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    cells = measure_sweep(model, {"lm": drafter}, arms, prompts, [[3, 4]], params, (1, 2), {1: 2, 2: 4}, [1], passes=2)
    assert [(c.batch_size, c.arm.label) for c in cells] == [(b, a.label) for b in (1, 2) for a in arms]
    for c in cells:
        assert len(c.passes) == 2 and len(c.ratios) == 2
        assert c.passes[0].tokens == 12 * (2 if c.batch_size == 1 else 4)
        total, draft, forward, rest = c.step_split_ms()
        assert total == pytest.approx(draft + forward + rest) and forward > 0
        if c.arm.strategy == "none":
            assert c.ratios == [1.0, 1.0] and draft == 0 and c.accept_length == 1.0
    lm = best_ratio(cells, 1, "lm")
    assert lm is not None and lm.arm.label == "chain:2 LM" and lm.accept_length > 1.0
    table = sweep_table(cells)
    assert table.count("\n") == 1 + len(cells) and "chain:2 LM" in table


def test_sweep_needs_a_baseline():
    with pytest.raises(ValueError, match="'none' arm"):
        measure_sweep(
            tiny_random_model("qwen2"),
            {},
            [Arm("suffix", "suffix")],
            [[3]],
            [[3]],
            SamplingParams(max_new_tokens=2),
            (1,),
            {},
            [1],
        )
