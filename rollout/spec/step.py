"""A speculative step drafted from the host's text, after its drafts (``draft_step.py``: each
sequence's tree, fitted to its limits and KV blocks), as three functions with a clear input and output:

    verify   the target's processed distribution at every scored row, and a verdict per sequence
    accept   the tokens each verdict emits, with their logprobs (one gather for the batch)
    commit   the kept K/V and tokens appended to each sequence, and what a feature-reading drafter
             must observe

The engine runs the target forward before ``verify`` and finishes sequences after ``commit``. Why
the output is exactly the target's: ``rollout/spec/verify.py``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from ...draft_contract import DraftTree
from ...kernels.transfers import read_back, select_rows
from ..model.kv_cache import PagedKVCache
from ..position_noise import keyed_scores
from ..request import Sequence
from ..sampling import BatchSamplingTensors, draw_uniforms, processed_logprobs
from .kv_blocks import keep_accepted_kv
from .verify import Verdict, verify_batch


@dataclass
class Verified:
    verdicts: list[Verdict]
    logprobs: torch.Tensor  # [scored rows, vocab]: the processed distribution at every scored row
    first_rows: list[int]  # each sequence's first scored row
    # a batch of greedy and position-keyed rows: the logprob of each row's argmax (of its perturbed
    # scores where keyed), read with that argmax (every token such a batch emits is one)
    row_best: list[float] | None = None


def verify(
    seqs: Seq[Sequence], trees: Seq[DraftTree], logits: torch.Tensor, num_new: Seq[int], generator: torch.Generator
) -> Verified:
    """Verdicts for every sequence's tree from one forward's logits (``num_new`` rows each)."""
    st = BatchSamplingTensors.from_params([s.params for s in seqs], logits.device, repeats=num_new)
    logprobs = processed_logprobs(logits, st)
    first_rows = list(accumulate(num_new, initial=0))[:-1]
    keyed = None
    if any(s.params.position_keyed for s in seqs):  # per-row lists only when some row needs them
        params = [s.params for s, n in zip(seqs, num_new) for _ in range(n)]
        indices = [len(s.output_ids) + d for s, t in zip(seqs, trees) for d in (0, *t.depths)]
        keyed = keyed_scores(logprobs, params, indices)
    # position-keyed sequences: the target's token at each row is the argmax of its perturbed
    # scores, fixed before any draft is looked at, so they verify as greedy ones on those scores
    scores = logprobs if keyed is None else keyed[0]
    greedy = [seq.params.greedy or seq.params.position_keyed for seq in seqs]
    if all(greedy):  # one read: the rows' argmax and its logprob
        argmax = scores.argmax(dim=-1)
        tokens, best = read_back(argmax, logprobs.gather(-1, argmax.unsqueeze(-1)))
        no_uniforms = torch.zeros(0, dtype=torch.float64)
        verdicts = verify_batch(trees, scores, greedy, no_uniforms, argmax=tokens)
        return Verified(verdicts, logprobs, first_rows, best)
    # sampled rows: one uniform per scored row, aligned with the rows (greedy sequences ignore theirs)
    uniforms = draw_uniforms([s.generator for s in seqs], generator, list(num_new))
    return Verified(verify_batch(trees, scores, greedy, uniforms, emitted_from=logprobs), logprobs, first_rows)


@dataclass
class Accepted:
    tokens: list[list[tuple[int, int]]]  # per sequence: (token, scored row within the sequence)
    logprobs: list[list[float]]  # per sequence: each emitted token's processed logprob


def accept(trees: Seq[DraftTree], verified: Verified) -> Accepted:
    """The tokens every verdict emits and their logprobs, in one gather for the whole batch (none
    where the verification read them already)."""
    emitted = [verdict.emitted(tree) for tree, verdict in zip(trees, verified.verdicts)]
    rows = [verified.first_rows[i] + r for i, seq_emitted in enumerate(emitted) for _, r in seq_emitted]
    tokens = [t for seq_emitted in emitted for t, _ in seq_emitted]
    if verified.row_best is not None:
        packed = [verified.row_best[r] for r in rows]
    elif all(v.logprobs is not None for v in verified.verdicts):  # read with the verdicts
        packed = [lp for v in verified.verdicts for lp in v.logprobs]
    else:
        flat = np.asarray(rows, dtype=np.int64) * verified.logprobs.shape[-1] + np.asarray(tokens, dtype=np.int64)
        packed = select_rows(verified.logprobs.reshape(-1), flat).tolist()
    starts = list(accumulate((len(e) for e in emitted), initial=0))
    return Accepted(emitted, [packed[starts[i] : starts[i + 1]] for i in range(len(emitted))])


@dataclass
class Kept:
    observed: list[tuple[Sequence, int, list[int], list[int]]]  # (seq, first position, rows, logit rows)
    drafted: int
    accepted: int
    emitted: int


def commit(
    seqs: Seq[Sequence], trees: Seq[DraftTree], verified: Verified, accepted: Accepted, cache: PagedKVCache
) -> Kept:
    """Keep each sequence's accepted K/V, append its emitted tokens (up to where it is done) and
    count them; no sequence is finished here."""
    out = Kept([], sum(len(t) for t in trees), 0, 0)
    for i, (seq, tree, verdict) in enumerate(zip(seqs, trees, verified.verdicts)):
        keep_accepted_kv(cache, seq, verdict.path)
        first_position = seq.num_cached
        seq.num_cached += 1 + len(verdict.path)
        seq.num_spec_steps += 1
        seq.num_drafted += len(tree)
        seq.num_accepted += len(verdict.path)
        out.accepted += len(verdict.path)
        kept = []
        for (token, row), logprob in zip(accepted.tokens[i], accepted.logprobs[i]):
            seq.append(token, logprob)
            kept.append(verified.first_rows[i] + row)
            out.emitted += 1
            if seq.done:
                break
        out.observed.append((seq, first_position, kept, kept))
    return out
