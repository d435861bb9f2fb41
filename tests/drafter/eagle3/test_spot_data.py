"""What spot training trains on and how a trained head is judged: draws weighted towards where the
head fails, and the held-out acceptance that decides whether a version ships."""

import random

import pytest
from eagle3_helpers import collect, random_head, random_prompts, target, trained_head

from tailspec.drafter.eagle3 import Eagle3Drafter, FeatureBuffer
from tailspec.drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig, held_out_acceptance
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


def recorded(n: int, seed: int):
    """``n`` samples recorded from greedy rollouts of the llama test target."""
    model = target("llama")
    _, _, buffer = collect(model, random_head(model, std=0.02), random_prompts(n, seed=seed), GREEDY)
    return buffer.samples()


def test_focus_draws_the_samples_the_head_fails_on():
    samples = recorded(6, seed=3)
    buffer = FeatureBuffer(1 << 30)
    for s in samples:
        buffer.add(s)
    rng = random.Random(0)
    assert len(buffer.sample(12, rng, focus=1.0)) == 12  # no losses yet: uniform
    buffer.record_losses(samples, [0.1, 0.1, 0.1, 0.1, 0.1, 5.0])
    drawn = buffer.sample(3000, rng, focus=1.0)
    assert sum(d is samples[5] for d in drawn) / 3000 == pytest.approx(5.0 / 5.5, abs=0.03)
    uniform = buffer.sample(3000, rng)
    assert sum(d is samples[5] for d in uniform) / 3000 == pytest.approx(1 / 6, abs=0.03)
    (new,) = recorded(1, seed=4)
    buffer.add(new)  # not trained on yet: counts at the highest loss seen
    drawn = buffer.sample(3000, rng, focus=1.0)
    assert sum(d is new for d in drawn) / 3000 == pytest.approx(5.0 / 10.5, abs=0.03)
    with pytest.raises(ValueError, match="focus"):
        DrafterTrainingConfig(focus=-1.0)


def test_the_trainer_records_each_drawn_samples_loss_and_evicted_ones_are_forgotten():
    model = target("llama")
    buffer = FeatureBuffer(1 << 30)
    samples = recorded(4, seed=5)
    for s in samples:
        buffer.add(s)
    head = random_head(model, std=0.02)
    DrafterTrainer(head, model.get_input_embeddings(), buffer, DrafterTrainingConfig(batch_size=4, focus=1.0)).train(3)
    assert buffer._losses and all(v > 0 for v in buffer._losses.values())
    small = FeatureBuffer(max(samples[0].nbytes, samples[1].nbytes) + 1)  # room for one
    small.add(samples[0])
    small.record_losses([samples[0]], [1.0])
    assert small.add(samples[1])  # evicts samples[0]
    assert small._losses == {}
    small.record_losses([samples[0]], [2.0])  # a sample no longer kept is not recorded
    assert small._losses == {}


def test_held_out_acceptance_ranks_heads_as_the_engine_does():
    """A trained head measures above a random one, as the engine's acceptance with each ranks
    them (greedy, the same prompts). The measure averages over every completion position, so it
    reads higher than the engine's per-round acceptance: a round starts after a rejection, where
    the next tokens are harder to guess; for choosing between two heads only the order counts."""
    model = target("llama")
    prompts = random_prompts(12, seed=91)
    _, _, buffer = collect(model, random_head(model, std=0.02), prompts, GREEDY)
    embed, samples = model.get_input_embeddings(), buffer.samples()
    good, bad = trained_head("llama"), random_head(model, seed=3)
    was_training = good.training
    measured = {h: held_out_acceptance(h, embed, samples, depth=4) for h in (good, bad)}
    assert 0.0 <= measured[bad] < measured[good] <= 4.0
    assert held_out_acceptance(good, embed, samples, depth=4) == measured[good]  # deterministic, no grad
    assert good.training == was_training

    def engine_accepts(head) -> float:
        engine = RolloutEngine(model, RolloutConfig(strategy="chain:4"), drafter=Eagle3Drafter(head, model))
        engine.generate(prompts, GREEDY)
        return engine.stats.as_dict()["mean_accept_length"]

    assert engine_accepts(bad) < engine_accepts(good)
    with pytest.raises(ValueError, match="at least one sample"):
        held_out_acceptance(good, embed, [], depth=4)
