"""Speculative steps whose state stays on the device: step N + 1 is launched before step N is read.

A speculative step read on the host before the next one is planned leaves the device idle while
the host reads accept lengths, appends tokens and builds the next inputs. Here, as in SGLang's
spec v2 and vLLM's async scheduling with speculative decoding, the device tensors are the truth
and the host is one step behind:

* **On the device**, per running sequence: ``cached`` (the tokens whose K/V the target cache
  holds: its pending token's position) and ``last_two`` (its tokens at ``cached - 1`` and
  ``cached``, the second one pending). A step's drafter drafts from them (``draft_step.py``: the
  drafter LM feeds the two tokens, then its chain, each token picked by the request's sampling
  rule), runs the target over ``[pending, drafts]`` at positions ``cached .. cached + k``, and
  verifies every row at once: greedy rows accept drafts equal to the argmax, sampled rows by
  speculative sampling (:func:`sampled_chain_verdicts`, with uniforms drawn on the host and
  queued), up to the first rejection ``L`` (a cumulative product). It leaves the next step's
  state, ``cached + L + 1`` and ``[token at cached + L, final token]``. Nothing is read for it.
* **The host assumes full acceptance.** Launching step N + 1 it knows each sequence's length up
  to step N - 1 (read), so step N + 1's pending token lies at most ``k + 1`` past it: it reserves
  blocks (target and drafter) for that bound plus the ``k + 1`` tokens step N + 1 writes, and
  pads every shape to it. A batch that cannot get the room or would pass ``max_model_len`` is
  drafted from the host's text instead (``rollout/host_step.py``). Position-keyed rows, whose noise follows each
  token's completion index, take that index from the device lengths.
* **Rejected slots are never attended to.** Step N writes K/V at ``cached .. cached + k``; a
  sequence that accepted ``L`` drafts keeps ``cached .. cached + L`` (chain node ``j`` is written
  at its own position), and its next pending token is written at ``cached + L + 1``, overwriting
  the first rejected slot; every later query attends to keys below its own index only (the mask
  is ``key <= cached + row``, the kernel's ``cached_lens``), and each step's slots past its
  accepted tokens are rewritten by the next step before any query can reach them. The drafter's
  state follows the same rule with the two tokens it feeds: the first rewrites the last kept
  slot, so a fully accepted chain (whose last draft it never fed) is covered too.
* **Trees** take the same course with static
  shapes: the drafter grows a best-first tree of ``n`` nodes per sequence on the device, the
  target runs the pending token and the nodes (node ``i`` at cache index ``cached + 1 + i``, at
  position ``cached + depth``, seeing its ancestors), ``verdicts.tree_verdicts`` walks every
  tree at once as ``verify.py`` walks one, and ``keep_path_kv`` moves the accepted nodes' K/V to
  ``cached + 1 ..``, so the sequence's cache is a chain's again before the next step reads it. The
  host reserves for ``n`` nodes, and the next step's pending token is at most ``depth + 1`` past.
* **Stops are applied at the commit**, one step late: tokens after a stop token or past
  ``max_new_tokens`` are dropped, never returned; a sequence that finished in step N has a row in
  step N + 1, computed and dropped (its blocks are freed after that row's writes are queued, so
  whoever gets them next writes after it). An unseeded sampled request's dropped row draws from
  the engine's generator, as a launched plain step's does (``rollout/sampled.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...draft_contract import DeviceDraftInputs, DeviceDrafts, Drafter, DraftTree, Settled, StepOnDevice
from ...kernels.transfers import QueuedRead, to_device
from ..launched import Committed, Launched
from ..model.device_inputs import BlockTables, completion_offsets
from ..model.runner import ModelRunner
from ..position_noise import keyed_scores_at
from ..request import SeqStatus, Sequence
from ..sampling import BatchSamplingTensors, draw_uniforms, processed_logprobs
from ..stats import Drafted, EngineStats
from ..strategy import Strategy
from .device_tree import keep_path_kv, tree_rows
from .verdicts import greedy_chain_verdicts, sampled_chain_verdicts, tree_verdicts

if TYPE_CHECKING:
    from .draft_step import EngineDraftStep


class DeviceLaunch(Launched):
    """A step launched from state on the device: its sequences (rows), the next step's state on the
    device, and the queued read of what it emitted (a tree's nodes and accepted path too)."""

    def __init__(
        self,
        steps: DeviceSteps,
        seqs: list[Sequence],
        strategy: Strategy,
        drafter: Drafter,
        step: StepOnDevice,
        fed: torch.Tensor,
        pending: QueuedRead,
        logits: torch.Tensor | None,
        draft_s: float,
        verify_s: float,
    ) -> None:
        super().__init__(seqs, steps.stats)
        self.steps, self.strategy, self.drafter = steps, strategy, drafter
        self.step: StepOnDevice | None = step  # what its verification left: what the next step's drafter reads
        cached, emitted, accepted = step.cached, step.emitted, step.accepted
        self.cached = cached + accepted + 1  # [B] the next step's: each sequence's cached tokens after this step
        last_kept = emitted.gather(1, (accepted - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        before_pending = torch.where(accepted > 0, last_kept, fed)  # fed: [B] the pending tokens it ran
        final = emitted.gather(1, accepted.unsqueeze(1)).squeeze(1)
        self.last_two = torch.stack([before_pending, final], dim=1)  # [B, 2] the next step's last two tokens
        # the emitted tokens [B, depth + 1], accept lengths [B], their logprobs [B, depth + 1]; a tree's
        # tokens and parents [B, n] and accepted nodes [B, depth]
        self.pending: QueuedRead | None = pending
        self.logits: torch.Tensor | None = (
            logits  # [B * (k + 1), V] with a drafter reading features: what it is handed at the commit
        )
        self.draft_s, self.verify_s = draft_s, verify_s
        self.consumed = False  # a step launched since drafted from this one's state

    def _commit(self) -> Committed:
        committed = self.steps.read(self)
        self.pending = self.logits = self.step = None  # read: the loop holds the record a step longer
        return committed

    def cache_ahead(self, seq: Sequence) -> int:
        return 0 if self.committed or not self.holds(seq) else self.strategy.shape.depth + 1

    def next_inputs(self, rows: list[int]) -> DeviceDraftInputs:
        """What the next step over this step's ``rows`` drafts from, picked on the device."""
        self.consumed = True
        if rows == list(range(len(self.seqs))):
            return DeviceDraftInputs(self.cached, self.last_two, self.step)
        index = to_device(np.asarray(rows, dtype=np.int64), self.cached.device)
        step = self.step
        features = None if step.features is None else step.features.index_select(0, index)
        picked = StepOnDevice(
            *(t.index_select(0, index) for t in (step.cached, step.emitted, step.accepted)), features, step.tree
        )
        return DeviceDraftInputs(self.cached.index_select(0, index), self.last_two.index_select(0, index), picked)


@dataclass(eq=False)
class _Verified:
    """A step run and verified on the device, nothing read: the emitted tokens, accept lengths and
    their logprobs, the target's features at its rows and the logits kept for a drafter that reads
    them (None otherwise), and what else its read brings."""

    emitted: torch.Tensor
    accepted: torch.Tensor
    logprobs: torch.Tensor
    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    also_read: tuple[torch.Tensor, ...] = ()

    def kept_row(self) -> torch.Tensor:
        """``[B]``: each sequence's row of its last kept token (0 the pending token, ``j + 1`` draft
        node ``j``): a chain's accept length, a tree's last accepted node plus one."""
        if not self.also_read:
            return self.accepted
        path = self.also_read[2]  # a tree's accepted nodes
        last = path.gather(1, (self.accepted - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        return torch.where(self.accepted > 0, last + 1, torch.zeros_like(last))


class DeviceSteps:
    """Runs, verifies and reads :class:`DeviceLaunch` steps: the chains and trees a drafter drafted
    from the device's state (``DeviceDrafts``: the drafter LM, ``self:L``, the EAGLE-3 head)."""

    def __init__(
        self,
        runner: ModelRunner,
        stats: EngineStats,
        finish: Callable[[Sequence], None],
        generator: torch.Generator,
        feature_layers: Seq[int] | None,
        observer: Callable[[list, torch.Tensor, torch.Tensor], None],
    ) -> None:
        self.runner, self.stats, self.finish = runner, stats, finish
        self.generator = generator  # the verification's uniforms for rows without a generator of their own
        # a drafter reading the target's features: the layers tapped, and what is handed the kept rows
        self.feature_layers, self.observer = tuple(feature_layers or ()), observer

    def launch(self, step: EngineDraftStep, drafter: Drafter, drafts: DeviceDrafts, draft_s: float) -> DeviceLaunch:
        """Run and verify ``drafter``'s ``drafts`` for the sequences of ``step.on_device``: nothing
        read, the next step's state left on the device."""
        start, inputs = time.perf_counter(), step.inputs
        seqs, bound = inputs.seqs, inputs.bound
        if (
            drafts.parents is None
            and drafts.probs is None
            and not all(s.params.greedy or s.params.position_keyed for s in seqs)
        ):
            raise ValueError(f"the {drafter.name} drafter's chains for sampling rows need their distributions")
        tables = BlockTables([s.block_table for s in seqs])
        device = inputs.last_two.device
        if drafts.parents is not None:
            done = self._tree_step(seqs, inputs, drafts.tokens.to(device), drafts.parents.to(device), step.shape)
        else:
            done = self._chain_step(seqs, inputs, drafts.tokens.to(device), drafts.probs, tables, bound)
        if self.runner.states is not None:  # each sequence's state after the last token it kept, picked there
            self.runner.states.keep(to_device(np.asarray([s.state_slot for s in seqs]), device), done.kept_row())
        on_device = StepOnDevice(inputs.cached, done.emitted, done.accepted, done.features, drafts.parents is not None)
        read = QueuedRead(done.emitted, done.accepted, done.logprobs, *done.also_read)
        verify_s = time.perf_counter() - start
        self.stats.model_time_s += verify_s
        return DeviceLaunch(
            self, seqs, step.strategy, drafter, on_device, inputs.last_two[:, 1], read, done.logits, draft_s, verify_s
        )

    def _chain_step(self, seqs, inputs: DeviceDraftInputs, drafts, q, tables: BlockTables, bound: int) -> _Verified:
        """Run and verify a chain, the target's features tapped for a drafter reading them."""
        depth = drafts.shape[1]
        ids = torch.cat([inputs.last_two[:, 1:], drafts], dim=1).reshape(-1)
        slots = [s.state_slot for s in seqs]
        logits, features = self.runner.forward_on_device(
            tables, inputs.cached, ids, depth + 1, bound, self.feature_layers, slots=slots
        )
        emitted, accepted, logprobs = self._verdicts(seqs, logits, drafts, q, inputs.cached)
        if features is None:
            return _Verified(emitted, accepted, logprobs)
        return _Verified(emitted, accepted, logprobs, features.view(len(seqs), depth + 1, -1), logits)

    def _tree_step(self, seqs, inputs: DeviceDraftInputs, tokens, parents, shape) -> _Verified:
        """Run and verify a tree; its accepted nodes' K/V moved into place, its tokens, parents and
        accepted nodes read with the rest (to learn its first branch), and for a drafter reading
        features the target's features and logits at the kept tokens' rows, laid out as a chain
        step's."""
        cached, device = inputs.cached, inputs.last_two.device
        tables = BlockTables([s.block_table for s in seqs])
        rows = tree_rows(parents, shape.depth)
        ids = torch.cat([inputs.last_two[:, 1:], tokens], dim=1).reshape(-1)
        width = tokens.shape[1] + 1
        slots = [s.state_slot for s in seqs]
        logits, features = self.runner.forward_on_device(
            tables, cached, ids, width, inputs.bound, self.feature_layers, tree=rows, slots=slots
        )
        emitted, accepted, path, logprobs = self._tree_verdicts(seqs, logits, tokens, parents, shape, cached, rows)
        padded = tables.padded(len(seqs), tables.longest(), 0, device)
        keep_path_kv(self.runner.cache, padded, cached, path, accepted)
        read = (tokens, parents, path)
        if features is None:
            return _Verified(emitted, accepted, logprobs, also_read=read)
        # the kept tokens' rows as a chain's: the pending token's, then the accepted nodes' (padding past them)
        kept = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)
        flat = (torch.arange(len(seqs), device=device).unsqueeze(1) * width + kept).reshape(-1)
        kept_features = features.index_select(0, flat).view(len(seqs), shape.depth + 1, -1)
        return _Verified(emitted, accepted, logprobs, kept_features, logits.index_select(0, flat), read)

    def _processed(self, seqs: list[Sequence], logits: torch.Tensor, cached, offsets: torch.Tensor) -> tuple:
        """The processed logprobs of ``offsets.shape[1]`` rows a sequence, the scores position-keyed
        rows take their argmax of (keyed on completion indices from ``cached`` and the rows'
        ``offsets`` ``[1 or B, width]``; None without such rows), and which rows take an argmax."""
        width, device = offsets.shape[1], logits.device
        params = [s.params for s in seqs]
        logprobs = processed_logprobs(logits, BatchSamplingTensors.from_params(params, device, [width] * len(seqs)))
        scores = None
        if any(p.position_keyed for p in params):
            first = cached + to_device(completion_offsets(seqs), device)
            indices = (first.unsqueeze(1) + offsets).reshape(-1)
            scores, _ = keyed_scores_at(logprobs, [p for p in params for _ in range(width)], indices)
        return logprobs, scores, [p.greedy or p.position_keyed for p in params]

    def _uniforms(self, seqs: list[Sequence], width: int, device: torch.device) -> torch.Tensor:
        """``[B, width]`` float64 on the device: each row's verification draws, drawn on the host."""
        uniforms = draw_uniforms([s.generator for s in seqs], self.generator, [width] * len(seqs))
        return to_device(uniforms.view(-1, width), device)

    def _verdicts(
        self, seqs: list[Sequence], logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, cached
    ) -> tuple[torch.Tensor, ...]:
        """The emitted tokens, accept lengths and logprobs of a chain's verification, on the device.
        A batch with sampled rows draws its uniforms (``k + 1`` a row) on the host and queues them."""
        width, device = drafts.shape[1] + 1, logits.device
        offsets = torch.arange(width, device=device).unsqueeze(0)
        logprobs, scores, greedy = self._processed(seqs, logits, cached, offsets)
        if q is None or all(greedy):
            return greedy_chain_verdicts(logprobs, drafts, scores)
        greedy_t = to_device(np.asarray(greedy), device)
        uniforms = self._uniforms(seqs, width, device)
        return sampled_chain_verdicts(logprobs, drafts, q, uniforms, greedy_t, scores)

    def _tree_verdicts(self, seqs, logits, tokens, parents, shape, cached, rows) -> tuple[torch.Tensor, ...]:
        """:meth:`_verdicts` for trees (``device_tree.tree_verdicts``): also the accepted nodes."""
        logprobs, scores, greedy = self._processed(seqs, logits, cached, rows.offsets)
        greedy_t = to_device(np.asarray(greedy), logits.device)
        uniforms = None if all(greedy) else self._uniforms(seqs, tokens.shape[1] + 1, logits.device)
        return tree_verdicts(logprobs, tokens, parents, shape.depth, shape.topk, greedy_t, uniforms, scores)

    def read(self, launched: DeviceLaunch) -> Committed:
        """Append what ``launched`` emitted (waiting for it), up to each sequence's stop: the requests
        it finished, and its drafts and accept lengths (of the rows read). A row of a request that
        finished, was aborted or handed over meanwhile is dropped. A drafter reading features is
        handed those of the kept tokens, before any finishes."""
        tokens, accepted, logprobs, *tree = launched.pending.result()
        width, is_tree = launched.strategy.shape.depth + 1, launched.step.tree
        nodes = len(tree[0]) // len(launched.seqs) if is_tree else width - 1
        read, emitted, kept, branches = [], 0, 0, []
        for i, seq in enumerate(launched.seqs):
            if seq.status is SeqStatus.FINISHED:
                self.stats.dropped_rows += 1
                continue
            cached, n = seq.num_cached, accepted[i]
            seq.num_cached += n + 1
            seq.num_spec_steps += 1
            seq.num_drafted += nodes
            seq.num_accepted += n
            kept += n
            branches.append(_first_branch(tree, i, nodes, width - 1, n) if is_tree else (width - 1, n))
            rows = []
            for j in range(i * width, i * width + n + 1):
                seq.append(tokens[j], logprobs[j])
                rows.append(j)
                if seq.done:
                    break
            emitted += len(rows)
            read.append((seq, cached, n, rows))
        if launched.logits is not None and read:
            features = launched.step.features.reshape(len(launched.seqs) * width, -1)
            self.observer([(seq, c, rows, rows) for seq, c, _, rows in read], features, launched.logits)
        finished = []
        for seq, cached, n, _ in read:
            if seq.done:
                self.finish(seq)
                finished.append(seq.seq_id)
            else:  # a tree's drafter forwards wrote scratch, not its accepted nodes
                launched.drafter.settled(seq, Settled(0 if is_tree else n, cached, launched.consumed))
        s = self.stats
        s.record_spec_step(
            str(launched.strategy),
            len(read),
            len(read) * nodes,
            kept,
            emitted,
            launched.draft_s,
            launched.verify_s,
        )
        s.generated_tokens += emitted
        counts = [n for _, _, n, _ in read]
        return Committed(finished, emitted, Drafted([nodes] * len(read), counts, branches))


def _first_branch(read: list[list], i: int, nodes: int, depth: int, accepted: int) -> tuple[int, int]:
    """Row ``i``'s tree's first branch and how much of it its accepted path kept, from the read
    tokens, parents and accepted nodes."""
    tokens, parents, path = read
    tree = DraftTree(tokens[i * nodes : (i + 1) * nodes], parents[i * nodes : (i + 1) * nodes])
    return tree.first_branch(path[i * depth : i * depth + accepted])
