"""The deep-policy recipe: function-preserving growth, distillation loss, cost measurement, the quick run."""

import json
import shutil

import pytest
import torch

from tailspec.tasks.chain_sum import ChainSumConfig, sample_problems
from tailspec.tasks.deep import OUTPUT_PROJECTIONS, DeepRecipe, grow_depth, main, measure_shape_costs
from tailspec.tasks.sft import distillation_loss, evaluate_accuracy, load_shipped
from tailspec.testing import ARCHITECTURES, tiny_random_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_grow_depth_keeps_the_function(arch):
    model = tiny_random_model(arch, num_layers=2, initializer_range=0.05)
    grown = grow_depth(model, 6)
    assert grown.config.num_hidden_layers == 6 and len(grown.model.layers) == 6
    ids = torch.randint(2, model.config.vocab_size, (2, 17))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, grown(ids).logits)
    for i in (1, 2, 4, 5):  # the copies write nothing to the residual stream ...
        for proj in OUTPUT_PROJECTIONS:
            assert not grown.get_submodule(f"model.layers.{i}.{proj}").weight.any()
    # ... but their other weights are perturbed copies of their source, not exact clones
    q0, q1, q2 = (grown.get_submodule(f"model.layers.{i}.self_attn.q_proj").weight for i in (0, 1, 2))
    assert torch.equal(q0, model.get_submodule("model.layers.0.self_attn.q_proj").weight)
    assert not torch.equal(q1, q0) and not torch.equal(q1, q2)
    assert torch.allclose(q1, q0, atol=0.1 * q0.abs().max().item())


def test_grown_copies_learn():
    """Zero output projections still get gradients, so the new blocks start carrying signal."""
    grown = grow_depth(tiny_random_model("qwen2", num_layers=1), 3).train()
    ids = torch.randint(2, 96, (2, 9))
    grown(input_ids=ids, labels=ids).loss.backward()
    assert grown.get_submodule("model.layers.1.mlp.down_proj").weight.grad.abs().sum() > 0


def test_grow_depth_refuses_a_depth_it_cannot_reach():
    model = tiny_random_model("llama", num_layers=2)
    with pytest.raises(ValueError, match="multiple of the model's 2 layers"):
        grow_depth(model, 5)
    with pytest.raises(ValueError, match="multiple"):
        grow_depth(model, 1)


def test_distillation_loss():
    labels = torch.tensor([[-100, -100, 3, 4, -100]])
    teacher = torch.randn(1, 5, 11)
    assert distillation_loss(teacher, teacher, labels).abs() < 1e-6
    student = torch.randn(1, 5, 11)
    loss = distillation_loss(student, teacher, labels)
    assert loss > 0
    # only the positions that predict a trained label count (1 and 2 here: labels are shifted by one)
    changed = student.clone()
    changed[0, 0] += 5
    changed[0, 4] += 5
    assert torch.allclose(distillation_loss(changed, teacher, labels), loss)


def test_measure_shape_costs_is_sane():
    costs = measure_shape_costs(tiny_random_model("qwen2", num_layers=4), context=16, repeats=3)
    assert costs.one_token_ms > 0 and costs.five_tokens_ms > 0
    assert 0 < costs.layer_share < 1
    assert costs.verify5_ratio == pytest.approx(costs.five_tokens_ms / costs.one_token_ms)


def test_engine_and_hf_greedy_evaluations_agree():
    model, tokenizer = load_shipped("tiny")
    problems = sample_problems(6, seed=3, cfg=ChainSumConfig())
    hf = evaluate_accuracy(model, tokenizer, problems, max_new_tokens=40, return_completions=True)
    engine = evaluate_accuracy(model, tokenizer, problems, max_new_tokens=40, return_completions=True, backend="engine")
    assert hf["completions"] == engine["completions"]
    assert {k: v for k, v in hf.items() if v == v} == {k: v for k, v in engine.items() if v == v}  # NaN != NaN
    with pytest.raises(ValueError, match="backend"):
        evaluate_accuracy(model, tokenizer, problems, backend="vllm")


def test_recipe_validates_its_fields():
    with pytest.raises(ValueError, match="finetune_lr"):
        DeepRecipe(finetune_lr=0)
    with pytest.raises(ValueError, match="warmup_rounds"):
        DeepRecipe(warmup_rounds=0)
    with pytest.raises(ValueError, match="cost_repeats"):
        DeepRecipe(cost_repeats=0)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """A quick recipe's output folder, made once for the module (tests that write copy it first)."""
    out = tmp_path_factory.mktemp("quick")
    assert main(["--out", str(out), "--quick", "--threads", "1"]) == 0
    return out


def test_quick_recipe_writes_every_asset(quick_run):
    tmp_path = quick_run
    for kind in ("policy", "drafter"):
        config = json.loads((tmp_path / kind / "config.json").read_text())
        assert config["dtype"] == "float16"
        assert "task" in json.loads((tmp_path / kind / "eval.json").read_text())
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["num_hidden_layers"] == 8
    assert (tmp_path / "eagle3" / "model.safetensors").exists()
    assert (tmp_path / "policy" / "tokenizer.json").exists() and (tmp_path / "drafter" / "chat_template.jinja").exists()
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert set(costs) == {"deep policy", "tiny policy"}
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "tailspec train-deep" in card and "block expansion" in card


def test_stages_reuse_what_an_earlier_run_saved(quick_run, tmp_path):
    from tailspec.drafter.eagle3.checkpoint import load_checkpoint
    from tailspec.tasks.deep import run_recipe

    tmp_path = tmp_path / "run"
    shutil.copytree(quick_run, tmp_path)
    before = load_checkpoint(tmp_path / "eagle3").metadata["rounds"]
    policy_bytes = (tmp_path / "policy" / "model.safetensors").read_bytes()
    assert main(["--out", str(tmp_path), "--quick", "--threads", "1", "--stages", "head,eval", "--continue-head"]) == 0
    after = load_checkpoint(tmp_path / "eagle3").metadata["rounds"]
    assert len(after) == 2 * len(before) and [r["round"] for r in after] == list(range(len(after)))
    assert (tmp_path / "policy" / "model.safetensors").read_bytes() == policy_bytes  # not retrained
    log = json.loads((tmp_path / "recipe_log.json").read_text())
    assert [entry["stages"] for entry in log] == [["policy", "drafter", "head", "eval"], ["head", "eval"]]
    assert "--continue-head" in (tmp_path / "MODEL_CARD.md").read_text()
    with pytest.raises(ValueError, match="stages must be"):
        run_recipe(DeepRecipe(), tmp_path, "x", stages=("grow",))
    with pytest.raises(FileNotFoundError, match="run the stage"):
        run_recipe(DeepRecipe(), tmp_path / "empty", "x", stages=("eval",))


def test_shipped_deep_assets_have_the_shape_and_agree():
    """The shipped deep policy has the realistic shape (24 layers), loads as fp32 from fp16, solves
    easy problems, and its drafter LM and EAGLE-3 head are fitted to it (the drafter's greedy
    choices agree with the policy's on nearly every position of the policy's own solutions)."""
    from tailspec.tasks.sft import count_parameters, load_shipped_eagle3
    from tailspec.tasks.tokenizer import chat_ids

    policy, tokenizer = load_shipped("deep", "policy")
    drafter, _ = load_shipped("deep", "drafter")
    assert policy.config.num_hidden_layers >= 24 and next(policy.parameters()).dtype == torch.float32
    assert 5 * count_parameters(drafter) <= count_parameters(policy)
    head = load_shipped_eagle3("deep")
    head.config.check_target(policy.config)
    problems = sample_problems(12, seed=4, cfg=ChainSumConfig(max_terms=4, long_fraction=0.0))
    result = evaluate_accuracy(
        policy, tokenizer, problems, max_new_tokens=40, backend="engine", return_completions=True
    )
    assert result["accuracy"] > 0.4
    agreements = []
    for problem, completion in zip(problems[:4], result["completions"][:4]):
        prompt = chat_ids(tokenizer, [{"role": "user", "content": problem.question}], True)
        ids = torch.tensor([prompt + tokenizer.encode(completion)])
        with torch.no_grad():
            same = policy(ids).logits.argmax(-1) == drafter(ids).logits.argmax(-1)
        agreements.append(same[0, len(prompt) - 1 :].float().mean().item())  # the response positions
    assert sum(agreements) / len(agreements) > 0.9
