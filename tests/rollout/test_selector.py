"""The per-batch strategy selector on a simulated cost model, and in the engine."""

import math
import random

import pytest
from conftest import cached_model, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.selector import Choice, SelectorConfig, StrategySelector
from tailspec.rollout.strategy import parse_strategy
from tailspec.testing import perturbed_copy

ARMS = ("none", "chain:2", "chain:4", "suffix")


def simulated_goodput(arm: str, batch: int, spec_gain: float = 1.8, crossover: int = 12) -> float:
    """Tokens/s of a step: speculation multiplies goodput by up to ``spec_gain`` at batch 1 and
    loses past ``crossover`` sequences (verification costs more than it returns)."""
    base = 100.0 * batch**0.8
    if arm == "none":
        return base
    depth = {"chain:2": 2, "chain:4": 4, "suffix:8,2,16": 3}[str(parse_strategy(arm))]
    gain = spec_gain * (1 + 0.05 * depth) / 1.2
    return base * gain * (crossover / (crossover + batch)) * 1.6


ACCEPT = {"none": 1.0, "chain:2": 2.2, "chain:4": 3.2, "suffix:8,2,16": 2.0, "tree:4,2,8": 3.4, "hybrid:4,2,12": 3.6}


def as_step(arm: str, batch: int, goodput: float, accept: dict[str, float] = ACCEPT) -> tuple[float, float]:
    """A step with the given goodput, as the engine reports it: ``tokens`` (their expectation) from
    the arm's acceptance (a property of the arm, not of the batch size), ``seconds`` from the cost
    that gives ``goodput``."""
    tokens = batch * accept[str(parse_strategy(arm))]
    return tokens, tokens / goodput


def run(selector, steps, goodput, rng, sizes=(1, 2, 3, 6, 12, 24, 48, 96)):
    """Steps of random batch sizes; ``goodput(arm, n)`` is the noise-free rate, +-10% noise on the
    step time."""
    picks = []
    for _ in range(steps):
        n = rng.choice(sizes)
        arm = selector.choose(n)
        tokens, seconds = as_step(str(arm), n, goodput(str(arm), n))
        selector.observe(n, arm, tokens=tokens, seconds=seconds * rng.uniform(0.9, 1.1))
        picks.append((n, str(arm)))
    return picks


def truth(n, goodput):
    return max(ARMS, key=lambda a: goodput(a, n))


@pytest.mark.parametrize("policy", ["ucb", "epsilon"])
def test_converges_to_the_best_arm_per_bucket(policy):
    rng = random.Random(0)
    selector = StrategySelector(SelectorConfig(arms=ARMS, policy=policy, seed=1))
    picks = run(selector, 3000, simulated_goodput, rng)
    for n in (1, 2, 3, 6, 12, 24, 48, 96):
        assert str(selector.best(n)) == str(parse_strategy(truth(n, simulated_goodput))), n
    late = picks[-600:]
    right = sum(arm == str(parse_strategy(truth(n, simulated_goodput))) for n, arm in late)
    assert right / len(late) > 0.8


def test_speculation_turns_off_for_large_batches():
    rng = random.Random(1)
    selector = StrategySelector(SelectorConfig(arms=ARMS))
    run(selector, 3000, simulated_goodput, rng)
    assert str(selector.best(96)) == "none" and str(selector.best(48)) == "none"
    assert str(selector.best(1)) != "none"
    late = [selector.choose(96) for _ in range(50)]
    assert sum(str(a) == "none" for a in late) >= 45


def test_re_adapts_when_costs_change():
    rng = random.Random(2)
    selector = StrategySelector(SelectorConfig(arms=ARMS, window=16))
    run(selector, 1500, simulated_goodput, rng, sizes=(2,))
    assert str(selector.best(2)) != "none"

    def slower_speculation(arm, n):  # e.g. the policy moved away from the drafter
        return simulated_goodput(arm, n) * (0.3 if arm != "none" else 1.0)

    picks = run(selector, 1500, slower_speculation, rng, sizes=(2,))
    assert str(selector.best(2)) == "none"
    assert sum(arm == "none" for _, arm in picks[-300:]) > 240


def test_a_new_drafter_version_decays_or_resets_model_arms():
    for mode, keep in (("decay", 4), ("reset", 0)):
        selector = StrategySelector(SelectorConfig(arms=ARMS, drafter_update=mode, decay_keep=4))
        selector.on_drafter_version(1)
        run(selector, 400, simulated_goodput, random.Random(3), sizes=(1,))
        before = {arm: n for arm, (_, n) in selector.estimates()[1].items()}
        selector.on_drafter_version(1)  # same version: nothing happens
        assert {arm: n for arm, (_, n) in selector.estimates()[1].items()} == before
        selector.on_drafter_version(2)
        counts = {arm: n for arm, (_, n) in selector.estimates()[1].items()}
        assert counts.get("chain:2", 0) == min(keep, before["chain:2"]) and counts.get("chain:4", 0) == keep
        for arm in ("none", "suffix:8,2,16"):  # arms without the model drafter keep theirs
            assert counts[arm] == before[arm]


def test_a_new_drafter_version_is_re_measured_only_where_its_acceptance_moved():
    """``detect`` (the default): a new version's arms keep their samples until the version has 32
    drafting sequence-steps of its own; within 10% of the old acceptance they stay, beyond it they
    are dropped. Arms without the model drafter are never touched; a checkpoint keeps the marks."""
    selector = StrategySelector(SelectorConfig(arms=ARMS))
    chain4, none = parse_strategy("chain:4"), parse_strategy("none")

    def count(arm):
        return selector.estimates()[16][str(arm)][1]

    def steps(k, accept):
        for _ in range(k):
            selector.observe(12, chain4, tokens=12 * accept, seconds=0.1)

    selector.observe(12, none, tokens=12, seconds=0.05)
    steps(10, 3.2)
    selector.on_drafter_version(1)  # the first version seen: nothing to re-measure
    selector.on_drafter_version(2)
    steps(2, 3.3)  # 24 sequence-steps of the new version: not judged yet
    assert count(chain4) == 12 and selector.acceptance(chain4) == pytest.approx((10 * 3.2 + 2 * 3.3) / 12)
    restored = StrategySelector(SelectorConfig(arms=ARMS))
    restored.load_state_dict(selector.state_dict())
    steps(1, 3.3)  # 36: 3% above the old samples' acceptance, so they stay
    assert count(chain4) == 13 and count(none) == 1
    selector.on_drafter_version(3)
    steps(3, 2.0)  # 38% below: the old version's samples go
    assert count(chain4) == 3 and selector.acceptance(chain4) == pytest.approx(2.0) and count(none) == 1
    restored.observe(12, chain4, tokens=12 * 2.0, seconds=0.1)  # the restored one still judges version 2:
    assert restored.estimates()[16]["chain:4"][1] == 3  # its 3 steps are 10.4% below, so the 10 old go
    with pytest.raises(ValueError, match="drafter_update must be one of"):
        SelectorConfig(drafter_update="forget")


def test_state_round_trip_and_validation():
    selector = StrategySelector(SelectorConfig(arms=ARMS))
    run(selector, 200, simulated_goodput, random.Random(4))
    other = StrategySelector(SelectorConfig(arms=ARMS))
    other.load_state_dict(selector.state_dict())
    assert other.estimates() == selector.estimates()
    with pytest.raises(ValueError, match="other arms"):
        StrategySelector(SelectorConfig(arms=("none",))).load_state_dict(selector.state_dict())
    with pytest.raises(ValueError, match="policy"):
        SelectorConfig(policy="thompson")
    with pytest.raises(ValueError, match="adaptive"):
        SelectorConfig(arms=("none", "adaptive"))
    with pytest.raises(ValueError, match="bucket_bounds"):
        SelectorConfig(bucket_bounds=(4, 2))
    assert [str(a) for a in StrategySelector(SelectorConfig(arms=ARMS), has_model_drafter=False).arms] == [
        "none",
        "suffix:8,2,16",
    ]


def tail_goodput(arm: str, batch: int) -> float:
    """Suffix drafting loses badly at large batches and wins in the tail; chain:2 is a little
    better than none everywhere below 16 sequences (the shape measured on the long-tail bench)."""
    base = 100.0 * batch**0.8
    if arm == "none":
        return base
    if str(parse_strategy(arm)).startswith("suffix"):
        return base * (1.5 if batch <= 4 else 0.4)
    return base * (1.1 if batch < 16 else 0.7)


def test_a_draining_batch_explores_the_tail_despite_losses_at_large_batches():
    """Rollouts drain from many active sequences to few, so an arm is first measured where the
    batch is large. Losing there says nothing about the tail (speculation pays more the fewer
    sequences run): the selector still tries it on smaller batches and finds where it wins."""
    selector = StrategySelector(SelectorConfig(arms=ARMS))
    rng = random.Random(6)
    for _ in range(4):  # four RL steps' rollouts, each draining 64 -> 1
        drain = [n for n in (64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1) for _ in range(20)]
        for n in drain:
            arm = selector.choose(n)
            tokens, seconds = as_step(str(arm), n, tail_goodput(str(arm), n))
            selector.observe(n, arm, tokens=tokens, seconds=seconds * rng.uniform(0.9, 1.1))
    for n in (1, 2, 4):
        assert str(selector.best(n)) == "suffix:8,2,16", n
    assert str(selector.best(64)) == "none"


def test_the_prior_keeps_large_batches_off_speculation_from_the_start():
    selector = StrategySelector(SelectorConfig(arms=ARMS, speculate_up_to=8))
    picks = run(selector, 100, simulated_goodput, random.Random(5), sizes=(64,))
    assert all(arm == "none" for _, arm in picks[:20])


def width_goodput(arm: str, batch: int, narrow_ratio: float) -> float:
    """A large batch where a speculative arm's goodput falls with its draft width (verification
    rows grow faster than accepted tokens); ``chain:2`` gets ``narrow_ratio`` of plain decoding."""
    strategy = parse_strategy(arm)
    base = 100.0 * batch**0.8
    return base if not strategy.speculative else base * narrow_ratio * (1 - 0.03 * (strategy.max_draft_nodes - 2))


@pytest.mark.parametrize("narrow_ratio", [0.45, 0.95])
def test_a_narrow_arm_losing_clearly_spares_exploring_the_wider_ones(narrow_ratio):
    """A cold selector on a uniform large batch (no smaller bucket to learn from): where ``chain:2``
    loses clearly, the wider model-drafter arms are not paid for; where it is close, they are tried."""
    selector = StrategySelector(SelectorConfig())  # the default arms
    rng = random.Random(8)
    picks = run(selector, 120, lambda a, n: width_goodput(a, n, narrow_ratio), rng, sizes=(64,))
    tried = {arm for _, arm in picks}
    wider_model_arms = {"chain:4", "tree:4,2,8", "hybrid:4,2,12"}
    assert {"none", "chain:2", "suffix:8,2,16"} <= tried
    if narrow_ratio < selector.config.width_prune_ratio:
        assert not tried & wider_model_arms
        assert sum(arm == "none" for _, arm in picks) >= 110
    else:
        assert wider_model_arms <= tried
    assert str(selector.best(64)) == "none"
    # the next rollouts (warm): an arm known or bounded to lose is not paid for again and again
    later = run(selector, 256, lambda a, n: width_goodput(a, n, narrow_ratio), rng, sizes=(64,))
    assert sum(arm != "none" for _, arm in later) <= 3


def hit_or_miss_goodput(arm: str, rng: random.Random) -> float:
    """One sequence (batch 1): a suffix draft either hits (2.7x) or misses (0.3x), 1.5x on average;
    the model-drafter arms lose a little; one step's reward says little about an arm's mean."""
    if arm == "none":
        return 100.0 * rng.uniform(0.9, 1.1)
    if arm.startswith("suffix"):
        return 100.0 * (2.7 if rng.random() < 0.5 else 0.3)
    return 80.0 * rng.uniform(0.9, 1.1)


def test_small_batches_are_sampled_enough_before_an_arm_is_judged():
    """At batch 1 one step is one noisy sample: with ``min_sequence_steps`` each arm gets several
    before the selector settles, so it finds the arm that wins on average far more often than
    when one unlucky first step could rule it out."""

    def settle(min_sequence_steps: int) -> tuple[int, float]:
        found, goodput = 0, 0.0
        for seed in range(40):
            config = SelectorConfig(arms=ARMS, min_sequence_steps=min_sequence_steps, seed=seed)
            selector, rng = StrategySelector(config), random.Random(seed)
            for _ in range(300):
                arm = selector.choose(1)
                reward = hit_or_miss_goodput(str(arm), rng)
                selector.observe(1, arm, tokens=int(reward), seconds=1.0)
                goodput += reward / 300 / 40
            found += str(selector.best(1)).startswith("suffix")
        return found, goodput

    assert SelectorConfig().min_sequence_steps == 8
    found, goodput = settle(8)
    found_one_sample, goodput_one_sample = settle(0)
    assert found >= 25 and found >= found_one_sample + 8, (found, found_one_sample)
    assert goodput > 1.1 * goodput_one_sample
    with pytest.raises(ValueError, match="min_sequence_steps"):
        SelectorConfig(min_sequence_steps=-1)


def test_an_arm_that_lost_on_a_full_batch_is_not_retried_on_an_uncertainty_bonus():
    """One step of 64 sequences averages 64 sequences' drafts: once ``chain:2`` measured 0.95x of
    plain decoding there (with +-10% timing noise per step: a close arm gets a few full steps
    before it is judged), the bonus (counted in sequence-steps) does not send it back (each retry
    of a model-drafter arm after plain steps also pays the drafter's catch-up)."""
    selector = StrategySelector(SelectorConfig(arms=("none", "chain:2"), reprobe_every=0))  # no deliberate re-probes
    rng = random.Random(9)
    picks = run(selector, 1000, lambda a, n: 100.0 * n * (0.95 if a != "none" else 1.0), rng, sizes=(64,))
    assert sum(arm == "chain:2" for _, arm in picks) <= 12
    assert sum(arm == "chain:2" for _, arm in picks[30:]) == 0


def test_an_arm_ruled_out_by_a_narrower_one_is_not_exploited_either():
    """On one sequence every speculative arm loses (the tiny policy's case): ``chain:2`` and
    ``suffix`` are sampled enough to be judged; the wider model-drafter arms, ruled out by
    ``chain:2`` (0.85x), are never run, not even for an exploration bonus (which used to revive
    each of them for a full set of trials)."""
    selector = StrategySelector(SelectorConfig())  # the default arms
    rng = random.Random(10)
    picks = run(selector, 600, lambda a, n: 100.0 * (0.85 if a != "none" else 1.0), rng, sizes=(1,))
    counts = {arm: sum(a == arm for _, a in picks) for arm in {a for _, a in picks}}
    assert set(counts) == {"none", "chain:2", "suffix:8,2,16"}, counts
    assert counts["chain:2"] + counts["suffix:8,2,16"] <= 2 * selector.config.min_sequence_steps + 4, counts


def test_a_state_of_the_per_bucket_goodput_selector_is_ignored_with_a_warning(caplog):
    """Engine states saved before the goodput model (no ``version``) load without error; the
    selector starts afresh (it relearns within a rollout) and says so."""
    selector = StrategySelector(SelectorConfig(arms=ARMS))
    run(selector, 100, simulated_goodput, random.Random(11))
    state = selector.state_dict()
    del state["version"]
    other = StrategySelector(SelectorConfig(arms=ARMS))
    with caplog.at_level("WARNING", logger="tailspec.rollout.selector"):
        other.load_state_dict(state)
    assert other.estimates() == {} and "earlier release" in caplog.text


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_adaptive_engine_matches_plain_decoding(arch):
    """Switching arms between steps (including hybrid and suffix) never changes greedy output."""
    model = cached_model(arch)
    drafter = perturbed_copy(model, noise=0.3, seed=7)
    prompts = random_prompts(12, seed=21)
    params = [SamplingParams(max_new_tokens=8 + 6 * i, temperature=0.0) for i in range(12)]  # a long tail
    want = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
    engine = RolloutEngine(
        model,
        RolloutConfig(
            strategy="adaptive", selector={"seed": 3, "prune_ratio": 0.0, "width_prune_ratio": 0.0}
        ),  # try every arm
        drafter=drafter,
    )
    for _ in range(2):  # the second call starts from what the first learned
        got = engine.generate(prompts, params)
        assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
    used = engine.stats.strategy_steps
    assert len(used) >= 4, used  # it really switched
    assert engine.stats.prefill_steps <= 4
    log = list(engine.stats.step_log)
    assert sum(r.emitted for r in log) == engine.stats.generated_tokens - 2 * len(prompts)  # prefill emits one each
    assert engine.stats.tail_steps > 0 and engine.stats.tail_time_s > 0


def test_adaptive_without_a_drafter_uses_model_free_arms_and_says_so(caplog):
    """Silently running adaptive without its drafter is how the demo's adaptive runs drafted at 9%
    acceptance (issue 39): the engine names the arms it dropped."""
    engine = RolloutEngine(cached_model("llama"), RolloutConfig(strategy="adaptive"))
    with caplog.at_level("WARNING", logger="tailspec.rollout.strategy_choice"):
        engine.generate(random_prompts(4, seed=2), SamplingParams(max_new_tokens=20, temperature=0.0))
    assert set(engine.stats.strategy_steps) <= {"none", "suffix:8,2,16"}
    assert "has no model drafter" in caplog.text and "chain:4" in caplog.text
    assert parse_strategy("adaptive").wants_model_drafter and not parse_strategy("adaptive").uses_model_drafter
    assert not parse_strategy("suffix").wants_model_drafter and parse_strategy("chain:2").wants_model_drafter


def probe_run(selector, steps, arms, batch=64, seed=12):
    """Drive ``plan``/``observe`` like the engine. ``arms``: arm -> (tokens per drafting sequence,
    extra step time of a full step relative to a plain one, half drafting, half verification). A
    probe step drafts for ``drafting`` sequences only: the others take one plain token each."""
    rng, picks, plain_s = random.Random(seed), [], 0.01
    for _ in range(steps):
        choice = selector.plan(batch)
        arm, m = str(choice.strategy), choice.drafting
        tokens_per_seq, extra = arms[arm]
        share = 1.0 if m is None else m / batch
        draft_s = plain_s * extra / 2 * (1.0 if m is None else 0.5)  # one batched draft: less than in proportion
        seconds = (plain_s + draft_s + plain_s * extra / 2 * share) * rng.uniform(0.98, 1.02)
        tokens = batch + (tokens_per_seq - 1) * batch * share
        selector.observe(batch, choice.strategy, int(tokens), seconds, m, draft_s)
        picks.append((arm, m))
    return picks


def test_a_large_batch_first_tries_an_arm_on_a_few_sequences():
    """Once plain decoding is measured on a large batch, an arm's first try is a probe: only
    ``probe_sequences`` of the batch draft. A probe that says the arm loses clearly (here 0.6x)
    spares the full step; an arm whose probe comes out close gets full steps that measure it."""
    selector = StrategySelector(SelectorConfig(arms=("none", "chain:2", "suffix"), probe_sequences=8))
    arms = {"none": (1.0, 0.0), "chain:2": (1.5, 1.5), "suffix:8,2,16": (1.8, 0.5)}  # 0.6x and 1.2x
    picks = probe_run(selector, 60, arms)
    assert picks[0] == ("none", None)  # plain decoding first: the probe extrapolates from its step time
    firsts = {arm: m for arm, m in reversed(picks)}
    assert firsts["chain:2"] == 8 and firsts["suffix:8,2,16"] == 8
    assert ("chain:2", None) not in picks  # ruled out by its probe
    assert ("suffix:8,2,16", None) in picks  # close or better: measured on the whole batch
    assert str(selector.best(64)) == "suffix:8,2,16"
    assert sum(arm == "suffix:8,2,16" for arm, _ in picks[-20:]) >= 18


def test_a_probe_is_recorded_as_the_full_step_it_stands_for():
    """``observe`` of a probe: the drafting sequences' acceptance as measured; the step time of the
    plain step for this batch, plus the drafting as measured, plus the extra verification scaled
    from ``drafting`` to all sequences."""
    selector = StrategySelector(SelectorConfig(arms=("none", "chain:2")))
    none, chain = parse_strategy("none"), parse_strategy("chain:2")
    selector.observe(64, none, tokens=64, seconds=0.1)  # plain: 640 sequence-steps/s
    # 8 of 64 drafted: 8 extra tokens, 0.02 s of drafting, 0.01 s of extra verification
    selector.observe(64, chain, tokens=72, seconds=0.13, drafting=8, draft_seconds=0.02)
    b = selector.bucket(64)
    (sample,) = selector._stats[b][chain].samples
    full_s = 0.1 + 0.02 + 0.01 * 8
    assert sample.probe and (sample.sequences, sample.drafting, sample.tokens) == (64, 8, 16.0)
    assert sample.seconds == pytest.approx(full_s)
    assert selector.acceptance(chain) == pytest.approx(2.0)
    assert selector.predicted(chain, b) == pytest.approx(2.0 * 64 / full_s)
    # no plain measurement yet: the step time as it ran (an optimistic bound); every sequence drafting: a full step
    fresh = StrategySelector(SelectorConfig(arms=("none", "chain:2")))
    fresh.observe(64, chain, tokens=72, seconds=0.13, drafting=8, draft_seconds=0.02)
    fresh.observe(64, chain, tokens=128, seconds=0.2, drafting=64)
    first, full = fresh._stats[b][chain].samples
    assert first.probe and first.seconds == pytest.approx(0.13) and not full.probe
    assert fresh._stats[b][chain].speed == pytest.approx(64 / 0.2)  # a full step outranks the probe


def test_probes_are_off_on_small_batches_and_when_disabled():
    for config, batch in ((SelectorConfig(arms=ARMS), 8), (SelectorConfig(arms=ARMS, probe_sequences=0), 64)):
        selector = StrategySelector(config)
        selector.observe(batch, parse_strategy("none"), tokens=batch, seconds=0.1)
        assert all(selector.plan(batch).drafting is None for _ in range(5))
    with pytest.raises(ValueError, match="probe_sequences"):
        SelectorConfig(probe_sequences=-1)
    with pytest.raises(ValueError, match="probe_from"):
        SelectorConfig(probe_from=0)


def test_probe_steps_in_the_engine_draft_for_a_few_sequences_and_stay_lossless():
    """An engine whose selector probes on every batch of 4 or more: the probe steps draft for the
    spread subset only, and greedy output equals plain decoding."""
    model = cached_model("qwen2")
    drafter = perturbed_copy(model, noise=0.3, seed=7)
    prompts = random_prompts(8, seed=23)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    want = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
    selector = {"probe_sequences": 2, "probe_from": 4, "prune_ratio": 0.0, "width_prune_ratio": 0.0, "seed": 1}
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive", selector=selector), drafter=drafter)
    drafted: list[int] = []
    propose = engine._spec_decode

    def spy(batch, plan):
        drafted.append((len(batch.seqs), plan.probe))
        return propose(batch, plan)

    engine._spec_decode = spy
    got = engine.generate(prompts, params)
    assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
    assert any(probe == 2 and n >= 4 for n, probe in drafted), drafted
    samples = [s for stats in engine.selector._stats for arm in stats.values() for s in arm.samples]
    assert any(s.probe and s.drafting == 2 for s in samples)


def test_spread_mask_picks_evenly():
    from tailspec.rollout.length_budget import spread_mask

    assert spread_mask(8, 2) == [True, False, False, False, True, False, False, False]
    assert sum(spread_mask(64, 8)) == 8 and spread_mask(3, 5) == [True] * 3


def test_a_switch_steps_catch_up_does_not_condemn_a_model_arm():
    """A model-drafter arm's first step after many plain ones also pays the drafter's catch-up on
    every token they emitted (here 4x a step). Judged by that step, ``chain:2`` and with it every
    wider model arm would be ruled out for good on a batch where ``chain:4`` wins 1.4x; flagged as
    a switch, it is judged by the next (steady) step, and the selector settles on ``chain:4``."""

    def settle(flag_switches: bool) -> dict[str, int]:
        selector = StrategySelector(SelectorConfig(arms=("none", "chain:2", "chain:4")))
        gain = {"none": 1.0, "chain:2": 1.2, "chain:4": 1.4}
        gap, picks = 10, []
        for _ in range(300):
            arm = selector.choose(24)
            model = arm.uses_model_drafter
            switch = model and gap >= 4
            seconds = 1.0 + (4.0 if switch else 0.0)
            selector.observe(24, arm, int(2400 * gain[str(arm)]), seconds, switch=switch and flag_switches)
            gap = 0 if model else gap + 1
            picks.append(str(arm))
        return {a: picks[-100:].count(a) for a in gain}

    flagged, unflagged = settle(True), settle(False)
    assert flagged["chain:4"] >= 95, flagged
    assert unflagged["none"] >= 95, unflagged  # the failure the flag prevents


def test_every_switch_step_is_set_aside_once_the_arm_has_a_steady_one():
    """Each return of a model arm after plain steps pays a catch-up on their tokens: a cost of
    switching, not of the arm. Counted as they ran, the demo's in-process rollout kept 56
    sequences on plain decoding, where ``chain:2`` runs 1.07x and ``chain:4`` 1.23x of it.
    Acceptance counts every step."""
    selector = StrategySelector(SelectorConfig(arms=("none", "chain:2")))
    chain, b = parse_strategy("chain:2"), selector.bucket(24)
    selector.observe(24, chain, 24, 4.0, switch=True)
    assert selector._stats[b][chain].speed == pytest.approx(24 / 4.0)  # nothing else to go by
    selector.observe(24, chain, 48, 1.0)
    selector.observe(24, chain, 24, 4.0, switch=True)
    samples = selector._stats[b][chain].samples
    assert [x.switch for x in samples] == [True, False, True]
    assert selector._stats[b][chain].speed == pytest.approx(24 / 1.0)
    assert selector.acceptance(chain) == pytest.approx(96 / 72)


def test_the_engine_flags_a_model_drafters_first_step_after_a_gap():
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, noise=0.3, seed=7))
    seen = []
    observe = engine.selector.observe

    def spy(n, arm, tokens, seconds, drafting=None, draft_seconds=0.0, switch=False):
        seen.append((str(arm), switch))
        observe(n, arm, tokens, seconds, drafting, draft_seconds, switch)

    engine.selector.observe = spy
    engine.generate(random_prompts(4, seed=5), SamplingParams(max_new_tokens=40, temperature=0.0))
    model_steps = [(i, sw) for i, (arm, sw) in enumerate(seen) if parse_strategy(arm).uses_model_drafter]
    assert model_steps and model_steps[0][1]  # the first one catches up on the whole prompt
    for (i, sw), (j, _) in zip(model_steps[1:], model_steps):
        gap = i - j - 1  # steps of other arms between two model-drafter steps
        assert sw == (gap >= 4), (i, j, sw)


GPU_ACCEPT = {
    "none": 1.0,
    "chain:2": 2.6,
    "chain:4": 4.0,
    "tree:4,2,8": 4.3,
    "suffix:8,2,16": 1.8,
    "hybrid:4,2,12": 4.4,
}


def gpu_like_step_seconds(arm: str, n: int) -> float:
    """A bandwidth-bound step (the grown 1B policy on an H100, roughly): a forward costs 4.5 ms
    plus a little per token; a model-drafter arm drafts ``depth`` small forwards; the suffix
    drafter costs host time per sequence."""
    strategy = parse_strategy(arm)

    def forward(tokens: int) -> float:
        return 4.5e-3 + 2e-5 * tokens

    seconds = forward(n * (1 + strategy.max_draft_nodes))
    if strategy.uses_model_drafter:
        seconds += strategy.shape.depth * (1.1e-3 + 5e-6 * n * max(1, strategy.shape.topk))
    if "suffix" in strategy.drafters:
        seconds += 4e-5 * n
    return seconds


def cpu_like_step_seconds(arm: str, n: int) -> float:
    """A compute-bound step (2 CPU cores): every token of a forward costs the same, so wide drafts
    and large batches pay in full and speculation loses past a handful of sequences."""
    strategy = parse_strategy(arm)
    seconds = 2e-3 + 1e-3 * n * (1 + strategy.max_draft_nodes)
    if strategy.uses_model_drafter:
        seconds += strategy.shape.depth * 2e-4 * n * max(1, strategy.shape.topk)
    if "suffix" in strategy.drafters:
        seconds += 1e-4 * n
    return seconds


def drain_rollout(choose, step_seconds, rng, start: int = 56) -> tuple[float, float]:
    """One rollout draining from ``start`` sequences to 1 (each size for a few steps, as lengths
    spread); ``choose(n)`` picks the arm and gets ``(tokens, seconds)`` back. Tokens and time
    carry the noise of real steps. Returns (tokens, seconds)."""
    tokens_total = seconds_total = 0.0
    for n in [n for n in (56, 48, 40, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1) if n <= start for _ in range(6)]:
        tokens_total_n, seconds_n = choose(n, rng)
        tokens_total += tokens_total_n
        seconds_total += seconds_n
    return tokens_total, seconds_total


def step_outcome(arm: str, n: int, step_seconds, rng) -> tuple[float, float]:
    """A step's tokens (the drafts' acceptance varies +-30% for one sequence, averaging out over
    many) and its time (+-3%)."""
    accept, spread = GPU_ACCEPT[str(parse_strategy(arm))], 0.3 / math.sqrt(n)
    tokens = n + (accept - 1) * n * rng.uniform(1 - spread, 1 + spread)
    return tokens, step_seconds(arm, n) * rng.uniform(0.97, 1.03)


@pytest.mark.parametrize("hardware", [gpu_like_step_seconds, cpu_like_step_seconds])
def test_adaptive_reaches_the_best_fixed_arm_from_the_second_rollout(hardware):
    """Issue 39: from the second RL step on, ``adaptive`` is within 5% of the best fixed arm per
    rollout (pooled acceptance: a probe on 8 sequences tells every batch size what an arm
    accepts; speeds are carried between batch sizes and measured with one step), and where the
    best arm changes with the batch size (the CPU-like costs) it beats every fixed arm."""
    selector = StrategySelector(SelectorConfig())  # the default arms

    def adaptive(n, rng):
        choice = selector.plan(n)
        arm = str(choice.strategy)
        tokens, seconds = step_outcome(arm, n, hardware, rng)
        if choice.drafting is not None:  # a probe: only ``drafting`` sequences drafted
            m = choice.drafting
            tokens = n + (tokens - n) * m / n
            seconds = hardware("none", n) + (seconds - hardware("none", n)) * m / n
        selector.observe(n, choice.strategy, tokens, seconds, choice.drafting, 0.0)
        return tokens, seconds

    fixed = {}
    for arm in SelectorConfig().arms:
        rng = random.Random(1)
        runs = [drain_rollout(lambda n, r, a=arm: step_outcome(a, n, hardware, r), hardware, rng) for _ in range(4)]
        fixed[arm] = [t / s for t, s in runs]
    rng = random.Random(1)
    got = [t / s for t, s in (drain_rollout(adaptive, hardware, rng) for _ in range(4))]
    best = max(fixed, key=lambda a: sum(fixed[a]))
    for step in range(1, 4):
        assert got[step] >= 0.95 * fixed[best][step], (step, got, best, fixed[best])
    if hardware is cpu_like_step_seconds:
        assert best == "none" or sum(got[1:]) > sum(fixed[best][1:])


def test_a_fresh_selector_on_one_sequence_settles_within_a_short_generation():
    """The GPU check's batch-1 case: a fresh engine's first 40 steps on one sequence (the first
    rollout of a run that starts small). Pooled evidence needs ``min_sequence_steps`` per arm, and
    narrower arms rule out wider ones, so exploration is bounded and the rest is the best arm."""
    selector = StrategySelector(SelectorConfig())
    rng, picks = random.Random(3), []
    for _ in range(120):
        arm = selector.choose(1)
        tokens, seconds = step_outcome(str(arm), 1, gpu_like_step_seconds, rng)
        selector.observe(1, arm, tokens, seconds)
        picks.append(str(arm))
    assert picks[-40:].count("chain:4") + picks[-40:].count("hybrid:4,2,12") + picks[-40:].count("tree:4,2,8") >= 36


def test_the_selector_times_steps_without_their_graph_captures(monkeypatch):
    """A step that captures a graph pays the capture once (60-110 ms for a 1B policy on an H100:
    10-20 steps); judged by it, an arm tried on a new batch size would lose there for good. The
    engine reports each step's time less what every graph pool spent capturing in it."""
    import time as clock

    from tailspec.rollout import graph_pool

    def slow_capture(self, fn, example):
        clock.sleep(0.3)
        return graph_pool._EagerForward(fn, example)

    monkeypatch.setattr(graph_pool.EagerBackend, "capture", slow_capture)
    model = cached_model("llama")
    engine = RolloutEngine(
        model,
        RolloutConfig(strategy="adaptive", graph_backend="eager"),
        drafter=perturbed_copy(model, noise=0.3, seed=7),
    )
    observed = []
    observe = engine.selector.observe

    def spy(n, arm, tokens, seconds, drafting=None, draft_seconds=0.0, switch=False):
        observed.append(seconds)
        observe(n, arm, tokens, seconds, drafting, draft_seconds, switch)

    engine.selector.observe = spy
    engine.generate(random_prompts(4, seed=5), SamplingParams(max_new_tokens=24, temperature=0.0))
    steps = [r.seconds for r in engine.stats.step_log]
    assert engine.runner.graph_pool.stats.captures >= 2
    captured = [i for i, s in enumerate(steps) if s > 0.3]
    assert captured and len(observed) == len(steps)
    for i in captured:
        assert observed[i] < steps[i] - 0.25, (i, observed[i], steps[i])


def test_a_probe_that_paid_the_catch_up_is_probed_again():
    """The first model-drafter step of a rollout is a probe on the large batch and also the
    drafter's catch-up on every prompt: extrapolated to the whole batch, the catch-up made
    ``chain:2`` look 0.74x plain decoding on the demo's 56 sequences in-process, and (narrower)
    it ruled out ``chain:4``, which runs 1.7x there. The switch probe is re-run as a probe, and
    the arm judged by the steady one."""
    selector = StrategySelector(SelectorConfig(arms=("none", "chain:2", "chain:4")))
    none, chain2 = parse_strategy("none"), parse_strategy("chain:2")
    assert selector.plan(56) == Choice(none)
    selector.observe(56, none, 56, 0.06)
    first = selector.plan(56)
    assert first == Choice(chain2, 8)
    selector.observe(56, chain2, 56 + 8 * 1.8, 0.06 + 0.16, drafting=8, draft_seconds=0.15, switch=True)
    assert selector.plan(56) == Choice(chain2, 8)  # probed again, not judged by the catch-up
    selector.observe(56, chain2, 56 + 8 * 1.8, 0.075, drafting=8, draft_seconds=0.01)
    b = selector.bucket(56)
    assert selector._stats[b][chain2].speed == pytest.approx(56 / (0.06 + 0.01 + 0.005 * 7))
    assert str(selector.plan(56).strategy) == "chain:4"  # chain:2 close enough: the wider arm is explored


def test_a_full_model_step_after_probes_only_is_flagged_as_a_switch():
    """A probe drafts for a few sequences, so the drafter still lags on the others: the first full
    step after it catches them up (on the demo's 56 sequences a ``chain:2`` step took 0.31 s
    instead of 0.15 s) and must not be judged as the arm's steady speed."""
    from tailspec.rollout.strategy_choice import SWITCH_GAP

    model = cached_model("qwen2")
    selector = {"probe_sequences": 2, "probe_from": 4, "prune_ratio": 0.0, "width_prune_ratio": 0.0, "seed": 1}
    engine = RolloutEngine(
        model, RolloutConfig(strategy="adaptive", selector=selector), drafter=perturbed_copy(model, noise=0.3, seed=7)
    )
    seen = []
    observe = engine.selector.observe

    def spy(n, arm, tokens, seconds, drafting=None, draft_seconds=0.0, switch=False):
        seen.append((arm.uses_model_drafter, drafting, switch))
        observe(n, arm, tokens, seconds, drafting, draft_seconds, switch)

    engine.selector.observe = spy
    engine.generate(random_prompts(8, seed=23), SamplingParams(max_new_tokens=24, temperature=0.0))
    since_any = since_full = SWITCH_GAP  # steps since the drafter last drafted, for every sequence
    for model_arm, drafting, switch in seen:
        if model_arm:
            assert switch == ((since_any if drafting is not None else since_full) >= SWITCH_GAP), seen
        since_any = 0 if model_arm else since_any + 1
        since_full = 0 if model_arm and drafting is None else since_full + 1
    full_after_probe = [
        i for i, (m, d, _) in enumerate(seen) if m and d is None and any(pm and pd for pm, pd, _ in seen[:i])
    ]
    assert full_after_probe and seen[full_after_probe[0]][2]  # the first full step after probes caught up


def test_a_drafter_that_catches_up_with_the_policy_is_found_again():
    """Where plain decoding won (the drafter fell behind the policy: every drafting arm 0.6x),
    the best drafting arm is probed again every ``reprobe_every`` plain steps; once the drafter
    pays again (1.5x), the bucket goes back to drafting. Without re-probes it never would: no
    measurement of the drafting arms changes while none of them runs."""

    seconds = {"none": 0.05, "chain:2": 0.08, "chain:4": 0.1}  # a step of 64 sequences
    behind = {"none": 1.0, "chain:2": 1.0, "chain:4": 1.1}  # tokens per sequence-step: 0.6x, 0.55x
    caught_up = {"none": 1.0, "chain:2": 2.4, "chain:4": 3.6}  # 1.5x, 1.8x

    def after_recovery(reprobe_every: int) -> int:
        selector = StrategySelector(SelectorConfig(arms=("none", "chain:2", "chain:4"), reprobe_every=reprobe_every))
        rng = random.Random(13)
        picks = []
        for accept in (behind, caught_up):
            for _ in range(400):
                choice = selector.plan(64)
                arm, m = str(choice.strategy), choice.drafting
                drafting = 64 if m is None else m
                tokens = 64 + (accept[arm] - 1) * drafting * rng.uniform(0.9, 1.1)
                share = drafting / 64
                step_s = seconds["none"] + (seconds[arm] - seconds["none"]) * share
                resumed = selector.observe(64, choice.strategy, tokens, step_s * rng.uniform(0.97, 1.03), m, 0.0)
                picks.append(arm)
                reprobes.append(choice.reprobe)
                resumptions.append(resumed)
        return picks[-100:].count("chain:4")

    reprobes, resumptions = [], []
    assert after_recovery(64) >= 90
    # re-probes ran while plain decoding won (what the engine counts for drafter health), and once
    # the drafter caught up, drafting resumed in full once, after the 400 steps of lagging
    assert sum(reprobes[:400]) >= 3 and sum(resumptions) == 1 and resumptions.index(True) > 400
    reprobes.clear()
    assert after_recovery(0) == 0 and not any(reprobes)
    with pytest.raises(ValueError, match="reprobe_every"):
        SelectorConfig(reprobe_every=-1)


def test_the_engine_counts_reprobes_and_the_drafting_they_resume(caplog):
    """``EngineStats.reprobes`` counts the selector's re-probes; ``reprobes_paying`` the steps that
    resumed drafting after one (``observe`` says so), which drafter health reports to the trainer."""

    model = cached_model("qwen2")
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, noise=0.3, seed=7))
    plans, observe = [], engine.selector.observe

    def plan(n):
        plans.append(Choice(parse_strategy("chain:2"), reprobe=len(plans) in (3, 9)))
        return plans[-1]

    def spy(n, arm, tokens, seconds, drafting=None, draft_seconds=0.0, switch=False):
        observe(n, arm, tokens, seconds, drafting, draft_seconds, switch)
        return len(plans) == 5  # the step after the first re-probe resumed drafting

    engine.selector.plan, engine.selector.observe = plan, spy
    with caplog.at_level("INFO", logger="tailspec.rollout.strategy_choice"):
        engine.generate(random_prompts(2, seed=3), SamplingParams(max_new_tokens=32, temperature=0.0))
    assert len(plans) > 9
    assert engine.stats.reprobes == 2 and engine.stats.reprobes_paying == 1
    assert "drafting (chain:2) resumes on 2 sequences" in caplog.text
