"""The adaptive selector: analytic choice from calibrated costs and pooled acceptance, in the engine."""

import math
import statistics
from collections import deque

import pytest
from rollout_helpers import cached_model, random_prompts

from tailspec.config_tree import ConfigError
from tailspec.draft_contract import DraftTree
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.adaptive.acceptance import AcceptanceBook, book_key
from tailspec.rollout.adaptive.choice import calibrated_batch
from tailspec.rollout.adaptive.cost_model import SHIFT_RUN, BatchRatio, StepCosts, _correction_in, push
from tailspec.rollout.adaptive.forward_table import ForwardTable
from tailspec.rollout.adaptive.selector import MEDIAN_SE, SelectorConfig, StrategySelector
from tailspec.rollout.strategy import parse_strategy
from tailspec.testing import perturbed_copy

S = parse_strategy


def evidence(book: AcceptanceBook, arm) -> float:
    """The sequence-steps of evidence behind ``arm``'s expected tokens (0 before its first)."""
    counts = book.counts.get(book_key(arm))
    return counts.evidence if counts is not None else 0


def linear_costs(fixed: float = 10e-3, per_row: float = 1e-3) -> StepCosts:
    """A CPU-like table: every row of a forward costs the same."""
    shapes = {(n, t): fixed + per_row * n * t for n in (1, 2, 4, 8, 16, 32) for t in (1, 3, 5, 9, 13, 17)}
    return StepCosts(ForwardTable(shapes))


def selector_with(costs: StepCosts, arms=("none", "chain:2", "chain:4"), **config) -> StrategySelector:
    selector = StrategySelector(SelectorConfig(arms=arms, **config))
    selector.use_costs(costs)
    return selector


def teach_chain(selector: StrategySelector, hazard: float, steps: int = 400, depth: int = 4) -> None:
    """Chain steps whose every draft level is accepted with probability ``hazard`` (expected counts)."""
    drafted, accepted = [], []
    for k in range(depth + 1):  # accepted k of depth: P = hazard^k (1 - hazard), the rest at depth
        share = hazard**k * (1 - hazard) if k < depth else hazard**depth
        drafted += [depth] * round(steps * share)
        accepted += [k] * round(steps * share)
    selector.acceptance.observe(S(f"chain:{depth}"), drafted, accepted)


@pytest.mark.parametrize(
    "field, value",
    [
        ("optimism", -1),
        ("version_weight", 1.5),
        ("calibration_rows", 0),
        ("calibration_repeats", 0),
        ("recalibrate_at", 1),
        ("switch_margin", -0.5),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        SelectorConfig(**{field: value})
    with pytest.raises(ConfigError, match="arms"):
        SelectorConfig(arms=("none", "adaptive"))


def test_one_chain_arm_teaches_every_depth_of_its_drafter():
    book = AcceptanceBook()
    book.observe(S("chain:4"), [4] * 1000, [4] * 600 + [1] * 400)  # P(>=1) = 1, P(>=2) = 0.6
    assert book.expected(S("chain:2")) == pytest.approx(1 + 1 + 0.6, abs=0.01)
    assert book.expected(S("chain:4")) == pytest.approx(1 + 1 + 0.6 * 3, abs=0.01)
    assert evidence(book, S("chain:2")) == 1000 and evidence(book, S("tree:4,2,8")) == 0
    book.observe(S("chain:2"), [2, 1, 0], [0, 1, 0])  # a sequence that did not draft adds nothing
    assert evidence(book, S("chain:4")) == 1002
    # a tree keeps its own counter, with its drafter's chain of the same depth as its prior (the
    # tree's first branch is that chain); optimism moves an arm towards its best case
    assert book.expected(S("tree:4,2,8")) == pytest.approx(book.expected(S("chain:4")))
    book.observe(S("tree:4,2,8"), [8, 8], [3, 1])
    assert book.expected(S("tree:4,2,8")) == pytest.approx((4 + 2 + book.expected(S("chain:4"))) / 3)
    assert book.expected(S("suffix")) == pytest.approx(1 + sum(0.5**j for j in range(1, 9)))  # nothing known
    assert book.expected(S("suffix"), optimism=1.0) == 9  # never drafted: its best case
    book.observe(S("suffix"), [16], [0])
    assert 9 > book.expected(S("suffix"), optimism=1.0) > book.expected(S("suffix"))


def test_a_trees_first_branch_teaches_its_drafters_chains():
    """A tree's first child at every level is what its drafter's chain drafts, so how much of that
    branch the accepted path kept is what the chain would have kept: a tree arm's steps tell the
    selector what ``chain:K`` accepts without running it."""
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 2])  # first branch: nodes 0 -> 2 -> 4
    assert tree.first_branch([0, 2, 4]) == (3, 3)
    assert tree.first_branch([0, 3]) == (3, 1)  # left the first branch at depth 2
    assert tree.first_branch([1]) == (3, 0)
    assert DraftTree.chain([1, 2, 3]).first_branch([0, 1]) == (3, 2)
    book = AcceptanceBook()
    book.observe(S("tree:4,2,8"), [8] * 100, [3] * 100, [(4, 3)] * 100)
    assert evidence(book, S("chain:4")) == 100
    assert book.expected(S("chain:2")) == pytest.approx(3.0, abs=0.02)
    assert book.expected(S("chain:4")) == pytest.approx(4.0, abs=0.05)  # the fourth level never kept


def test_versions_fade_and_workers_merge_by_averaging():
    book = AcceptanceBook()
    book.observe(S("chain:4"), [4] * 100, [4] * 100)
    book.observe(S("suffix"), [16] * 10, [2] * 10)
    before = book.expected(S("chain:4"))
    book.fade({"chain-chain"}, 0.5)
    assert evidence(book, S("chain:4")) == 50 and evidence(book, S("suffix")) == 10
    assert book.expected(S("chain:4")) < before  # the prior weighs more, the estimate itself stays
    other = AcceptanceBook()
    other.observe(S("chain:2"), [2] * 50, [0] * 50)
    merged = AcceptanceBook.merged([book.state_dict(), other.state_dict()])
    again = AcceptanceBook.merged([merged, merged])
    assert again == merged  # merging at every sync never counts a step twice
    pooled = AcceptanceBook()
    pooled.load_state_dict(merged)
    assert evidence(pooled, S("chain:4")) == 50  # (50 + 50) / 2
    assert pooled.counts["chain-chain"].passed[0] == pytest.approx(25)


def test_drafting_and_catch_up_ratios_are_learned_from_steps():
    costs = linear_costs()
    chain = S("chain:4")
    level = costs.table.seconds(8, 1)  # one draft level over 8 sequences
    for _ in range(30):
        costs.observe(chain, 8, 1.0, draft_seconds=4 * 0.3 * level, lag_tokens=0)
    assert costs.draft["model"].value(8) == pytest.approx(0.3, rel=0.05)  # the prior (0.1) weighs half a step
    catch_up = 0.05 * costs.table.seconds(200, 1)
    for _ in range(10):
        costs.observe(chain, 8, 1.0, draft_seconds=4 * 0.3 * level + catch_up, lag_tokens=200)
    assert costs.catch_up_seconds(200) == pytest.approx(catch_up, rel=0.15)
    assert costs.catch_up_seconds(0) == 0.0


def test_the_drafting_ratio_follows_the_batch_size():
    """On a GPU the drafter's host work grows with the batch while the target's forward barely
    does: the ratio is kept per batch bucket, interpolated between measured ones, and a bucket
    never measured past either end reads the nearest measured one."""
    costs = linear_costs()
    chain = S("chain:4")
    for n, ratio in ((1, 0.2), (16, 1.6)):
        for _ in range(30):
            costs.observe(chain, n, 1.0, draft_seconds=ratio * costs._model_unit(chain, n), lag_tokens=0)
    model = costs.draft["model"]
    assert model.value(1) == pytest.approx(0.2, rel=0.1) and model.value(16) == pytest.approx(1.6, rel=0.1)
    assert model.value(1) < model.value(4) < model.value(16)
    assert model.value(4) == pytest.approx(math.sqrt(model.value(1) * model.value(16)), rel=0.01)  # halfway in log n
    assert model.value(64) == model.value(16) and model.value(17) == model.value(31)
    restored = StepCosts(costs.table)
    restored.load_state_dict(costs.state_dict(), [chain])
    assert [restored.draft["model"].value(n) for n in (1, 4, 64)] == [model.value(n) for n in (1, 4, 64)]


def test_a_drafter_level_timed_at_calibration_prices_the_drafting_until_steps_outweigh_it():
    """Before any step drafts, a model arm's drafting is priced from the drafter's level timed at
    calibration (``seed_drafting``), not from the prior ratio (a tenth of the target's forward,
    which made an untried tree look three times cheaper than it was on the deep policy); the
    arms' steps then take over, as from any first measurement."""
    costs = linear_costs()
    chain = S("chain:4")
    costs.seed_drafting({1: 0.35 * costs.table.seconds(1, 1), 8: 0.5 * costs.table.seconds(8, 1)})
    model = costs.draft["model"]
    assert model.value(1) == pytest.approx(0.35, rel=0.25) and model.value(8) == pytest.approx(0.5, rel=0.25)
    assert costs.draft_seconds(chain, 1) == pytest.approx(4 * model.value(1) * costs.table.seconds(1, 1))
    for _ in range(30):
        costs.observe(chain, 8, 1.0, draft_seconds=0.9 * costs._model_unit(chain, 8), lag_tokens=0)
    assert model.value(8) == pytest.approx(0.9, rel=0.1)


def test_calibration_times_the_drafter_lms_level():
    """The drafter LM times one of its levels at every batch size calibration timed the target at
    (``TimesDraftLevels``), so a model arm is priced from its drafter's real cost from the first step."""
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, 0.3, 7))
    engine.choice.calibrate(4)
    costs = engine.selector.costs
    sizes = {n for n, _ in costs.table.measured}
    assert len(sizes) > 1 and len(costs.draft["model"].pooled.logs) == len(sizes)  # one timing per batch size
    # the drafter is the target's copy: a level costs about a one-token target forward, not a tenth of it
    assert costs.draft["model"].value(1) > 0.3


def test_corrections_shrink_to_one_and_resist_outliers():
    costs = linear_costs()
    none = S("none")
    predicted = costs.verify_seconds(none, 4)
    costs.observe(none, 4, 100 * predicted, 0.0, 0)  # the first step at a batch bucket: a warm-up, ignored
    assert costs.seconds(none, 4) == predicted
    costs.observe(none, 4, 3 * predicted, 0.0, 0)  # one slow step moves it a little
    assert 1.0 < costs.seconds(none, 4) / predicted < 1.3
    for _ in range(31):
        costs.observe(none, 4, 1.5 * predicted, 0.0, 0)
    # the bucket's median (the slow step gone: four steps in a row far below it were a shift),
    # shrunk towards the arm's pooled median, itself shrunk towards 1
    pooled = math.log(1.5) * 32 / 40
    assert costs.seconds(none, 4) / predicted == pytest.approx(math.exp((31 * math.log(1.5) + 8 * pooled) / 39))
    assert costs.drift() == pytest.approx(math.exp(pooled))
    assert costs.seconds(none, 64) / predicted * costs.verify_seconds(none, 4) / costs.verify_seconds(none, 64) == (
        pytest.approx(costs.seconds(none, 4) / predicted)
    )  # a bucket never measured reads the nearest measured one


def test_a_run_of_measurements_off_the_median_is_a_shift_and_a_lone_outlier_is_not():
    logs = deque(maxlen=32)
    for _ in range(20):
        push(logs, 0.0)
    push(logs, math.log(3))  # a spike
    for _ in range(3):
        push(logs, 0.0)
    assert len(logs) == 24 and statistics.median(logs) == 0.0
    for i in range(SHIFT_RUN):  # the level moves by 2x
        push(logs, math.log(2))
        assert len(logs) == (SHIFT_RUN if i == SHIFT_RUN - 1 else 25 + i)
    assert statistics.median(logs) == pytest.approx(math.log(2))
    for _ in range(SHIFT_RUN):  # 1.2x is within the noise: no shift
        push(logs, math.log(2) + math.log(1.2))
    assert len(logs) == 2 * SHIFT_RUN


def test_a_shift_in_one_batch_bucket_moves_the_others():
    ratio = BatchRatio(1.0, 0.5)
    for n in (1, 16):
        for _ in range(10):
            ratio.add(n, 1.0, 1.0)
    assert ratio.value(16) == pytest.approx(1.0)
    for _ in range(SHIFT_RUN):
        ratio.add(1, 3.0, 1.0)  # batch 1 drafts at 3x
    # each bucket's median is log 3 now, shrunk towards the pooled median (still log 1) as if it
    # were one more step: batch 1 has 4 steps, batch 16 its 10 moved ones
    assert ratio.value(1) == pytest.approx(3 ** (4 / 5))
    assert ratio.value(16) == pytest.approx(3 ** (10 / 11))  # never measured since: moved with it


def test_the_drafting_and_the_verification_are_corrected_apart():
    """A chain's drafting triples: its ratio learns it, and the verification's correction stays
    at 1, so the step's prediction meets the measured step instead of counting the change twice."""
    costs = linear_costs()
    chain = S("chain:4")
    n = 4
    verify = costs.verify_seconds(chain, n)
    unit = costs._model_unit(chain, n)
    for draft_ratio in (0.1, 0.3):
        for _ in range(40):
            draft = draft_ratio * unit
            costs.observe(chain, n, verify + draft, draft, 0)
        assert costs.seconds(chain, n) == pytest.approx(verify + draft, rel=0.02)
    assert costs.correction[chain].value(n) == pytest.approx(1.0)
    hybrid = S("hybrid:4,2,12")  # two drafters: its drafting has a correction of its own
    for _ in range(40):
        costs.observe(
            hybrid,
            n,
            costs.verify_seconds(hybrid, n) + 2 * costs.draft_seconds(hybrid, n),
            2 * costs.draft_seconds(hybrid, n),
            0,
        )
    assert costs.draft_correction[hybrid].value(n) == pytest.approx(2.0, rel=0.05)
    assert costs.correction[hybrid].value(n) == pytest.approx(1.0)


def test_the_hosts_part_of_a_step_is_measured_and_prices_an_arm_that_never_ran():
    """Calibration times forwards only: a step's sampling, reading and bookkeeping are learned from
    every step (its time less its forward and drafting). An arm that never ran is priced with its
    kind's host part (every speculative arm's), never as free; another batch bucket with the
    nearest measured one's, scaled by the batch."""
    costs = linear_costs()
    none, chain2, chain4 = S("none"), S("chain:2"), S("chain:4")
    n = 4
    before = costs.seconds(chain2, n)
    forward = costs.verify_seconds(chain4, n)
    errors = []
    for _ in range(20):  # chain:4 steps whose host part is 5 ms beyond the forward and the drafting
        draft = costs.draft_seconds(chain4, n)
        errors.append(costs.observe(chain4, n, forward + draft + 5e-3, draft, 0, forward_seconds=forward))
    assert errors[0] is None and errors[-1] == pytest.approx(0.0, abs=0.01)  # the first step teaches nothing
    assert costs.host.value(chain4, n) == pytest.approx(5e-3, rel=1e-6)
    assert costs.seconds(chain4, n) == pytest.approx(forward + costs.draft_seconds(chain4, n) + 5e-3, rel=0.02)
    assert costs.seconds(chain2, n) == pytest.approx(before + 5e-3, rel=0.02)  # its kind's, untried
    assert costs.host.value(none, n) == pytest.approx(5e-3, rel=1e-6)  # the other kind's: the nearest known
    assert costs.host.value(chain4, 2 * n) == pytest.approx(10e-3, rel=1e-6)  # a larger bucket: scaled
    assert costs.correction[chain4].value(n) == pytest.approx(1.0)  # the forward itself was as calibrated
    state = costs.state_dict()
    again = linear_costs()
    again.load_state_dict(state, [none, chain2, chain4])
    assert again.host.value(chain4, n) == pytest.approx(5e-3, rel=1e-6)


def test_the_last_arm_keeps_running_unless_another_is_faster_by_more_than_the_model_can_resolve():
    """Predictions closer than a standard error of their difference cannot be told apart: the arm
    of the last step keeps running. That error shrinks with the steps each arm's cost was learned
    from (the per-step error over the root of their number), so a gap the model could not resolve
    at first is acted on once both arms ran often enough."""
    selector = selector_with(linear_costs(), optimism=0.0)
    teach_chain(selector, hazard=0.8)
    n, remaining = 1, 100
    ranked = selector.predictions(n, remaining)
    best, second = ranked[0], ranked[1]
    assert selector.error == 0.0 and selector.choose(n, remaining) == best.arm
    selector.last_arm = second.arm
    gap = math.log(second.finish_s / best.finish_s)
    selector.errors.extend([gap] * 8)  # per step, the model is off by as much as the gap
    # an arm no step has measured is tried as soon as it is predicted faster: only running it measures it
    assert selector.margin(second.arm, best.arm) == 0.0 and selector.choose(n, remaining) == best.arm
    for steps in (2, 30):  # steady steps each, as predicted
        for arm in (best.arm, second.arm):
            for _ in range(steps):
                _correction_in(selector.costs.correction, arm).add(n, 1.0, 1.0)
        if steps == 2:
            assert selector.margin(second.arm, best.arm) == pytest.approx(MEDIAN_SE * gap)
            assert selector.choose(n, remaining) == second.arm  # two steps each cannot resolve the gap
    assert selector.margin(second.arm, best.arm) == pytest.approx(MEDIAN_SE * gap / 4)
    assert selector.predictions(n, remaining)[0].arm == best.arm and selector.choose(n, remaining) == best.arm
    # switch_margin 0: the point estimates alone
    selector = selector_with(linear_costs(), optimism=0.0, switch_margin=0.0)
    teach_chain(selector, hazard=0.8)
    selector.last_arm, selector.errors = second.arm, deque([10 * gap] * 8)
    assert selector.choose(n, remaining) == best.arm
    # steady steps of an arm record how far their prediction was off
    selector = selector_with(linear_costs(), optimism=0.0)
    for _ in range(12):
        selector.observe(S("none"), 2, 1.2 * selector.costs.seconds(S("none"), 2))
    assert selector.last_arm == S("none") and len(selector.errors) == 11 and selector.error > 0


def test_the_choice_follows_goodput_where_the_best_arm_changes_with_batch_size():
    selector = selector_with(linear_costs(), optimism=0.0)
    teach_chain(selector, hazard=0.8)
    picks = {n: str(selector.choose(n, remaining=100 * n)) for n in (1, 2, 8, 32)}
    assert picks[1] == "chain:4" and picks[32] == "none", picks
    # ... and on the predictions it ranks by
    for n, pick in picks.items():
        best = selector.predictions(n, 100 * n)[0]
        assert str(best.arm) == pick and best.finish_s == min(p.finish_s for p in selector.predictions(n, 100 * n))


def test_a_switch_to_a_model_arm_pays_its_catch_up_only_with_enough_work_left():
    costs = linear_costs()
    costs.catch_up.prior = 2.0  # an expensive catch-up
    selector = selector_with(costs, optimism=0.0)
    teach_chain(selector, hazard=0.8)
    assert str(selector.choose(1, remaining=2000, lag_tokens=300)) == "chain:4"
    assert str(selector.choose(1, remaining=10, lag_tokens=300)) == "none"
    assert str(selector.choose(1, remaining=10, lag_tokens=0)) == "chain:4"


def test_optimism_tries_an_unseen_arm_once_where_it_could_win_then_judges_it():
    selector = selector_with(linear_costs(), arms=("none", "chain:4", "tree:4,2,8"), optimism=1.0)
    teach_chain(selector, hazard=0.6)
    assert str(selector.choose(1, remaining=100)) == "tree:4,2,8"  # never drafted: its upper bound wins
    tree = S("tree:4,2,8")
    selector.observe(tree, 1, 0.02, 0.0, [8] * 50, [0] * 50)  # ... and it accepts nothing
    assert str(selector.choose(1, remaining=100)) == "chain:4"


def test_a_new_drafter_version_weighs_its_arms_evidence_down():
    selector = selector_with(linear_costs(), arms=("none", "chain:4", "suffix"), version_weight=0.25)
    teach_chain(selector, hazard=0.8, steps=400)
    selector.acceptance.observe(S("suffix"), [16] * 40, [1] * 40)
    selector.on_drafter_version(1)
    selector.on_drafter_version(2)
    assert evidence(selector.acceptance, S("chain:4")) == pytest.approx(100)
    assert evidence(selector.acceptance, S("suffix")) == 40  # the suffix drafter did not change
    selector.on_drafter_version(2)
    assert evidence(selector.acceptance, S("chain:4")) == pytest.approx(100)


def test_state_round_trip_and_an_earlier_releases_state(caplog):
    selector = selector_with(linear_costs())
    teach_chain(selector, hazard=0.7)
    selector.observe(S("chain:4"), 4, 0.05, 0.01, [4] * 4, [2] * 4)
    state = selector.state_dict()
    other = selector_with(linear_costs())
    other.load_state_dict(state)
    assert [str(p.arm) for p in other.predictions(3, 90)] == [str(p.arm) for p in selector.predictions(3, 90)]
    assert other.acceptance.expected(S("chain:2")) == selector.acceptance.expected(S("chain:2"))
    with pytest.raises(ValueError, match="other arms"):
        selector_with(linear_costs(), arms=("none", "chain:2")).load_state_dict(state)
    fresh = selector_with(linear_costs())
    with caplog.at_level("WARNING"):
        fresh.load_state_dict({**state, "version": 2})
    assert "earlier release" in caplog.text and fresh.acceptance.counts == {}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_adaptive_engine_matches_plain_decoding(arch):
    """Switching arms between steps (including hybrid and suffix) never changes greedy output."""
    model = cached_model(arch)
    drafter = perturbed_copy(model, noise=0.3, seed=7)
    prompts = random_prompts(12, seed=21)
    params = [SamplingParams(max_new_tokens=8 + 6 * i, temperature=0.0) for i in range(12)]  # a long tail
    want = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive", selector={"optimism": 3.0}), drafter=drafter)
    # the drafter is the target's size, which its timed levels would price as such (no model arm
    # would run): priced by the prior instead, as a drafter far smaller than its target, since the
    # switching, not the pricing, is under test
    engine.choice._timed_drafter = None
    for _ in range(2):  # the second call starts from what the first learned
        got = engine.generate(prompts, params)
        assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
    used = engine.stats.strategy_steps
    assert len(used) >= 3, used  # it really switched
    assert engine.stats.prefill_steps <= 4
    log = list(engine.stats.step_log)
    assert sum(r.emitted for r in log) == engine.stats.generated_tokens - 2 * len(prompts)  # prefill emits one each
    assert engine.stats.tail_steps > 0 and engine.stats.tail_time_s > 0
    costs = engine.selector.costs
    assert len(costs.table.measured) >= 12 and all(s > 0 for s in costs.table.measured.values())


def test_adaptive_without_a_drafter_uses_model_free_arms_and_says_so(caplog):
    """Silently running adaptive without its drafter is how the demo's adaptive runs drafted at 9%
    acceptance (issue 39): the engine names the arms it dropped."""
    with caplog.at_level("WARNING", logger="tailspec.rollout.adaptive.choice"):
        engine = RolloutEngine(cached_model("llama"), RolloutConfig(strategy="adaptive"))
        engine.generate(random_prompts(4, seed=2), SamplingParams(max_new_tokens=20, temperature=0.0))
    assert set(engine.stats.strategy_steps) <= {"none", "suffix:8,2,16"}
    assert "has no model drafter" in caplog.text and "chain:4" in caplog.text
    assert parse_strategy("adaptive").wants_model_drafter and not parse_strategy("adaptive").uses_model_drafter
    assert not parse_strategy("suffix").wants_model_drafter and parse_strategy("chain:2").wants_model_drafter


def spy_on(engine) -> list[dict]:
    seen = []
    observe = engine.selector.observe

    def spy(arm, n, seconds, draft_seconds=0.0, drafted=None, accepted=None, lag_tokens=0, branches=None, **kwargs):
        seen.append(
            {"arm": arm, "n": n, "seconds": seconds, "drafted": drafted, "accepted": accepted, "lag": lag_tokens}
        )
        seen[-1].update(branches=branches, timed=kwargs.get("timed", True), forward=kwargs.get("forward_seconds"))
        observe(arm, n, seconds, draft_seconds, drafted, accepted, lag_tokens, branches, **kwargs)

    engine.selector.observe = spy
    return seen


def test_the_engine_reports_each_sequences_draft_and_what_a_model_drafter_caught_up_on():
    model = cached_model("llama")
    engine = RolloutEngine(
        model, RolloutConfig(strategy="adaptive", selector={"optimism": 3.0}), drafter=perturbed_copy(model, 0.3, 7)
    )
    seen = spy_on(engine)
    cycle = [S("none"), S("none"), S("chain:4"), S("suffix"), S("chain:2")]
    engine.selector.choose = lambda n, remaining, lag, context: cycle[len(seen) % len(cycle)]  # switch arms often
    prompts = random_prompts(4, seed=5)
    engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.0))
    spec = [s for s in seen if s["arm"].speculative]
    assert spec and all(len(s["drafted"]) == s["n"] == len(s["accepted"]) for s in spec)
    assert all(0 <= a <= d for s in spec for d, a in zip(s["drafted"], s["accepted"]))
    assert all(d <= s["arm"].max_draft_nodes for s in spec for d in s["drafted"])
    assert all(k <= a and k <= depth for s in spec for (depth, k), a in zip(s["branches"], s["accepted"]))
    # a model arm's step catches up on what its sequences emitted since the drafter's last; its
    # first step meets the prompts (and what other arms emitted before it), a one-off: no lag, and
    # it teaches no costs
    first_model = next(i for i, s in enumerate(seen) if s["arm"].uses_model_drafter)
    assert seen[first_model]["lag"] == 0 and not seen[first_model]["timed"]
    lag, sizes = 0, set()
    for s in seen[first_model + 1 :]:
        if s["arm"].uses_model_drafter:
            assert s["lag"] <= lag, s  # finished sequences owe nothing
            if sizes <= {s["n"]}:  # none finished since: all of it
                assert s["lag"] == lag, s
            lag, sizes = 0, set()
        else:
            assert s["lag"] == 0
            lag += s["n"] if not s["arm"].speculative else sum(1 + a for a in s["accepted"])
            sizes.add(s["n"])
    assert any(s["lag"] for s in seen)


def test_calibration_captures_the_graphs_and_one_off_steps_teach_no_costs(monkeypatch):
    """A step that captures a graph pays the capture once (60-110 ms for a 1B policy on an H100):
    calibration captures every shape the arms verify before the rollout, and a step that still
    captures (the target's or the drafter's graphs) teaches the selector acceptance, not costs."""
    import time as clock

    from tailspec.rollout.model import graph_pool

    captured = []

    def slow_capture(self, fn, example):
        clock.sleep(0.05)
        captured.append(1)
        return graph_pool._EagerForward(fn, example, self.device)

    monkeypatch.setattr(graph_pool.EagerBackend, "capture", slow_capture)
    model = cached_model("llama")
    arms = {"arms": ("none", "chain:2", "chain:4")}
    engine = RolloutEngine(
        model,
        RolloutConfig(strategy="adaptive", graph_backend="eager", max_num_seqs=8, selector=arms),
        drafter=perturbed_copy(model, 0.05, 7),
    )
    # fine context buckets below calibration's (context 128 -> 256): the rollout's first steps capture
    pool = engine.runner.graph_pool = graph_pool.GraphPool(
        graph_pool.EagerBackend(), context_buckets=(32, 64, 128, 256), memory_budget=1 << 30
    )
    assert engine.selector.costs is None and pool.stats.captures == 0  # nothing before a rollout needs it
    engine.choice.before_rollout(4)
    calibrated = pool.stats.captures
    assert calibrated == len(engine.selector.costs.table.measured)
    seen = spy_on(engine)
    # what the selector picks follows this machine's timings: take every arm in turn instead
    cycle = [S("none"), S("chain:4"), S("none"), S("chain:2")]
    engine.selector.choose = lambda n, remaining, lag, context: cycle[len(seen) % len(cycle)]
    capturing = []  # per decode step: whether a graph was captured in it
    decode_step = engine.launcher.decode

    def counted(*args):
        before = len(captured)
        out = decode_step(*args)
        if out is not None:  # None: every sequence stopped on the step before
            capturing.append(len(captured) > before)
        return out

    engine.launcher.decode = counted
    engine.generate(random_prompts(4, seed=5), SamplingParams(max_new_tokens=24, temperature=0.0))
    assert len(engine.selector.costs.table.measured) == calibrated  # the rollout's batch was covered
    assert len(seen) == len(capturing) == len(engine.stats.step_log)
    assert any(capturing)  # context buckets other than calibration's
    # untimed: the steps that captured, and the model drafter's first (it meets the prompts)
    first_model = next(i for i, s in enumerate(seen) if s["arm"].uses_model_drafter)
    assert [s["timed"] for s in seen] == [not (c or i == first_model) for i, c in enumerate(capturing)]


def test_calibration_covers_the_batch_a_rollout_reaches_and_grows_with_it():
    """On a GPU every calibrated shape is a graph capture: a rollout of 32 completions with the
    default ``max_num_seqs`` (256) once calibrated 45 shapes (13.9 s on an H200, docs/GPU.md run 10);
    it times the batches its rollout can reach, and a larger rollout later adds only what it lacks."""
    model = cached_model("llama")
    # no recalibration for drift (a loaded machine can run the steps 2x off their calibration)
    selector = {"recalibrate_at": 1e9}
    config = RolloutConfig(strategy="adaptive", graph_backend="eager", max_num_seqs=64, selector=selector)
    engine = RolloutEngine(model, config, drafter=perturbed_copy(model, 0.3, 7))
    short = SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.generate(random_prompts(3, seed=5), SamplingParams(max_new_tokens=32, temperature=0.0))
    first = dict(engine.selector.costs.table.measured)
    assert engine.choice.covered_batch == 4 and max(n for n, _ in first) == 4
    costs = engine.selector.costs
    assert any(r.pooled.logs for r in costs.correction.values())
    captures = engine.runner.graph_pool.stats.captures
    engine.generate(random_prompts(4, seed=6), short)  # within what is covered: nothing timed
    assert engine.selector.costs.table.measured == first
    engine.generate(random_prompts(11, seed=7), short)
    grown = engine.selector.costs.table.measured
    assert engine.choice.covered_batch == 16 and max(n for n, _ in grown) == 16
    assert {s: grown[s] for s in first} == first  # the timed shapes kept, only larger batches added
    assert engine.runner.graph_pool.stats.captures > captures
    assert engine.selector.costs is costs  # what the steps taught (corrections, drafting ratios) kept
    # a batch that grew inside a rollout (requests joining a running one, as a server's or a Ray
    # worker's do) is covered from the next rollout on, however few requests that one starts with
    for prompt in random_prompts(2, seed=8):
        engine.add_request(prompt, short)
    engine.step()
    for prompt in random_prompts(30, seed=9):
        engine.add_request(prompt, short)
    while engine.has_unfinished():
        engine.step()
    assert engine.choice.covered_batch == 16 and engine.choice.largest_batch > 16
    engine.generate(random_prompts(2, seed=10), short)
    assert engine.choice.covered_batch == 32 and max(n for n, _ in engine.selector.costs.table.measured) == 32


def test_a_rollout_told_its_batch_calibrates_it_from_the_first_step():
    """A Ray worker's session starts with one chunk and grows as more arrive: told the batch it
    reaches (``expect_batch``), its first rollout times that batch before it starts, and the next
    rollout, starting with as few, times nothing more."""
    model = cached_model("llama")
    config = RolloutConfig(strategy="adaptive", max_num_seqs=64, selector={"recalibrate_at": 1e9})
    engine = RolloutEngine(model, config, drafter=perturbed_copy(model, 0.3, 7))
    with pytest.raises(ValueError, match="expected batch must be an int >= 1"):
        engine.expect_batch(0)
    engine.expect_batch(12)
    short = SamplingParams(max_new_tokens=4, temperature=0.0)
    for prompt in random_prompts(2, seed=8):
        engine.add_request(prompt, short)
    engine.step()
    assert engine.choice.covered_batch == 16  # timed up to 12 -> 16 before the first step, not 2
    calibrated = engine.stats.calibration_time_s
    assert calibrated > 0
    for prompt in random_prompts(10, seed=9):
        engine.add_request(prompt, short)
    while engine.has_unfinished():
        engine.step()
    timed = dict(engine.selector.costs.table.measured)
    assert max(n for n, _ in timed) == 16
    engine.generate(random_prompts(2, seed=10), short)
    assert engine.selector.costs.table.measured == timed and engine.choice.covered_batch == 16
    assert engine.stats.calibration_time_s == calibrated  # nothing timed again


def test_switching_to_adaptive_inside_a_rollout_calibrates_then():
    model = cached_model("llama")
    prompts = random_prompts(3, seed=11)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    want = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
    engine = RolloutEngine(model, RolloutConfig(), drafter=perturbed_copy(model, 0.3, 7))
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    engine.set_strategy("adaptive")
    assert engine.selector.costs is None
    while engine.has_unfinished():
        engine.step()
    assert [engine.pop_output(i).completion_ids for i in ids] == [o.completion_ids for o in want]
    assert engine.choice.covered_batch == 4 and engine.stats.strategy_steps


def test_calibrated_batch_is_the_next_power_of_two_within_max_num_seqs():
    assert [calibrated_batch(r, 256) for r in (1, 2, 3, 5, 32, 33, 300)] == [1, 2, 4, 8, 32, 64, 256]
    assert calibrated_batch(20, 24) == 24


def test_recalibration_runs_between_rollouts_once_the_arms_drift():
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, 0.3, 7))
    engine.generate(random_prompts(2, seed=4), SamplingParams(max_new_tokens=4, temperature=0.0))
    table = engine.selector.costs.table
    costs = engine.selector.costs
    for arm in engine.selector.arms:
        for _ in range(32):
            costs.observe(arm, 2, 10 * (costs.verify_seconds(arm, 2) + costs.draft_seconds(arm, 2)), 0.0, 0)
    assert engine.selector.needs_recalibration
    engine.generate(random_prompts(2, seed=5), SamplingParams(max_new_tokens=4, temperature=0.0))
    assert engine.selector.costs.table is not table and not engine.selector.needs_recalibration
    assert math.isclose(engine.selector.costs.drift(), 1.0, rel_tol=0.5)
