"""The split-KV Triton paged attention (issue 48) against the torch reference: every split count
(a split past the context is empty), grouped query heads in one tile, tree masks, sliding windows,
decode and verification shapes, a half-precision cache, padded rows of no sequence. Without CUDA
the kernels run in Triton's interpreter."""

import pytest
import torch
from test_paged_attention import random_case

from tailspec.kernels.paged_attention import (
    PagedAttentionPlan,
    paged_attention_reference,
    paged_attention_split_kv,
    split_count,
)

pytest.importorskip("triton")
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "splits,heads,kv_heads,head_dim,block_size,trees",
    [(1, 8, 2, 24, 16, True), (2, 8, 2, 24, 16, False), (8, 4, 4, 16, 4, False), (8, 6, 2, 32, 1, True)],
)
def test_split_kv_equals_reference(splits, heads, kv_heads, head_dim, block_size, trees):
    seed = splits * 1000 + heads * 10 + head_dim + trees
    q, k, v, plan = random_case(seed, block_size, heads, kv_heads, head_dim, trees)
    for window in (None, 9):
        want = paged_attention_reference(q, k, v, plan, 0.3, window)
        got = paged_attention_split_kv(q, k, v, plan, 0.3, window, num_splits=splits, block_n=16)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_decode_over_a_long_context_in_half_precision():
    """One new token per sequence over a few hundred cached ones: the decode shape split-KV is for."""
    g = torch.Generator().manual_seed(11)
    block_size, kv_heads, heads, head_dim = 16, 2, 8, 32
    lens = [700, 33, 256]
    tables, start = [], 0
    for n in lens:
        blocks = -(-(n + 1) // block_size)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    plan = PagedAttentionPlan.build(tables, lens, [1, 1, 1], [0, 1, 2], torch.tensor(lens), [None] * 3, block_size, CPU)
    k = torch.randn(start * block_size, kv_heads, head_dim, generator=g).half()
    v = torch.randn(start * block_size, kv_heads, head_dim, generator=g).half()
    q = torch.randn(3, heads, head_dim, generator=g).half()
    want = paged_attention_reference(q.double(), k.double(), v.double(), plan)
    got = paged_attention_split_kv(q, k, v, plan, num_splits=4, block_n=32)
    assert ((got.double() - want).norm() / want.norm()) < 5e-3


def test_rows_of_no_sequence_are_zero_and_the_split_count_is_a_power_of_two():
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(64, 1, 16, generator=g), torch.randn(64, 1, 16, generator=g)
    plan = PagedAttentionPlan.build([[2], [5, 1]], [3, 5], [0, 2], [0, 0], torch.tensor([5, 6]), [None, None], 4, CPU)
    q = torch.randn(3, 2, 16, generator=g)  # a third, padded row that belongs to no sequence
    out = paged_attention_split_kv(q, k, v, plan, num_splits=2, block_n=16)
    torch.testing.assert_close(out[:2], paged_attention_reference(q[:2], k, v, plan))
    assert out[2].abs().sum() == 0 and out[:2].abs().sum() > 0
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_split_kv(q, k, v, plan, num_splits=3)
    assert split_count(1, 8, 32768, 132, 64) == 32  # batch 1: 264 programs wanted, a power of two
    assert split_count(64, 8, 32768, 132, 64) == 1  # a full batch fills the SMs without splitting
    assert split_count(1, 8, 512, 132, 64) == 2  # no split shorter than 4 key blocks
    assert all(s & (s - 1) == 0 for s in (split_count(b, 4, 8192, 132, 64) for b in range(1, 300)))


@pytest.mark.parametrize("splits", [1, 4])
def test_split_kv_with_sinks_and_a_soft_cap_equals_reference(splits):
    """The sink joins the sum where the output is normalised: in the one split, or in the merge."""
    q, k, v, plan = random_case(31 + splits, 4, 8, 2, 16, trees=True)
    q = q * 3
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(6)) * 2
    for softcap in (None, 2.5):
        want = paged_attention_reference(q, k, v, plan, 0.3, 9, sinks=sinks, softcap=softcap)
        got = paged_attention_split_kv(
            q, k, v, plan, 0.3, 9, sinks=sinks, softcap=softcap, num_splits=splits, block_n=16
        )
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 4])
def test_values_of_another_size_than_keys(splits):
    """MLA's values (here 8 numbers) are smaller than its keys (24): both kernels as the reference."""
    from tailspec.kernels.paged_attention import paged_attention_triton

    q, k, _, plan = random_case(51 + splits, 4, 4, 4, 24, trees=True)
    v = torch.randn(k.shape[0], k.shape[1], 8, generator=torch.Generator().manual_seed(3))
    want = paged_attention_reference(q, k, v, plan, 0.3, None)
    assert want.shape[-1] == 8
    got = paged_attention_split_kv(q, k, v, plan, 0.3, None, num_splits=splits, block_n=16)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(paged_attention_triton(q, k, v, plan, 0.3, None), want, atol=2e-5, rtol=1e-4)
