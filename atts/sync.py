"""The synchronous baseline: a barrier every turn and a rank-based takeover budget.

Each turn, every unfinished sample (of every question) drafts a chunk; when all have drafted, the
target scores all chunks; the ``round(alpha * m)`` worst-scoring of the ``m`` chunks are taken over
and the target rewrites them; only then does the next turn start. No calibration set is needed,
but every turn waits for its slowest sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..rollout.engine import RolloutEngine
from .clients import EngineClient, wait_all
from .config import ATTSConfig
from .runner import ATTSResult, ATTSRunner, EventLog, collect, make_samples
from .sample import Phase


def takeover_budget(alpha: float, num_chunks: int) -> int:
    """Chunks taken over in a turn of ``num_chunks``: alpha * num_chunks rounded half up."""
    return min(num_chunks, math.floor(alpha * num_chunks + 0.5))


def run_synchronous(
    draft: RolloutEngine | EngineClient,
    target: RolloutEngine | EngineClient,
    prompts: Sequence[Sequence[int]],
    config: ATTSConfig,
    *,
    draft_tokenizer=None,
    target_tokenizer=None,
) -> ATTSResult:
    runner = ATTSRunner(draft, target, config, draft_tokenizer=draft_tokenizer, target_tokenizer=target_tokenizer)
    draft, target = runner.draft, runner.target
    states = make_samples(runner.check_prompts(prompts), config, runner.eos_ids)
    log = EventLog()
    decisions: list[float] = []
    with runner.sessions():
        active = list(states)
        while active:
            for s in active:
                log.add(s, "submit_draft")
            chunks = wait_all(draft, [s.draft_request() for s in active])
            log.tick += 1
            score_requests = []
            for s, out in zip(active, chunks):
                log.add(s, "drafted")
                score_requests.append(s.on_draft(out.completion_ids))
            scored = wait_all(target, [(r.input_ids, params) for r, params in score_requests])
            log.tick += 1
            scores = [
                s.on_score(r, out.prompt_logprobs or []) for s, (r, _), out in zip(active, score_requests, scored)
            ]
            decisions.extend(scores)
            budget = takeover_budget(config.alpha, len(active))
            ranked = sorted(range(len(active)), key=lambda i: scores[i], reverse=True)[:budget]
            cut = scores[ranked[-1]] if ranked else math.inf
            worst = set(ranked)
            for i, s in enumerate(active):
                log.add(s, "scored")
                s.on_decision(i in worst, cut, config.alpha)
                log.add(s, "takeover" if s.phase is Phase.TAKEOVER else "accepted")
            rewrite = [s for s in active if s.phase is Phase.TAKEOVER]
            if rewrite:
                for s, out in zip(rewrite, wait_all(target, [s.takeover_request() for s in rewrite])):
                    s.on_takeover(out.completion_ids)
                    log.add(s, "rewritten")
                log.tick += 1
            for s in active:
                if s.done:
                    log.add(s, "finished")
            active = [s for s in active if not s.done]
    return collect(states, log, config, decisions)
