from pathlib import Path

import pytest
import yaml

from tailspec.cli import build_parser
from tailspec.demo import DemoConfig
from tailspec.rollout.params import RolloutConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_cli_has_subcommands():
    parser = build_parser()
    assert parser.parse_args(["demo", "--steps", "3", "--no-wandb"]).steps == 3
    assert parser.parse_args(["demo", "--seed", "5"]).seed == 5
    assert parser.parse_args(["bench", "--quick"]).quick
    bench = parser.parse_args(["bench", "--section", "sweep", "--policy", "tiny", "--threads", "2"])
    assert (bench.section, bench.policy, bench.threads) == ("sweep", "tiny", 2)
    assert parser.parse_args(["bench"]).policy == "deep"
    assert parser.parse_args(["atts", "--policy", "deep"]).policy == "deep"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--policy", "huge"])
    with pytest.raises(SystemExit):
        parser.parse_args(["no-such-command"])


def test_demo_yaml_loads_and_validates(tmp_path):
    cfg = DemoConfig.from_yaml(CONFIGS / "demo_cpu.yaml")
    assert cfg.max_steps >= 1 and cfg.num_generations >= 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 3\nnot_a_field: 1\n")
    with pytest.raises(ValueError, match="not_a_field"):
        DemoConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="num_generations"):
        DemoConfig(num_generations=1)
    with pytest.raises(ValueError, match="rollout.engine.strategy is not valid"):
        DemoConfig().with_overrides(strategy="chain:0")
    with pytest.raises(ValueError, match="device"):
        DemoConfig(device="tpu")
    assert build_parser().parse_args(["demo", "--strategy", "suffix"]).strategy == "suffix"


def test_the_plain_twin_of_a_self_drafting_demo_trains_no_exit_adapter():
    """The twin decodes plainly: the main run's exit adapter is not the twin's to train (it has no
    drafter, and an adapter without one is an error)."""
    from tailspec.demo import _plain_twin

    cfg = DemoConfig(policy="tiny", drafter="self:2", baseline=True).with_overrides(
        **{"rollout.training.self_adapter_rank": 4, "rollout.workers.num_workers": 0}
    )
    twin = _plain_twin(cfg)
    assert twin.config.engine.strategy == "none" and twin.config.training.self_adapter_rank is None


def test_rollout_yaml_is_a_valid_rollout_config():
    data = yaml.safe_load((CONFIGS / "rollout_default.yaml").read_text())
    cfg = RolloutConfig.from_dict(data)
    assert cfg.total_blocks == data["kv_cache_tokens"] // data["block_size"]


def test_drafter_warmup_then_export_from_the_command_line(tmp_path, capsys):
    from tailspec.cli import main
    from tailspec.drafter.eagle3.checkpoint import load_checkpoint, read_exported

    ckpt = tmp_path / "head"
    argv = ["drafter", "warmup", "--num-prompts", "6", "--rounds", "2", "--steps", "2", "--max-new-tokens", "24"]
    assert main([*argv, "--batch-size", "2", "--out", str(ckpt)]) == 0
    loaded = load_checkpoint(ckpt)
    assert loaded.step == 4 and loaded.optimizer_state is not None
    assert loaded.metadata["policy"] == "tiny"
    for fmt in ("sglang", "vllm"):
        assert (
            main(["drafter", "export", "--checkpoint", str(ckpt), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
        )
        config, _ = read_exported(tmp_path / fmt)
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "round 1:" in capsys.readouterr().out


def test_demo_tells_the_whole_story(tmp_path, capsys):
    """The demo's whole path: warm-up of the shipped head, TRL GRPO with speculative rollouts and its
    plain-decoding twin at every step (the same completions, same-step ratios), the head trained
    online, the export."""
    from tailspec.demo import run_demo

    cfg = DemoConfig().with_overrides(
        max_steps=2,
        num_generations=2,
        prompts_per_step=2,
        max_completion_length=32,
        num_train_prompts=16,
        wandb=False,
        output_dir=str(tmp_path),
        strategy="chain:3",
        warmup_steps=3,
        warmup_prompts=4,
        baseline=True,
        position_noise=True,
        export="sglang",
    )
    summary = run_demo(cfg)
    captured = capsys.readouterr()
    printed = captured.out
    for stream in (captured.out, captured.err):  # not a terminal: no bar redraws, no per-step warnings
        assert "\r" not in stream and "is deprecated" not in stream
    assert "drafter warm-up: 4 rollouts" in printed
    assert "per step: chain:3 (eagle3) vs no speculation" in printed
    assert "accept  drafter  strategies" in printed and "chain:3 100%" in printed  # per step: accept length, mix
    assert "reward, mean of the first vs last 1 steps:" in printed
    assert "plain decoding emitted the same completions at 2 of 2 steps" in printed
    assert summary["same_completions_steps"] == "2 of 2" and summary["run_speedup"] > 0
    assert summary["steps"] == 2 and summary["rollout_tokens"] > 0
    assert 0.0 < summary["draft_acceptance_rate"] <= 1.0
    assert 0.0 <= summary["groups_with_signal"] <= 1.0  # the share of groups whose rewards differ
    assert "{'loss'" not in printed  # TRL's raw per-step dicts stay out of the story (wandb keeps them)
    online = cfg.rollout.training.drafter_train_steps
    assert summary["drafter_version"] == 1600 + 3 + 2 * online  # shipped, warm-up, online
    assert summary["baseline_rollout_time_s"] > 0 and summary["rollout_throughput_vs_none"] > 0
    exported = tmp_path / "drafter_sglang"
    assert summary["exported_drafter"] == str(exported)
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()
    assert "exported drafter" in printed


def test_the_default_demo_config_is_the_story():
    from tailspec.tasks.chain_sum import ChainSumProblem

    cfg = DemoConfig.from_yaml(CONFIGS / "demo_cpu.yaml")
    assert cfg.num_workers == 2 and cfg.warmup_steps > 0 and cfg.baseline and cfg.export == "sglang"
    assert cfg.policy == "deep"  # the shape where speculation pays; the tiny policy is for tests
    assert cfg.strategy == "adaptive" and cfg.drafter in ("small_lm", "eagle3")  # issue 39: the product's path
    # a fixed set: short problems with room to learn, and one long problem for the rollout's tail
    terms = sorted(len(ChainSumProblem.from_question(q).terms) for q in cfg.problems)
    assert terms[0] <= 4 and terms[-1] >= 20


def test_a_fixed_problem_set_is_every_step_in_order():
    from tailspec.demo import train_dataset

    problems = ["add 7 7 8", "add 1 2", "add 3 9 8 2 5"]
    cfg = DemoConfig(max_steps=3, prompts_per_step=3, problems=problems)
    data = train_dataset(cfg)
    assert [row["prompt"][0]["content"] for row in data] == problems * 3
    assert data[0]["answer"] == 22 and data[2]["answer"] == 27
    with pytest.raises(ValueError, match=r"prompts_per_step must be a divisor of the number of problems \(3\)"):
        DemoConfig(prompts_per_step=2, problems=problems)
    # a set of more than a step's prompts: a step's worth at a time, in order, as long as the steps take
    blocks = DemoConfig(max_steps=3, prompts_per_step=1, problems=problems[:2])
    assert [row["prompt"][0]["content"] for row in train_dataset(blocks)] == problems[:2] * 2
    with pytest.raises(ValueError, match="problems holds 'add 12 3': a chain-sum question"):
        DemoConfig(prompts_per_step=1, problems=["add 12 3"])
    with pytest.raises(ValueError, match="problems must be null or a non-empty list"):
        DemoConfig(problems=[])
    with pytest.raises(ValueError, match="export"):
        DemoConfig(export="onnx")
    with pytest.raises(ValueError, match="policy must be one of"):
        DemoConfig(policy="huge")
    with pytest.raises(ValueError, match="deepspeed"):
        DemoConfig(deepspeed="zero4")


def test_drafters_compared_beside_the_main_one_are_checked():
    cfg = DemoConfig(drafter="small_lm", baseline=True, compare_drafters=["eagle3", "self:4"])
    assert cfg.compare_drafters == ["eagle3", "self:4"]
    with pytest.raises(ValueError, match="rollout.workers.num_workers must be 0 when compare_drafters is set"):
        cfg.with_overrides(workers=2, drafter_train_steps=0)
    with pytest.raises(ValueError, match="baseline must be true when compare_drafters is set"):
        DemoConfig(compare_drafters=["small_lm"])
    with pytest.raises(ValueError, match="compare_drafters must be drafters other than each other"):
        DemoConfig(drafter="eagle3", baseline=True, compare_drafters=["eagle3"])
    with pytest.raises(ValueError, match="compare_drafters must be 'eagle3', 'small_lm' or 'self:L', got 'tree'"):
        DemoConfig(baseline=True, compare_drafters=["tree"])
    with pytest.raises(ValueError, match="compare_drafters must be a list"):
        DemoConfig(baseline=True, compare_drafters="eagle3")


def test_the_adapter_rank_belongs_to_the_self_drafter_among_those_compared():
    from tailspec.demo import _for_drafter

    cfg = DemoConfig(drafter="small_lm", baseline=True, compare_drafters=["self:4"]).with_overrides(self_adapter_rank=8)
    assert _for_drafter(cfg, "self:4").rollout.training.self_adapter_rank == 8
    assert _for_drafter(cfg, "small_lm").rollout.training.self_adapter_rank is None
    alone = DemoConfig(drafter="small_lm").with_overrides(self_adapter_rank=8)  # the user's mistake stays theirs
    assert _for_drafter(alone, "small_lm").rollout.training.self_adapter_rank == 8


def test_the_demo_problems_leave_the_shipped_policy_room_to_learn():
    """GRPO learns only from groups whose rewards differ: the demo's short problems must be ones the
    shipped policy sometimes, but not mostly, gets right at T = 1 (seeded, so deterministic)."""
    from tailspec import RolloutConfig, RolloutEngine, SamplingParams
    from tailspec.tasks.chain_sum import ChainSumProblem, chain_sum_reward
    from tailspec.tasks.sft import load_shipped
    from tailspec.tasks.tokenizer import chat_ids

    cfg = DemoConfig.from_yaml(CONFIGS / "demo_cpu.yaml")
    model, tokenizer = load_shipped(cfg.policy, "policy")
    engine = RolloutEngine(model, RolloutConfig(), eos_token_ids=[tokenizer.eos_token_id])
    problems = [ChainSumProblem.from_question(q) for q in cfg.problems]
    short = [p for p in problems if len(p.terms) <= 4]
    n = 48
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p.question}], True) for p in short for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=64, seed=i) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    for k, problem in enumerate(short):
        texts = [tokenizer.decode(o.completion_ids, skip_special_tokens=True) for o in outputs[k * n : (k + 1) * n]]
        solved = sum(chain_sum_reward(texts, [problem.answer] * n)) / n
        assert 0.0 < solved < 0.5, (problem.question, solved)
