"""The optional DeepSpeed path of DrafterTrainer (skipped where DeepSpeed is not installed; runs on
DeepSpeed's CPU accelerator here)."""

import pytest
import torch
from eagle3_helpers import collect, random_head, random_prompts, target

from tailspec.drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig
from tailspec.rollout import SamplingParams

deepspeed = pytest.importorskip("deepspeed")


def _setup():
    model = target("qwen2")
    head = random_head(model, std=0.02)
    _, _, buffer = collect(model, head, random_prompts(6, seed=4), SamplingParams(max_new_tokens=16, temperature=1.0))
    return model, buffer


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_deepspeed_steps_match_plain_adamw(stage, tmp_path):
    model, buffer = _setup()
    cfg = DrafterTrainingConfig(batch_size=2, seed=3, learning_rate=1e-3)
    plain = DrafterTrainer(random_head(model, seed=1, std=0.02), model.get_input_embeddings(), buffer, cfg)
    ds = DrafterTrainer(
        random_head(model, seed=1, std=0.02),
        model.get_input_embeddings(),
        buffer,
        cfg,
        deepspeed_config={"zero_optimization": {"stage": stage}},
    )
    assert ds.uses_deepspeed
    a, b = plain.train(3), ds.train(3)
    assert [r.loss for r in a] == pytest.approx([r.loss for r in b], rel=1e-4)
    for key, value in plain.head.state_dict().items():
        torch.testing.assert_close(ds.head.state_dict()[key], value, atol=1e-5, rtol=1e-4)
    assert ds.head.version == 3
    ds.save(tmp_path / "ck")
    assert (tmp_path / "ck" / "deepspeed").is_dir()
    resumed = DrafterTrainer(
        random_head(model, seed=7),
        model.get_input_embeddings(),
        buffer,
        cfg,
        deepspeed_config={"zero_optimization": {"stage": stage}},
    )
    resumed.load(tmp_path / "ck")
    assert resumed.step_count == 3
    for key, value in ds.head.state_dict().items():
        assert torch.equal(resumed.head.state_dict()[key], value)


def test_zero3_is_refused():
    model, buffer = _setup()
    with pytest.raises(ValueError, match="stage must be 0, 1 or 2"):
        DrafterTrainer(
            random_head(model),
            model.get_input_embeddings(),
            buffer,
            deepspeed_config={"zero_optimization": {"stage": 3}},
        )


def test_a_crafted_deepspeed_file_is_refused_and_never_runs(tmp_path, crafted):
    """DeepSpeed's files are pickles: read weights-only, a crafted one is refused in one line."""
    from tailspec.safe_files import UnsafeFile

    model, buffer = _setup()
    cfg = DrafterTrainingConfig(batch_size=2, seed=3, learning_rate=1e-3)
    ds_config = {"zero_optimization": {"stage": 1}}
    ds = DrafterTrainer(
        random_head(model, seed=1), model.get_input_embeddings(), buffer, cfg, deepspeed_config=ds_config
    )
    ds.train(1)
    ds.save(tmp_path / "ck")
    (optim,) = (tmp_path / "ck" / "deepspeed").rglob("*optim_states.pt")
    crafted.torch_file(optim)
    resumed = DrafterTrainer(
        random_head(model, seed=7), model.get_input_embeddings(), buffer, cfg, deepspeed_config=ds_config
    )
    with pytest.raises(UnsafeFile, match="optim_states.pt: refused") as refused:
        resumed.load(tmp_path / "ck")
    assert "\n" not in str(refused.value)
    assert not crafted.ran
