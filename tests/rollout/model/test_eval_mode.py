"""eval_mode: eval inside, each module's own mode given back after (a mixed model keeps its mix),
and a model already in eval mode is left untouched (no ``train``/``eval`` walk)."""

import pytest
from torch import nn

from tailspec.rollout.model.eval_mode import eval_mode


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)))


def test_every_module_evaluates_inside_and_gets_its_own_mode_back():
    model = _model()
    model.train()
    model[2].eval()  # a mixed model: the root trains, one branch does not
    before = [m.training for m in model.modules()]
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == before


def test_modes_come_back_when_the_body_raises():
    model = _model().train()
    with pytest.raises(RuntimeError), eval_mode(model):
        raise RuntimeError("a step failed")
    assert all(m.training for m in model.modules())


def test_a_model_in_eval_mode_is_not_walked(monkeypatch):
    model = _model().eval()

    def walked(self, mode=True):
        raise AssertionError("train()/eval() walked a model already in eval mode")

    monkeypatch.setattr(nn.Module, "train", walked)
    with eval_mode(model):
        pass
    assert not any(m.training for m in model.modules())
