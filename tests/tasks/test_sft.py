import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig

from tailspec.tasks.chain_sum import ChainSumConfig, sample_problem
from tailspec.tasks.sft import (
    DRAFTER,
    POLICY,
    SFTBatches,
    SFTConfig,
    TinyModelSpec,
    build_parser,
    collate,
    count_parameters,
    encode_example,
    evaluate_accuracy,
    load_tiny,
    main,
    native_bf16,
    tiny_assets_dir,
    train_model,
)
from tailspec.tasks.tokenizer import build_tokenizer

SMALL = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
SHIPPED = (tiny_assets_dir() / "policy" / "config.json").exists() and (tiny_assets_dir() / "drafter").exists()
needs_assets = pytest.mark.skipif(not SHIPPED, reason=f"shipped tiny models absent from {tiny_assets_dir()}")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_specs_and_parameter_counts(tok):
    torch.manual_seed(0)
    policy, drafter = POLICY.build(tok), DRAFTER.build(tok)
    n_policy, n_drafter = count_parameters(policy), count_parameters(drafter)
    assert 2.5e6 < n_policy < 3.5e6
    assert 5 <= n_policy / n_drafter <= 10
    for model in (policy, drafter):
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
        assert model.config.bos_token_id is None
        assert model.generation_config.eos_token_id == tok.eos_token_id
        assert model.generation_config.pad_token_id == tok.pad_token_id


def test_encode_example_masks_only_the_prompt(tok):
    p = sample_problem(random.Random(0), num_terms=4)
    ids, prompt_len = encode_example(tok, p)
    assert tok.decode(ids[:prompt_len]) == f"<|user|>{p.question}<|assistant|>"
    assert tok.decode(ids[prompt_len:]) == p.solution + "<|eos|>"


def test_examples_and_batches_in_another_layout(tok):
    p = sample_problem(random.Random(1), num_terms=3)
    ids, prompt_len = encode_example(tok, p, "lines")
    assert tok.decode(ids[prompt_len:]) == p.solution_in("lines") + "<|eos|>"
    input_ids, _, labels = next(iter(SFTBatches(tok, SFTConfig(steps=1, batch_size=4, layout="lines"))))
    assert all("answer:" in tok.decode(row[row != -100]) for row in labels)
    with pytest.raises(ValueError, match="layout"):
        SFTConfig(layout="json")


def test_collate_pads_right_and_masks(tok):
    a, b = [5, 6, 3, 7, 1], [5, 3, 8, 9, 10, 11, 1]
    input_ids, mask, labels = collate([(a, 3), (b, 2)], tok.pad_token_id, max_len=64)
    assert input_ids.tolist() == [a + [0, 0], b]
    assert mask.tolist() == [[1] * 5 + [0, 0], [1] * 7]
    assert labels.tolist() == [[-100] * 3 + [7, 1, -100, -100], [-100] * 2 + [8, 9, 10, 11, 1]]
    truncated, _, labels_t = collate([(b, 2)], tok.pad_token_id, max_len=4)
    assert truncated.tolist() == [b[:4]] and labels_t.tolist() == [[-100, -100, 8, 9]]


def test_batches_are_bucketed_and_masked(tok):
    cfg = SFTConfig(steps=1, batch_size=8, bucket_batches=4, seed=3)
    batches = iter(SFTBatches(tok, cfg))
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    widths = []
    for _ in range(4):
        input_ids, mask, labels = next(batches)
        assert input_ids.shape[0] == 8
        widths.append(input_ids.shape[1])
        for row_ids, row_mask, row_labels in zip(input_ids, mask, labels):
            length = int(row_mask.sum())
            assert row_mask[:length].all() and not row_mask[length:].any()  # right padding
            split = (row_ids == assistant).nonzero()[0].item()
            assert (row_labels[: split + 1] == -100).all() and (row_labels[length:] == -100).all()
            assert torch.equal(row_labels[split + 1 : length], row_ids[split + 1 : length])
            assert row_ids[length - 1] == tok.eos_token_id
    assert len(set(widths)) > 1  # sorted pools give batches of different widths
    # Deterministic from the seed.
    again = iter(SFTBatches(tok, cfg))
    assert torch.equal(next(again)[0], next(iter(SFTBatches(tok, cfg)))[0])


def test_lr_schedule():
    cfg = SFTConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(1e-4)
    assert cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(99) == pytest.approx(1e-4)
    lrs = [cfg.lr_at(s) for s in range(10, 100)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(steps=0), "steps"),
        (dict(batch_size=0), "batch_size"),
        (dict(lr=0), "lr"),
        (dict(uniform_fraction=1.5), "uniform_fraction"),
        (dict(max_len=4), "max_len"),
    ],
)
def test_sft_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SFTConfig(**kwargs)


def test_loss_falls_and_model_round_trips(tok, tmp_path):
    cfg = SFTConfig(steps=30, batch_size=8, lr=1e-2, warmup_steps=3, threads=1, log_every=10)
    metrics = train_model(SMALL, cfg, tok, tmp_path / "m", progress=False)
    assert math.isfinite(metrics["final_loss"])
    assert metrics["final_loss"] < 0.8 * metrics["first_loss"]
    assert [p["step"] for p in metrics["loss_curve"]] == [10, 20, 30]
    assert metrics["parameters"] > 0 and metrics["trained_tokens"] < metrics["sequence_tokens"]
    for name in ("model.safetensors", "config.json", "generation_config.json", "sft_metrics.json"):
        assert (tmp_path / "m" / name).exists(), name
    assert json.loads((tmp_path / "m" / "sft_metrics.json").read_text())["config"]["steps"] == 30

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.eos_token_id == tok.eos_token_id and loaded.config.pad_token_id == tok.pad_token_id
    gen = GenerationConfig.from_pretrained(tmp_path / "m")
    assert gen.eos_token_id == tok.eos_token_id and gen.pad_token_id == tok.pad_token_id
    # Same seed, same run: the saved weights are reproducible.
    train_model(SMALL, cfg, tok, tmp_path / "again", progress=False)
    first, second = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_bf16_autocast_is_used_where_the_cpu_computes_bf16_natively_unless_told():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert SFTConfig().uses_bf16(cpu) == native_bf16() and SFTConfig().uses_bf16(cuda)
    assert SFTConfig(bf16=True).uses_bf16(cpu) and not SFTConfig(bf16=False).uses_bf16(cuda)
    parser = build_parser()
    assert parser.parse_args(["--bf16"]).bf16 and parser.parse_args(["--no-bf16"]).no_bf16
    with pytest.raises(SystemExit):  # one or the other
        parser.parse_args(["--bf16", "--no-bf16"])


def test_recipe_cli_quick(tmp_path):
    assert main(["--out", str(tmp_path), "--quick", "--no-progress"]) == 0
    assert (tmp_path / "MODEL_CARD.md").exists()
    for kind in ("policy", "drafter"):
        for name in ("model.safetensors", "config.json", "generation_config.json", "eval.json", "tokenizer.json"):
            assert (tmp_path / kind / name).exists(), f"{kind}/{name}"
        ev = json.loads((tmp_path / kind / "eval.json").read_text())
        assert ev["task"]["num_problems"] == 4 and 0 <= ev["task"]["accuracy"] <= 1
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "python -m tailspec.tasks.sft --out" in card and "--quick" in card
    assert "| policy | task |" in card and "| drafter | long set |" in card


@needs_assets
def test_shipped_policy_solves_easy_problems():
    model, tok = load_tiny("policy")
    assert not model.training and model.config.eos_token_id == tok.eos_token_id
    rng = random.Random(1234)
    easy = [sample_problem(rng, num_terms=rng.randint(2, 3)) for _ in range(20)]
    result = evaluate_accuracy(model, tok, easy, max_new_tokens=48)
    assert result["accuracy"] > 0.5
    assert result["num_short"] == 20 and result["num_long"] == 0 and math.isnan(result["accuracy_long"])
    drafter, _ = load_tiny("drafter")
    assert 5 * count_parameters(drafter) <= count_parameters(model)


@needs_assets
def test_batched_greedy_matches_one_at_a_time():
    model, tok = load_tiny("policy")
    rng = random.Random(7)
    problems = [sample_problem(rng, ChainSumConfig(), num_terms=n) for n in (2, 3, 6, 9)]
    batched = evaluate_accuracy(model, tok, problems, max_new_tokens=96, batch_size=4, return_completions=True)
    single = [evaluate_accuracy(model, tok, [p], max_new_tokens=96, return_completions=True) for p in problems]
    assert batched["completions"] == [s["completions"][0] for s in single]
    assert batched["accuracy"] == pytest.approx(sum(s["accuracy"] for s in single) / len(single))
    assert len(set(batched["completions"])) == len(problems)  # distinct, non-trivial responses


def test_load_tiny_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        load_tiny("critic")
