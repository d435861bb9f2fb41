"""The EAGLE-3 head's configuration and vocabulary mapping."""

import pytest
import torch
from eagle3_helpers import target

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.drafter.eagle3.model import default_aux_layer_ids, vocab_from_counts


def test_defaults_follow_the_target():
    model = target("qwen3", num_layers=8)
    cfg = Eagle3Config.for_target(model.config)
    assert cfg.aux_layer_ids == (2, 4, 5) == default_aux_layer_ids(8)  # inputs to layers 2, L//2, L-3
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (64, 64, 96, 96)
    assert cfg.feature_size == 3 * 64
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "change,match",
    [
        ({"draft_vocab_size": 200}, "draft_vocab_size"),
        ({"draft_vocab_size": 0}, "draft_vocab_size"),
        ({"aux_layer_ids": (0, 1, 9)}, "aux_layer_ids"),
        ({"aux_layer_ids": (0, 1)}, "aux_layer_ids"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_configs_are_refused(change, match):
    base = Eagle3Config.for_target(target("llama").config).to_dict()
    with pytest.raises(ValueError, match=match):
        Eagle3Config.from_dict({**base, **change})
    with pytest.raises(ValueError, match="unknown Eagle3Config field"):
        Eagle3Config.from_dict({**base, "num_layers": 2})


def test_reduced_vocabulary_maps_both_ways():
    cfg = Eagle3Config.for_target(target("llama").config, draft_vocab_size=10)
    head = Eagle3Head(cfg)
    ids = vocab_from_counts(torch.arange(96, dtype=torch.float), 10, always=[3])
    assert ids.tolist() == [3, *range(87, 96)]  # the most frequent, plus the always-kept id, ascending
    head.set_vocab_map(ids)
    assert torch.equal(head.draft_to_target_ids(), ids)
    assert head.target_to_draft_ids(torch.tensor([3, 87, 95, 50])).tolist() == [0, 1, 9, -1]
    spread = head.target_logits(torch.arange(10, dtype=torch.float).view(1, -1))
    assert spread.shape == (1, 96) and spread[0, 95] == 9 and spread[0, 50] == float("-inf")
    with pytest.raises(ValueError, match="ascending"):
        head.set_vocab_map(ids.flip(0))
    with pytest.raises(ValueError, match="needs 10"):
        head.set_vocab_map(ids[:5])
