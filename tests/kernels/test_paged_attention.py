"""The Triton paged attention kernel against the torch reference and the engine's SDPA path:
ragged context and query lengths, contexts that cross cache blocks and kernel tiles, tree masks,
grouped-query heads, sliding windows, the padded layout of captured graphs. Without CUDA the
kernel runs in Triton's interpreter."""

import types

import pytest
import torch

from tailspec.kernels.paged_attention import PagedAttentionPlan, paged_attention_reference, paged_attention_triton
from tailspec.rollout.model.attention import (
    SequenceSlice,
    build_metadata,
    paged_attention_forward,
)
from tailspec.rollout.model.kv_cache import KVLayout, PagedKVCache
from tailspec.rollout.model.padded_metadata import build_padded_metadata

pytest.importorskip("triton")

CPU = torch.device("cpu")


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_slices(g: torch.Generator, num_seqs: int, block_size: int, num_blocks: int, trees: bool):
    """Sequences with random cached/new lengths over disjoint shuffled blocks."""
    free = torch.randperm(num_blocks, generator=g).tolist()
    slices = []
    for i in range(num_seqs):
        cached = int(torch.randint(0, 70, (1,), generator=g))
        new = int(torch.randint(1, 21, (1,), generator=g)) if i else 1  # one decode-like sequence
        n_blocks = -(-(cached + new) // block_size)
        table, free = free[:n_blocks], free[n_blocks:]
        mask = None
        if trees and i % 2:
            mask = ancestor_mask([int(torch.randint(-1, j, (1,), generator=g)) for j in range(new)])
        slices.append(SequenceSlice(table, cached, new, mask))
    return slices


def plan_of(slices, block_size, positions=None) -> PagedAttentionPlan:
    q_lens = [s.num_new for s in slices]
    starts = torch.tensor([0, *q_lens[:-1]]).cumsum(0).tolist()
    if positions is None:
        positions = torch.cat([torch.arange(s.num_cached, s.num_cached + s.num_new) for s in slices])
    return PagedAttentionPlan.build(
        [s.block_table for s in slices],
        [s.num_cached for s in slices],
        q_lens,
        starts,
        positions,
        [s.new_token_mask for s in slices],
        block_size,
        CPU,
    )


def random_case(seed: int, block_size: int, heads: int, kv_heads: int, head_dim: int, trees: bool):
    """Five sequences of random cached and new lengths (trees on every other one), their plan,
    and random queries and caches: (q, k, v, plan)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 4 * 100 // block_size + 8
    slices = random_slices(g, 5, block_size, num_blocks, trees)
    slots = num_blocks * block_size
    k = torch.randn(slots, kv_heads, head_dim, generator=g)
    v = torch.randn(slots, kv_heads, head_dim, generator=g)
    plan = plan_of(slices, block_size)
    q = torch.randn(plan.query_positions.shape[0], heads, head_dim, generator=g)
    return q, k, v, plan


@pytest.mark.parametrize(
    "block_size,heads,kv_heads,head_dim,trees",
    [(1, 8, 2, 24, True), (1, 4, 2, 16, False), (4, 4, 4, 16, False), (4, 8, 2, 24, True), (16, 4, 2, 16, True)],
)
def test_kernel_equals_reference(block_size, heads, kv_heads, head_dim, trees):
    seed = block_size * 100 + heads * 10 + head_dim + trees
    q, k, v, plan = random_case(seed, block_size, heads, kv_heads, head_dim, trees)
    for window in (None, 9):
        want = paged_attention_reference(q, k, v, plan, 0.3, window)
        got = paged_attention_triton(q, k, v, plan, 0.3, window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_half_precision_cache():
    g = torch.Generator().manual_seed(5)
    slices = random_slices(g, 3, 4, 64, trees=True)
    k = torch.randn(256, 2, 16, generator=g).half()
    v = torch.randn(256, 2, 16, generator=g).half()
    plan = plan_of(slices, 4)
    q = torch.randn(plan.query_positions.shape[0], 4, 16, generator=g).half()
    torch.testing.assert_close(
        paged_attention_triton(q, k, v, plan), paged_attention_reference(q, k, v, plan), atol=2e-3, rtol=2e-3
    )


def test_sequences_without_queries_are_left_zero():
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(64, 1, 16, generator=g), torch.randn(64, 1, 16, generator=g)
    plan = PagedAttentionPlan.build([[2], [5, 1]], [3, 5], [0, 2], [0, 0], torch.tensor([5, 6]), [None, None], 4, CPU)
    q = torch.randn(2, 2, 16, generator=g)
    out = paged_attention_triton(q, k, v, plan)
    torch.testing.assert_close(out, paged_attention_reference(q, k, v, plan))
    assert out.abs().sum() > 0


def _engine_attention(cache, meta, q_packed, k_new, v_new, window=None):
    """The engine's attention function (writes the new K/V, then attends) for layer 0."""
    module = types.SimpleNamespace(layer_idx=0)
    out, _ = paged_attention_forward(
        module,
        q_packed.transpose(0, 1).unsqueeze(0),
        k_new.transpose(0, 1).unsqueeze(0),
        v_new.transpose(0, 1).unsqueeze(0),
        None,
        scaling=0.25,
        sliding_window=window,
        tailspec_attn=meta,
    )
    return out[0]  # [T, H, D]


def _layout(kv_heads, head_dim):
    return KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32, device=CPU)


@pytest.mark.parametrize("window", [None, 6])
def test_engine_attention_is_the_same_with_either_backend(window):
    """``build_metadata`` + ``paged_attention_forward``: SDPA over gathered slots (torch) and the
    kernel over block tables (triton) write the same cache and return the same outputs."""
    g = torch.Generator().manual_seed(7)
    block_size, num_blocks = 4, 120
    slices = random_slices(g, 4, block_size, num_blocks, trees=True)
    total = sum(s.num_new for s in slices)
    positions = torch.cat([torch.arange(s.num_cached, s.num_cached + s.num_new) for s in slices])
    q, k_new, v_new = (torch.randn(total, n, 16, generator=g) for n in (4, 2, 2))
    outs, caches = [], []
    for backend in ("torch", "triton"):
        cache = PagedKVCache(_layout(2, 16), num_blocks, block_size)
        gen = torch.Generator().manual_seed(8)  # same prefix K/V in both caches
        cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
        cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
        meta = build_metadata(cache, slices, positions, kernels=backend)
        assert (meta.plan is not None) == (backend == "triton")
        outs.append(_engine_attention(cache, meta, q, k_new, v_new, window))
        caches.append(cache)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])


def test_padded_layout_of_captured_graphs():
    """The kernel over the padded metadata of a graph bucket gives the unpadded rows' outputs and
    leaves padding rows finite (zero)."""
    g = torch.Generator().manual_seed(9)
    block_size, num_blocks = 4, 80
    slices = [
        SequenceSlice([3, 9, 4], 9, 1),
        SequenceSlice([7, 2], 5, 3, ancestor_mask([-1, 0, 0])),
    ]
    positions = [9, 5, 6, 6]
    q, k_new, v_new = (torch.randn(4, n, 16, generator=g) for n in (4, 2, 2))
    cache = PagedKVCache(_layout(2, 16), num_blocks, block_size)
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    dense = _engine_attention(cache, build_metadata(cache, slices, torch.tensor(positions), "torch"), q, k_new, v_new)

    batch, tokens, context, scratch = 3, 4, 16, (num_blocks - 1) * block_size
    meta = build_padded_metadata(cache, slices, positions, batch, tokens, context, scratch, kernels="triton")
    assert meta.plan is not None and meta.plan.tree_mask.shape == (batch, tokens, tokens)
    rows = [0, 4, 5, 6]  # sequence i's new tokens are rows i * tokens + r
    padded_q = torch.zeros(batch * tokens, 4, 16)
    padded_k, padded_v = torch.zeros(batch * tokens, 2, 16), torch.zeros(batch * tokens, 2, 16)
    padded_q[rows], padded_k[rows], padded_v[rows] = q, k_new, v_new
    out = _engine_attention(cache, meta, padded_q, padded_k, padded_v)
    torch.testing.assert_close(out[rows], dense, atol=2e-5, rtol=1e-4)
    padding = [r for r in range(batch * tokens) if r not in rows]
    assert torch.all(out[padding] == 0)


@pytest.mark.parametrize("variant", ["sinks", "softcap", "both"])
def test_sinks_and_soft_caps_equal_the_reference(variant):
    """gpt-oss's per-head sink logits and Gemma 2's logit cap, in the kernel as in the reference."""
    q, k, v, plan = random_case(77, 4, 8, 2, 16, trees=True)
    q = q * 3  # logits large enough that the cap binds
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2 if variant != "softcap" else None
    softcap = 2.5 if variant != "sinks" else None
    for window in (None, 9):
        want = paged_attention_reference(q, k, v, plan, 0.3, window, sinks=sinks, softcap=softcap)
        assert not torch.allclose(want, paged_attention_reference(q, k, v, plan, 0.3, window), atol=1e-3)
        got = paged_attention_triton(q, k, v, plan, 0.3, window, sinks=sinks, softcap=softcap)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
