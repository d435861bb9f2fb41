"""Scripted engine clients for ATTS tests: each request finishes after a chosen number of polls."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

from tailspec.rollout.engine import RequestLimits
from tailspec.rollout.params import SamplingParams
from tailspec.rollout.request import RequestOutput

EOS = 1


class ScriptedClient:
    """``reply(prompt_ids, params) -> (completion_ids, prompt_logprobs, polls_needed)``."""

    def __init__(
        self, name: str, reply: Callable[[list[int], SamplingParams], tuple[list[int], list[float] | None, int]]
    ):
        self.name = name
        self.reply = reply
        self.eos_token_ids = frozenset({EOS})
        self.vocab_size = 64
        self.limits = RequestLimits(vocab_size=64, max_model_len=4096, block_size=16, total_blocks=4096)
        self._next = 0
        self._pending: dict[int, list] = {}
        self.submitted: list[tuple[list[int], SamplingParams]] = []

    def submit(self, prompt_ids, params):
        self.limits.check(list(prompt_ids), params)
        completion, prompt_logprobs, polls = self.reply(list(prompt_ids), params)
        ticket, self._next = self._next, self._next + 1
        out = RequestOutput(
            ticket, list(prompt_ids), completion, [0.0] * len(completion), "stop", prompt_logprobs=prompt_logprobs
        )
        self._pending[ticket] = [polls, out]
        self.submitted.append((list(prompt_ids), params))
        return ticket

    def poll(self):
        done = []
        for ticket, item in list(self._pending.items()):
            item[0] -= 1
            if item[0] <= 0:
                done.append((ticket, item[1]))
                del self._pending[ticket]
        return done

    def num_pending(self):
        return len(self._pending)

    def session(self):
        return contextlib.nullcontext()


def chunk_writer(token: int, chunks_per_sample: int, polls: Callable[[list[int]], int]):
    """A draft/target that writes 2-token chunks ``[token, token]`` and ends a sample with EOS after
    ``chunks_per_sample`` chunks (counted from the context length: prompts are 2 tokens)."""

    def reply(prompt_ids, params):
        written = (len(prompt_ids) - 2) // 2
        chunk = [token, EOS] if written + 1 >= chunks_per_sample else [token, token]
        return chunk, None, polls(prompt_ids)

    return reply


def iid_scorer(seed: int, draft_reply):
    """A target that scores every chunk with an iid random mean NLL (exchangeable scores) and
    writes takeover chunks with ``draft_reply``."""
    rng = random.Random(seed)

    def reply(prompt_ids, params):
        if params.prompt_logprobs:
            value = -rng.expovariate(1.0)
            return [0], [value] * params.prompt_logprobs, 1
        return draft_reply(prompt_ids, params)

    return reply
