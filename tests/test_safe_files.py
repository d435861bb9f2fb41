"""Files from a user's path are read as data, never run: a crafted pickle is refused in one line
naming it, and its payload never runs (``crafted.ran`` stays false); honest files load as before."""

import pytest
import torch
from safetensors.torch import save_file

from tailspec.safe_files import (
    UnsafeFile,
    check_safetensors_bytes,
    join_optimizer_state,
    load_causal_lm,
    load_weights_only,
    split_optimizer_state,
)


def _adamw_state() -> dict:
    layer = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, betas=(0.8, 0.95))
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def _assert_same_state(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for key in a:
            _assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_state(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_the_crafted_payload_is_live(crafted, tmp_path):
    """What the refusals below guard against: an unsafe load runs the file's code."""
    crafted.torch_file(tmp_path / "opt.pt")
    torch.load(tmp_path / "opt.pt", weights_only=False)
    assert crafted.ran


def test_a_weights_only_load_reads_an_honest_optimizer_state(tmp_path):
    state = _adamw_state()
    torch.save(state, tmp_path / "opt.pt")
    _assert_same_state(state, load_weights_only(tmp_path / "opt.pt"))


def test_a_crafted_torch_file_is_refused_and_never_runs(crafted, tmp_path):
    crafted.torch_file(tmp_path / "opt.pt")
    with pytest.raises(UnsafeFile) as refused:
        load_weights_only(tmp_path / "opt.pt")
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path / "opt.pt") in message and "exec" in message
    assert not crafted.ran


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_plain_pickle_is_refused_and_never_runs(crafted, tmp_path):
    crafted.pickle_file(tmp_path / "opt.pt")
    with pytest.raises(UnsafeFile, match="opt.pt: refused"):
        load_weights_only(tmp_path / "opt.pt")
    assert not crafted.ran


def test_an_optimizer_state_round_trips_through_json_and_safetensors(tmp_path):
    state = _adamw_state()
    tree, tensors = split_optimizer_state(state)
    save_file(tensors, str(tmp_path / "opt.safetensors"))
    from safetensors.torch import load_file

    _assert_same_state(state, join_optimizer_state(tree, load_file(str(tmp_path / "opt.safetensors")), "opt"))


def test_a_joined_state_names_every_stored_tensor_exactly():
    tree, tensors = split_optimizer_state(_adamw_state())
    with pytest.raises(ValueError, match="does not name"):
        join_optimizer_state(tree, {**tensors, "extra": torch.zeros(1)}, "opt")
    with pytest.raises(ValueError, match="is not stored"):
        join_optimizer_state(tree, {}, "opt")
    with pytest.raises(ValueError, match="cannot store"):
        split_optimizer_state({"state": {0: {"x": object()}}, "param_groups": []})


def test_bytes_that_are_not_safetensors_are_refused(crafted, tmp_path):
    import pickle

    save_file({"w": torch.ones(2)}, str(tmp_path / "ok.safetensors"))
    check_safetensors_bytes((tmp_path / "ok.safetensors").read_bytes(), "ok")
    for data in (pickle.dumps(crafted.payload()), b"", b"\x08" + b"\0" * 7 + b"not json"):
        with pytest.raises(UnsafeFile, match="src: refused: not a safetensors file"):
            check_safetensors_bytes(data, "src")
    assert not crafted.ran


def test_a_model_folder_of_pickles_is_refused_and_never_runs(crafted, tmp_path):
    from transformers import LlamaConfig

    folder = tmp_path / "model"
    folder.mkdir()
    LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(folder)
    crafted.torch_file(folder / "pytorch_model.bin")
    with pytest.raises(UnsafeFile, match=r"pytorch_model\.bin \(pickles\) and no safetensors"):
        load_causal_lm(folder)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_causal_lm(folder, trust_remote_code=True)
    assert not crafted.ran


def test_a_safetensors_model_folder_loads(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    model.save_pretrained(tmp_path / "model")
    loaded = load_causal_lm(tmp_path / "model", dtype=torch.float32)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
