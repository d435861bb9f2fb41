"""The engine's decode step, one shape for every strategy, as gpt-fast reads it: propose -> forward ->
verify -> commit (the functions of ``rollout/spec/step.py``).

* **propose**: the :class:`Proposer`'s drafts, one tree per sequence; plain decoding's are all empty.
* **forward**: one target forward over each sequence's pending token and its draft nodes.
* **verify**: an empty draft needs no verification: its token is sampled on the device and its read
  queued (:class:`Sampled`); a draft is verified against the target's processed distribution
  (``rollout/spec/verify.py``: why the output is exactly the target's).
* **commit**: the tokens appended (stopped sequences finished), the kept K/V moved into place, what
  a feature-reading drafter observes handed over.

A step with empty drafts can leave its commit for later (``RolloutConfig(overlap=True)``): the next
step is launched on its tokens while they are still on the device, and reads them after its own
launch (``rollout/sampled.py`` says what that changes). A step with drafts reads the step in flight
first: drafting and verification read every token on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..kernels.transfers import QueuedRead
from .feature_taps import FeatureTaps
from .model.runner import ModelRunner
from .params import RolloutConfig
from .proposer import Proposal, Proposer
from .request import SeqStatus, Sequence
from .sampled import Sampled
from .sampling import sample_tokens
from .spec.device_step import DeviceLaunch, DeviceSteps
from .spec.kv_blocks import pack_verify_batch, release_unused_blocks
from .spec.step import accept, commit, verify
from .stats import Drafted, EngineStats, StepResult
from .strategy import Strategy


class DecodeStep:
    def __init__(
        self,
        runner: ModelRunner,
        config: RolloutConfig,
        proposer: Proposer,
        taps: FeatureTaps,
        generator: torch.Generator,
        stats: EngineStats,
        finish: Callable[[Sequence], None],
        max_model_len: int,
    ) -> None:
        self.runner, self.config, self.proposer, self.taps = runner, config, proposer, taps
        self.generator, self.stats, self.finish = generator, stats, finish
        self.on_device = DeviceSteps(
            runner, proposer.drafter, max_model_len, stats, finish, generator, taps.layers, taps.observer
        )
        # a step whose tokens are not read yet (config.overlap): a plain one, or a chain's or tree's on the device
        self.in_flight: Sampled | DeviceLaunch | None = None

    def __call__(self, seqs: list[Sequence], strategy: Strategy, overlap: bool) -> StepResult:
        """One step of ``strategy`` over ``seqs`` (``overlap``: it may be left in flight)."""
        finished: list[int] = []
        if strategy.speculative and overlap and self.on_device.serves(strategy):
            if self.in_flight is not None and not isinstance(self.in_flight, DeviceLaunch):
                finished, seqs = self._read_first(seqs)  # a plain step's tokens: the host's state, exact again
            launched = self.on_device.launch(seqs, strategy, self.in_flight) if seqs else None
            if launched is not None:
                done, drafted = self._read(consumed=True)
                self.in_flight = launched
                self.stats.overlapped_steps += 1
                return StepResult(finished + done, drafted, launched=True)
        if self.in_flight is not None and (strategy.speculative or isinstance(self.in_flight, DeviceLaunch)):
            # a host-read step drafts and verifies from tokens on the host, and a plain step's inputs
            # are a plain step's tokens: the step in flight is read first
            done, seqs = self._read_first(seqs)
            finished += done
        if not seqs:
            return StepResult(finished)
        done, drafted = self._step(seqs, strategy, overlap)
        return StepResult(finished + done, drafted)

    def _read_first(self, seqs: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """Read the step in flight; the requests it finished, and those of ``seqs`` still running."""
        finished = self.settle()
        return finished, [seq for seq in seqs if seq.status is SeqStatus.RUNNING]

    def _step(self, seqs: list[Sequence], strategy: Strategy, overlap: bool) -> tuple[list[int], Drafted | None]:
        start = time.perf_counter()
        proposal = self.proposer.propose(seqs, strategy, self.runner.cache.allocator, self.config.block_size)
        drafted_at = time.perf_counter()
        pending = self.in_flight.inputs_for(seqs) if self.in_flight is not None else None
        slices, tokens, positions = pack_verify_batch(seqs, proposal.trees, pending)
        with proposal.around_forward(self.runner, seqs):
            logits = self.forward(slices, tokens, positions, list(range(len(positions))))
        if proposal.plain:
            return self._sampled(seqs, logits, overlap), None
        return self._verified(seqs, proposal, logits, [s.num_new for s in slices], start, drafted_at)

    def forward(self, slices, tokens, positions: list[int], logits_index: list[int]) -> torch.Tensor:
        """The target forward (tapping features when a drafter reads them), timed."""
        start = time.perf_counter()
        logits = self.taps.forward(slices, tokens, positions, logits_index)
        self.stats.model_time_s += time.perf_counter() - start
        return logits

    def _sampled(self, seqs: list[Sequence], logits: torch.Tensor, overlap: bool) -> list[int]:
        """Empty drafts: one token each, sampled on the device; kept in flight when ``overlap``."""
        if self.taps.layers:  # one row per sequence, built only for a drafter that reads features
            self.taps.observe([(seq, seq.num_cached, [row], [row]) for row, seq in enumerate(seqs)], logits)
        for seq in seqs:
            seq.num_cached += 1
        self.stats.decode_steps += 1
        self.stats.batch_sizes.append(len(seqs))
        launched = self.sample(seqs, logits)
        finished = self.settle()
        if overlap:
            self.in_flight = launched
            self.stats.overlapped_steps += 1
            return finished
        return finished + self.append(launched)

    def _verified(
        self, seqs: list[Sequence], proposal: Proposal, logits, num_new: list[int], start: float, drafted_at: float
    ) -> tuple[list[int], Drafted]:
        """Drafts: verified, the accepted tokens and K/V committed, the rejected drafts' blocks freed."""
        trees, bases = proposal.trees, [seq.num_tokens for seq in seqs]
        verified = verify(seqs, trees, logits, num_new, self.generator)
        committed = commit(seqs, trees, verified, accept(trees, verified), self.runner.cache)
        self.stats.generated_tokens += committed.emitted
        proposal.verified(seqs, verified.verdicts, bases)
        self.taps.observe(committed.observed, logits)  # before finishing: a recording drafter needs every feature
        allocator, bs = self.runner.cache.allocator, self.config.block_size
        for seq in seqs:
            if not seq.done:
                release_unused_blocks(seq, allocator, bs)
        self.stats.record_spec_step(
            str(proposal.strategy),
            len(seqs),
            committed.drafted,
            committed.accepted,
            committed.emitted,
            drafted_at - start,
            time.perf_counter() - drafted_at,
        )
        finished = [seq for seq in seqs if seq.done]
        for seq in finished:
            self.finish(seq)
        paths = [v.path for v in verified.verdicts]
        branches = [t.first_branch(p) for t, p in zip(trees, paths)]
        return [seq.seq_id for seq in finished], Drafted([len(t) for t in trees], [len(p) for p in paths], branches)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> Sampled:
        """Each sequence's next token, sampled on the device; its read to the host queued."""
        tokens, logprobs = sample_tokens(seqs, logits, self.generator, [seq.tokens_in_flight for seq in seqs])
        for seq in seqs:
            seq.tokens_in_flight += 1
        return Sampled(seqs, tokens, QueuedRead(tokens, logprobs))

    def settle(self) -> list[int]:
        """Read the step in flight, if one is: its tokens appended, its finished requests finished."""
        return self._read()[0]

    def _read(self, consumed: bool = False) -> tuple[list[int], Drafted | None]:
        """:meth:`settle`, with what a speculative step read drafted and accepted (``consumed``: a
        step launched since drafted from its state on the device)."""
        launched, self.in_flight = self.in_flight, None
        if isinstance(launched, DeviceLaunch):
            return self.on_device.read(launched, consumed)
        return (self.append(launched) if launched is not None else []), None

    def append(self, sampled: Sampled) -> list[int]:
        """Append the sampled tokens (waiting for them); the ids of the requests they finished. A
        row of a request that finished, was aborted or handed over meanwhile is dropped."""
        tokens, logprobs = sampled.read()
        finished = []
        for seq, token, logprob in zip(sampled.seqs, tokens, logprobs):
            seq.tokens_in_flight -= 1
            if seq.status is SeqStatus.FINISHED:
                self.stats.dropped_rows += 1
                continue
            seq.append(token, logprob)
            self.stats.generated_tokens += 1
            if seq.done:
                self.finish(seq)
                finished.append(seq.seq_id)
        return finished
