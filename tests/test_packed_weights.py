import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailspec import packed_weights as sw
from tailspec.tasks.sft import assets_dir


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILSPEC_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "m"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(33, 7, generator=g), "ids": torch.arange(5)}, d / sw.WEIGHTS_FILE)
    (d / "config.json").write_text('{"dtype": "float32"}')
    return d


@pytest.mark.parametrize("stride", [1, 2, 4, 3])
def test_planes_round_trip_any_length(stride):
    data = bytes(range(256)) * 3 + b"xyz"
    assert sw.from_planes(sw.to_planes(data, stride), stride, len(data)) == data


def test_pack_then_unpack_restores_the_exact_bytes_once(model_dir):
    original = (model_dir / sw.WEIGHTS_FILE).read_bytes()
    sw.pack(model_dir, stride=4)
    assert sw.is_packed(model_dir) and not (model_dir / sw.WEIGHTS_FILE).exists()
    first = sw.unpacked_dir(model_dir)
    assert first != model_dir and (first / sw.WEIGHTS_FILE).read_bytes() == original
    assert json.loads((first / "config.json").read_text()) == {"dtype": "float32"}
    stamp = (first / sw.WEIGHTS_FILE).stat().st_mtime_ns
    assert sw.unpacked_dir(model_dir) == first and (first / sw.WEIGHTS_FILE).stat().st_mtime_ns == stamp


def test_a_corrupted_pack_is_refused(model_dir):
    sw.pack(model_dir)
    meta = json.loads((model_dir / sw.PACKED_META).read_text())
    meta["sha256"] = "0" * 64
    (model_dir / sw.PACKED_META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="corrupted"):
        sw.unpacked_dir(model_dir)


def test_a_pack_of_a_pickle_is_refused_and_never_runs(model_dir, tmp_path, crafted):
    """A crafted pack carries its own matching hash: what it unpacks to must be a safetensors file."""
    from tailspec.safe_files import UnsafeFile

    crafted.torch_file(model_dir / sw.WEIGHTS_FILE)
    sw.pack(model_dir)
    with pytest.raises(UnsafeFile, match="refused: not a safetensors file"):
        sw.unpacked_dir(model_dir)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob(sw.WEIGHTS_FILE))
    assert not crafted.ran


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no index", "bad index", "wrong size"])
def test_a_damaged_pack_is_a_clear_error_and_leaves_nothing_in_the_cache(model_dir, tmp_path, damage):
    sw.pack(model_dir)
    packed, index = model_dir / sw.PACKED_FILE, model_dir / sw.PACKED_META
    if damage == "truncated":
        packed.write_bytes(packed.read_bytes()[:-40])
    elif damage == "garbage":
        packed.write_bytes(b"not xz at all")
    elif damage == "no index":
        index.unlink()
    elif damage == "bad index":
        index.write_text("{")
    else:
        meta = json.loads(index.read_text())
        index.write_text(json.dumps({**meta, "size": meta["size"] + 1}))
    with pytest.raises(ValueError) as caught:
        sw.unpacked_dir(model_dir)
    message = str(caught.value)
    assert str(model_dir) in message and "git checkout" in message
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))


def test_the_cli_says_so_in_one_line(model_dir, capsys):
    from tailspec.cli import main

    sw.pack(model_dir)
    packed = model_dir / sw.PACKED_FILE
    packed.write_bytes(packed.read_bytes()[:-40])
    assert main(["drafter", "export", "--checkpoint", str(model_dir), "--format", "sglang", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert "damaged or truncated" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_plain_directory_is_used_as_it_is(model_dir):
    assert sw.unpacked_dir(model_dir) == model_dir
    with pytest.raises(FileNotFoundError, match="neither"):
        sw.unpacked_dir(model_dir.parent)


def test_float16_storage_keeps_integer_tensors(model_dir):
    sw.to_float16(model_dir / sw.WEIGHTS_FILE)
    tensors = load_file(model_dir / sw.WEIGHTS_FILE)
    assert tensors["w"].dtype == torch.float16 and tensors["ids"].dtype == torch.int64


@pytest.mark.parametrize("name", ["tiny", "deep"])
def test_every_shipped_model_is_packed_in_16_bits(name):
    """The tracked tree stays small enough to travel to a lent GPU (issue 36): no shipped weights
    as plain safetensors, none wider than 16 bits."""
    for kind in ("policy", "drafter", "eagle3"):
        d = assets_dir(name) / kind
        assert sw.is_packed(d), f"{d} is not packed (run `tailspec pack-assets`)"
        tensors = load_file(sw.unpacked_dir(d) / sw.WEIGHTS_FILE)
        wide = [k for k, t in tensors.items() if t.is_floating_point() and t.element_size() > 2]
        assert not wide, f"{d}: {wide} stored wider than 16 bits"
