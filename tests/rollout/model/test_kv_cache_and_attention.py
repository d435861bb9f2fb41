import pytest
import torch
from rollout_helpers import cached_model

from tailspec.rollout.model.attention import (
    SequenceSlice,
    build_metadata,
    paged_attention_enabled,
)
from tailspec.rollout.model.kv_cache import BlockAllocator, KVLayout, OutOfBlocks, PagedKVCache, blocks_for
from tailspec.rollout.model.padded_metadata import build_padded_metadata
from tailspec.rollout.model.runner import ModelRunner


def test_allocator_refcounts():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert alloc.num_free == 1
    shared = alloc.share(a[:2])
    alloc.free(a)
    assert alloc.num_free == 2  # the shared blocks are still referenced
    alloc.free(shared)
    assert alloc.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([a[0]])
    with pytest.raises(OutOfBlocks):
        alloc.allocate(5)
    with pytest.raises(RuntimeError, match="free block"):
        alloc.share([a[0]])


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def _cache(num_blocks=8, block_size=4):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    return PagedKVCache(layout, num_blocks, block_size)


def test_metadata_for_causal_and_tree_sequences():
    cache = _cache()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 0 with two children
    seqs = [
        SequenceSlice([3, 5], num_cached=2, num_new=3),
        SequenceSlice([1], num_cached=1, num_new=3, new_token_mask=tree),
    ]
    positions = torch.tensor([2, 3, 4, 1, 2, 2])
    meta = build_metadata(cache, seqs, positions)
    # new tokens go to cache indices 2,3,4 of seq 0 (blocks 3,3,5) and 1,2,3 of seq 1 (block 1)
    assert meta.slot_mapping.tolist() == [3 * 4 + 2, 3 * 4 + 3, 5 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3]
    assert meta.gather_slots[0].tolist() == [12, 13, 14, 15, 20]
    mask = meta.mask[:, 0]
    expected0 = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    expected1 = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(mask[0], expected0)
    assert torch.equal(mask[1], expected1)


def test_ragged_queries_are_padded_and_masked():
    cache = _cache()
    seqs = [SequenceSlice([0], 0, 3), SequenceSlice([2], 1, 1)]
    meta = build_metadata(cache, seqs, torch.tensor([0, 1, 2, 1]))
    assert meta.query_index.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert meta.valid_queries.tolist() == [True, True, True, True, False, False]
    assert meta.mask[1, 0, 1:].sum(-1).tolist() == [1, 1]  # padded rows attend to one key only (no NaN)


def test_padded_metadata_agrees_with_packed_metadata():
    """A captured bucket's metadata (whole-array numpy) holds the packed forward's slots and mask
    for every real row; padding rows and padding sequences write to the scratch slot and see key 0."""
    cache, scratch = _cache(num_blocks=16), 15 * 4
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    seqs = [
        SequenceSlice([3, 5, 7], num_cached=6, num_new=2),  # a block beyond its context: not read
        SequenceSlice([1], num_cached=1, num_new=3, new_token_mask=tree),
        SequenceSlice([2, 4], num_cached=0, num_new=1),
    ]
    positions = [6, 7, 1, 2, 2, 0]
    batch, tokens, context = 4, 3, 8
    padded = build_padded_metadata(cache, seqs, positions, batch, tokens, context, scratch, kernels="torch")
    packed = build_metadata(cache, seqs, torch.tensor(positions), kernels="torch")
    rows = [i * tokens + r for i, s in enumerate(seqs) for r in range(s.num_new)]
    assert padded.slot_mapping[rows].tolist() == packed.slot_mapping.tolist()
    others = [r for r in range(batch * tokens) if r not in rows]
    assert padded.slot_mapping[others].tolist() == [scratch] * len(others)
    assert padded.query_positions.reshape(-1)[rows].tolist() == positions
    for i, s in enumerate(seqs):
        ctx = s.num_cached + s.num_new
        assert padded.gather_slots[i, :ctx].tolist() == packed.gather_slots[i, :ctx].tolist()
        assert padded.gather_slots[i, ctx:].tolist() == [scratch] * (context - ctx)
        assert torch.equal(padded.mask[i, 0, : s.num_new, :ctx], packed.mask[i, 0, : s.num_new, :ctx])
        assert not padded.mask[i, 0, : s.num_new, ctx:].any()
        assert padded.mask[i, 0, s.num_new :].sum(-1).tolist() == [1] * (tokens - s.num_new)
    assert padded.gather_slots[3].tolist() == [scratch] * context
    assert padded.mask[3, 0].sum(-1).tolist() == [1] * tokens and padded.mask[3, 0, :, 0].all()


def test_padded_metadata_refuses_a_block_table_shorter_than_the_context():
    seqs = [SequenceSlice([3], num_cached=4, num_new=1)]  # 5 tokens in one block of 4
    with pytest.raises(ValueError, match="sequence 0 .*block table"):
        build_padded_metadata(_cache(), seqs, [4], 1, 1, 8, 7 * 4, kernels="torch")


def test_tree_mask_forward_equals_causal_paths():
    """Each node of a tree verified in one forward gets the logits of its root-to-node path."""
    model = cached_model("qwen3")
    runner = ModelRunner(model, num_blocks=32, block_size=4)
    prefix = [5, 9, 13, 2, 40, 41]
    # tree: a -> b, a -> c -> d  (nodes in order a, b, c, d)
    nodes = [7, 8, 11, 12]
    parent = [-1, 0, 0, 2]
    depth = [0, 1, 1, 2]
    tree = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    table = runner.cache.allocator.allocate(4)
    with torch.no_grad(), paged_attention_enabled(model):
        runner.forward([SequenceSlice(table, 0, len(prefix))], prefix, list(range(len(prefix))), [len(prefix) - 1])
        logits = runner.forward(
            [SequenceSlice(table, len(prefix), 4, new_token_mask=tree)],
            nodes,
            [len(prefix) + d for d in depth],
            [0, 1, 2, 3],
        )
    paths = {0: [7], 1: [7, 8], 2: [7, 11], 3: [7, 11, 12]}
    with torch.no_grad():
        for node, path in paths.items():
            ref = model(torch.tensor([prefix + path])).logits[0, -1]
            assert torch.allclose(logits[node], ref, atol=1e-4), node


def test_all_blocks_return_after_groups_and_preemption():
    from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams

    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(block_size=2, num_blocks=30))
    prompts = [[5, 6, 7]] * 4 + [[8, 9]] * 3 + [[10]]
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True))
    assert engine.stats.preemptions > 0 and engine.stats.forked_prefills > 0
    assert engine.runner.cache.allocator.num_free == 30
    assert all(engine.runner.cache.allocator.refcount(b) == 0 for b in range(30))
