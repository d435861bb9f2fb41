from tailspec.benchmarks.goodput import goodput_by_bucket
from tailspec.rollout.stats import StepRecord


def test_goodput_by_batch_size_bucket():
    steps = [
        StepRecord(1, "none", 1, 0.5, False),
        StepRecord(3, "chain:4", 3, 1.0, False),
        StepRecord(40, "none", 40, 2.0, False),
    ]
    buckets = goodput_by_bucket(steps, (1, 4, 16))
    assert sorted(buckets) == [1, 4, 16]  # 40 active falls in the last bucket
    assert buckets[4].goodput == 3.0 and buckets[4].arms == {"chain:4": 1} and buckets[16].steps == 1
