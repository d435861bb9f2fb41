"""A verification through a Gated DeltaNet layer in one call equals transformers' own one-token decode
step walked down each row's path (chains, trees, sequences of different lengths), states included."""

import pytest
import torch

from tailspec.rollout.model.delta_rule_rows import ROW_VERIFIED, conv_windows, verify_rows
from tailspec.rollout.model.recurrent_state import recurrent_mixers
from tailspec.rollout.model.state_slots import RowCache
from tailspec.testing.families import tiny_family_model

PARENTS = {
    "chain": [[-1, 0, 1, 2, 3]] * 3,
    "tree": [[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 0], [-1, 0, 0, 0, 0]],
    "ragged": [[-1, 0, 1, -1, -1], [-1, 0, 0, 2, 3], [-1, -1, -1, -1, -1]],  # past a sequence's rows: -1
}


def _one_token_walk(mixer, x, parents, conv, recurrent, row):
    """Row ``r`` of sequence ``s`` as plain decoding computes it: the layer's forward one token at a
    time down the path from the slot to ``r``."""
    path, at = [], row
    while at >= 0:
        path.append(at)
        at = parents[at]
    cache = RowCache(conv.clone(), recurrent.clone())
    for step in reversed(path):
        out = type(mixer).forward(mixer, x[step].view(1, 1, -1), cache_params=cache)
    return out[0, 0], cache.conv[0], cache.recurrent[0]


@pytest.mark.parametrize("shape", sorted(PARENTS))
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_one_call_equals_the_one_token_step_down_each_path(family, shape):
    model = tiny_family_model(family, seed=4)
    mixer = recurrent_mixers(model)[0]
    assert type(mixer).__name__ in ROW_VERIFIED
    gen = torch.Generator().manual_seed(7)
    parents = torch.tensor(PARENTS[shape])
    seqs, rows = parents.shape
    x = torch.randn(seqs, rows, model.config.hidden_size, generator=gen)
    conv = torch.randn(seqs, mixer.conv_dim, mixer.conv_kernel_size, generator=gen)
    recurrent = 0.1 * torch.randn(seqs, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, generator=gen)
    with torch.no_grad():
        out, conv_rows, rec_rows = verify_rows(mixer, x, parents, conv, recurrent)
        for s in range(seqs):
            for r in range(rows):
                if r > 0 and parents[s, r] < 0:
                    continue  # a row past the sequence's: its output is never read
                want = _one_token_walk(mixer, x[s], parents[s].tolist(), conv[s : s + 1], recurrent[s : s + 1], r)
                torch.testing.assert_close(out[s, r], want[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(conv_rows[s, r], want[1], atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(rec_rows[s, r], want[2], atol=1e-5, rtol=1e-4)


def test_conv_windows_walk_each_row_s_path_back_into_the_slot_state():
    """Kernel 4: columns 0-3 are the slot's convolution state, 4 + r row r."""
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    windows = conv_windows(parents, 4)[0].tolist()
    assert windows == [[1, 2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 6], [3, 4, 5, 7], [4, 5, 7, 8]]
