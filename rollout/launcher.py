"""Every step the engine runs, launched: each returns a :class:`~tailspec.rollout.launched.Launched`
record whose commit brings its tokens to the host (``launched.py``).

* **prefill**: the scheduled prompts in one forward, each first token sampled on the device
  (:class:`Sampled`).
* **plain**: one token a sequence; its inputs are the step before's tokens still on the device
  when that step was a plain one holding every sequence (``sampled.py``), the host's otherwise.
* **speculative**: the drafter the strategy names drafts, the one way there is
  (``Drafter.draft``), from the state it asks its :class:`EngineDraftStep` for: drafts from the
  device's state are run and verified there, nothing read (``spec/device_step.py``); drafts from
  the host's text, whose drafter had the step before committed first, are verified on the host and
  committed before the launch returns (``host_step.py``).

The loop does not know which steps committed the step before them.
"""

from __future__ import annotations

import time

import torch

from ..draft_contract import DeviceDrafts
from ..kernels.transfers import QueuedRead
from .feature_taps import FeatureTaps
from .host_step import HostVerified
from .launched import Launched, committed_first
from .model.runner import ModelRunner
from .params import RolloutConfig
from .prefill import commit_prefill, pack_prefill
from .proposer import Proposal, Proposer
from .request import Sequence
from .request_book import RequestBook
from .sampled import Sampled
from .sampling import sample_tokens, store_prompt_logprobs
from .scheduler import ScheduledBatch
from .spec.device_step import DeviceSteps
from .spec.draft_step import EngineDraftStep
from .spec.kv_blocks import pack_plain_batch, pack_verify_batch
from .spec.step import verify
from .stats import EngineStats
from .strategy import Strategy


class StepLauncher:
    def __init__(
        self,
        runner: ModelRunner,
        config: RolloutConfig,
        proposer: Proposer,
        taps: FeatureTaps,
        stats: EngineStats,
        requests: RequestBook,
    ) -> None:
        self.runner, self.config, self.proposer, self.taps, self.stats = runner, config, proposer, taps, stats
        self.finish = requests.finish
        self.generator = torch.Generator().manual_seed(config.seed)  # draws of rows without a seed of their own
        self.max_model_len = requests.limits.max_model_len
        self.on_device = DeviceSteps(
            runner,
            stats,
            self.finish,
            self.generator,
            taps.layers,
            taps.observer,
        )

    def decode(self, seqs: list[Sequence], strategy: Strategy, previous: Launched | None) -> Launched | None:
        """A decode step of ``strategy`` over ``seqs`` (None: each of them stopped on a token of the
        step before, committed first)."""
        self.proposer.before_step(strategy)
        if strategy.speculative:
            return self._speculative(seqs, strategy, previous)
        pending = previous.inputs_for(seqs) if isinstance(previous, Sampled) else None
        if pending is None:
            seqs = committed_first(seqs, previous)
        return self._plain(seqs, pending) if seqs else None

    def _speculative(self, seqs: list[Sequence], strategy: Strategy, previous: Launched | None) -> Launched | None:
        """The drafter the strategy names drafts (from the device's state or the host's text: its
        choice, :class:`EngineDraftStep`); its drafts are verified where they are."""
        drafter = self.proposer.drafters.drafter_for(strategy)
        step = EngineDraftStep(seqs, strategy, previous, self.runner, self.max_model_len, self.config.length_budget)
        start = time.perf_counter()
        drafts = drafter.draft(step)
        draft_s = time.perf_counter() - start - step.commit_s
        if isinstance(drafts, DeviceDrafts):
            return self.on_device.launch(step, drafter, drafts, draft_s)
        trees = step.fitted(drafts, drafter.name)
        if not step.seqs:
            return None
        return self._verify_on_host(step.seqs, Proposal(step.strategy, trees, drafter), draft_s)

    def prefill(self, batch: ScheduledBatch) -> Sampled:
        """The scheduled prompts' forward; each sequence's first token sampled (a group's followers
        fork their leader's blocks and sample from its row)."""
        pack = pack_prefill(batch)
        logits = self.forward(pack.slices, pack.tokens, pack.positions, pack.logits_index)
        if pack.scored:
            store_prompt_logprobs(pack.scored, logits[len(pack.last) :], batch.followers)
            logits = logits[: len(pack.last)]
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += len(pack.tokens)
        seqs, rows, observed = commit_prefill(batch, pack, self._fork_from)
        self.taps.observe(observed, logits)
        self.stats.forked_prefills += len(seqs) - len(batch.seqs)
        return self.sample(seqs, logits[rows] if len(rows) != len(batch.seqs) else logits)

    def forward(self, slices, tokens, positions: list[int], logits_index: list[int]) -> torch.Tensor:
        """The target forward (tapping features when a drafter reads them), timed."""
        start = time.perf_counter()
        logits = self.taps.forward(slices, tokens, positions, logits_index)
        self.stats.model_time_s += time.perf_counter() - start
        return logits

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, ahead: int = 0) -> Sampled:
        """Each sequence's next token, sampled on the device, its read queued (``ahead``: tokens each
        sequence has in flight already, which position-keyed rows count)."""
        tokens, logprobs = sample_tokens(seqs, logits, self.generator, [ahead] * len(seqs))
        return Sampled(seqs, tokens, QueuedRead(tokens, logprobs), self.finish, self.stats)

    def _plain(self, seqs: list[Sequence], pending: torch.Tensor | None) -> Sampled:
        """One token each: the forward over each sequence's pending token (``pending``: the step
        before's tokens, still on the device; position-keyed rows count that token in flight)."""
        slices, tokens, positions = pack_plain_batch(seqs, pending)
        logits = self.forward(slices, tokens, positions, list(range(len(positions))))
        if self.taps.layers:  # one row per sequence, built only for a drafter that reads features
            self.taps.observe([(seq, seq.num_cached, [row], [row]) for row, seq in enumerate(seqs)], logits)
        for seq in seqs:
            seq.num_cached += 1
        self.stats.decode_steps += 1
        self.stats.batch_sizes.append(len(seqs))
        return self.sample(seqs, logits, int(pending is not None))

    def _verify_on_host(self, seqs: list[Sequence], proposal: Proposal, draft_s: float) -> HostVerified:
        """Drafts from the host's text, verified on the host and committed before it returns."""
        start = time.perf_counter()
        slices, tokens, positions = pack_verify_batch(seqs, proposal.trees)
        with proposal.around_forward(self.runner, seqs):
            logits = self.forward(slices, tokens, positions, list(range(len(positions))))
        forward_s = time.perf_counter() - start
        verified = verify(seqs, proposal.trees, logits, [s.num_new for s in slices], self.generator)
        seconds = (draft_s, forward_s, time.perf_counter() - start)  # verifying: the forward's too
        step = HostVerified(
            seqs,
            proposal,
            verified,
            logits,
            seconds,
            self.runner.cache,
            self.runner.states,
            self.taps,
            self.stats,
            self.finish,
        )
        step.commit()
        return step

    def _fork_from(self, leader: Sequence, member: Sequence) -> None:
        """Member shares the leader's full blocks; copy the leader's partial last block."""
        partial = leader.num_tokens % self.config.block_size
        if partial:
            self.runner.cache.copy_block(leader.block_table[-1], member.block_table[-1], partial)
        if self.runner.states is not None:  # a recurrent model's state after the leader's prompt
            self.runner.states.copy(leader.state_slot, member.state_slot)
        member.num_cached = leader.num_cached
