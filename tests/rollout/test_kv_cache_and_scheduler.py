"""Block pool, scheduler decisions, attention metadata for ragged batches with tree masks, and
tree-masked forwards against causal runs. (Basic allocator and metadata cases are in
test_kv_cache_and_attention.py.)"""

import pytest
import torch
from rollout_helpers import cached_model

from tailspec.rollout.model.attention import SequenceSlice, build_metadata, paged_attention_enabled
from tailspec.rollout.model.kv_cache import BlockAllocator, KVLayout, OutOfBlocks, PagedKVCache, blocks_for
from tailspec.rollout.model.runner import ModelRunner
from tailspec.rollout.params import SamplingParams
from tailspec.rollout.request import SeqStatus, Sequence
from tailspec.rollout.scheduler import Scheduler, StepKind
from tailspec.testing import ARCHITECTURES

# -- block pool ------------------------------------------------------------------------------


def test_allocator_hands_out_distinct_blocks_and_fails_atomically():
    alloc = BlockAllocator(6)
    assert alloc.allocate(0) == []
    a, b = alloc.allocate(2), alloc.allocate(3)
    assert len(set(a + b)) == 5 and alloc.num_free == 1
    assert all(alloc.refcount(x) == 1 for x in a + b)
    with pytest.raises(OutOfBlocks, match="asked for 2 blocks, 1 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1 and all(alloc.refcount(x) == 1 for x in a + b)  # nothing leaked
    alloc.share(a)
    alloc.share(a[:1])
    assert [alloc.refcount(x) for x in a] == [3, 2]
    alloc.free(a)
    alloc.free(a)
    assert alloc.num_free == 2 and alloc.refcount(a[0]) == 1
    alloc.free(a[:1])
    assert alloc.num_free == 3 and alloc.refcount(a[0]) == 0
    alloc.free(b)
    assert alloc.num_free == 6
    assert sorted(alloc.allocate(6)) == list(range(6))
    with pytest.raises(RuntimeError, match="double free"):
        BlockAllocator(3).free([1])  # never allocated


def test_blocks_for_matches_ceil_division():
    for bs in (1, 3, 16):
        for n in range(0, 40):
            assert blocks_for(n, bs) == -(-n // bs) == (n + bs - 1) // bs


def test_copy_block_and_slots():
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=3, dtype=torch.float32, device=torch.device("cpu"))
    cache = PagedKVCache(layout, num_blocks=4, block_size=4)
    for layer in range(2):
        cache.k[layer].copy_(torch.arange(16 * 3, dtype=torch.float32).view(16, 1, 3) + 100 * layer)
        cache.v[layer].copy_(-cache.k[layer])
    before = [k.clone() for k in cache.k]
    cache.copy_block(src=1, dst=3, num_tokens=2)
    for layer in range(2):
        assert torch.equal(cache.k[layer][12:14], before[layer][4:6])
        assert torch.equal(cache.v[layer][12:14], -before[layer][4:6])
        assert torch.equal(cache.k[layer][14:16], before[layer][14:16])  # the rest of dst untouched
        assert torch.equal(cache.k[layer][:12], before[layer][:12])
    table = torch.tensor([[2, 0], [3, 1]])
    assert cache.slots(table, torch.tensor([[0, 5], [3, 4]])).tolist() == [[8, 1], [15, 4]]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_kv_layout_from_model_config(arch):
    model = cached_model(arch)
    layout = KVLayout.from_hf_config(model.config, torch.float32, torch.device("cpu"))
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert layout.bytes_per_token() == 2 * 2 * 2 * 16 * 4


# -- scheduler -------------------------------------------------------------------------------


def _seq(seq_id, num_prompt, group=None):
    params = SamplingParams(temperature=0.0, max_new_tokens=50)
    return Sequence(seq_id, list(range(2, 2 + num_prompt)), params, frozenset({1}), group=group)


def _scheduler(num_blocks, block_size=4, max_num_seqs=16, max_prefill_tokens=1000):
    return Scheduler(BlockAllocator(num_blocks), block_size, max_num_seqs, max_prefill_tokens)


def _run_prefill(batch):
    """What the engine does after a prefill forward: everything cached, one token sampled."""
    for leader in batch.seqs:
        for s in [leader] + batch.followers.get(leader.seq_id, []):
            s.num_cached = s.num_tokens
            s.append(7, 0.0)


def _run_decode(batch):
    for s in batch.seqs:
        s.num_cached += 1
        s.append(7, 0.0)


def test_prefill_admits_while_blocks_last_then_decodes():
    sched = _scheduler(num_blocks=10)
    seqs = [_seq(i, 9) for i in range(4)]  # 3 blocks each
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.kind is StepKind.PREFILL and batch.seqs == seqs[:3]
    assert [len(s.block_table) for s in seqs[:3]] == [3, 3, 3] and sched.allocator.num_free == 1
    assert seqs[3].status is SeqStatus.WAITING and not seqs[3].block_table
    _run_prefill(batch)
    batch = sched.schedule()  # seqs[3] still does not fit: decode the running ones
    assert batch.kind is StepKind.DECODE and batch.seqs == seqs[:3]
    assert sched.allocator.num_free == 1  # 10 tokens still fit in 3 blocks


def test_prefill_respects_token_and_sequence_limits():
    sched = _scheduler(num_blocks=50, max_prefill_tokens=8)
    big, a, b = _seq(0, 12), _seq(1, 5), _seq(2, 5)
    for s in (big, a, b):
        sched.add(s)
    assert sched.schedule().seqs == [big]  # over the limit alone: admitted alone
    assert sched.schedule().seqs == [a]  # a + b = 10 tokens > 8
    sched = _scheduler(num_blocks=50, max_num_seqs=2)
    seqs = [_seq(i, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert sched.schedule().seqs == seqs[:2]
    assert sched.schedule().kind is StepKind.DECODE  # no free slot for seqs[2]


def test_decode_preempts_the_most_recently_admitted():
    sched = _scheduler(num_blocks=4, block_size=2)
    a, b = _seq(0, 4), _seq(1, 4)  # 2 blocks each: the pool is full after admitting both
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and sched.allocator.num_free == 0
    _run_prefill(batch)  # 5 tokens each; the next token of each needs a third block
    batch = sched.schedule()
    assert batch.kind is StepKind.DECODE and batch.seqs == [a]
    assert len(a.block_table) == 3
    assert b.status is SeqStatus.WAITING and list(sched.waiting) == [b]
    assert (b.block_table, b.num_cached, b.num_preemptions, sched.num_preemptions) == ([], 0, 1, 1)
    assert b.output_ids and not b.is_fresh  # it keeps its tokens and is recomputed, not regrouped
    _run_decode(batch)
    batch = sched.schedule()  # b (7 tokens = 4 blocks) cannot come back while a holds 3
    assert batch.kind is StepKind.DECODE and batch.seqs == [a]
    sched.finish(a)
    batch = sched.schedule()
    assert batch.kind is StepKind.PREFILL and batch.seqs == [b] and len(b.block_table) == 3


def test_a_sequence_that_cannot_grow_preempts_itself():
    sched = _scheduler(num_blocks=3, block_size=2)
    a, b = _seq(0, 3), _seq(1, 2)  # a: 2 blocks, b: 1 block
    sched.add(a)
    sched.add(b)
    _run_prefill(sched.schedule())  # a has 4 tokens (fits 2 blocks), b has 3 (needs a second block)
    batch = sched.schedule()
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING and b.num_preemptions == 1
    assert sched.allocator.num_free == 1


@pytest.mark.parametrize("prompt_len", [6, 8], ids=["partial-last-block", "exact-blocks"])
def test_group_members_share_full_blocks_and_own_their_partial_block(prompt_len):
    sched = _scheduler(num_blocks=20)
    group = [_seq(i, prompt_len, group=1) for i in range(4)]
    loner = _seq(9, prompt_len)  # same tokens, no group: not forked
    for s in group[:2] + [loner] + group[2:]:
        sched.add(s)
    batch = sched.schedule()
    leader = group[0]
    assert batch.seqs == [leader, loner] and batch.followers == {leader.seq_id: group[1:]}
    full = prompt_len // 4
    for m in group[1:]:
        assert m.status is SeqStatus.RUNNING
        assert m.block_table[:full] == leader.block_table[:full]
    for b in leader.block_table[:full]:
        assert sched.allocator.refcount(b) == 4
    if prompt_len % 4:
        lasts = [s.block_table[-1] for s in group]
        assert len(set(lasts)) == 4 and all(sched.allocator.refcount(b) == 1 for b in lasts)
    else:
        assert all(len(s.block_table) == full for s in group)
    assert sched.allocator.num_free == 20 - blocks_for(prompt_len, 4) * 2 - (3 if prompt_len % 4 else 0)
    for s in group + [loner]:
        sched.finish(s)
    assert sched.allocator.num_free == 20


def test_group_admission_is_capped_by_slots_and_blocks():
    sched = _scheduler(num_blocks=20, max_num_seqs=2)
    group = [_seq(i, 6, group=1) for i in range(4)]
    for s in group:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [group[0]] and batch.followers == {0: [group[1]]}
    assert list(sched.waiting) == group[2:] and all(s.is_fresh for s in group[2:])

    sched = _scheduler(num_blocks=3)  # leader takes 2 blocks: one left for one private partial block
    group = [_seq(i, 6, group=1) for i in range(4)]
    for s in group:
        sched.add(s)
    batch = sched.schedule()
    assert batch.followers == {0: [group[1]]} and sched.allocator.num_free == 0
    _run_prefill(batch)
    sched.finish(group[0])
    sched.finish(group[1])
    batch = sched.schedule()  # the rest of the group is forked from a new leader
    assert batch.seqs == [group[2]] and batch.followers == {2: [group[3]]}


def test_abort_waiting_and_running():
    sched = _scheduler(num_blocks=3)
    a, b = _seq(0, 8), _seq(1, 8)  # 2 blocks each: b waits
    sched.add(a)
    sched.add(b)
    assert sched.schedule().seqs == [a] and b.status is SeqStatus.WAITING
    sched.abort(b)
    assert b.status is SeqStatus.FINISHED and not sched.waiting
    sched.abort(a)
    assert a.status is SeqStatus.FINISHED and not a.block_table and not sched.has_work()
    assert sched.allocator.num_free == 3


# -- attention metadata ----------------------------------------------------------------------


def _meta_cache(num_blocks=8, block_size=4):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    return PagedKVCache(layout, num_blocks, block_size)


def _ancestor_mask(parent):
    n = len(parent)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def test_metadata_for_a_ragged_batch_with_a_tree():
    """seq 0: 5 cached + 3 causal new tokens; seq 1: 2 cached + a 4-node tree a->b, a->c->d."""
    cache = _meta_cache()
    tree = _ancestor_mask([-1, 0, 0, 2])
    seqs = [
        SequenceSlice([2, 6], num_cached=5, num_new=3),
        SequenceSlice([1, 3], num_cached=2, num_new=4, new_token_mask=tree),
    ]
    positions = torch.tensor([5, 6, 7, 2, 3, 3, 4])  # tree positions by depth
    meta = build_metadata(cache, seqs, positions)
    # writes: seq 0 cache indices 5,6,7 -> block 6; seq 1 indices 2,3 -> block 1, 4,5 -> block 3
    assert meta.slot_mapping.tolist() == [25, 26, 27, 6, 7, 12, 13]
    assert meta.gather_slots.tolist() == [[8, 9, 10, 11, 24, 25, 26, 27], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert meta.query_index.tolist() == [[0, 1, 2, 0], [3, 4, 5, 6]]
    assert meta.valid_queries.tolist() == [True] * 3 + [False] + [True] * 4
    assert meta.query_positions.tolist() == [[5, 6, 7, 5], [2, 3, 3, 4]]
    T, F = True, False
    expected = torch.tensor(
        [
            [  # seq 0: 5 cached keys visible, causal among keys 5..7, padded 4th query sees key 0
                [T, T, T, T, T, T, F, F],
                [T, T, T, T, T, T, T, F],
                [T, T, T, T, T, T, T, T],
                [T, F, F, F, F, F, F, F],
            ],
            [  # seq 1: 2 cached keys visible, then each node sees its ancestors among keys 2..5
                [T, T, T, F, F, F, F, F],
                [T, T, T, T, F, F, F, F],
                [T, T, T, F, T, F, F, F],
                [T, T, T, F, T, T, F, F],
            ],
        ]
    )
    assert meta.mask.shape == (2, 1, 4, 8)
    assert torch.equal(meta.mask[:, 0], expected)
    window = meta.mask_for(2)[:, 0]  # sliding window of 2 positions
    assert window[0, 0].tolist() == [F, F, F, F, T, T, F, F]
    assert window[1, 3].tolist() == [F, F, F, F, T, T, F, F]  # position 4 sees its parent c (3) and itself


# -- tree-masked forward ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_forward_gives_each_node_its_path_logits(arch):
    """Two branches sharing a prefix, verified in one forward next to an ordinary causal sequence."""
    model = cached_model(arch)
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    prefix_a = [5, 9, 13, 2, 40, 41, 42]  # tree sequence
    prefix_b = [70, 71, 72, 73]  # causal sequence in the same forwards
    # tree: root r -> x -> y (branch 1), r -> z -> w -> v (branch 2); nodes in this order
    nodes = [30, 31, 32, 50, 51, 52]
    parent = [-1, 0, 1, 0, 3, 4]
    depth = [0, 1, 2, 1, 2, 3]
    tree = _ancestor_mask(parent)
    cont_b = [74, 75, 76]
    table_a = runner.cache.allocator.allocate(blocks_for(len(prefix_a) + len(nodes), 4))
    table_b = runner.cache.allocator.allocate(blocks_for(len(prefix_b) + len(cont_b), 4))
    na, nb = len(prefix_a), len(prefix_b)
    with torch.no_grad(), paged_attention_enabled(model):
        runner.forward(
            [SequenceSlice(table_a, 0, na), SequenceSlice(table_b, 0, nb)],
            prefix_a + prefix_b,
            list(range(na)) + list(range(nb)),
            [na - 1, na + nb - 1],
        )
        logits = runner.forward(
            [SequenceSlice(table_b, nb, len(cont_b)), SequenceSlice(table_a, na, len(nodes), new_token_mask=tree)],
            cont_b + nodes,
            list(range(nb, nb + len(cont_b))) + [na + d for d in depth],
            list(range(len(cont_b) + len(nodes))),
        )
    with torch.no_grad():
        ref_b = model(torch.tensor([prefix_b + cont_b])).logits[0, nb:]
        assert torch.allclose(logits[: len(cont_b)], ref_b, atol=1e-4)
        for i in range(len(nodes)):
            path, j = [], i
            while j >= 0:
                path.insert(0, nodes[j])
                j = parent[j]
            assert len(path) == depth[i] + 1
            ref = model(torch.tensor([prefix_a + path])).logits[0, -1]
            assert torch.allclose(logits[len(cont_b) + i], ref, atol=1e-4), (arch, i, path)
