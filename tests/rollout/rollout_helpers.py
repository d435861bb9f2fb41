"""Helpers the rollout tests import (a module of its own: ``conftest`` is a name every test
folder's conftest shares, so importing from it breaks when pytest collects several folders)."""

import functools

from tailspec.testing import (  # noqa: F401 (used by tests)
    chi_square_pvalue,
    generate_committing_each_step,
    hf_greedy,
    tiny_random_model,
)
from tailspec.testing import random_prompts as testing_random_prompts

EOS = 1
VOCAB = 96


@functools.cache
def cached_model(arch: str, seed: int = 1, initializer_range: float = 0.2):
    return tiny_random_model(arch, seed=seed, initializer_range=initializer_range)


def random_prompts(n: int, seed: int, min_len: int = 1, max_len: int = 25) -> list[list[int]]:
    return testing_random_prompts(n, seed, min_len, max_len, VOCAB)


def serve_handing_one_over(engine, other, prompts, params, lengths) -> dict:
    """``engine.serve`` an inbox (what a Ray worker runs): the first five requests, then the rest
    joining the running batch while the unfinished one with the longest completion (``lengths``:
    each request's) is handed back and finished by ``other``. Returns every request's output by
    index; ``engine`` left nothing in flight."""
    from tailspec.rollout.handoff import InboxItem, RequestInbox

    inbox = RequestInbox()
    inbox.put([InboxItem(i, prompts[i], params[i]) for i in range(5)])
    updates = engine.serve(inbox, idle_wait_s=0.05)
    got = dict(next(updates).finished)
    moved = max((k for k in range(5) if k not in got), key=lambda k: lengths[k])
    inbox.put([InboxItem(i, prompts[i], params[i]) for i in range(5, len(prompts))])  # joins the running batch
    inbox.release([moved])
    inbox.close(len(prompts))
    released = {}
    for update in updates:
        got.update(update.finished)
        released.update(update.released)
    assert sorted([*got, *released]) == list(range(len(prompts))) and list(released) == [moved]
    assert engine.in_flight is None
    rid = other.add_request(prompts[moved], params[moved], resume=released[moved])
    while other.has_unfinished():
        other.step()
    got[moved] = other.pop_output(rid)
    return got


def with_growth(engine, names, call):
    """``call()``'s result and how much each of the engine statistics ``names`` grew in it."""
    before = [getattr(engine.stats, name) for name in names]
    result = call()
    return result, tuple(getattr(engine.stats, name) - b for name, b in zip(names, before))


def plain_greedy_outputs(model, prompts, params):
    """Plain decoding's outputs (the EOS of the tests' engines, small blocks)."""
    from tailspec.rollout import RolloutConfig, RolloutEngine

    return RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=4096), eos_token_ids=[EOS]).generate(
        prompts, params
    )
