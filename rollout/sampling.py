"""Sampling as small pure functions over batched logits.

``processed_logprobs`` turns raw logits into the log-probabilities of the *processed
distribution* (temperature, then top-k, top-p, min-p, the order Hugging Face ``generate``
uses), one parameter set per row. ``sample_from_logprobs`` draws from it by inverse CDF with
one uniform per row, so the randomness of a request can come from its own generator and a
request's samples do not depend on which other requests share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from ..kernels.transfers import to_device
from .params import SamplingParams
from .position_noise import keyed_scores


@dataclass
class BatchSamplingTensors:
    """Per-row sampling parameters as tensors on the logits' device, queued there without waiting
    (``kernels/transfers.py``). An all-greedy batch reads none of them (its token is the argmax),
    so it keeps them on the host."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    any_greedy: bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # the largest top_k when every row asks for one, else 0 (some row keeps all): top-k's width,
    # known on the host, where reading it from the tensor would wait for the device
    widest_top_k: int = 0

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device, repeats: Sequence[int] | None = None
    ) -> BatchSamplingTensors:
        """One row per entry of ``params``, or ``repeats[i]`` rows for entry ``i`` (one per scored
        position of a sequence); built on the host and queued to ``device`` without waiting."""
        if repeats is not None:
            params = [p for p, n in zip(params, repeats) for _ in range(n)]
        temps = [p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        all_greedy = all(t == 0 for t in temps)
        device = torch.device("cpu") if all_greedy else device
        return cls(
            temperature=to_device(np.asarray(temps, dtype=np.float32), device),
            top_k=to_device(np.asarray(top_k, dtype=np.int64), device),
            top_p=to_device(np.asarray(top_p, dtype=np.float32), device),
            min_p=to_device(np.asarray(min_p, dtype=np.float32), device),
            any_greedy=any(t == 0 for t in temps),
            all_greedy=all_greedy,
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0 for m in min_p),
            widest_top_k=max(top_k) if top_k and min(top_k) > 0 else 0,
        )


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature; greedy rows (T = 0) are left unscaled."""
    safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / safe.unsqueeze(-1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, widest: int | None = None) -> torch.Tensor:
    """Keep the ``top_k`` largest logits of each row (0 = keep all); ties at the edge are kept.
    ``widest``: the largest ``top_k`` when every row has one, else 0, if the caller knows it."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    width = int(k.max().item()) if widest is None else (widest if 0 < widest < vocab else vocab)
    kth = torch.topk(logits, width, dim=-1).values
    threshold = kth.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove_sorted = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def processed_logprobs(logits: torch.Tensor, st: BatchSamplingTensors) -> torch.Tensor:
    """Log-probabilities of the processed distribution, shape ``[B, V]``, in float32.

    Greedy rows get the plain log-softmax of their logits (their token is the argmax either way).
    """
    x = logits.float()
    if not st.all_greedy:
        x = apply_temperature(x, st.temperature)
        filtered = x
        if st.any_top_k:
            filtered = apply_top_k(filtered, st.top_k, st.widest_top_k)
        if st.any_top_p:
            filtered = apply_top_p(filtered, st.top_p)
        if st.any_min_p:
            filtered = apply_min_p(filtered, st.min_p)
        if st.any_greedy:
            filtered = torch.where((st.temperature > 0).unsqueeze(-1), filtered, x)
        x = filtered
    return torch.log_softmax(x, dim=-1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one index per row of non-negative (not necessarily normalised) ``probs``.

    The CDF is accumulated in float64 and scaled by its own total, so rounding can never select
    an entry of zero probability.
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, uniforms.double().unsqueeze(-1) * total, right=True)
    last_positive = (cdf < total).sum(dim=-1, keepdim=True)  # the last entry with probability > 0
    return torch.minimum(idx, last_positive).squeeze(-1)


def sample_from_logprobs(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from ``exp(logprobs)`` using ``uniforms`` in [0, 1) (see :func:`sample_from_probs`)."""
    return sample_from_probs(logprobs.double().exp(), uniforms)


def choose_tokens(
    logprobs: torch.Tensor,
    st: BatchSamplingTensors,
    uniforms: torch.Tensor | None,
    keyed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Greedy rows take the argmax, the others sample with their uniform; position-keyed rows
    (``keyed``: perturbed scores and their row mask, ``rollout/position_noise.py``) take the
    argmax of their scores."""
    greedy_tokens = logprobs.argmax(dim=-1)
    if st.all_greedy:
        return greedy_tokens
    assert uniforms is not None, "sampled rows need uniforms"
    chosen = sample_from_logprobs(logprobs, uniforms)
    if st.any_greedy:
        chosen = torch.where(st.temperature == 0, greedy_tokens, chosen)
    if keyed is not None:
        scores, rows = keyed
        chosen = torch.where(rows, scores.argmax(dim=-1), chosen)
    return chosen


def sample_tokens(
    seqs: Sequence[Any], logits: torch.Tensor, fallback: torch.Generator, ahead: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's next token from its row of ``logits`` under its own sampling parameters,
    and the token's logprob under the processed distribution, both left on the logits' device.
    ``seqs`` are the engine's sequences (their ``params``, ``generator`` and ``output_ids``);
    unseeded rows draw from ``fallback``. ``ahead[i]``: tokens sampled for sequence ``i`` that its
    ``output_ids`` do not hold yet (still on the device), so that a position-keyed row keys on the
    token's own index."""
    st = BatchSamplingTensors.from_params([s.params for s in seqs], logits.device)
    logprobs = processed_logprobs(logits, st)
    uniforms = None
    if not st.all_greedy:
        uniforms = to_device(draw_uniforms([s.generator for s in seqs], fallback), logits.device)
    keyed = None
    if any(s.params.position_keyed for s in seqs):
        emitted = [len(s.output_ids) + (ahead[i] if ahead is not None else 0) for i, s in enumerate(seqs)]
        keyed = keyed_scores(logprobs, [s.params for s in seqs], emitted)
    chosen = choose_tokens(logprobs, st, uniforms, keyed)
    return chosen, logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)


def draw_uniforms(
    generators: Sequence[torch.Generator | None], fallback: torch.Generator, counts: Sequence[int] | None = None
) -> torch.Tensor:
    """``counts[i]`` uniforms (default one) for row ``i``, concatenated: from the row's own generator
    when it has one (seeded requests, whose draws then do not depend on the rest of the batch),
    else from ``fallback``."""
    sizes = list(counts) if counts is not None else [1] * len(generators)
    ends = list(accumulate(sizes))
    out = torch.empty(ends[-1] if ends else 0, dtype=torch.float64)
    shared = [(end - n, end) for g, n, end in zip(generators, sizes, ends) if g is None and n > 0]
    if shared:
        draws = torch.rand(sum(e - s for s, e in shared), generator=fallback, dtype=torch.float64)
        out[torch.cat([torch.arange(s, e) for s, e in shared])] = draws
    for g, n, end in zip(generators, sizes, ends):
        if g is not None and n > 0:
            out[end - n : end] = torch.rand(n, generator=g, dtype=torch.float64)
    return out


def store_prompt_logprobs(scored: list[tuple[Any, int]], span_logits: torch.Tensor, followers: dict[int, list]) -> None:
    """Unprocessed log-probabilities of each scored prompt span (``(leader, n)``: the last ``n``
    prompt tokens of ``leader``); a group's followers (same prompt) take the suffix of their
    leader's span that they asked for."""
    targets = [tok for seq, n in scored for tok in seq.prompt_ids[len(seq.prompt_ids) - n :]]
    target = to_device(np.asarray(targets, dtype=np.int64), span_logits.device).unsqueeze(-1)
    picked = torch.log_softmax(span_logits.float(), dim=-1).gather(-1, target).squeeze(-1).tolist()
    offset = 0
    for leader, n in scored:
        span = picked[offset : offset + n]
        offset += n
        for seq in [leader, *followers.get(leader.seq_id, [])]:
            k = seq.params.prompt_logprobs
            if k and seq.prompt_logprobs is None:
                seq.prompt_logprobs = span[n - k :]
