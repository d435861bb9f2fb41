"""Training data for the EAGLE-3 head, captured from the target forwards the engine already runs.

A :class:`Eagle3Sample` is one finished sequence: its tokens, the target features of every token
but the last (the last token is never fed to the target), and for each completion token the
target's top-k distribution it was drawn from (soft labels). :class:`SequenceRecorder` assembles
samples from the engine's per-step observations (only tokens the sequence kept: prefill, plain
decode, and the accepted part of every verification); :class:`FeatureBuffer` holds them under a
byte cap, keeping the most recent ones or a uniform reservoir sample, and draws training batches
uniformly or weighted towards the samples the head fails on (its last loss on each).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import torch

from ...kernels.transfers import QueuedCopy

BUFFER_POLICIES = ("recent", "reservoir")


@dataclass
class Eagle3Sample:
    tokens: torch.Tensor  # [n] int64
    features: torch.Tensor  # [n - 1, feature_size]: target features of tokens 0 .. n-2
    prompt_len: int
    label_ids: torch.Tensor | None = None  # [n - prompt_len, k] target top-k ids for tokens prompt_len .. n-1
    label_probs: torch.Tensor | None = None  # [n - prompt_len, k] their probabilities

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if n < 2 or self.features.shape[0] != n - 1:
            raise ValueError(f"a sample of {n} tokens needs {n - 1} feature rows, got {self.features.shape[0]}")
        if not 1 <= self.prompt_len < n:
            raise ValueError(f"prompt_len must be in [1, {n - 1}], got {self.prompt_len}")
        if (self.label_ids is None) != (self.label_probs is None):
            raise ValueError("label_ids and label_probs come together")
        if self.label_ids is not None and self.label_ids.shape[0] != n - self.prompt_len:
            raise ValueError(
                f"soft labels cover {self.label_ids.shape[0]} tokens, the completion has {n - self.prompt_len}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        tensors = [self.tokens, self.features, self.label_ids, self.label_probs]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class FeatureBuffer:
    """Samples under a byte cap. ``recent`` drops the oldest; ``reservoir`` keeps a uniform sample
    of everything ever added (Algorithm R over samples, evicting until the cap holds)."""

    def __init__(self, max_bytes: int = 256 << 20, policy: str = "recent", seed: int = 0) -> None:
        if not (isinstance(max_bytes, int) and max_bytes > 0):
            raise ValueError(f"max_bytes must be an int > 0, got {max_bytes!r}")
        if policy not in BUFFER_POLICIES:
            raise ValueError(f"policy must be one of {BUFFER_POLICIES}, got {policy!r}")
        self.max_bytes = max_bytes
        self.policy = policy
        self._samples: deque[Eagle3Sample] = deque()
        self._bytes = 0
        self._rng = random.Random(seed)
        self._losses: dict[int, float] = {}  # id(sample) -> the head's last loss on it (kept samples only)
        self.num_seen = 0
        self.num_tokens_seen = 0

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def add(self, sample: Eagle3Sample) -> bool:
        """Add a sample; False if it was not kept (larger than the cap, or lost the reservoir draw)."""
        self.num_seen += 1
        self.num_tokens_seen += sample.num_tokens
        if sample.nbytes > self.max_bytes:
            return False
        if self.policy == "reservoir" and self._bytes + sample.nbytes > self.max_bytes:
            # keep with probability len / seen, replacing a uniformly chosen sample
            if self._rng.random() >= len(self._samples) / self.num_seen:
                return False
            self._remove(self._rng.randrange(len(self._samples)))
        while self._samples and self._bytes + sample.nbytes > self.max_bytes:
            self._remove(0)
        self._samples.append(sample)
        self._bytes += sample.nbytes
        return True

    def _remove(self, index: int) -> None:
        victim = self._samples[index]
        del self._samples[index]
        self._bytes -= victim.nbytes
        self._losses.pop(id(victim), None)

    def sample(self, n: int, generator: random.Random, focus: float = 0.0) -> list[Eagle3Sample]:
        """``n`` samples drawn with replacement: uniformly (``focus`` 0), or with probability
        proportional to ``loss ** focus``, the head's last loss on each (prioritised replay: where
        it fails). A sample it has not been trained on counts at the highest loss seen."""
        if not self._samples:
            raise ValueError("the feature buffer is empty; run rollouts with an EAGLE-3 drafter attached first")
        if focus <= 0 or not self._losses:
            return [self._samples[generator.randrange(len(self._samples))] for _ in range(n)]
        top = max(self._losses.values())
        weights = [max(self._losses.get(id(s), top), 1e-6) ** focus for s in self._samples]
        return generator.choices(list(self._samples), weights=weights, k=n)

    def record_losses(self, samples: list[Eagle3Sample], losses: list[float]) -> None:
        """The head's loss on each of ``samples`` in the step just taken (those still kept)."""
        kept = {id(s) for s in self._samples}
        for sample, loss in zip(samples, losses):
            if id(sample) in kept:
                self._losses[id(sample)] = float(loss)

    def samples(self) -> list[Eagle3Sample]:
        return list(self._samples)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the buffered samples (for a reduced draft vocabulary)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for s in self._samples:
            counts += torch.bincount(s.tokens, minlength=vocab_size)[:vocab_size]
        return counts


def soft_labels(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` next-token ids and probabilities (unprocessed softmax) per row, on
    the logits' device."""
    top = torch.topk(torch.softmax(logits.detach().float(), dim=-1), min(k, logits.shape[-1]), dim=-1)
    return top.indices, top.values


@dataclass
class _Recording:
    prompt_len: int
    features: list[torch.Tensor] = field(default_factory=list)  # host rows, copied
    labels: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # position -> (ids, probs)
    num_features: int = 0  # rows observed, their copies landed or still queued
    num_copied: int = 0  # rows in ``features``


@dataclass
class _Taker:
    """One sequence's part of a recorded forward: rows of the forward's queued copy."""

    seq_id: int
    recording: _Recording
    rows: slice
    logit_rows: slice
    first_label: int  # the position whose token the first logits row is the distribution of


@dataclass
class _QueuedForward:
    copy: QueuedCopy  # the forward's kept feature rows, then (with labels) top-k ids and probs
    takers: list[_Taker]


# One sequence's part of an observed forward, in the order of its rows:
# (seq_id, prompt_len, start, number of feature rows, number of logits rows after them)
RecordedPart = tuple[int, int, int, int, int]


class SequenceRecorder:
    """Builds :class:`Eagle3Sample` s from the engine's observations of live sequences.

    A forward's kept rows and soft labels go to the host in one queued copy (:class:`QueuedCopy`),
    so recording adds no wait for the device to a step: copies are taken over when they have
    landed, at the latest when a sequence finishes, and then only as far as its tokens reach
    (a launched step's row past them, still being computed, is not waited for)."""

    _MAX_QUEUED = 4  # forwards whose copies may be in flight; the oldest is waited for past this

    def __init__(self, label_topk: int = 8, dtype: torch.dtype | None = None) -> None:
        if not (isinstance(label_topk, int) and 0 <= label_topk <= 1024):
            raise ValueError(f"label_topk must be an int in [0, 1024] (0 = hard labels only), got {label_topk!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None (the features' own), got {dtype!r}")
        self.label_topk = label_topk
        self.dtype = dtype
        self._live: dict[int, _Recording] = {}
        self._queued: deque[_QueuedForward] = deque()

    def observe(self, seq_id: int, prompt_len: int, start: int, features: torch.Tensor, next_logits: torch.Tensor):
        """One sequence's rows: features of positions ``start ..`` and the logits after the last
        ``next_logits.shape[0]`` of them (:meth:`observe_batch` of one)."""
        part = (seq_id, prompt_len, start, features.shape[0], next_logits.shape[0])
        self.observe_batch([part], features, next_logits)

    def observe_batch(self, parts: list[RecordedPart], features: torch.Tensor, next_logits: torch.Tensor) -> None:
        """One forward's kept rows of every sequence in ``parts``, packed in that order, and the
        logits rows after them, packed the same way."""
        self._take_landed()
        takers, row, logit_row = [], 0, 0
        for seq_id, prompt_len, start, num_rows, num_logits in parts:
            rec = self._recording(seq_id, prompt_len, start)
            if rec is not None:
                rows, logit_rows = slice(row, row + num_rows), slice(logit_row, logit_row + num_logits)
                takers.append(_Taker(seq_id, rec, rows, logit_rows, first_label=start + num_rows - num_logits + 1))
                rec.num_features += num_rows
            row, logit_row = row + num_rows, logit_row + num_logits
        if not takers:
            return
        tensors = [features.detach().to(self.dtype or features.dtype)]
        if self.label_topk:
            tensors += soft_labels(next_logits, self.label_topk)
        self._queued.append(_QueuedForward(QueuedCopy(*tensors), takers))

    def _recording(self, seq_id: int, prompt_len: int, start: int) -> _Recording | None:
        """The recording that rows from ``start`` continue, or None when they cannot be recorded."""
        rec = self._live.get(seq_id)
        if rec is None or start < rec.num_features:  # new, or recomputed after a preemption
            if start != 0:
                self._live.pop(seq_id, None)  # joined mid-way: this sequence cannot be recorded whole
                return None
            rec = self._live[seq_id] = _Recording(prompt_len)
        elif start > rec.num_features:
            self._live.pop(seq_id, None)  # a gap: some tokens' features were never seen
            return None
        return rec

    def _take_landed(self) -> None:
        """Take over every queued copy that has landed, oldest first; past the queue's bound, wait
        for the oldest to make room."""
        while self._queued and (self._queued[0].copy.ready() or len(self._queued) >= self._MAX_QUEUED):
            self._take_oldest()

    def _take_oldest(self) -> None:
        """Each live taker's rows of the oldest queued forward, as host tensors of its own (a
        forward's copy is not kept alive by one sequence's rows)."""
        forward = self._queued.popleft()
        features, *labels = forward.copy.result()
        for taker in forward.takers:
            rec = taker.recording
            if self._live.get(taker.seq_id) is not rec:
                continue  # dropped, restarted or finished since
            rec.features.append(features[taker.rows].clone())
            rec.num_copied += taker.rows.stop - taker.rows.start
            if labels:
                ids, probs = (part[taker.logit_rows].clone() for part in labels)
                for j in range(ids.shape[0]):
                    rec.labels[taker.first_label + j] = (ids[j], probs[j])

    def finish(self, seq_id: int, token_ids: list[int]) -> Eagle3Sample | None:
        rec = self._live.get(seq_id)
        n = len(token_ids)
        if rec is None or rec.num_features < n - 1 or n < 2:
            self._live.pop(seq_id, None)
            return None
        while rec.num_copied < n - 1:  # the copies holding its rows (labels come with them)
            self._take_oldest()
        self._live.pop(seq_id)
        features = torch.cat(rec.features)[: n - 1]
        label_ids = label_probs = None
        wanted = range(rec.prompt_len, n)
        if self.label_topk and all(j in rec.labels for j in wanted):
            label_ids = torch.stack([rec.labels[j][0] for j in wanted])
            label_probs = torch.stack([rec.labels[j][1] for j in wanted])
        return Eagle3Sample(torch.tensor(token_ids, dtype=torch.long), features, rec.prompt_len, label_ids, label_probs)

    def drop(self, seq_id: int) -> None:
        self._live.pop(seq_id, None)
