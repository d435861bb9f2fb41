import itertools
import random

import pytest
import torch

import tailspec
from tailspec.testing import tiny_random_model
from tailspec.trainer_hooks.length_groups import completion_lengths, forward_by_length, plan_length_groups


def _cost(groups, lengths, prompt_width, overhead):
    return sum(len(g) * (prompt_width + max(max(1, lengths[r]) for r in g)) + overhead for g in groups)


def _brute_force(lengths, prompt_width, overhead):
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    best = None
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, current = [], [order[0]]
        for row, cut in zip(order[1:], cuts):
            if cut:
                groups.append(current)
                current = []
            current.append(row)
        groups.append(current)
        cost = _cost(groups, lengths, prompt_width, overhead)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_an_optimal_partition(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 3, 5, 5, 8, 40, 120]) for _ in range(rng.randint(1, 9))]
    prompt_width, overhead = rng.randint(0, 20), rng.choice([0, 16, 64, 512])
    groups = plan_length_groups(lengths, prompt_width, overhead)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    assert _cost(groups, lengths, prompt_width, overhead) == _brute_force(lengths, prompt_width, overhead)


def test_plan_extremes_and_bad_arguments():
    lengths = [7, 300, 7, 20, 7]
    assert plan_length_groups(lengths, 10, overhead_tokens=10**9) == [[0, 2, 4, 3, 1]]
    assert plan_length_groups(lengths, 10, overhead_tokens=0) == [[0, 2, 4], [3], [1]]
    assert plan_length_groups([], 10, 0) == []
    with pytest.raises(ValueError, match="length_group_overhead_tokens"):
        plan_length_groups(lengths, 10, -1)
    with pytest.raises(ValueError, match="prompt_width"):
        plan_length_groups(lengths, -1, 0)


def test_completion_lengths_count_to_the_last_attended_column():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    assert completion_lengths(mask, 4).tolist() == [2, 4, 1, 0]


def _batch(model, seed=0, rows=8, prompt=6, completion=40):
    """TRL's layout: left-padded prompts, right-padded completions of very different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, model.config.vocab_size, (rows, prompt + completion), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : r % 3] = 0  # prompt padding
        mask[r, prompt + (completion if r == 0 else 1 + (r * 7) % 12) :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _logps_and_entropy(model, calls):
    def forward(ids, mask, keep):
        calls.append(tuple(ids.shape))
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1 : -1].float()
        logps = logits.log_softmax(-1)
        entropy = -(logps.exp() * logps).sum(-1)
        return logps.gather(-1, ids[:, -keep:, None])[..., 0], entropy

    return forward


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_grouped_forward_gives_the_padded_values_and_gradients(arch):
    model = tiny_random_model(arch, seed=1).train()
    ids, mask = _batch(model)
    keep = 40
    completion_mask = mask[:, -keep:].float()
    results = []
    for grouped in (False, True):
        model.zero_grad()
        calls: list[tuple[int, int]] = []
        forward = _logps_and_entropy(model, calls)
        logps, entropy = forward_by_length(forward, ids, mask, keep, 16) if grouped else forward(ids, mask, keep)
        ((logps * completion_mask).sum() + (entropy * completion_mask).sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((logps, entropy, grads, calls))
    (plain, plain_entropy, plain_grads, _), (logps, entropy, grads, calls) = results
    assert len(calls) > 1 and max(width for _, width in calls) == ids.shape[1]
    assert sum(rows * width for rows, width in calls) < 0.5 * ids.numel()  # the padding is gone
    assert logps.shape == plain.shape == (8, keep)
    kept = completion_mask.bool()
    torch.testing.assert_close(logps[kept], plain[kept], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[kept], plain_entropy[kept], atol=1e-5, rtol=1e-5)
    assert (logps[1:, 12:] == 0).all()  # past every short row's group: cut off, zeros
    for g, p in zip(grads, plain_grads):
        torch.testing.assert_close(g, p, atol=1e-5, rtol=1e-4)


def test_a_batch_without_padding_is_one_forward():
    model = tiny_random_model("qwen2", seed=1)
    ids = torch.randint(2, model.config.vocab_size, (3, 10))
    calls: list[tuple[int, int]] = []
    forward_by_length(_logps_and_entropy(model, calls), ids, torch.ones_like(ids), 4, 0)
    assert calls == [(3, 10)]
    with pytest.raises(ValueError, match="logits_to_keep"):
        forward_by_length(_logps_and_entropy(model, calls), ids, torch.ones_like(ids), 0, 0)


def _train(common, make_policy, varied_length_rollout, grouped: bool, **overrides):
    model = make_policy()
    args = common["args"]
    for key, value in overrides.items():
        setattr(args, key, value)
    args.generation_batch_size = None
    args.__post_init__()
    trainer = tailspec.GRPOTrainer(
        **{**common, "model": model},
        rollout=varied_length_rollout(),
        length_grouped_forward=grouped,
        length_group_overhead_tokens=0,
    )
    widths: list[int] = []  # of the trainer's forwards (TRL passes labels; the rollout engine's do not)

    def record(module, args, kwargs):
        if "labels" in kwargs:
            widths.append(kwargs["input_ids"].shape[1])

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()
    handle.remove()
    return trainer, model, widths


@pytest.mark.parametrize("overrides", [{}, {"num_iterations": 2, "loss_type": "grpo"}])
def test_trainer_learns_the_same_with_grouped_forwards(common, make_policy, varied_length_rollout, overrides):
    """The same weights, seeds and completions, with TRL's padded forwards and grouped ones: the
    same updates and logged metrics, from forwards that are narrower than the batch."""
    padded, padded_model, padded_widths = _train(common, make_policy, varied_length_rollout, False, **overrides)
    grouped, grouped_model, grouped_widths = _train(common, make_policy, varied_length_rollout, True, **overrides)
    assert len(grouped_widths) > len(padded_widths) and min(grouped_widths) < min(padded_widths)
    for key, value in padded_model.state_dict().items():
        torch.testing.assert_close(grouped_model.state_dict()[key], value, atol=1e-5, rtol=1e-4, msg=key)
    keys = ["loss", "entropy", "clip_ratio/region_mean", "sampling/importance_sampling_ratio/mean"]
    for before, after in zip(padded.state.log_history, grouped.state.log_history):
        for key in keys:
            if key in before:
                assert after[key] == pytest.approx(before[key], abs=1e-5), key


def test_overhead_must_not_be_negative(common):
    with pytest.raises(ValueError, match="length_group_overhead_tokens"):
        tailspec.GRPOTrainer(**common, length_group_overhead_tokens=-1)
