"""verl 0.9.1 rolls out through tailspec with ``rollout.name=tailspec`` and no user code: its own
``LLMServerManager`` finds the replica through the ``verl.plugins`` entry point and launches it on
Ray (CPUs here), its client's requests decode exactly, an abort returns partial tokens, the
trainer-side adapter pushes weights (outputs change, and the originals restore them exactly), and
the drafter's version advances across pushes. These run where verl is installed: ``make
test-verl`` (an environment holding torch 2.13.0 and ``tailspec[verl]``); elsewhere they skip."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

verl = pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402

from tailspec.testing import perturbed_copy, tiny_random_model  # noqa: E402
from tailspec.testing.families import no_cache_greedy, no_cache_logprobs  # noqa: E402

PROMPTS = [[5, 9, 17, 33, 3], [7, 7, 12], [10, 11, 12, 13, 14], [3, 4]]
GREEDY = {"temperature": 0.0, "top_k": -1, "logprobs": True}
CHAT_TEMPLATE = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}" + (
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<user>", "<assistant>"]
    vocab = {t: i for i, t in enumerate(special + list("0123456789 +=abcdefghijklmnopqrstuvwxyz\n"))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>"), len(vocab)


@pytest.fixture(scope="module")
def ray_cpus():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)  # logical CPUs: actors
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    tokenizer, vocab = _tokenizer()
    policy = tiny_random_model("qwen2", seed=2, vocab_size=vocab)
    folder = tmp_path_factory.mktemp("policy")
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    drafter = tmp_path_factory.mktemp("drafter")
    perturbed_copy(policy, 0.05).save_pretrained(drafter)
    return folder, drafter, policy


def _config(policy_dir, settings):
    import verl.trainer.config as trainer_config

    path = os.path.join(os.path.dirname(trainer_config.__file__), "_generated_ppo_trainer.yaml")
    cfg = OmegaConf.load(path)
    cfg.actor_rollout_ref.model.path = str(policy_dir)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name, rollout.nnodes, rollout.n_gpus_per_node, rollout.tensor_model_parallel_size = "tailspec", 1, 1, 1
    rollout.prompt_length, rollout.response_length = 64, 16
    rollout.engine_kwargs = {"tailspec": settings}
    return cfg


def _generate(client, prompts, fields):
    async def run():
        calls = [client.generate(f"q{i}", prompt_ids=p, sampling_params=dict(fields)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*calls)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def served(ray_cpus, policy_dir):
    """A replica launched by verl with a drafter LM, chain:3 and online drafter training."""
    folder, drafter, policy = policy_dir
    settings = {"strategy": "chain:3", "drafter": str(drafter), "drafter_train_steps": 2, "holdout_every": 0}
    manager = LLMServerManager.create(config=_config(folder, settings))
    yield manager, manager.get_client(), policy
    for server in manager.rollout_replicas[0].servers:
        ray_cpus.kill(server)


def test_verl_finds_tailspec_by_its_entry_point():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert RolloutReplicaRegistry.get("tailspec").__name__ == "TailspecReplica"
    assert get_rollout_class("tailspec", "async").__name__ == "TailspecServerAdapter"


def test_greedy_through_verls_client_equals_a_recompute(served):
    _, client, policy = served
    outs = _generate(client, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [no_cache_greedy(policy, p, 16) for p in PROMPTS]
    assert all(o.stop_reason == "completed" for o in outs)
    assert any(o.extra_fields["accept_length"] > 1 for o in outs), "chain:3 accepted no draft"


@pytest.mark.parametrize("settings", [{"strategy": "none"}, {"strategy": "chain:2", "drafter": "self:1"}])
def test_greedy_without_a_drafter_and_self_drafted_equals_a_recompute(ray_cpus, policy_dir, settings):
    folder, _, policy = policy_dir
    rank = 2 if settings["strategy"] == "none" else 3  # a replica's server is named by its rank
    manager = LLMServerManager.create(config=_config(folder, settings), start_rank=rank)
    try:
        outs = _generate(manager.get_client(), PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [no_cache_greedy(policy, p, 16) for p in PROMPTS]
    finally:
        for server in manager.rollout_replicas[0].servers:
            ray_cpus.kill(server)


def test_sampled_requests_carry_the_targets_logprobs(served):
    _, client, policy = served
    outs = _generate(client, PROMPTS, {"temperature": 1.0, "seed": 3, "logprobs": True})
    for prompt, out in zip(PROMPTS, outs):
        want = no_cache_logprobs(policy, prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.log_probs, dtype=torch.float64), want, atol=1e-4, rtol=0)


def test_an_abort_returns_partial_tokens(served):
    manager, client, policy = served
    replica = manager.rollout_replicas[0]

    async def run():
        before = (await replica.servers[0].metrics.remote())["tailspec/generated_tokens"]
        fields = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 400}
        running = [
            asyncio.ensure_future(client.generate(f"a{i}", prompt_ids=p, sampling_params=dict(fields)))
            for i, p in enumerate(PROMPTS)
        ]
        server = replica.servers[0]
        while (await server.metrics.remote())["tailspec/generated_tokens"] < before + 20:  # decoding
            await asyncio.sleep(0.01)
        await replica.abort_all_requests()
        outs = await asyncio.gather(*running)
        await replica.resume_generation()
        return outs

    outs = asyncio.run(run())
    assert all(o.stop_reason == "aborted" and len(o.token_ids) < 400 for o in outs)
    for prompt, out in zip(PROMPTS, outs):  # what was generated is greedy's own prefix
        assert out.token_ids == no_cache_greedy(policy, prompt, len(out.token_ids), eos_id=-1)


def test_a_weight_push_through_the_adapter_changes_the_outputs_and_back(served, policy_dir, monkeypatch):
    from verl.workers.rollout.base import get_rollout_class

    _, client, policy = served
    monkeypatch.setenv("RANK", "0")
    config = _config(policy_dir[0], {}).actor_rollout_ref
    adapter = get_rollout_class("tailspec", "async")(config=config.rollout, model_config=config.model, device_mesh=None)
    before = [o.token_ids for o in _generate(client, PROMPTS, GREEDY)]
    version = before_version = _generate(client, PROMPTS[:1], GREEDY)[0].extra_fields["drafter_version"]
    moved = perturbed_copy(policy, 0.5, seed=9)

    asyncio.run(adapter.resume(["weights"]))
    asyncio.run(adapter.update_weights((name, t) for name, t in moved.state_dict().items()))
    asyncio.run(adapter.resume(["kv_cache"]))
    after = [o.token_ids for o in _generate(client, PROMPTS, GREEDY)]
    assert after != before and after == [no_cache_greedy(moved, p, 16) for p in PROMPTS]

    async def originals():  # an async generator, as a streaming checkpoint engine hands them over
        for name, tensor in policy.state_dict().items():
            yield name, tensor

    asyncio.run(adapter.update_weights(originals()))
    assert [o.token_ids for o in _generate(client, PROMPTS, GREEDY)] == before
    for _ in range(100):  # the drafter trained on what was served between pushes
        version = _generate(client, PROMPTS[:1], GREEDY)[0].extra_fields["drafter_version"]
        if version > before_version:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert version > before_version


def test_verls_agent_loop_rolls_out_a_batch_through_tailspec(ray_cpus, tmp_path):
    """``AgentLoopManager.generate_sequences`` (verl's single-turn agent, its chat template, its
    padding; tailspec's subclass, chosen by verl's ``agent_loop_manager_class``): every response is
    greedy's own, tailspec's fields reach the batch and its summary the metrics verl logs."""
    import numpy as np
    from verl import DataProto

    from tailspec.trainer_hooks.verl.agent_loop import TailspecAgentLoopManager

    tokenizer, vocab = _tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    policy = tiny_random_model("llama", seed=5, vocab_size=vocab)
    policy.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cfg = _config(tmp_path, {"strategy": "suffix"})
    cfg.actor_rollout_ref.rollout.agent.num_workers = 1
    manager = LLMServerManager.create(config=cfg, start_rank=1)  # rank 0 is the served fixture's
    try:
        agents = TailspecAgentLoopManager.create(config=cfg, llm_client=manager.get_client())
        messages = [[{"role": "user", "content": f"add {i} {i + 3}"}] for i in range(4)]
        batch = DataProto.from_dict(
            non_tensors={"raw_prompt": np.array(messages, dtype=object)}, meta_info={"validate": True}
        )
        out = agents.generate_sequences(batch)
        width = out.batch["prompts"].shape[1]
        for i in range(len(messages)):  # the prompt as the agent loop tokenized it (left-padded)
            prompt = out.batch["prompts"][i][out.batch["attention_mask"][i][:width].bool()].tolist()
            n = int(out.batch["response_mask"][i].sum())
            assert out.batch["responses"][i][:n].tolist() == no_cache_greedy(policy, prompt, 16)[:n]
        assert {"accept_length", "drafter_version", "drafter_health", "weight_pushes"} <= set(out.non_tensor_batch)
        timing = out.meta_info["timing"]  # what verl's trainer logs as timing_s/...
        assert timing["tailspec/accept_length/mean"] >= 1.0 and timing["tailspec/drafter_health/min"] == -1.0
    finally:
        for server in manager.rollout_replicas[0].servers:
            ray_cpus.kill(server)


def test_with_no_strategy_named_the_backend_runs_adaptive():
    from tailspec.trainer_hooks.verl.replica import tailspec_settings

    def rollout(settings):
        return OmegaConf.create({"engine_kwargs": {"tailspec": settings}})

    assert tailspec_settings(rollout({}))["strategy"] == "adaptive"
    assert tailspec_settings(OmegaConf.create({"engine_kwargs": {"vllm": {}}})) == {"strategy": "adaptive"}
    assert "strategy" not in tailspec_settings(rollout({"engine": {"strategy": "none"}}))
    assert tailspec_settings(rollout({"strategy": "chain:4"}))["strategy"] == "chain:4"


def test_a_batchs_speculation_summary():
    from tailspec.trainer_hooks.verl.agent_loop import rollout_metrics

    fields = {
        "accept_length": [2.0, 3.0],
        "drafter_health": [-1.0, 0.4],
        "drafter_version": [3, 4],
        "weight_pushes": [2, 2],
    }
    assert rollout_metrics(fields) == {
        "tailspec/accept_length/mean": 2.5,
        "tailspec/accept_length/min": 2.0,
        "tailspec/drafter_version": 4.0,
        "tailspec/drafter_health/min": 0.4,
        "tailspec/weight_pushes": 2.0,
    }
    assert rollout_metrics({}) == {}


def test_a_wrong_tailspec_setting_is_one_line_naming_it(ray_cpus, policy_dir):
    with pytest.raises(ValueError, match=r"engine_kwargs\.tailspec: stratgy is not a field") as wrong:
        LLMServerManager.create(config=_config(policy_dir[0], {"stratgy": "chain:3"}))
    assert "\n" not in str(wrong.value)
