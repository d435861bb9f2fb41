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


def test_a_dtype_with_nothing_in_it_is_left_alone():
    """The gathering path's mask is empty when the split-KV kernel runs: its group needs no copy."""
    example = {**_inputs(0), "mask": torch.zeros(3, 1, 2, 0, dtype=torch.bool)}
    staged = StagedInputs(example, "cpu")
    staged.load({**_inputs(1), "mask": torch.zeros(3, 1, 2, 0, dtype=torch.bool)})
    assert staged.views["mask"].shape == (3, 1, 2, 0) and torch.equal(staged.views["ids"], _inputs(1)["ids"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_copies_fill_the_device_views_load_after_load():
    """On CUDA the host buffers are pinned and each load's copies asynchronous: a load waits for
    the previous copies before rewriting them, so back-to-back loads each land whole."""
    staged = StagedInputs(_inputs(0), "cuda")
    snapshots = []
    for seed in range(1, 6):  # no sync between the loads: each snapshot is queued after its copies
        staged.load(_inputs(seed))
        snapshots.append({name: view.clone() for name, view in staged.views.items()})
    torch.cuda.synchronize()
    for seed, snapshot in zip(range(1, 6), snapshots):
        assert all(torch.equal(snapshot[name].cpu(), tensor) for name, tensor in _inputs(seed).items())
    on_device = {k: v.cuda() for k, v in _inputs(9).items()}
    staged.load(on_device)
    assert all(torch.equal(staged.views[k], v) for k, v in on_device.items())
