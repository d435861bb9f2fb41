"""Checkpoints and exports end to end (the file-level contract is in test_eagle3_checkpoint_io.py):
a trainer resumes exactly from its checkpoint, and an exported head drafts exactly like the original
inside the engine."""

import pytest
import torch
from eagle3_helpers import collect, random_head, random_prompts, target

from tailspec.drafter.eagle3 import Eagle3Drafter
from tailspec.drafter.eagle3.checkpoint import export_checkpoint, head_from_export
from tailspec.drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams


def test_trainer_save_and_load_resume_exactly(tmp_path):
    model = target("qwen2")
    head = random_head(model, std=0.02)
    _, _, buffer = collect(model, head, random_prompts(6, seed=2), SamplingParams(max_new_tokens=12, temperature=1.0))
    cfg = DrafterTrainingConfig(batch_size=2, seed=4)
    trainer = DrafterTrainer(head, model.get_input_embeddings(), buffer, cfg)
    trainer.train(2)
    trainer.save(tmp_path / "ck")
    other = DrafterTrainer(random_head(model, seed=9), model.get_input_embeddings(), buffer, cfg)
    other.load(tmp_path / "ck", target_config=model.config)
    assert other.step_count == 2 and other.head.version == 2
    for key, value in head.state_dict().items():
        assert torch.equal(other.head.state_dict()[key], value)
    other.rng.setstate(trainer.rng.getstate())  # same batches from here on
    a, b = trainer.train_step(), other.train_step()
    assert a.loss == b.loss
    for key, value in head.state_dict().items():
        assert torch.equal(other.head.state_dict()[key], value), key  # the optimizer state came back too


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_an_exported_head_drafts_identically_in_the_engine(tmp_path, fmt):
    model = target("llama", num_layers=4)
    head = random_head(model, aux_layer_ids=(1, 2, 3))
    reloaded = head_from_export(export_checkpoint(head, tmp_path / fmt, format=fmt), format=fmt)
    prompts = random_prompts(4, seed=6)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3)
    runs = []
    for h in (head, reloaded):
        engine = RolloutEngine(model, RolloutConfig(strategy="chain:3", seed=1), drafter=Eagle3Drafter(h, model))
        outs = engine.generate(prompts, params)
        runs.append(([o.completion_ids for o in outs], engine.stats.drafted_tokens, engine.stats.accepted_tokens))
    assert runs[0] == runs[1]
    assert runs[0][1] > 0
