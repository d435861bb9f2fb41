"""Every subcommand answers a user's mistake with one line ``tailspec: error: ...`` and exit status
2, no traceback (``TAILSPEC_DEBUG=1`` raises it instead); a local path that does not exist is
reported as such, never handed to the hub loader."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tailspec.cli import main
from tailspec.packed_weights import unpacked_dir

ROOT = Path(__file__).resolve().parent.parent
TINY_HEAD = ROOT / "assets" / "tiny" / "eagle3"


@pytest.fixture
def files(tmp_path):
    truncated = tmp_path / "truncated_head"
    shutil.copytree(unpacked_dir(TINY_HEAD), truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    (tmp_path / "bad_key.yaml").write_text("max_stepz: 3\n")
    (tmp_path / "bad_value.yaml").write_text("max_steps: 3\nnum_generations: 1\n")
    (tmp_path / "not_yaml.yaml").write_text("max_steps: [3\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1 + 2 ="}\n{"question": "no prompt key"}\n')
    (tmp_path / "a_file").write_text("x")
    pickled = tmp_path / "pickled_model"
    pickled.mkdir()
    (pickled / "config.json").write_text('{"model_type": "llama"}')
    (pickled / "pytorch_model.bin").write_bytes(b"a pickle")
    return tmp_path


CASES = [
    # (argv with {tmp} for the fixture's folder, words the message must hold)
    (["demo", "--config", "/no/such.yaml"], "--config: no such file: /no/such.yaml"),
    (["demo", "--config", "{tmp}"], "is a directory, not a file"),
    (["demo", "--config", "{tmp}/bad_key.yaml"], "max_stepz is not a field of DemoConfig or of any config below it"),
    (["demo", "--config", "{tmp}/bad_value.yaml"], "num_generations"),
    (["demo", "--config", "{tmp}/not_yaml.yaml"], "while parsing"),
    (["demo", "--no-wandb", "--strategy", "chian:4"], "unknown strategy 'chian:4'"),
    (["demo", "--no-wandb", "--deepspeed", "/no/ds.json"], "no file at '/no/ds.json'"),
    (["bench", "--out", "/no/dir/BENCHMARKS.md", "--section", "sweep"], "the folder /no/dir"),
    (["atts", "--alpha", "1.5"], "alpha"),
    (["atts", "--out", "/no/dir/B.md"], "the folder /no/dir"),
    (["drafter", "warmup", "--policy", "/no/such/dir", "--out", "{tmp}/w"], "no such directory: /no/such/dir"),
    (["drafter", "warmup", "--policy", "./relative/dir", "--out", "{tmp}/w"], "no such directory: ./relative/dir"),
    (["drafter", "warmup", "--policy", "{tmp}/a_file", "--out", "{tmp}/w"], "is a file"),
    (["drafter", "warmup", "--policy", "{tmp}/pickled_model", "--out", "{tmp}/w"], "pytorch_model.bin (pickles)"),
    (["drafter", "warmup", "--policy", "tiny", "--tokenizer", "/no/tok", "--out", "{tmp}/w"], "--tokenizer: no such"),
    (["drafter", "warmup", "--prompts", "/no/p.jsonl", "--out", "{tmp}/w"], "no such file: /no/p.jsonl"),
    (["drafter", "warmup", "--prompts", "{tmp}/prompts.jsonl", "--out", "/no/dir/w"], "the folder /no/dir"),
    (["drafter", "warmup", "--prompts", "{tmp}/prompts.jsonl", "--out", "{tmp}/w"], "line 2 of"),
    (["drafter", "export", "--checkpoint", "/no/such", "--format", "sglang", "--out", "{tmp}/o"], "does not exist"),
    (["drafter", "export", "--checkpoint", "{tmp}/truncated_head", "--format", "vllm", "--out", "{tmp}/o"], "corrupt"),
    (["drafter", "export", "--checkpoint", "{tmp}", "--format", "vllm", "--out", "{tmp}/o"], "config.json"),
    (["train-deep", "--threads", "0", "--stages", "eval"], "threads must be >= 1"),
    (["train-deep", "--out", "/no/such", "--stages", "head", "--continue-head"], "/no/such/policy is missing"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_a_mistake_is_one_line_and_status_2(argv, message, files, capsys, monkeypatch):
    monkeypatch.delenv("TAILSPEC_DEBUG", raising=False)
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tailspec: error: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["demo", "--workers", "-1"], "argument --workers: must be an integer >= 0, got -1"),
        (["bench", "--threads", "two"], "argument --threads: must be an integer >= 1, got 'two'"),
        (["atts", "--samples", "0"], "argument --samples"),
        (["drafter", "warmup", "--rounds", "0", "--out", "x"], "argument --rounds"),
    ],
)
def test_bad_numbers_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("TAILSPEC_DEBUG", "1")
    with pytest.raises(ValueError, match="does not exist"):
        main(["drafter", "export", "--checkpoint", "/no/such", "--format", "sglang", "--out", "/tmp/x"])


def test_the_installed_command_exits_2_without_a_traceback():
    run = subprocess.run(
        [str(Path(sys.executable).parent / "tailspec"), "demo", "--config", "/no/such.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2
    assert run.stderr.strip() == "tailspec: error: --config: no such file: /no/such.yaml"


@pytest.mark.parametrize(
    "argv,what",
    [
        (["demo", "--no-wandb"], "`tailspec demo`"),
        (["bench", "--quick"], "`tailspec bench`"),
        (["train-deep"], "`tailspec train-deep`"),
        (["drafter", "warmup", "--policy", "deep", "--out", "{tmp}/head"], "--policy deep"),
        (["drafter", "warmup", "--policy", "{tmp}", "--out", "{tmp}/head"], None),  # a user's model: no checkout
    ],
)
def test_what_needs_the_checkout_says_so_where_the_wheel_is_installed(argv, what, tmp_path, monkeypatch, capsys):
    """The wheel leaves the task, the shipped models and the benchmark harness in the checkout
    (tests/test_wheel.py): installed from it, the commands that need them answer in one line."""
    import importlib.util

    find_spec = importlib.util.find_spec
    left_out = ("tailspec.tasks", "tailspec.benchmarks")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in left_out else find_spec(name, *a))
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    if what is None:
        assert "runs from a checkout" not in err and err.startswith("tailspec: error:")  # its own error: no config.json
    else:
        assert err.startswith(f"tailspec: error: {what} runs from a checkout of the tailspec repository"), err


def test_a_crafted_config_is_refused_and_never_runs(tmp_path, crafted, capsys, monkeypatch):
    """Configs are read with ``yaml.safe_load``: a Python tag is a one-line error, and its code never
    runs (read unsafely, the same file would run it: the last lines show the file is live)."""
    import yaml

    from tailspec.config_tree import parse_assignments

    monkeypatch.delenv("TAILSPEC_DEBUG", raising=False)
    payload = f"!!python/object/apply:builtins.exec [\"open({str(crafted.marker)!r}, 'w').write('ran')\"]"
    config = tmp_path / "crafted.yaml"
    config.write_text(f"max_steps: {payload}\n")
    assert main(["demo", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tailspec: error: ") and "python/object/apply" in err[-1], err
    assert parse_assignments([f"max_steps={payload}"]) == {"max_steps": payload}  # kept as text
    assert not crafted.ran
    yaml.unsafe_load(config.read_text())
    assert crafted.ran
