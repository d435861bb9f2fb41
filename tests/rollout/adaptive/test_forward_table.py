"""The forward table: the target forward's calibrated seconds per shape, and what a longer context adds."""

import math

import pytest

from tailspec.rollout.adaptive.cost_model import StepCosts
from tailspec.rollout.adaptive.forward_table import ForwardTable
from tailspec.rollout.adaptive.selector import SelectorConfig, StrategySelector
from tailspec.rollout.strategy import parse_strategy

S = parse_strategy


def test_forward_table_interpolates_and_pads_to_graph_buckets():
    table = ForwardTable({(1, 1): 1.0, (4, 1): 4.0, (1, 5): 2.0, (4, 5): 8.0})
    assert table.seconds(2, 1) == pytest.approx(2.0)
    assert table.seconds(8, 1) == pytest.approx(8.0)  # linear past the last point
    assert table.seconds(2, 3) == pytest.approx((2.0 + 4.0) / 2)
    padded = ForwardTable({(1, 1): 1.0, (4, 1): 2.0}, pad=lambda n, t: (1 if n == 1 else 4, 1))
    assert padded.seconds(2, 1) == padded.seconds(3, 1) == 2.0  # a step function, as replays are


def context_table() -> ForwardTable:
    """A CPU-like table timed at 128 cached tokens, a cached token costing each sequence 1 us per
    row at width 1 and 2 us at width 5 (attention grows with rows x context)."""
    shapes = {(n, t): 1e-2 + 1e-3 * n * t for n in (1, 2, 4, 8, 16) for t in (1, 3, 5)}
    return ForwardTable(shapes, context=128, per_token={1: 1e-6, 5: 2e-6})


def test_a_longer_context_adds_its_tokens_per_sequence_at_the_widths_slope():
    table = context_table()
    base = table.seconds(4, 1)
    assert table.seconds(4, 1, None) == table.seconds(4, 1, 128) == base  # calibration's context
    assert table.seconds(4, 1, 1128) == pytest.approx(base + 4 * 1e-6 * 1000)
    assert table.seconds(4, 3, 1128) == pytest.approx(table.seconds(4, 3) + 4 * 1.5e-6 * 1000)  # between widths
    assert table.seconds(4, 5, 0) == pytest.approx(table.seconds(4, 5) - 4 * 2e-6 * 128)  # shorter: cheaper
    assert table.seconds(4, 5, -1e9) == table.seconds(4, 5) / 2  # never below the weights' half
    flat = ForwardTable(dict(table.measured), context=128)  # no slopes measured: the context is not priced
    assert flat.seconds(4, 1, 4096) == base


def steps_at_growing_context(costs: StepCosts, arm, priced: bool, contexts=range(128, 4096, 64)) -> None:
    """Steps of ``arm`` at batch 4 that take exactly what the table says at their context."""
    for context in contexts:
        seconds = costs.table.seconds(4, 1 + arm.max_draft_nodes, context)
        costs.observe(arm, 4, seconds, 0.0, 0, forward_seconds=seconds, context=context if priced else None)


def test_steps_priced_at_their_context_leave_the_corrections_at_one():
    """A long tail's steps grow dearer with their context for every arm. Priced at their context,
    an arm's correction stays at 1 and the table stays fresh; priced at calibration's, the arm
    that ran carries the rise alone and looks dearer than the arms that did not run."""
    chain = S("chain:4")
    priced, unpriced = StepCosts(context_table()), StepCosts(context_table())
    steps_at_growing_context(priced, chain, priced=True)
    steps_at_growing_context(unpriced, chain, priced=False)
    assert priced.correction[chain].value(4) == pytest.approx(1.0)
    assert priced.drift() == pytest.approx(1.0)
    assert unpriced.correction[chain].value(4) > 1.05
    # at a long context, plain decoding's step is predicted dearer as well
    selector = StrategySelector(SelectorConfig(arms=("none", "chain:4")))
    selector.use_costs(priced)
    at = {str(p.arm): p.seconds for p in selector.predictions(4, 400, context=4000)}
    short = {str(p.arm): p.seconds for p in selector.predictions(4, 400, context=128)}
    assert at["none"] > short["none"] and at["chain:4"] > short["chain:4"]
    assert math.isclose(at["none"] - short["none"], 4 * 1e-6 * (4000 - 128), rel_tol=0.05)
