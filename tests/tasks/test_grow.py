import pytest
import torch

from tailspec.tasks.grow import grow_policy, kept_layer_positions
from tailspec.testing import ARCHITECTURES, random_prompts, tiny_random_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_grown_policy_computes_the_same_function(arch):
    model = tiny_random_model(arch, seed=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    grown = grow_policy(model, hidden_size=160, intermediate_size=300, num_layers=5, seed=1)
    assert (grown.config.hidden_size, grown.config.num_attention_heads, grown.config.num_key_value_heads) == (
        160,
        10,
        5,
    )
    assert sum(p.numel() for p in grown.parameters()) > 4 * sum(p.numel() for p in model.parameters())
    ids = torch.tensor(random_prompts(3, seed=4, min_len=12, max_len=12))
    with torch.no_grad():
        want, got = model(ids).logits, grown(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    # dead heads and units do real arithmetic on random weights; they only write nothing
    q = grown.model.layers[0].self_attn.q_proj.weight
    assert q[64:].abs().sum() > 0 and grown.model.layers[0].self_attn.o_proj.weight[:, 64:].abs().sum() == 0


def test_added_layers_are_spread_and_bad_sizes_are_named():
    assert kept_layer_positions(24, 28) == [
        0,
        1,
        2,
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        12,
        13,
        14,
        15,
        16,
        18,
        19,
        20,
        21,
        22,
        23,
        24,
        26,
        27,
    ]
    model = tiny_random_model("qwen2", hidden_size=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="hidden_size must be a multiple of head_dim 16"):
        grow_policy(model, hidden_size=70, intermediate_size=128, num_layers=2)
    with pytest.raises(ValueError, match="GQA group 2"):
        grow_policy(model, hidden_size=80, intermediate_size=128, num_layers=2)
    with pytest.raises(ValueError, match="num_layers must be >= 2"):
        grow_policy(model, hidden_size=64, intermediate_size=128, num_layers=1)
