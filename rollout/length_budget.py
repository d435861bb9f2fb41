"""A length-aware speculation budget (DAS-style): in a speculative step only the sequences expected
to set the batch's makespan draft; the others take the verification forward with no draft (one
token, as in plain decoding) and cost it almost nothing.

A sequence's expected remaining length is its predicted completion length (handed over with the
request, e.g. by the coordinator's length predictor) minus what it has generated; one that has
outlived its prediction expects as many more tokens as it has generated (lengths are heavy-tailed:
the longer a completion runs, the longer it is likely to run on). A sequence without a prediction
counts as the longest. The sequences whose expected
remaining length is at least ``ratio`` times the batch's longest draft in full.

``spread_mask`` picks the few sequences that draft in the selector's probe step (an arm's first,
cheap try on a large batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

from .request import Sequence


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


def spread_mask(n: int, m: int) -> list[bool]:
    """``m`` of ``n`` sequences, evenly spread over the batch (a probe step's drafting sequences)."""
    if m >= n:
        return [True] * n
    chosen = {(i * n) // m for i in range(m)}
    return [i in chosen for i in range(n)]
