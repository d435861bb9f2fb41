from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trainer_stand_in import greedy_trainer, grpo_args

from tailspec.rollout.params import SamplingParams
from tailspec.trainer_hooks import SpecRollout, sampling_params_from_trl


def test_sampling_params_follow_grpo_config():
    sp = sampling_params_from_trl(grpo_args(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05))
    assert sp == SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_new_tokens=32)
    assert sampling_params_from_trl(grpo_args()).min_p == 0.0  # GRPOConfig.min_p=None means off


def test_generation_kwargs_override_and_greedy():
    sp = sampling_params_from_trl(
        grpo_args(generation_kwargs={"do_sample": False, "max_tokens": 7, "stop_token_ids": [5]})
    )
    assert sp.greedy and sp.max_new_tokens == 7 and sp.stop_token_ids == (5,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(repetition_penalty=1.1), "repetition_penalty"),
        (dict(generation_kwargs={"num_beams": 4}), "num_beams"),
        (dict(generation_kwargs={"repetition_penalty": 1.3}), "repetition_penalty"),
        (dict(temperature=-1.0), "temperature"),
    ],
)
def test_unsupported_sampling_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling_params_from_trl(grpo_args(**kwargs))


def test_tokenize_prompts_matches_chat_template(task_tokenizer):
    convs = [[{"role": "user", "content": "add 1 2"}], [{"role": "user", "content": "add 3 4 5"}]]
    ids = SpecRollout.tokenize_prompts(convs, task_tokenizer)
    for conv, row in zip(convs, ids):
        expected = task_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert row == list(expected["input_ids"])
    plain = SpecRollout.tokenize_prompts(["add 1 2"], task_tokenizer)
    assert plain == [task_tokenizer("add 1 2")["input_ids"]]


@pytest.mark.parametrize("prompts", [[], ["add 1", [{"role": "user", "content": "x"}]]])
def test_tokenize_prompts_rejects_bad_input(task_tokenizer, prompts):
    with pytest.raises(ValueError):
        SpecRollout.tokenize_prompts(prompts, task_tokenizer)


def test_rollout_contract_with_repeated_prompts(task_tokenizer, tiny_policy):
    """One row per prompt, in order, repeated prompts forked, greedy rows equal HF generate."""
    convs = [[{"role": "user", "content": f"add {i} {i + 1}"}] for i in range(3)]
    prompts = [c for c in convs for _ in range(4)]  # TRL repeats each prompt num_generations times
    trainer = SimpleNamespace(
        args=grpo_args(max_completion_length=10, generation_kwargs={"do_sample": False}),
        processing_class=task_tokenizer,
        model=tiny_policy,
    )
    rollout = SpecRollout(model=tiny_policy)
    out = rollout(prompts, trainer)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"}
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == len(prompts)
    expected_prompts = SpecRollout.tokenize_prompts(prompts, task_tokenizer)
    assert out["prompt_ids"] == expected_prompts
    assert rollout.engine.stats.forked_prefills == 9
    eos = task_tokenizer.eos_token_id
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        assert len(c) == len(lp) >= 1
        assert eos not in c[:-1]
        ref = tiny_policy.generate(
            torch.tensor([p]),
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=eos,
            pad_token_id=task_tokenizer.pad_token_id,
        )[0, len(p) :].tolist()
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        assert c == ref
    assert rollout.last_stats.num_prompts == len(prompts)


@pytest.mark.parametrize("strategy", ["chain:3", "tree:3,2,6", "suffix"])
def test_speculative_rollout_matches_plain_and_logs_acceptance(task_tokenizer, tiny_policy, strategy):
    from tailspec.testing import perturbed_copy

    convs = [[{"role": "user", "content": f"add {i} {i + 2} {i + 1}"}] for i in range(3)]
    prompts = [c for c in convs for _ in range(3)]
    trainer, metrics = greedy_trainer(task_tokenizer, tiny_policy)
    plain = SpecRollout(model=tiny_policy)(prompts, trainer)
    drafter = perturbed_copy(tiny_policy, noise=0.2, seed=1) if strategy != "suffix" else None
    rollout = SpecRollout(model=tiny_policy, strategy=strategy, drafter=drafter)
    out = rollout(prompts, trainer)
    assert out["completion_ids"] == plain["completion_ids"]
    for a, b in zip(out["logprobs"], plain["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    stats = rollout.last_stats
    assert stats.strategy == strategy if strategy != "suffix" else stats.strategy.startswith("suffix")
    assert stats.drafted_tokens > 0 and stats.mean_accept_length >= 1.0
    assert metrics["eval"]["rollout/accept_length"] == [stats.mean_accept_length]


def test_model_strategy_without_a_drafter_is_refused():
    with pytest.raises(ValueError, match="needs a drafter model"):
        SpecRollout(strategy="chain:4")
    with pytest.raises(ValueError, match="strategy"):
        SpecRollout(strategy="chain")


def test_eagle3_head_drafts_and_trains_online_between_rollouts(task_tokenizer, tiny_policy):
    """SpecRollout(drafter=head, drafter_train_steps=N): rollouts stay lossless, record features,
    and the head takes N training steps (version, loss metrics) after every call."""
    import torch

    from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
    from tailspec.drafter.eagle3.train import DrafterTrainingConfig

    convs = [[{"role": "user", "content": f"add {i} {i + 2} {i + 1}"}] for i in range(3)]
    prompts = [c for c in convs for _ in range(2)]
    trainer, metrics = greedy_trainer(task_tokenizer, tiny_policy)
    plain = SpecRollout(model=tiny_policy)(prompts, trainer)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(tiny_policy.config))
    rollout = SpecRollout(
        model=tiny_policy,
        strategy="chain:3",
        drafter=head,
        drafter_train_steps=3,
        drafter_training=DrafterTrainingConfig(batch_size=2),
    )
    for call in range(2):
        out = rollout(prompts, trainer)
        assert out["completion_ids"] == plain["completion_ids"]
        assert rollout.last_stats.drafter_version == 3 * (call + 1)
    assert len(rollout.online.buffer) == 2 * len(prompts)
    assert len(metrics["eval"]["drafter/loss"]) == 2
    with pytest.raises(ValueError, match="EAGLE-3 head .*, a drafter LM .* or drafter=.self:L."):
        SpecRollout(strategy="suffix", drafter_train_steps=2)


def test_streaming_heads_train_online_between_rollouts_and_resume(task_tokenizer, tiny_policy):
    """SpecRollout(drafter=SmallLMDrafter(lm, streaming_heads=...), drafter_train_steps=N): rollouts
    stay lossless while a copy of the heads takes N steps on the recent completions after every call
    and ships past the held-out gate; a checkpoint's state carries the heads and their optimizer
    into a new rollout."""
    from tailspec.drafter.small_lm import SmallLMDrafter
    from tailspec.drafter.streaming import StreamingHeads
    from tailspec.testing import perturbed_copy

    convs = [[{"role": "user", "content": f"add {i} {i + 2} {i + 1}"}] for i in range(3)]
    prompts = [c for c in convs for _ in range(2)]
    trainer, metrics = greedy_trainer(task_tokenizer, tiny_policy)
    plain = SpecRollout(model=tiny_policy)(prompts, trainer)
    lm = perturbed_copy(tiny_policy, noise=0.05, seed=3)

    def rollout_with_heads() -> tuple[SpecRollout, StreamingHeads]:
        heads = StreamingHeads(lm.config.hidden_size, 1)
        drafter = SmallLMDrafter(lm, streaming_heads=heads)
        rollout = SpecRollout(model=tiny_policy, strategy="chain:3", drafter=drafter, drafter_train_steps=3)
        rollout.online.min_gain = -10.0  # every trained copy ships: the drafting heads follow training
        return rollout, heads

    rollout, heads = rollout_with_heads()
    for call in range(2):
        assert rollout(prompts, trainer)["completion_ids"] == plain["completion_ids"]
        assert rollout.last_stats.drafter_version == heads.version == 3 * (call + 1)
    assert heads.blocks[0].weight.abs().sum() > 0  # zero-initialised, trained since
    assert len(metrics["eval"]["drafter/loss"]) == 2
    state = rollout.state_dict()

    resumed, fresh = rollout_with_heads()
    resumed.load_state_dict(state)
    torch.testing.assert_close(fresh.blocks[0].weight, heads.blocks[0].weight)
    assert resumed(prompts, trainer)["completion_ids"] == plain["completion_ids"]
    assert resumed.online.trainer.step_count == 6 + 3 and fresh.version == 6 + 3
    assert resumed.online.trainer.optimizer.state_dict()["state"][0]["step"] == 6 + 3  # Adam moments carried over


def test_a_bare_drafter_lm_is_distilled_online_behind_the_held_out_gate_and_resumes(task_tokenizer, tiny_policy):
    """SpecRollout(drafter=lm, drafter_train_steps=N): the drafter LM's own weights train N steps
    on the completions after every call (a copy; it replaces the drafting LM only past the held-out
    gate), rollouts stay lossless, and a checkpoint carries the drafting LM and the optimizer."""
    from tailspec.drafter.lm_trainer import DraftLMTrainingConfig, versioned_lm
    from tailspec.testing import perturbed_copy

    convs = [[{"role": "user", "content": f"add {i} {i + 2} {i + 1}"}] for i in range(4)]
    prompts = [c for c in convs for _ in range(2)]
    trainer, metrics = greedy_trainer(task_tokenizer, tiny_policy)
    plain = SpecRollout(model=tiny_policy)(prompts, trainer)
    lm = perturbed_copy(tiny_policy, noise=0.3, seed=3)
    training = DraftLMTrainingConfig(learning_rate=1e-3, batch_size=4)
    rollout = SpecRollout(
        model=tiny_policy, strategy="chain:3", drafter=lm, drafter_train_steps=3, drafter_training=training
    )
    rollout.online.min_gain = -10.0  # every trained copy ships: the drafting LM follows training
    for call in range(2):
        assert rollout(prompts, trainer)["completion_ids"] == plain["completion_ids"]
        assert rollout.last_stats.drafter_version == versioned_lm(lm).version == 3 * (call + 1)
    assert rollout.online.shipped == 2 and rollout.online.last_held_out is not None
    assert len(metrics["eval"]["drafter/loss"]) == 2
    state = rollout.state_dict()
    assert state["drafter"].version == 6 and state["drafter"].step == 6

    fresh = perturbed_copy(tiny_policy, noise=0.3, seed=4)
    resumed = SpecRollout(model=tiny_policy, strategy="chain:3", drafter=fresh, drafter_train_steps=3)
    resumed.load_state_dict(state)
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in fresh.state_dict().items())
    assert resumed(prompts, trainer)["completion_ids"] == plain["completion_ids"]
    assert resumed.online.trainer.step_count == 6 + 3
    with pytest.raises(ValueError, match="training.holdout_every must be 0 or an int >= 2, got 1"):
        SpecRollout(drafter=lm, drafter_train_steps=3, holdout_every=1)
    with pytest.raises(ValueError, match="ship_min_gain must be a float >= 0"):
        SpecRollout(drafter=lm, drafter_train_steps=3, ship_min_gain=-1.0)


def test_online_drafters_draft_on_the_engine_s_bf16_copy(task_tokenizer, tiny_policy):
    """With dtype="bfloat16", a drafter online training builds (here self:L with its exit adapter)
    is made for the engine's bf16 copy: it drafts with the copy's layers, its fp32 adapter trains
    towards the copy's distributions, and the completions are the bf16 copy's plain decoding."""
    import torch

    convs = [[{"role": "user", "content": f"add {i} {i + 2}"}] for i in range(3)]
    trainer, _ = greedy_trainer(task_tokenizer, tiny_policy)
    plain = SpecRollout(model=tiny_policy, dtype="bfloat16")(convs, trainer)
    rollout = SpecRollout(
        model=tiny_policy,
        dtype="bfloat16",
        strategy="chain:3",
        drafter="self:1",
        self_adapter_rank=4,
        drafter_train_steps=2,
    )
    for _ in range(2):
        assert rollout(convs, trainer)["completion_ids"] == plain["completion_ids"]
    engine = rollout.engine
    assert engine.stats.drafted_tokens > 0 and rollout.online.adapter.version == 4
    drafter_layer = next(engine.drafter.model.parameters())
    assert drafter_layer.dtype == torch.bfloat16 and any(drafter_layer is p for p in engine.model.parameters())
    assert rollout.online.adapter.down.weight.dtype == torch.float32


def test_the_self_speculative_exit_adapter_trains_online_and_resumes(task_tokenizer, tiny_policy):
    """SpecRollout(drafter="self:L", self_adapter_rank=R, drafter_train_steps=N): the policy's own
    first L layers draft through an exit adapter that trains N steps towards the policy's next-token
    distributions after every call (a copy, shipped past the held-out gate), losslessly; a
    checkpoint carries it and its optimizer."""
    convs = [[{"role": "user", "content": f"add {i} {i + 1} {i + 3}"}] for i in range(3)]
    prompts = [c for c in convs for _ in range(2)]
    trainer, metrics = greedy_trainer(task_tokenizer, tiny_policy)
    plain = SpecRollout(model=tiny_policy)(prompts, trainer)

    def self_rollout() -> SpecRollout:
        rollout = SpecRollout(
            model=tiny_policy, strategy="chain:3", drafter="self:1", self_adapter_rank=8, drafter_train_steps=4
        )
        rollout.online.min_gain = -10.0  # every trained copy ships: the drafting adapter follows training
        return rollout

    rollout = self_rollout()
    losses = []
    for call in range(3):
        assert rollout(prompts, trainer)["completion_ids"] == plain["completion_ids"]
        assert rollout.last_stats.drafter_version == rollout.online.adapter.version == 4 * (call + 1)
        losses.append(rollout.last_stats.drafter_loss)
    assert losses[-1] < losses[0]  # the early exit moves towards the full model's distribution
    assert rollout.online.adapter.up.weight.abs().sum() > 0
    state = rollout.state_dict()

    resumed = self_rollout()
    resumed.load_state_dict(state)
    assert resumed(prompts, trainer)["completion_ids"] == plain["completion_ids"]
    assert resumed.online.trainer.step_count == 12 + 4 and resumed.online.adapter.version == 12 + 4
    with pytest.raises(ValueError, match="self_adapter_rank is for drafter='self:L'"):
        SpecRollout(strategy="suffix", self_adapter_rank=8)
    with pytest.raises(ValueError, match="self_adapter_rank must be None or an int >= 1"):
        SpecRollout(strategy="chain:2", drafter="self:1", self_adapter_rank=0)


@pytest.mark.solo  # whether it tries its chains follows measured step times
def test_adaptive_rollout_is_lossless_and_reports_its_strategy_mix(task_tokenizer, tiny_policy):
    convs = [[{"role": "user", "content": f"add {i} {i + 3}"}] for i in range(4)]
    prompts = [c for c in convs for _ in range(2)]
    trainer, metrics = greedy_trainer(task_tokenizer, tiny_policy)
    plain = SpecRollout(model=tiny_policy)(prompts, trainer)
    rollout = SpecRollout(
        model=tiny_policy,
        strategy="adaptive",
        # the policy's first layer drafts, priced from calibration at a fraction of a plain step: with
        # strong optimism it tries its chains beside plain steps however noisy the timings (a drafter
        # of the policy's size was priced about even with plain steps and, on a loaded machine, never tried)
        drafter="self:1",
        selector={"optimism": 4.0, "arms": ("none", "chain:2", "chain:4")},
    )
    out = rollout(prompts, trainer)
    assert out["completion_ids"] == plain["completion_ids"]
    stats = rollout.last_stats
    assert stats.strategy == "adaptive" and len(stats.strategy_steps) >= 2
    assert metrics["eval"]["rollout/speculative_step_fraction"] and metrics["eval"]["rollout/tail_s"]
    assert stats.calibration_time_s > 0 and metrics["eval"]["rollout/calibration_s"]  # its first rollout calibrated
    prefix = "rollout/strategy_fraction/"
    mix = {k[len(prefix) :]: v for k, v in metrics["eval"].items() if k.startswith(prefix)}
    ran = {k: v[-1] for k, v in mix.items() if k in stats.strategy_steps}  # (the plain rollout logged `none`)
    assert set(ran) == set(stats.strategy_steps) and sum(ran.values()) == pytest.approx(1.0)


def test_position_noise_makes_sampled_rollouts_independent_of_the_strategy(task_tokenizer, tiny_policy):
    """With position-keyed sampling each request gets its own derived seed: a GRPO group's samples
    differ, a speculative rollout emits the plain one's completions (same digest), and the next
    step draws new ones."""
    from tailspec.testing import perturbed_copy

    convs = [[{"role": "user", "content": f"add {i} {i + 3} {i + 1}"}] for i in range(2)]
    prompts = [c for c in convs for _ in range(4)]
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer = SimpleNamespace(
        args=grpo_args(max_completion_length=24, seed=5),
        processing_class=task_tokenizer,
        model=tiny_policy,
        _metrics=metrics,
        state=SimpleNamespace(global_step=3),
    )
    plain = SpecRollout(model=tiny_policy, position_noise=True)
    spec = SpecRollout(
        model=tiny_policy,
        strategy="chain:3",
        drafter=perturbed_copy(tiny_policy, noise=0.2, seed=1),
        position_noise=True,
    )
    want, got = plain(prompts, trainer), spec(prompts, trainer)
    assert got["completion_ids"] == want["completion_ids"]
    assert spec.last_stats.completions_digest == plain.last_stats.completions_digest
    assert spec.last_stats.drafted_tokens > 0
    assert len({tuple(c) for c in want["completion_ids"][:4]}) > 1  # a group's samples are not copies
    trainer.state.global_step = 4
    assert plain(prompts, trainer)["completion_ids"] != want["completion_ids"]
    assert plain.last_stats.completions_digest != spec.last_stats.completions_digest


def test_catch_up_raises_the_online_heads_learning_rate_after_a_fall(task_tokenizer, tiny_policy):
    """A rollout far under the catch-up reference (here one carried over from a run whose drafts
    were far better) makes the next online training run at lr_scale x its rate; the state goes
    into the rollout's checkpoint state."""
    import torch

    from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
    from tailspec.drafter.eagle3.train import DrafterTrainingConfig

    convs = [[{"role": "user", "content": f"add {i} {i + 2} {i + 1}"}] for i in range(2)]
    trainer, _ = greedy_trainer(task_tokenizer, tiny_policy)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(tiny_policy.config))
    rollout = SpecRollout(
        model=tiny_policy,
        strategy="chain:3",
        drafter=head,
        drafter_train_steps=1,
        drafter_training=DrafterTrainingConfig(batch_size=2, learning_rate=1e-4),
        catch_up={"below": 0.8, "lr_scale": 5.0},
    )
    rollout.catch_up.load_state_dict({"reference": 50.0})
    rollout(convs, trainer)
    assert rollout.last_stats.drafter_lr_scale == 5.0 and rollout.drafter_lr_scale == 5.0
    assert rollout.online.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert rollout.state_dict()["catch_up"]["lr_scale"] == 5.0
    with pytest.raises(ValueError, match="catch_up"):
        SpecRollout(catch_up={"threshold": 0.5})


def test_a_drafter_the_resized_policy_outgrew_is_set_aside_with_a_warning(task_tokenizer, tiny_policy, caplog):
    """Issue 39, item 3: the drafter's fit is checked at every sync. After the policy's embeddings
    grow (added tokens) under a bound drafter LM, the rollout decodes without it (the same tokens
    as plain decoding), scores drafter health 0 and says what to check; on Ray workers, where such
    a policy cannot be synced, it is a clear error."""
    import copy

    from tailspec.testing import perturbed_copy

    tokenizer = copy.deepcopy(task_tokenizer)
    prompts = [[{"role": "user", "content": f"add {i} {i + 2}"}] for i in range(3)]
    trainer, metrics = greedy_trainer(tokenizer, tiny_policy)
    rollout = SpecRollout(model=tiny_policy, strategy="chain:3", drafter=perturbed_copy(tiny_policy, 0.1, seed=1))
    rollout(prompts, trainer)
    assert rollout.last_stats.drafter_health == 1.0
    tokenizer.add_tokens([f"<tool_{i}>" for i in range(8)])  # the user adds tokens, and grows the policy
    tiny_policy.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with caplog.at_level("WARNING", logger="tailspec.trainer_hooks.drafter_health"):
        out = rollout(prompts, trainer)
    assert rollout.last_stats.drafter_health == 0.0 and rollout.last_stats.drafted_tokens == 0
    assert metrics["eval"]["rollout/drafter_health"] == [1.0, 0.0]
    assert "does not fit the policy synced for this rollout" in caplog.text and "resize" in caplog.text
    assert out["completion_ids"] == SpecRollout(model=tiny_policy)(prompts, trainer)["completion_ids"]
    with pytest.raises(ValueError, match="does not fit the policy to sync to the Ray workers"):
        rollout._require_fit(tiny_policy, tokenizer)
