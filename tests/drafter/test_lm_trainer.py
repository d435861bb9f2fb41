"""drafter/lm_trainer.py and the drafter LM's online training: distilled on completions only,
scored by the accepted draft tokens a greedy chain would get, shipped only past the held-out gate."""

import random

import pytest
import torch

from tailspec.config_tree import ConfigError
from tailspec.drafter.eagle3.data import FeatureBuffer
from tailspec.drafter.lm_trainer import (
    DraftLMTrainer,
    DraftLMTrainingConfig,
    SequenceSample,
    VersionedLM,
    _batch,
    lm_held_out_acceptance,
    sequence_samples,
)
from tailspec.drafter.online_training import DrafterState, DraftLMTraining, online_training
from tailspec.drafter.part_learning import DraftLMLearner, PartLearning, learner_for
from tailspec.drafter.small_lm import SmallLMDrafter
from tailspec.testing import tiny_random_model

PATTERN = [5, 9, 14, 7, 22, 11, 30, 3]


def lm(seed=2):
    return tiny_random_model("llama", seed=seed, num_layers=1)


def pattern_samples(n: int, prompt_len: int = 3, length: int = 24) -> list[SequenceSample]:
    """Completions that cycle through PATTERN from a random phase: a drafter can learn them exactly."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        phase = rng.randrange(len(PATTERN))
        tokens = [PATTERN[(phase + i) % len(PATTERN)] for i in range(length)]
        out.append(SequenceSample.of(tokens[:prompt_len], tokens[prompt_len:]))
    return out


def brute_force_acceptance(model, samples, depth) -> float:
    """Per completion position, by enumeration: the chance a chain sampled from the drafter matches
    the emitted tokens for exactly j drafts, times j (one forward per sequence, prefixes by hand)."""
    accepted = positions = 0.0
    for s in samples:
        tokens = s.tokens.long().tolist()
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
        for t in range(s.prompt_len - 1, len(tokens) - 1):
            positions += 1
            run = 1.0
            for j in range(1, depth + 1):  # P(at least j matched) = product of the first j chances
                if t + j >= len(tokens):
                    break
                run *= float(probs[t + j - 1, tokens[t + j]])
                accepted += run  # E[matched] = sum over j of P(at least j)
    return accepted / positions


def test_only_completion_tokens_are_targets_and_a_long_sequence_keeps_them_in_its_window():
    short = SequenceSample.of([1, 2, 3], [4, 5])
    ids, mask, targets = _batch([short], 512, random.Random(0), torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3, 4, 5]] and mask.sum() == 5
    assert targets.tolist() == [[-100, -100, 4, 5]]  # the prompt is context, never a target
    long = SequenceSample.of(list(range(1, 41)), list(range(41, 61)))
    for seed in range(20):
        _, _, targets = _batch([long], 16, random.Random(seed), torch.device("cpu"))
        assert targets.shape == (1, 15) and (targets != -100).any()
    assert sequence_samples([[1], [2]], [[3], []])[0].tokens.tolist() == [1, 3]  # empty completions dropped


def test_the_held_out_score_is_the_greedy_chains_accepted_tokens():
    model = lm()
    samples = pattern_samples(5) + [SequenceSample.of([4, 4], [4, 4, 4, 4, 4])]
    for depth in (1, 3):
        assert lm_held_out_acceptance(model, samples, depth) == pytest.approx(
            brute_force_acceptance(model, samples, depth)
        )
    assert lm_held_out_acceptance(model, samples, 3, should_stop=lambda: True) is None
    with pytest.raises(ValueError, match="at least one sample"):
        lm_held_out_acceptance(model, [], 3)


def test_training_distils_the_completions_and_bumps_the_version_per_step():
    part = VersionedLM(lm())
    buffer = FeatureBuffer(1 << 20)
    for s in pattern_samples(32):
        buffer.add(s)
    held_out = pattern_samples(4)
    before = lm_held_out_acceptance(part.model, held_out, 4)
    trainer = DraftLMTrainer(part, buffer, DraftLMTrainingConfig(learning_rate=3e-3, batch_size=8))
    results = trainer.train(40)
    assert len(results) == 40 and part.version == trainer.step_count == 40
    assert results[-1].loss < 0.5 * results[0].loss
    assert lm_held_out_acceptance(part.model, held_out, 4) > before + 1.0
    assert trainer.train(5, should_stop=lambda: True) == []


def test_steps_draw_from_the_newest_sequences_only():
    part = VersionedLM(lm())
    buffer = FeatureBuffer(1 << 20)
    old, new = pattern_samples(20), pattern_samples(4, length=12)
    for s in old + new:
        buffer.add(s)
    trainer = DraftLMTrainer(part, buffer, DraftLMTrainingConfig(recent=4, batch_size=2))
    seen = []  # the range of every draw
    draw = trainer.rng.randrange
    trainer.rng.randrange = lambda n: seen.append(n) or draw(n)
    trainer.train(3)
    assert seen and set(seen) == {4}  # drawn among the 4 newest, never the 20 older ones


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match="depth must be an int in \\[1, 16\\]"):
        DraftLMTrainingConfig(depth=0)
    with pytest.raises(ConfigError, match="recent must be an int >= 1"):
        DraftLMTrainingConfig(recent=0)
    with pytest.raises(ConfigError, match="learning_rate must be a float > 0"):
        DraftLMTrainingConfig(learning_rate=0.0)
    drafter = SmallLMDrafter(lm())
    with pytest.raises(ValueError, match="drafter_training for a drafter LM must be a DraftLMTrainingConfig"):
        learner_for(drafter, lm(), training=object())


def test_in_process_the_drafter_lm_ships_only_what_beats_it_on_held_out_completions():
    drafter = SmallLMDrafter(lm())
    online = online_training(drafter, 4, 1 << 20, None, DraftLMTrainingConfig(learning_rate=3e-3), holdout_every=4)
    assert isinstance(online, DraftLMTraining) and online.part is drafter.lm
    samples = pattern_samples(32)
    online.observe(
        [s.tokens[: s.prompt_len].tolist() for s in samples], [s.tokens[s.prompt_len :].tolist() for s in samples]
    )
    assert len(online.learning.held_out) == 8 and len(online.learning.train_buffer) == 24
    start = {k: v.clone() for k, v in drafter.model.state_dict().items()}
    online.min_gain = 100.0  # no trained copy can win by that much: the drafting LM stays as it was
    assert len(online.train(4, 1.0)) == 4
    assert drafter.version == 0 and online.learning.train_part.version == 4
    assert all(torch.equal(v, drafter.model.state_dict()[k]) for k, v in start.items())
    online.min_gain = 0.0
    for _ in range(4):  # training on: once a trained copy drafts better on held-out completions, it ships
        online.train(8, 1.0)
    drafting, trained = online.last_held_out
    assert online.shipped >= 1 and drafter.version == online.learning.reference.version > 0
    assert drafting <= trained or drafter.version < online.learning.train_part.version
    # a checkpoint: the drafting LM and the trainer's optimizer; a resumed one continues from them
    state = online.state()
    resumed_drafter = SmallLMDrafter(lm(seed=5))
    resumed = online_training(resumed_drafter, 4, 1 << 20, None, holdout_every=4)
    resumed.load(state)
    assert resumed_drafter.version == drafter.version
    assert all(torch.equal(v, resumed_drafter.model.state_dict()[k]) for k, v in drafter.model.state_dict().items())
    resumed.observe([[5, 9]] * 4, [[14, 7, 22, 11]] * 4)
    resumed.train(1, 1.0)
    assert resumed.trainer.step_count == state.step + 1


def test_a_part_learning_continues_only_from_a_state_it_was_given():
    learning = PartLearning(VersionedLM(lm()), DraftLMLearner())
    learning.take(pattern_samples(4), 1 << 20, 0)
    with pytest.raises(RuntimeError, match="no trainer to continue"):
        learning.prepare(None, None, 1.0)
    learning.prepare(DrafterState.of(learning.part), None, 2.0)
    assert learning.trainer.lr_scale == 2.0 and len(learning.train(2)) == 2
