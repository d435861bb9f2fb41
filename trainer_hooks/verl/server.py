"""A tailspec engine serving verl's agent loop: token in, token out, with logprobs.

Every concurrent ``generate`` call joins one running batch (the engine's :func:`serve` loop on a
thread of its own, fed through a :class:`RequestInbox`), so the agent loop's requests decode
together and speculate together. Around it, what verl's rollout servers do: abort every request
with the tokens it has (``stop_reason="aborted"``, so a partial rollout resumes it), hold new
requests until generation resumes, free the KV cache while asleep, and take the policy's new
weights in place. The drafter follows the policy: its online training (the same
:class:`SpecRollout` machinery as in a TRL run) learns from the served completions whenever the
server is idle, every weight push closes a "rollout" for the catch-up rule and the drafter's
health, and each response carries the drafter's version and accept length back to verl.

Nothing here imports verl: ``replica.py`` wraps it in verl's server actor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...draft_contract import Versioned
from ...rollout.handoff import InboxItem, PartialRequest, RequestInbox
from ...rollout.request import RequestOutput
from ...rollout.serving import serve
from ...rollout.stats import EngineCounts
from ...rollout.strategy import parse_strategy
from ..spec_rollout import SpecRollout
from .sampling import sampling_from_verl

logger = logging.getLogger(__name__)


@dataclass
class ServedOutput:
    """One request's answer, the fields of verl's ``TokenOutput``."""

    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # "completed" or "aborted"
    num_preempted: int = 0
    extra_fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Waiting:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt_ids: list[int]


class TailspecServer:
    """Serves ``model`` (decoded in place; weight pushes change it) with tailspec's rollout settings
    ``settings`` (a :class:`SpecRolloutConfig` as a dict, e.g. ``{"strategy": "adaptive"}``; errors
    name the key) and ``drafter`` (what ``SpecRollout`` takes). ``response_length`` is the default
    ``max_tokens``."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        settings: dict[str, Any] | None = None,
        drafter: Any = None,
        response_length: int = 512,
        seed: int = 0,
    ) -> None:
        self.model = model.eval()
        self.rollout = SpecRollout(model=model, tokenizer=tokenizer, drafter=drafter, **dict(settings or {}))
        self.engine = self.rollout.engine_for(model, tokenizer, seed)
        self.response_length = response_length
        self.inbox = RequestInbox()
        self._keys = itertools.count()
        self._waiting: dict[int, _Waiting] = {}
        self._lock = threading.RLock()  # held by the serving thread around engine work, and by weight pushes
        self._admitting = threading.Event()
        self._admitting.set()
        self._rejecting = False
        self._pushing = False  # a weight push is being copied in: requests wait
        self._asleep = False  # the KV cache is released: requests wait for wake_up
        self._handed_out = 0
        self.health_score: float | None = None
        self._learned: list[tuple[list[int], list[int]]] = []  # served completions the drafter has not seen
        self._since_push = self.engine.stats.counts()
        self.weight_pushes = 0
        self._thread = threading.Thread(target=self._serve, name="tailspec-verl-server", daemon=True)
        self._thread.start()

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> ServedOutput:
        """One request, decoded in the running batch; its tokens and their logprobs."""
        prompt = [int(t) for t in prompt_ids]
        params = sampling_from_verl(
            dict(sampling_params), self.response_length, self.engine.max_model_len - len(prompt)
        )
        self.engine.limits.check(prompt, params)
        while not self._admitting.is_set() or self._pushing or self._asleep:  # held until generation resumes
            if self._rejecting:
                raise RuntimeError(f"request {request_id}: generation is paused (abort_all_requests) and rejecting")
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        key = next(self._keys)
        self._handed_out += 1
        waiting = _Waiting(loop, loop.create_future(), prompt)
        self._waiting[key] = waiting
        self.inbox.put([InboxItem(key, prompt, params)])
        return await waiting.future

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Stop every request where it is: each returns its tokens so far with ``stop_reason
        "aborted"``; new requests wait (or, with ``reject_request``, fail) until
        :meth:`resume_generation`."""
        self._rejecting = reject_request
        self._admitting.clear()
        keys = list(self._waiting)
        self.inbox.release(keys)
        futures = [self._waiting[k].future for k in keys if k in self._waiting]
        if futures:
            await asyncio.gather(*futures, return_exceptions=True)
        return {"aborted_count": len(keys), "request_ids": [str(k) for k in keys]}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._admitting.set()

    # -- memory and weights -----------------------------------------------------------------------
    async def sleep(self) -> None:
        """Free the KV cache and the captured graphs (waits for running requests first)."""
        self._asleep = True
        await self._drained()
        with self._lock:
            self.engine.runner.release_memory()

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        with self._lock:
            self.engine.runner.restore_memory()
        self._asleep = False

    async def clear_kv_cache(self) -> None:
        with self._lock:
            self.engine.runner.cache.allocator.clear_prefixes()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], last: bool = True) -> int:
        """Copy pushed weights into the model in place, by their Hugging Face names (a chunk of them;
        ``last``: the push is complete). A tied output embedding shares its tensor with the input's,
        so either name updates both. Unknown names or shapes are refused before anything is copied.
        A complete push closes the drafter's "rollout": its accept length since the last push goes
        to the catch-up rule and the drafter's health. Returns the tensors copied."""
        named = list(named_tensors)
        model = self.model  # tied weights under every name they have (lm_head.weight and the embeddings)
        targets = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        for name, tensor in named:
            if name not in targets:
                raise ValueError(f"update_weights: the model has no weight {name!r}")
            if tuple(targets[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {list(targets[name].shape)}, got {list(tensor.shape)}"
                )
        self._pushing = True
        try:
            await self._drained()
            with self._lock, torch.no_grad():
                for name, tensor in named:
                    targets[name].copy_(tensor.to(targets[name].device, targets[name].dtype))
                if last:
                    self.engine.weights_changed()
                    self.weight_pushes += 1
                    self._close_rollout()
        finally:
            self._pushing = False
        return len(named)

    def _close_rollout(self) -> None:
        """What was served since the last push, as one rollout for the catch-up rule and health."""
        counts = self.engine.stats.counts() - self._since_push
        self._since_push = self.engine.stats.counts()
        if self.rollout.drafter is None or counts.drafted_tokens == 0:
            return
        scale = self.rollout.catch_up.observe(counts.mean_accept_length, counts.drafted_tokens)
        model_steps = sum(n for k, n in counts.strategy_steps.items() if parse_strategy(k).uses_model_drafter)
        adaptive = parse_strategy(self.rollout.config.engine.strategy).adaptive
        self.health_score = self.rollout.health.update(counts.mean_accept_length, model_steps, adaptive)
        logger.info(
            "weight push %d: accept length %.2f since the last, drafter lr x%.2f, health %.2f",
            self.weight_pushes,
            counts.mean_accept_length,
            scale,
            self.health_score,
        )

    @property
    def busy(self) -> bool:
        """Requests are being decoded (or wait to be)."""
        return bool(self._waiting)

    async def _drained(self) -> None:
        while self.busy:
            await asyncio.sleep(0.01)

    # -- what verl reads back ------------------------------------------------------------------------
    @property
    def drafter_version(self) -> int:
        online = self.rollout.online
        if online is not None and online.part is not None:
            return int(online.part.version)
        drafter = self.engine.drafter
        return int(drafter.version) if isinstance(drafter, Versioned) else 0

    def metrics(self) -> dict[str, float]:
        """Counts since the server started, for the rollout's metrics."""
        counts: EngineCounts = self.engine.stats.counts()
        return {
            "tailspec/accept_length": counts.mean_accept_length,
            "tailspec/drafted_tokens": float(counts.drafted_tokens),
            "tailspec/generated_tokens": float(counts.generated_tokens),
            "tailspec/drafter_version": float(self.drafter_version),
            "tailspec/weight_pushes": float(self.weight_pushes),
            **{f"tailspec/strategy_steps/{k}": float(v) for k, v in counts.strategy_steps.items()},
        }

    def close(self) -> None:
        self.inbox.close(self._handed_out)
        self._thread.join(timeout=30)
        self.engine.close()

    # -- the serving thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        """The engine's serve loop (it returns only when the inbox is closed and drained). Engine work
        happens only while requests are held; weight pushes and sleep wait for none to be."""
        for update in serve(self.engine, self.inbox, idle_wait_s=0.05):
            for key, output in update.finished:
                self._answer(key, self._completed(output))
            for key, partial in update.released:
                self._answer(key, self._aborted(partial))
            if not self._waiting and not self.inbox.has_news():
                self._learn()

    @property
    def _learning(self) -> bool:
        return self.rollout.online is not None and bool(self.rollout.config.training.drafter_train_steps)

    def _completed(self, output: RequestOutput) -> ServedOutput:
        if self._learning:  # kept only for a drafter that trains (a long run would hold every completion)
            self._learned.append((list(output.prompt_ids), list(output.completion_ids)))
        return ServedOutput(
            list(output.completion_ids),
            list(output.logprobs),
            "completed",
            output.num_preemptions,
            self._extra(output.num_spec_steps, output.num_accepted),
        )

    def _aborted(self, partial: PartialRequest | None) -> ServedOutput:
        if partial is None:  # given back before it started
            return ServedOutput([], [], "aborted")
        extra = self._extra(partial.num_spec_steps, partial.num_accepted)
        return ServedOutput(list(partial.output_ids), list(partial.logprobs), "aborted", partial.num_preemptions, extra)

    def _extra(self, spec_steps: int, accepted: int) -> dict[str, Any]:
        accept = (accepted + spec_steps) / spec_steps if spec_steps else 1.0
        health = -1.0 if self.health_score is None else self.health_score  # -1: not scored yet (no push)
        return {
            "accept_length": accept,
            "drafter_version": self.drafter_version,
            "drafter_health": health,
            "weight_pushes": self.weight_pushes,
        }

    def _answer(self, key: int, answer: ServedOutput) -> None:
        waiting = self._waiting.pop(key, None)
        if waiting is not None:
            waiting.loop.call_soon_threadsafe(_resolve, waiting.future, answer)

    def _learn(self) -> None:
        """The server is idle: the drafter learns from what it served (online training's steps)."""
        online, steps = self.rollout.online, self.rollout.config.training.drafter_train_steps
        if not self._learning or not self._learned:
            return
        learned, self._learned = self._learned, []
        if self.rollout.health.misfit:  # a drafter that does not fit the policy learns nothing from it
            return
        start = time.perf_counter()
        with self._lock:
            online.observe([p for p, _ in learned], [c for _, c in learned])
            losses = online.train(steps, self.rollout.catch_up.lr_scale)
        logger.info(
            "drafter trained %d steps on %d served completions in %.2fs (version %d, loss %s)",
            len(losses),
            len(learned),
            time.perf_counter() - start,
            self.drafter_version,
            f"{sum(losses) / len(losses):.3f}" if losses else "-",
        )


def _resolve(future: asyncio.Future, answer: ServedOutput) -> None:
    if not future.done():
        future.set_result(answer)
