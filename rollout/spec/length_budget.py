"""A length-aware speculation budget (DAS-style): in a speculative step only the sequences expected
to set the batch's makespan draft; the others take the verification forward with no draft (one
token, as in plain decoding) and cost it almost nothing.

A sequence's expected remaining length is its predicted completion length (handed over with the
request, e.g. by the coordinator's length predictor) minus what it has generated; one that has
outlived its prediction expects as many more tokens as it has generated (lengths are heavy-tailed:
the longer a completion runs, the longer it is likely to run on). A sequence without a prediction
counts as the longest. The sequences whose expected
remaining length is at least ``ratio`` times the batch's longest draft in full.

``tokens_to_go`` sums the same expectation over a batch: the work ``adaptive`` weighs a drafter's
catch-up against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

from ..request import Sequence


def expected_remaining(seq: Sequence) -> float:
    if seq.expected_length is None:
        return math.inf
    generated = len(seq.output_ids)
    left_by_limit = seq.params.max_new_tokens - generated
    return max(1.0, min(float(left_by_limit), max(seq.expected_length - generated, float(generated))))


def drafting_mask(seqs: Seq[Sequence], ratio: float) -> list[bool]:
    """Which sequences draft this step (all of them when ``ratio`` is 0)."""
    if ratio <= 0 or not seqs:
        return [True] * len(seqs)
    remaining = [expected_remaining(s) for s in seqs]
    longest = max(remaining)
    if math.isinf(longest):
        return [math.isinf(r) for r in remaining]
    return [r >= ratio * longest for r in remaining]


def tokens_to_go(seqs: Seq[Sequence]) -> int:
    """Tokens the batch is expected to generate still: each sequence's expected remaining length,
    or what its ``max_new_tokens`` leaves without a prediction (as far as the host has read)."""
    return sum(int(min(expected_remaining(s), s.params.max_new_tokens - len(s.output_ids))) for s in seqs)
