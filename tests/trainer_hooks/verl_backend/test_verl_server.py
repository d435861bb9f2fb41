"""tailspec's verl rollout server without verl: concurrent token-in token-out requests decode in
one batch and are exact, aborts return what was generated, weight pushes change the policy in place
(and back, exactly), the drafter learns between pushes, sleep frees the KV cache."""

import asyncio

import pytest
import torch

from tailspec.testing import perturbed_copy, tiny_random_model
from tailspec.testing.families import no_cache_greedy, no_cache_logprobs
from tailspec.trainer_hooks.verl.sampling import sampling_from_verl
from tailspec.trainer_hooks.verl.server import TailspecServer

PROMPTS = [[5, 9, 17, 33, 3], [7, 7, 12], [40, 2, 8, 9, 10, 11], [3, 4]]


@pytest.fixture
def policy():
    return tiny_random_model("qwen2", seed=2)


def _serve(server, prompts, fields, ids=None):
    async def run():
        calls = [server.generate(p, dict(fields), f"r{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*calls)

    return asyncio.run(run())


@pytest.mark.parametrize(
    "settings, drafter", [({}, None), ({"strategy": "chain:3"}, "lm"), ({"strategy": "suffix"}, None)]
)
def test_concurrent_greedy_requests_decode_together_and_exactly(policy, settings, drafter):
    server = TailspecServer(
        policy, None, settings=settings, drafter=perturbed_copy(policy, 0.05) if drafter else None, response_length=12
    )
    try:
        outs = _serve(server, PROMPTS, {"temperature": 0.0, "top_k": -1, "logprobs": True})
        assert [o.token_ids for o in outs] == [no_cache_greedy(policy, p, 12) for p in PROMPTS]
        assert all(o.stop_reason == "completed" and len(o.log_probs) == len(o.token_ids) for o in outs)
        assert max(server.engine.stats.batch_sizes) > 1, "the requests did not share a batch"
        if drafter:
            assert server.engine.stats.counts().drafted_tokens > 0 and outs[0].extra_fields["accept_length"] >= 1
    finally:
        server.close()


def test_sampled_requests_return_the_targets_logprobs(policy):
    server = TailspecServer(policy, None, settings={"strategy": "chain:3"}, drafter=perturbed_copy(policy, 0.05))
    try:
        outs = _serve(server, PROMPTS, {"temperature": 1.0, "max_tokens": 10, "seed": 4})
        for prompt, out in zip(PROMPTS, outs):
            want = no_cache_logprobs(policy, prompt, out.token_ids)
            torch.testing.assert_close(torch.tensor(out.log_probs, dtype=torch.float64), want, atol=1e-4, rtol=0)
    finally:
        server.close()


def test_an_abort_returns_what_was_generated_and_holds_new_requests(policy):
    server = TailspecServer(policy, None, response_length=400)

    async def run():
        running = [
            asyncio.ensure_future(server.generate(p, {"temperature": 0.0, "ignore_eos": True}, "a")) for p in PROMPTS
        ]
        while server.engine.stats.counts().generated_tokens < 20:
            await asyncio.sleep(0.01)
        report = await server.abort_all_requests()
        aborted = await asyncio.gather(*running)
        held = asyncio.ensure_future(server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 5}, "b"))
        await asyncio.sleep(0.2)
        assert not held.done(), "a request ran while generation was paused"
        await server.resume_generation()
        return report, aborted, await held

    try:
        report, aborted, after = asyncio.run(run())
        assert report["aborted_count"] == len(PROMPTS)
        assert all(o.stop_reason == "aborted" and 0 < len(o.token_ids) < 400 for o in aborted)
        for prompt, out in zip(PROMPTS, aborted):  # the partial tokens are greedy's own prefix
            assert out.token_ids == no_cache_greedy(policy, prompt, len(out.token_ids), eos_id=-1)
        assert after.stop_reason == "completed" and after.token_ids == no_cache_greedy(policy, PROMPTS[0], 5)
    finally:
        server.close()


def test_a_weight_push_changes_the_outputs_and_the_originals_restore_them(policy):
    server = TailspecServer(policy, None, response_length=10)
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    moved = perturbed_copy(policy, 0.5, seed=9).state_dict()
    greedy = {"temperature": 0.0}
    try:
        before = [o.token_ids for o in _serve(server, PROMPTS, greedy)]
        pushed = asyncio.run(server.update_weights(list(moved.items())))
        assert pushed == len(moved) and server.weight_pushes == 1
        after = [o.token_ids for o in _serve(server, PROMPTS, greedy)]
        assert after != before and after == [no_cache_greedy(policy, p, 10) for p in PROMPTS]
        asyncio.run(server.update_weights(list(original.items())))
        assert [o.token_ids for o in _serve(server, PROMPTS, greedy)] == before
        with pytest.raises(ValueError, match="the model has no weight 'no.such.weight'"):
            asyncio.run(server.update_weights([("no.such.weight", torch.zeros(1))]))
        name, tensor = next(iter(original.items()))
        with pytest.raises(ValueError, match=f"{name} has shape"):
            asyncio.run(server.update_weights([(name, torch.zeros(3, 3, 3))]))
    finally:
        server.close()


def test_a_tied_model_takes_its_output_embedding_by_either_name():
    tied = tiny_random_model("qwen2", seed=3, tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    server = TailspecServer(tied, None, response_length=6)
    try:
        state = perturbed_copy(tied, 0.5, seed=4).state_dict()
        assert "lm_head.weight" in state
        asyncio.run(server.update_weights(list(state.items())))
        assert torch.equal(tied.lm_head.weight, state["lm_head.weight"])
        assert [o.token_ids for o in _serve(server, PROMPTS, {"temperature": 0.0})] == [
            no_cache_greedy(tied, p, 6) for p in PROMPTS
        ]
    finally:
        server.close()


def test_the_drafter_learns_between_pushes_and_says_its_version(policy):
    drafter = perturbed_copy(policy, 0.3)
    settings = {"strategy": "chain:3", "drafter_train_steps": 2, "holdout_every": 0}
    server = TailspecServer(policy, None, settings=settings, drafter=drafter, response_length=16)
    try:
        first = _serve(server, PROMPTS * 2, {"temperature": 1.0, "seed": 1})
        version = server.drafter_version
        asyncio.run(server.update_weights(list(policy.state_dict().items())))
        for _ in range(100):  # the drafter trains on the served completions once the server is idle
            if server.drafter_version > version:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert server.drafter_version > version
        second = _serve(server, PROMPTS, {"temperature": 1.0, "seed": 2})
        assert (
            second[0].extra_fields["drafter_version"]
            == server.drafter_version
            > first[0].extra_fields["drafter_version"]
        )
        assert server.metrics()["tailspec/weight_pushes"] == 1.0
    finally:
        server.close()


def test_sleep_frees_the_kv_cache_and_wake_up_restores_it(policy):
    server = TailspecServer(policy, None, response_length=6)
    try:
        before = [o.token_ids for o in _serve(server, PROMPTS, {"temperature": 0.0})]
        asyncio.run(server.sleep())
        assert server.engine.runner.cache.released
        asyncio.run(server.wake_up(["kv_cache"]))
        assert not server.engine.runner.cache.released
        assert [o.token_ids for o in _serve(server, PROMPTS, {"temperature": 0.0})] == before
    finally:
        server.close()


def test_a_wrong_setting_is_one_line_naming_it(policy):
    with pytest.raises(ValueError, match="stratgy is not a field"):
        TailspecServer(policy, None, settings={"stratgy": "chain:3"})
    with pytest.raises(ValueError, match="unknown strategy"):
        TailspecServer(policy, None, settings={"strategy": "chian:3"})


def test_verls_sampling_fields():
    params = sampling_from_verl({"temperature": 0.7, "top_k": -1, "top_p": 0.9, "logprobs": True}, 64, 1000)
    assert (params.temperature, params.top_k, params.top_p, params.max_new_tokens) == (0.7, 0, 0.9, 64)
    assert sampling_from_verl({"max_tokens": 500}, 64, 100).max_new_tokens == 100  # capped by the room left
    with pytest.raises(ValueError, match=r"sampling_params \['best_of'\] are not supported"):
        sampling_from_verl({"best_of": 2}, 64, 100)
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_from_verl({"repetition_penalty": 1.1}, 64, 100)
