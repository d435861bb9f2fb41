import pytest

from tailspec.rollout import RolloutConfig, RolloutEngine
from tailspec.rollout.strategy import DEFAULT_SUFFIX_SHAPE, parse_strategy
from tailspec.testing import tiny_random_model


@pytest.mark.parametrize(
    "text,kind,depth,topk,nodes",
    [
        ("chain:4", "chain", 4, 1, 4),
        ("tree:3,2,6", "tree", 3, 2, 6),
        ("suffix:5", "suffix", 5, 1, 5),
        ("suffix:6,3,12", "suffix", 6, 3, 12),
    ],
)
def test_parse_round_trips(text, kind, depth, topk, nodes):
    s = parse_strategy(text)
    assert (s.kind, s.shape.depth, s.shape.topk, s.shape.max_nodes) == (kind, depth, topk, nodes)
    assert str(s) == text
    assert parse_strategy(str(s)) == s


def test_defaults():
    assert not parse_strategy("none").speculative
    assert parse_strategy("suffix").shape == DEFAULT_SUFFIX_SHAPE
    assert parse_strategy("chain:2").uses_model_drafter and not parse_strategy("suffix").uses_model_drafter


@pytest.mark.parametrize(
    "text,needle",
    [
        ("magic", "unknown strategy"),
        ("none:3", "no parameters"),
        ("chain:0", "K must be in [1, 16]"),
        ("chain:17", "K must be in [1, 16]"),
        ("chain:x", "non-integer"),
        ("tree:3,2", "wrong number"),
        ("tree:3,9,10", "children per node"),
        ("tree:4,2,3", "node budget"),
        ("chain:2,2,2", "wrong number"),
        (3, "must be a string"),
    ],
)
def test_bad_strategies_name_the_problem(text, needle):
    with pytest.raises(ValueError, match="strategy") as err:
        parse_strategy(text)
    assert needle in str(err.value)
    with pytest.raises(ValueError, match="strategy is not valid"):
        RolloutConfig(strategy=text)


def test_model_strategies_need_a_drafter():
    model = tiny_random_model("qwen2")
    with pytest.raises(ValueError, match="needs a drafter model"):
        RolloutEngine(model, RolloutConfig(strategy="chain:3"))
    engine = RolloutEngine(model, RolloutConfig(strategy="suffix"))
    with pytest.raises(ValueError, match="needs a drafter model"):
        engine.set_strategy("tree:2,2,4")
    assert str(engine.strategy) == "suffix:8,2,16"


def test_hybrid_and_adaptive_forms():
    from tailspec.rollout.strategy import parse_strategy

    hybrid = parse_strategy("hybrid")
    assert str(hybrid) == "hybrid:4,2,12" and hybrid.uses_model_drafter and hybrid.speculative
    assert str(parse_strategy("hybrid:3,1,6")) == "hybrid:3,1,6"
    adaptive = parse_strategy("adaptive")
    assert adaptive.adaptive and not adaptive.speculative and not adaptive.uses_model_drafter
    for bad in ("hybrid:3", "adaptive:2", "hybrid:0,2,4"):
        with pytest.raises(ValueError, match="strategy"):
            parse_strategy(bad)


@pytest.mark.parametrize("spec", ["mirror:chain:4,k=2", "mirror:chain:1,k=0", "mirror:tree:4,2,8,k=4"])
def test_mirror_strategies_round_trip(spec):
    parsed = parse_strategy(spec)
    assert parsed.mirror and parsed.uses_model_drafter and str(parsed) == spec
    assert parse_strategy(str(parsed)) == parsed


@pytest.mark.parametrize(
    "spec,message",
    [
        ("mirror:chain:4", "needs its candidates as ',k=N'"),
        ("mirror:suffix:4,k=2", "drafts with 'chain:K' or 'tree:D,K,B'"),
        ("mirror:chain:4,k=5", r"candidates k must be in \[0, 4\]"),
        ("mirror:chain:4,k=x", "non-integer"),
        ("mirror:chain:17,k=1", r"K must be in \[1, 16\]"),
    ],
)
def test_bad_mirror_strategies_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_strategy(spec)
