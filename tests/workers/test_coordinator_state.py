"""A coordinator's learned state survives a restart: the workers' engine states (suffix history),
the length predictor and the newest drafter state (weights, optimizer, version) go into a
checkpoint and come back into new workers."""

import torch
from rollout_cases import coordinator, long_tail_batch

from tailspec.trainer_hooks.rollout_state import load_rollout_state, save_rollout_state


def test_state_round_trips_through_a_checkpoint_into_new_workers(tmp_path):
    prompts, params = long_tail_batch()
    first = coordinator(schedule="static")  # its idle worker spot-trains the head
    first.generate(prompts, params)
    first.generate(prompts, params)
    state = first.state_dict()
    first.shutdown()
    assert state["drafter"].version > 0 and state["drafter"].optimizer is not None
    assert all(e["suffix"]["history"] for e in state["engines"])
    save_rollout_state(state, tmp_path)
    loaded = load_rollout_state(tmp_path)

    second = coordinator(schedule="static")
    second.load_state_dict(loaded)
    assert second.drafter_state.version == state["drafter"].version
    assert {v for _, v in second.worker_versions().values()} == {state["drafter"].version}
    assert all(torch.equal(second.part.state_dict()[k], v) for k, v in state["drafter"].weights.items())
    again = second.state_dict()
    assert again["engines"] == state["engines"] and again["predictor"] == state["predictor"]
    assert second.predictor.predict(prompts[0]) is not None  # it knows the prompts' lengths
    second.shutdown()
