"""The asynchronous ATTS loop: every sample advances on its own.

There is no per-turn and no per-question barrier: whenever an engine returns a finished request,
that one sample takes its next step (score the chunk, take over, or draft the next chunk) and its
next request joins whatever the engines are already batching. A sample with a long chunk only
delays itself. Every state change is recorded as an :class:`ATTSEvent` with the loop tick it
happened in, so order can be checked without reading clocks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..progress import progress_bar
from ..rollout.engine import RolloutEngine
from ..rollout.params import SamplingParams
from .clients import EngineClient, as_client, wait_all
from .config import ATTSConfig
from .conformal import ConformalCalibration, NeverTakeover, TakeoverPolicy, make_policy
from .sample import Author, Phase, SampleState, ScoreRequest, Turn, request_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ATTSEvent:
    tick: int  # loop iteration (asynchronous runner) or phase number (synchronous baseline)
    time_s: float  # since the run started
    sample_id: int
    turn: int
    kind: str  # submit_draft | drafted | scored | accepted | takeover | rewritten | finished


@dataclass
class SampleResult:
    sample_id: int
    question_index: int
    completion_ids: list[int]
    turns: list[Turn]
    finish_reason: str | None

    @property
    def num_scored(self) -> int:
        return sum(t.score is not None for t in self.turns)

    @property
    def num_takeovers(self) -> int:
        return sum(t.author is Author.TARGET for t in self.turns)


@dataclass
class ATTSResult:
    samples: list[SampleResult]  # question-major: question q's samples are [q*S, (q+1)*S)
    events: list[ATTSEvent]
    wall_time_s: float
    num_samples: int
    decisions: list[float] = field(default_factory=list)  # every scored draft chunk's score, in decision order

    @property
    def num_scored(self) -> int:
        return sum(s.num_scored for s in self.samples)

    @property
    def num_takeovers(self) -> int:
        return sum(s.num_takeovers for s in self.samples)

    @property
    def takeover_rate(self) -> float:
        return self.num_takeovers / self.num_scored if self.num_scored else 0.0

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)

    def completions(self, question_index: int) -> list[list[int]]:
        k = self.num_samples
        return [s.completion_ids for s in self.samples[question_index * k : (question_index + 1) * k]]

    @property
    def num_questions(self) -> int:
        return len(self.samples) // self.num_samples


class EventLog:
    def __init__(self) -> None:
        self.events: list[ATTSEvent] = []
        self.start = time.perf_counter()
        self.tick = 0

    def add(self, state: SampleState, kind: str) -> None:
        self.events.append(
            ATTSEvent(self.tick, time.perf_counter() - self.start, state.sample_id, len(state.turns), kind)
        )


def check_tokenizers_match(draft_tokenizer, target_tokenizer) -> None:
    """``ValueError`` unless both tokenizers map every token to the same id (and agree on EOS)."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        only_draft = sorted(set(draft_vocab) - set(target_vocab))[:3]
        only_target = sorted(set(target_vocab) - set(draft_vocab))[:3]
        moved = sorted(t for t in set(draft_vocab) & set(target_vocab) if draft_vocab[t] != target_vocab[t])[:3]
        raise ValueError(
            "draft and target tokenizers differ (ATTS passes token ids between them): "
            f"{len(draft_vocab)} vs {len(target_vocab)} tokens; only in draft {only_draft}, only in target "
            f"{only_target}, different ids for {moved}"
        )
    if draft_tokenizer.eos_token_id != target_tokenizer.eos_token_id:
        raise ValueError(
            f"draft and target tokenizers disagree on eos_token_id: {draft_tokenizer.eos_token_id} vs "
            f"{target_tokenizer.eos_token_id}"
        )


def make_samples(prompts: Sequence[Sequence[int]], config: ATTSConfig, eos_ids: frozenset[int]) -> list[SampleState]:
    return [
        SampleState(q * config.num_samples + s, q, list(p), config, eos_ids)
        for q, p in enumerate(prompts)
        for s in range(config.num_samples)
    ]


def collect(states: list[SampleState], log: EventLog, config: ATTSConfig, decisions: list[float]) -> ATTSResult:
    samples = [
        SampleResult(s.sample_id, s.question_index, list(s.history), list(s.turns), s.finish_reason) for s in states
    ]
    return ATTSResult(samples, log.events, time.perf_counter() - log.start, config.num_samples, decisions)


class ATTSRunner:
    """Draft and target engines (in-process :class:`RolloutEngine` s or clients such as
    :class:`~tailspec.atts.clients.RayEngineClient`) driving ATTS with ``config``.

    Pass both tokenizers to have them checked for a mismatch (ATTS exchanges token ids).
    """

    def __init__(
        self,
        draft: RolloutEngine | EngineClient,
        target: RolloutEngine | EngineClient,
        config: ATTSConfig | None = None,
        *,
        draft_tokenizer=None,
        target_tokenizer=None,
        progress: bool = False,
    ) -> None:
        self.draft = as_client(draft, "draft")
        self.target = as_client(target, "target")
        self.config = config or ATTSConfig()
        self.progress = progress
        if draft_tokenizer is not None and target_tokenizer is not None:
            check_tokenizers_match(draft_tokenizer, target_tokenizer)
        tokenizer = target_tokenizer or draft_tokenizer
        for client in (self.draft, self.target):
            if tokenizer is not None and len(tokenizer) > client.vocab_size:
                raise ValueError(
                    f"the tokenizer has {len(tokenizer)} tokens but the {client.name} model's vocabulary has "
                    f"{client.vocab_size}"
                )
        self.eos_ids = self.target.eos_token_ids

    def sessions(self) -> contextlib.ExitStack:
        """Both engines' sessions (inference mode held across polls), as one context."""
        stack = contextlib.ExitStack()
        for client in (self.draft, self.target):
            stack.enter_context(client.session())
        return stack

    # -- validation ----------------------------------------------------------------------------------------
    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Every prompt must fit both engines with the whole token budget (plus the scoring token)."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        prompts = [list(p) for p in prompts]
        need = SamplingParams(max_new_tokens=self.config.max_new_tokens + 1)
        errors = []
        for i, p in enumerate(prompts):
            for client in (self.draft, self.target):
                try:
                    client.limits.check(p, need)
                except ValueError as e:
                    errors.append(f"prompt {i} ({client.name}): {e}")
        if errors:
            more = f"; and {len(errors) - 5} more" if len(errors) > 5 else ""
            raise ValueError("invalid prompt(s): " + "; ".join(errors[:5]) + more)
        return prompts

    # -- runs ----------------------------------------------------------------------------------------------
    def run(
        self,
        prompts: Sequence[Sequence[int]],
        calibration: ConformalCalibration | None = None,
        policy: TakeoverPolicy | None = None,
    ) -> ATTSResult:
        """ATTS over ``prompts`` (token ids, chat template applied): ``config.num_samples`` samples
        each. The takeover rule is ``policy``, else ``config.mode`` at ``config.alpha`` over
        ``calibration`` (see :meth:`calibrate`)."""
        prompts = self.check_prompts(prompts)
        if policy is None:
            if calibration is None:
                raise ValueError(
                    "calibration is required (build it with ATTSRunner.calibrate) unless a policy is given"
                )
            policy = make_policy(calibration, self.config.alpha, self.config.mode, self.config.online_step)
        states = make_samples(prompts, self.config, self.eos_ids)
        bar = progress_bar(total=len(states), desc="atts", unit="sample", disable=not self.progress, leave=False)
        loop = _Loop(self.draft, self.target, policy, bar)
        with self.sessions(), bar:
            for state in states:
                loop.next_draft(state)
            while loop.inflight:
                for client in (self.draft, self.target):
                    for ticket, output in client.poll():
                        loop.on_output(client, ticket, output)
                loop.log.tick += 1
        if not all(s.done for s in states):
            raise RuntimeError("ATTS loop ended with unfinished samples")
        return collect(states, loop.log, self.config, loop.decisions)

    def calibrate(self, prompts: Sequence[Sequence[int]]) -> ConformalCalibration:
        """Scores of every draft chunk of held-out ``prompts``, through exactly the test-time path
        (same template, chunking, stop rules and scorer; all turns), with no takeover."""
        result = self.run(prompts, policy=NeverTakeover())
        return ConformalCalibration.from_scores(result.decisions)


def sample_only(
    client: RolloutEngine | EngineClient,
    prompts: Sequence[Sequence[int]],
    config: ATTSConfig,
    role: str = "target",
) -> tuple[list[list[int]], float]:
    """``config.num_samples`` whole completions per prompt from one model (the target-only or
    draft-only baseline), with ATTS's sampling settings and token budget; completions question-major
    and the wall time."""
    client = as_client(client, role)
    requests = []
    for q, p in enumerate(prompts):
        for s in range(config.num_samples):
            sample_id = q * config.num_samples + s
            params = SamplingParams(
                temperature=config.temperature,
                top_p=config.top_p,
                max_new_tokens=config.max_new_tokens,
                seed=request_seed(config.seed, sample_id, 0, role + "-only"),
            )
            requests.append((list(p), params))
    start = time.perf_counter()
    with client.session():
        outputs = wait_all(client, requests)
    return [o.completion_ids for o in outputs], time.perf_counter() - start


class _Loop:
    """One ATTS run's requests in flight: each sample goes draft -> score -> (accepted, or a
    takeover by the target) -> next draft, as the engines answer."""

    def __init__(self, draft: EngineClient, target: EngineClient, policy: TakeoverPolicy, bar) -> None:
        self.draft, self.target, self.policy, self.bar = draft, target, policy, bar
        self.log = EventLog()
        self.decisions: list[float] = []
        self.inflight: dict[tuple[str, int], tuple[SampleState, Phase, ScoreRequest | None]] = {}

    def send(self, client: EngineClient, state: SampleState, request, params, score: ScoreRequest | None = None):
        self.inflight[(client.name, client.submit(request, params))] = (state, state.phase, score)

    def next_draft(self, state: SampleState) -> None:
        if state.done:
            self.log.add(state, "finished")
            self.bar.update(1)
            return
        self.log.add(state, "submit_draft")
        self.send(self.draft, state, *state.draft_request())

    def on_output(self, client: EngineClient, ticket: int, output) -> None:
        state, phase, score_request = self.inflight.pop((client.name, ticket))
        if phase is Phase.DRAFT:
            self.log.add(state, "drafted")
            request, params = state.on_draft(output.completion_ids)
            self.send(self.target, state, request.input_ids, params, request)
        elif phase is Phase.SCORE:
            self._on_score(state, score_request, output)
        else:
            state.on_takeover(output.completion_ids)
            self.log.add(state, "rewritten")
            self.next_draft(state)

    def _on_score(self, state: SampleState, score_request: ScoreRequest | None, output) -> None:
        score = state.on_score(score_request, output.prompt_logprobs or [])
        self.decisions.append(score)
        decision = self.policy.decide(score)
        self.log.add(state, "scored")
        state.on_decision(decision.takeover, decision.threshold, decision.level)
        if state.phase is Phase.TAKEOVER:
            self.log.add(state, "takeover")
            self.send(self.target, state, *state.takeover_request())
        else:
            self.log.add(state, "accepted")
            self.next_draft(state)
