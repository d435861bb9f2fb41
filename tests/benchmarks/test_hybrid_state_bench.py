"""The hybrid-state section: the hybrid and its attention-only twin per (arm, batch) over interleaved
passes, the share inside the Gated DeltaNet layers, and what a sequence's state and rows take."""

from transformers import AutoConfig

from tailspec.benchmarks.hybrid_state import hybrid_state_table, measure, memory_line, qwen35_like
from tailspec.tasks.sft import assets_dir


def test_the_two_models_differ_only_in_their_token_mixers():
    deep_config = AutoConfig.from_pretrained(assets_dir("deep") / "policy")
    hybrid, twin = qwen35_like(True, deep_config), qwen35_like(False, deep_config)
    assert hybrid.config.layer_types.count("linear_attention") == 18
    assert set(twin.config.layer_types) == {"full_attention"}
    assert hybrid.config.hidden_size == twin.config.hidden_size == 256


def test_each_model_arm_and_batch_gets_its_step_time_and_the_hybrid_its_state_share():
    runs, memory = measure(passes=2, new_tokens=3, batches=(1,))
    assert [(r.model, r.arm) for r in runs] == [
        ("hybrid", "none"),
        ("attention", "none"),
        ("hybrid", "chain:4"),
        ("attention", "chain:4"),
    ]
    for r in runs:
        assert len(r.step_ms) == 2 and all(ms > 0 for ms in r.step_ms)
        assert all((s > 0) == (r.model == "hybrid") for s in r.mixer_share)
    assert memory[("hybrid", "chain:4")]["verify_rows"] == 5 * memory[("hybrid", "chain:4")]["slot"] > 0
    assert memory[("attention", "none")]["slot"] == 0
    table = hybrid_state_table(runs)
    assert table.count("\n") == 1 + 2 and "| 1 | chain:4 |" in table
    assert "KiB" in memory_line(memory)
