import pytest
import torch

from tailspec.tasks.chain_sum import sample_problems
from tailspec.tasks.sft import (
    BatchSampler,
    SFTConfig,
    TinyModelSpec,
    evaluate_accuracy,
    load_tiny,
    main,
    tiny_assets_dir,
    train_model,
)
from tailspec.tasks.tokenizer import build_tokenizer

SMALL = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def test_batches_mask_the_prompt_and_respect_the_budget():
    tok = build_tokenizer()
    cfg = SFTConfig(steps=1, tokens_per_batch=1024)
    ids, mask, labels = BatchSampler(tok, cfg).batch()
    assert ids.numel() <= 1024 or ids.shape[0] == 1
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    for row_ids, row_labels in zip(ids, labels):
        split = (row_ids == assistant).nonzero()[0].item()
        assert (row_labels[: split + 1] == -100).all()  # prompt and the assistant tag are not trained on
        assert (
            row_labels[split + 1 :][row_labels[split + 1 :] != -100]
            == row_ids[split + 1 :][row_labels[split + 1 :] != -100]
        ).all()


def test_loss_falls_and_model_round_trips(tmp_path):
    tok = build_tokenizer()
    cfg = SFTConfig(steps=40, tokens_per_batch=1024, lr=1e-2, warmup_steps=2, threads=1)
    model, metrics = train_model(SMALL, cfg, tok, tmp_path / "m", progress=False)
    assert metrics["final_loss"] < metrics["first_loss"] * 0.8
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.tensor([[2, 10, 11]])
    assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)
    assert (tmp_path / "m" / "model.safetensors").exists()


def test_recipe_cli_quick(tmp_path):
    assert main(["--out", str(tmp_path), "--quick"]) == 0
    for name in ("tokenizer/tokenizer.json", "policy/model.safetensors", "drafter/model.safetensors", "MODEL_CARD.md"):
        assert (tmp_path / name).exists(), name


@pytest.mark.skipif(not (tiny_assets_dir() / "policy" / "config.json").exists(), reason="shipped tiny assets absent")
def test_shipped_policy_solves_easy_problems():
    model, tok = load_tiny("policy")
    easy = [p for p in sample_problems(400, seed=99) if len(p.terms) <= 3][:20]
    result = evaluate_accuracy(model, tok, easy, max_new_tokens=64)
    assert result["accuracy"] >= 0.6
    drafter, _ = load_tiny("drafter")
    assert sum(p.numel() for p in drafter.parameters()) * 5 <= sum(p.numel() for p in model.parameters())
