from tailspec.workers import shard_requests


def test_shards_keep_groups_together_and_balance():
    prompts = [[1]] * 4 + [[2]] * 2 + [[3]] * 2 + [[4]] * 3 + [[5]]
    shards = shard_requests(prompts, 2)
    assert sorted(i for s in shards for i in s) == list(range(len(prompts)))
    for s in shards:  # a group never straddles shards
        assert all(prompts[i] != prompts[j] for i in s for t in shards if t is not s for j in t)
    assert sorted(len(s) for s in shards) == [6, 6]
    assert shard_requests([[1], [2]], 5) == [[0], [1]]  # no empty shards
