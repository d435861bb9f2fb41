"""SpecRolloutConfig (issue 37, item 1): one tree holding the engine's RolloutConfig, the workers'
WorkersConfig and the online-training settings, so every engine field reaches a SpecRollout user,
by dotted path or by its name, and every error names the field's dotted path."""

from dataclasses import fields

import pytest
import yaml
from trainer_stand_in import greedy_trainer

from tailspec.config_tree import ConfigError, field_paths, parse_assignments
from tailspec.rollout.params import MirrorConfig, RolloutConfig
from tailspec.trainer_hooks import SpecRollout, SpecRolloutConfig
from tailspec.workers.config import WorkersConfig

ENGINE_SETTINGS = {  # a value other than the default for every engine field a user may set
    "block_size": 8,
    "num_blocks": 300,
    "kv_cache_tokens": 4096,
    "max_num_seqs": 64,
    "max_prefill_tokens": 1024,
    "max_model_len": 200,
    "strategy": "suffix",
    "draft_kv_cache_tokens": 2048,
    "suffix_history_tokens": 1000,
    "selector": {"version_weight": 0.25},
    "mirror": {"executor": "inline"},
    "mixed_batches": True,
    "prefix_caching": True,
    "tail_fraction": 0.5,
    "length_budget": 0.5,
    "graph_backend": "eager",
    "graph_memory_mb": 64,
    "kernels": "torch",
    "compile": True,
    "merge_projections": True,
    "dtype": "bfloat16",
    "progress": True,
}


def test_every_engine_field_is_covered_here():
    assert set(ENGINE_SETTINGS) == {f.name for f in fields(RolloutConfig)} - {"seed"}  # seed: SpecRolloutConfig.seed


def test_every_engine_field_reaches_the_engine_by_name(task_tokenizer, tiny_policy, monkeypatch):
    from contextlib import nullcontext

    from tailspec.rollout.model.compiled import CompiledLayers

    # compile=True reaches the engine; compiling itself is tests/rollout/model/test_compiled.py's
    monkeypatch.setattr(CompiledLayers, "active", lambda self: nullcontext())
    rollout = SpecRollout(model=tiny_policy, seed=5, **ENGINE_SETTINGS)
    trainer, _ = greedy_trainer(task_tokenizer, tiny_policy, max_completion_length=8)
    rollout([[{"role": "user", "content": "add 1 2"}]] * 2, trainer)
    engine = rollout._engine
    for name, value in ENGINE_SETTINGS.items():
        got = getattr(engine.config, name)
        if isinstance(value, dict):
            assert all(getattr(got, k) == v for k, v in value.items()), name
        else:
            assert got == value, name
    assert engine.config.seed == 5 and engine.max_model_len == 200


def test_dotted_paths_yaml_and_flat_names_build_the_same_tree():
    flat = SpecRolloutConfig().with_overrides(
        length_budget=0.5, num_workers=2, spot_training=False, version_weight=0.25
    )
    dotted = SpecRolloutConfig().with_overrides(
        **{
            "engine.length_budget": 0.5,
            "workers.num_workers": 2,
            "workers.spot_training": False,
            "engine.selector.version_weight": 0.25,
        }
    )
    nested = SpecRolloutConfig.from_dict(
        yaml.safe_load(
            "engine: {length_budget: 0.5, selector: {version_weight: 0.25}}\n"
            "workers: {num_workers: 2, spot_training: false}"
        )
    )
    assigned = SpecRolloutConfig().with_overrides(
        **parse_assignments(
            ["length_budget=0.5", "workers.num_workers=2", "spot_training=false", "version_weight=0.25"]
        )
    )
    assert flat == dotted == nested == assigned
    assert nested.workers.max_spot_steps == WorkersConfig().max_spot_steps  # the rest stays at its default
    assert SpecRolloutConfig().workers.num_workers == 0  # no workers unless asked: the in-process engine


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_size": 0}, r"^engine\.block_size must be an int in \[1, 1024\], got 0$"),
        ({"calibration_repeats": 0}, r"^engine\.selector\.calibration_repeats must be an int in \[1, 20\]"),
        ({"mirror": {"executor": "gpu"}}, r"^engine\.mirror\.executor must be one of"),
        ({"workers": {"schedule": "round-robin"}}, r"^workers\.schedule must be one of"),
        ({"catch_up": {"below": 1.5}}, r"^training\.catch_up\.below must be"),
        ({"catch_up": {"threshold": 0.5}}, r"^training\.catch_up\.threshold is not a field of CatchUpConfig"),
        ({"workers": 2, "drafter_train_steps": 4}, r"^training\.drafter_train_steps must be 0 with Ray workers"),
        ({"workers": 2, "self_adapter_rank": 8}, r"^training\.self_adapter_rank must be None with Ray workers"),
        ({"engine.seed": 3}, r"^engine\.seed must be left at its default: SpecRollout seeds its engines from `seed`"),
        ({"strategy": "chain:0"}, r"^engine\.strategy is not valid"),
        ({"no_such_field": 1}, r"^no_such_field is not a field of SpecRolloutConfig or of any config below it"),
    ],
)
def test_errors_name_the_dotted_path(overrides, message):
    with pytest.raises(ValueError, match=message):
        SpecRollout(**overrides)


def test_names_resolve_without_ambiguity():
    """A field named alone must mean one field: the engine's, the selector's, the mirror's, the
    workers' and the training settings share no name but ``seed``, where the top level's own wins."""
    shared = {name: paths for name, paths in field_paths(SpecRolloutConfig).items() if len(paths) > 1}
    assert shared == {"seed": ["engine.seed", "seed"]}
    assert SpecRolloutConfig().with_overrides(seed=3).seed == 3


def test_short_names_reach_their_fields_and_unknown_ones_are_refused():
    a = SpecRollout(workers=2, address="ray://head:10001", spot_training=False)
    assert a.config.workers.num_workers == 2 and a.config.workers.address == "ray://head:10001"
    assert a.config.workers.spot_training is False
    with pytest.raises(ConfigError, match="ray_address"):
        SpecRollout(ray_address="ray://head:10001")
    given = SpecRolloutConfig(engine=RolloutConfig(mirror=MirrorConfig(draft_threads=2)))
    assert SpecRollout(config=given, strategy="suffix").config.engine.mirror.draft_threads == 2
