"""StagedInputs: a captured forward's static inputs as views of one buffer per dtype, filled from
the host in one copy per dtype (the same code on CPU as on CUDA, where the host buffers are pinned)."""

import pytest
import torch

from tailspec.rollout.model.staged_inputs import StagedInputs


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 100, (1, 6), generator=g),
        "slot_mapping": torch.randint(0, 50, (6,), generator=g),
        "gather_slots": torch.zeros(3, 0, dtype=torch.long),  # empty, as on the split-KV path
        "plan.block_tables": torch.randint(0, 9, (3, 4), generator=g, dtype=torch.int32),
        "plan.cached_lens": torch.randint(0, 9, (3,), generator=g, dtype=torch.int32),
        "plan.tree_mask": torch.randint(0, 2, (3, 2, 2), generator=g, dtype=torch.uint8),
        "mask": torch.rand(3, 1, 2, 5, generator=g) > 0.5,
    }


def test_views_hold_each_load_and_stay_the_same_tensors():
    first = _inputs(0)
    staged = StagedInputs(first, "cpu")
    views = dict(staged.views)
    for name, tensor in first.items():
        assert torch.equal(staged.views[name], tensor) and staged.views[name].dtype == tensor.dtype
    second = _inputs(1)
    staged.load(second)
    for name, tensor in second.items():
        assert staged.views[name] is views[name]  # what a captured graph reads: the same storage
        assert torch.equal(views[name], tensor)
    # one buffer per dtype: int64, int32, uint8, bool
    assert len({v.untyped_storage().data_ptr() for v in staged.views.values() if v.numel()}) == 4
    assert staged.nbytes == sum(t.numel() * t.element_size() for t in second.values())


def test_inputs_not_on_the_host_are_copied_one_by_one():
    staged = StagedInputs(_inputs(0), "cpu")
    meta = {k: v.to("meta") for k, v in _inputs(1).items()}  # stands in for tensors on the device
    with pytest.raises(NotImplementedError):  # copying from meta is refused: the per-tensor path ran
        staged.load(meta)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x: x.pop("mask"), r"inputs \[.*\] are not the captured forward's"),
        (
            lambda x: x.update(ids=torch.zeros(1, 7, dtype=torch.long)),
            r"input 'ids' is \(1, 7\) torch.int64, the captured",
        ),
        (lambda x: x.update(ids=torch.zeros(1, 6, dtype=torch.int32)), r"input 'ids' is \(1, 6\) torch.int32"),
    ],
)
def test_inputs_of_another_shape_are_a_clear_error(change, message):
    staged = StagedInputs(_inputs(0), "cpu")
    wrong = _inputs(1)
    change(wrong)
    with pytest.raises(ValueError, match=message):
        staged.load(wrong)
