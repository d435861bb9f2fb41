import numpy as np
import pytest
import torch

from tailspec.kernels.transfers import QueuedCopy, QueuedRead, read_back, select_rows, to_device


@pytest.mark.parametrize(
    "values", [[3, 1, 4], np.array([[1, 5], [9, 2]], dtype=np.int32), torch.tensor([0.5, -2.25]), np.zeros(0)]
)
def test_to_device_keeps_values_shape_and_dtype(values):
    got = to_device(values, "cpu")
    want = torch.as_tensor(np.asarray(values)) if not isinstance(values, torch.Tensor) else values
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_to_device_casts_when_asked():
    got = to_device(np.array([1, 2, 3]), "cpu", torch.int32)
    assert got.dtype == torch.int32 and got.tolist() == [1, 2, 3]


def test_select_rows_takes_rows_in_the_order_given():
    x = torch.arange(12.0).view(4, 3)
    assert torch.equal(select_rows(x, [3, 0, 3]), x[[3, 0, 3]])
    assert select_rows(x, np.zeros(0, dtype=np.int64)).shape == (0, 3)


def test_read_back_returns_exact_ints_and_floats_per_tensor():
    ids = torch.tensor([[151935, 0], [7, 2**40]])  # a large vocabulary's ids and a large index
    logprobs = torch.tensor([-0.1234567, -17.5, float("-inf")], dtype=torch.float32)
    flags = torch.tensor([True, False])
    got_ids, got_lp, got_flags = read_back(ids, logprobs, flags)
    assert got_ids == [151935, 0, 7, 2**40] and all(isinstance(v, int) for v in got_ids)
    assert got_lp == logprobs.tolist()  # float32 values, exactly as tolist gives them
    assert got_flags == [1, 0]
    assert read_back() == [] and read_back(torch.zeros(0, dtype=torch.long)) == [[]]


def test_a_queued_read_gives_what_read_back_gives_whatever_the_tensors_become():
    ids, logprobs = torch.tensor([151935, 0, 7]), torch.tensor([-0.1234567, float("-inf")])
    want = read_back(ids, logprobs)
    queued = QueuedRead(ids, logprobs)
    ids.fill_(-1)  # the values were taken when the read was queued
    assert queued.result() == want and QueuedRead().result() == []


def test_a_queued_copy_gives_the_tensors_with_their_shapes_and_dtypes():
    features, ids = torch.randn(3, 5, dtype=torch.bfloat16), torch.tensor([[151935, 2], [7, 0]])
    queued = QueuedCopy(features, ids)
    assert queued.ready()  # on CPU the values are there when it is made
    got = queued.result()
    assert len(got) == 2 and got[0].dtype == torch.bfloat16 and torch.equal(got[0], features)
    assert torch.equal(got[1], ids) and QueuedCopy().result() == ()
    with pytest.raises(ValueError, match="share one device"):
        QueuedCopy(torch.zeros(1), torch.zeros(1, device="meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_queues_without_a_sync_and_owns_its_copy():
    """No synchronizing call (torch's sync debug mode raises on one), and the device tensor holds
    the values as they were at the call, whatever the host array becomes afterwards."""
    host = np.zeros(1000, dtype=np.int64)
    slow = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _ = slow @ slow  # keeps the stream busy while the copies are queued
        copies = []
        for i in range(5):  # one host array, rewritten after each call
            host[:] = np.arange(1000) + i
            copies.append(to_device(host, "cuda"))
        host[:] = -1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, copy in enumerate(copies):
        assert torch.equal(copy.cpu(), torch.arange(1000) + i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_queued_read_waits_for_its_own_copy_not_for_work_queued_after_it():
    """What overlapped decoding relies on: the read returns while later work still runs."""
    tokens = torch.arange(8, device="cuda")
    queued = QueuedRead(tokens)
    slow = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):  # tens of milliseconds of work queued behind the copy
        slow = slow @ slow / 64
    assert queued.result() == [list(range(8))]
    assert not torch.cuda.current_stream().query()  # the work after it had not finished
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_back_waits_once():
    a, b = torch.arange(5, device="cuda"), torch.rand(3, device="cuda")
    with pytest.warns(UserWarning, match="synchroniz") as caught:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = read_back(a, b)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert got[0] == list(range(5)) and got[1] == b.tolist()
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_queued_copy_waits_for_its_own_copy_and_holds_the_values_of_its_moment():
    """What the EAGLE-3 recorder relies on: a copy of a buffer the next forward overwrites holds
    the values it had when queued, and its result returns while later work still runs."""
    buffer = torch.arange(12.0, device="cuda").view(3, 4).to(torch.bfloat16)
    slow = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _ = slow @ slow  # the copy queues behind this work
        queued = QueuedCopy(buffer, buffer[:, 0].long())
        buffer.fill_(-1)  # the next forward's write, after the copy in stream order
        for _ in range(50):
            slow = slow @ slow / 64
    finally:
        torch.cuda.set_sync_debug_mode("default")
    features, ids = queued.result()
    assert not torch.cuda.current_stream().query()  # the work after it had not finished
    assert features.is_pinned() and features.dtype == torch.bfloat16
    assert torch.equal(features, torch.arange(12.0).view(3, 4).to(torch.bfloat16))
    assert ids.tolist() == [0, 4, 8] and queued.ready()
    torch.cuda.synchronize()
