"""A resumed run continues warm: the rollout's learned state (EAGLE-3 head weights, optimizer, step
and version; the adaptive selector's measurements and RNG; the suffix drafter's history) is saved
with every trainer checkpoint and restored on resume, so right after resuming the head accepts as
it did and the selector chooses as it would have."""

import copy
import json
from pathlib import Path

import pytest
import torch

import tailspec
from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.trainer_hooks import SpecRollout
from tailspec.trainer_hooks.rollout_state import FOLDER, load_rollout_state


def _head(policy, seed):
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(policy.config))
    head.reset_parameters(std=0.05)
    return head


def _rollout(head):
    return SpecRollout(strategy="adaptive", drafter=head, drafter_train_steps=2)


def _accept_length(policy, head, tokenizer):
    engine = RolloutEngine(policy, RolloutConfig(strategy="chain:3", kv_cache_tokens=4096), drafter=head)
    prompts = [tokenizer(text=f"add {i} {i + 3}")["input_ids"] for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    return [o.mean_accept_length for o in outs], [o.completion_ids for o in outs]


def test_rollout_state_is_saved_with_checkpoints_and_restored_on_resume(common, make_policy, task_tokenizer):
    args = common["args"]
    args.save_strategy, args.save_steps = "steps", 2
    first = _rollout(_head(common["model"], 0))
    tailspec.GRPOTrainer(**common, rollout=first).train()
    checkpoint = Path(args.output_dir) / "checkpoint-2"
    saved = load_rollout_state(checkpoint)
    assert (checkpoint / FOLDER / "drafter.safetensors").exists()
    assert saved["drafter"].version == first.drafter.version > 0 and saved["drafter"].optimizer is not None
    selector_before = copy.deepcopy(first.engine.selector)
    assert selector_before.acceptance.counts, "the selector should have measured arms in two rollouts"

    policy = make_policy()  # a fresh process: the same starting policy, a different head
    policy.load_state_dict(common["model"].state_dict())
    second = _rollout(_head(policy, 1))
    trainer = tailspec.GRPOTrainer(**{**common, "model": policy}, rollout=second)
    trainer._load_rollout_state(str(checkpoint))
    # the head: the same weights and version, so the same acceptance right after resume
    assert second.drafter.version == first.drafter.version
    resumed = _accept_length(policy, second.drafter, task_tokenizer)
    assert resumed == _accept_length(policy, first.drafter, task_tokenizer)
    # the selector and the suffix history: restored when the engine starts, choosing as before
    engine = second.engine_for(policy, task_tokenizer, seed=0)
    assert engine.selector.state_dict() == selector_before.state_dict()  # all but the forward table, re-timed
    arms = engine.selector.arms
    assert [engine.selector.acceptance.expected(a) for a in arms] == [
        selector_before.acceptance.expected(a) for a in arms
    ]
    assert engine.suffix_drafter.state_dict() == first.engine.suffix_drafter.state_dict()
    assert second.online.trainer.step_count == saved["drafter"].step


def test_resume_from_checkpoint_runs_on_warm(common):
    args = common["args"]
    args.save_strategy, args.save_steps = "steps", 2
    first = _rollout(_head(common["model"], 0))
    tailspec.GRPOTrainer(**common, rollout=first).train()
    version = first.drafter.version
    args.max_steps = 3
    second = _rollout(_head(common["model"], 1))
    trainer = tailspec.GRPOTrainer(**common, rollout=second)
    trainer.train(resume_from_checkpoint=True)  # the last checkpoint of output_dir
    assert trainer.state.global_step == 3 and len(second.history) == 1
    assert second.drafter.version == version + 2  # continued from the saved version, two more steps
    assert sum(c.evidence for c in second.engine.selector.acceptance.counts.values()) > 0


def test_the_checkpoint_keeps_spot_trainings_unshipped_state_and_the_catch_up_rule(tmp_path):
    """Spot training's trained state is apart from the drafting one while it has not shipped; a
    resume from disk continues training from it, not from the shipped head."""
    from tailspec.drafter.online_training import DrafterState
    from tailspec.trainer_hooks.rollout_state import save_rollout_state

    shipped = DrafterState({"w": torch.zeros(3)}, version=4, step=4)
    trained = DrafterState({"w": torch.ones(3)}, version=9, step=9, optimizer={"state": {}, "param_groups": []})
    state = {
        "engines": [{"x": 1}],
        "predictor": None,
        "drafter": shipped,
        "drafter_trained": trained,
        "catch_up": {"reference": 3.2, "lr_scale": 1.0, "rollouts_caught_up": 2},
    }
    save_rollout_state(state, tmp_path)
    loaded = load_rollout_state(tmp_path)
    assert loaded["drafter"].version == 4 and loaded["drafter"].optimizer is None
    assert loaded["drafter_trained"].version == 9 and torch.equal(loaded["drafter_trained"].weights["w"], torch.ones(3))
    assert loaded["drafter_trained"].optimizer == trained.optimizer
    assert loaded["catch_up"] == state["catch_up"] and loaded["engines"] == [{"x": 1}]


def _saved_with_optimizer(folder: Path) -> dict:
    from tailspec.drafter.online_training import DrafterState
    from tailspec.trainer_hooks.rollout_state import save_rollout_state

    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"engines": [], "drafter": DrafterState(dict(layer.state_dict()), 5, 1, opt.state_dict())}
    save_rollout_state(state, folder)
    return opt.state_dict()


def test_the_optimizer_is_saved_as_safetensors_and_json_and_comes_back_exactly(tmp_path):
    optimizer = _saved_with_optimizer(tmp_path)
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == [
        "drafter.safetensors",
        "drafter_optimizer.safetensors",
        "state.json",
    ]
    loaded = load_rollout_state(tmp_path)["drafter"].optimizer
    assert loaded["param_groups"] == optimizer["param_groups"]
    for name, value in optimizer["state"][0].items():
        assert torch.equal(loaded["state"][0][name], value) and loaded["state"][0][name].dtype == value.dtype


def test_an_earlier_checkpoints_optimizer_pt_still_resumes(tmp_path):
    """A checkpoint an earlier tailspec wrote keeps its optimizer in ``drafter_optimizer.pt``: read weights-only."""
    optimizer = _saved_with_optimizer(tmp_path)
    folder = tmp_path / FOLDER
    (folder / "drafter_optimizer.safetensors").unlink()
    meta = json.loads((folder / "state.json").read_text())
    meta["drafter"].pop("optimizer")
    (folder / "state.json").write_text(json.dumps(meta))
    torch.save(optimizer, folder / "drafter_optimizer.pt")
    loaded = load_rollout_state(tmp_path)["drafter"].optimizer
    assert torch.equal(loaded["state"][0]["exp_avg"], optimizer["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    "crafted_file", ["drafter_optimizer.pt", "drafter_optimizer.safetensors", "drafter.safetensors"]
)
def test_a_crafted_checkpoint_is_refused_before_training_and_never_runs(crafted_file, common, crafted, tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    _saved_with_optimizer(checkpoint)
    folder = checkpoint / FOLDER
    if crafted_file.endswith(".pt"):  # as an earlier tailspec laid it out
        (folder / "drafter_optimizer.safetensors").unlink()
        meta = json.loads((folder / "state.json").read_text())
        meta["drafter"].pop("optimizer")
        (folder / "state.json").write_text(json.dumps(meta))
        crafted.torch_file(folder / crafted_file)
    else:
        crafted.pickle_file(folder / crafted_file)
    with pytest.raises(ValueError) as refused:
        load_rollout_state(checkpoint)
    assert crafted_file in str(refused.value) and "\n" not in str(refused.value)

    trainer = tailspec.GRPOTrainer(**common, rollout=_rollout(_head(common["model"], 0)))
    with pytest.raises(ValueError, match=crafted_file):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 0 and trainer.rollout.history == []
    assert not crafted.ran
