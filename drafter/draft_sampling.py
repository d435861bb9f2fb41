"""How a model drafter picks its next chain token: the request's own sampling rule on the
drafter's logits, so that the draft distribution can be handed to the verifier."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..draft_contract import DraftRequest, DraftTree
from ..kernels.transfers import read_back, to_device
from ..rollout.position_noise import keyed_scores, keyed_scores_at
from ..rollout.request import Sequence as EngineSequence
from ..rollout.sampling import BatchSamplingTensors, draw_uniforms, processed_logprobs, sample_from_logprobs

DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15


def draft_generator(seed: int) -> torch.Generator:
    """A random stream of the drafter's own: drawing drafts with the same uniforms the verifier
    then uses to accept them would correlate the two and bias the output."""
    return torch.Generator().manual_seed((seed + DRAFT_SEED_OFFSET) % 2**63)


def pick_draft_tokens(
    seqs: Sequence[EngineSequence],
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    depths: Sequence[int] = (),
    st: BatchSamplingTensors | None = None,
    indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next draft token per row, as a tensor on the logits' device (nothing is read back): the
    argmax for greedy requests, a sample from the processed distribution otherwise (``uniforms``:
    one per row, on the device; None for an all-greedy batch), and, when any row samples, every
    row's processed draft distribution. ``st``: the rows' sampling tensors, when the caller built
    them once for several forwards; ``indices``: the rows' completion indices on the device, where
    the host does not know them (``depths`` then unused).

    A position-keyed request's row (``rollout/position_noise.py``) takes the argmax of its draft
    logprobs perturbed by the noise the target will use at that completion index (its
    ``len(output_ids)`` plus the row's chain ``depths`` entry, tokens drafted so far): the draft
    then agrees with the target's draw wherever the two distributions are close. That shared noise
    cannot bias the output: a keyed row's emitted token is the target's perturbed argmax whatever
    was drafted."""
    if all(s.params.greedy for s in seqs):  # the argmax of the logits: no distribution to hand over
        return logits.argmax(dim=-1), None
    assert uniforms is not None, "sampled rows need uniforms"
    st = st if st is not None else BatchSamplingTensors.from_params([s.params for s in seqs], logits.device)
    logprobs = processed_logprobs(logits, st)
    chosen = torch.where(st.temperature > 0, sample_from_logprobs(logprobs, uniforms), logprobs.argmax(dim=-1))
    params = [s.params for s in seqs]
    if indices is not None:
        keyed = keyed_scores_at(logprobs, params, indices)
    else:
        depths = list(depths) or [0] * len(seqs)
        keyed = keyed_scores(logprobs, params, [len(s.output_ids) + d for s, d in zip(seqs, depths)])
    if keyed is not None:
        chosen = torch.where(keyed[1], keyed[0].argmax(dim=-1), chosen)
    return chosen, logprobs.exp()


def choose_draft_tokens(
    seqs: Sequence[EngineSequence], logits: torch.Tensor, generator: torch.Generator, depths: Sequence[int] = ()
) -> tuple[list[int], torch.Tensor | None]:
    """:func:`pick_draft_tokens` for one forward, its uniforms drawn here (from each row's own
    generator, else ``generator``) and its tokens read back."""
    uniforms = None
    if not all(s.params.greedy for s in seqs):
        uniforms = to_device(draw_uniforms([s.generator for s in seqs], generator), logits.device)
    chosen, q = pick_draft_tokens(seqs, logits, uniforms, depths)
    return chosen.tolist(), q


def chain_uniforms(
    seqs: Sequence[EngineSequence], generator: torch.Generator, depths: Sequence[int], width: int
) -> torch.Tensor:
    """``[rows, width]`` float64 on the host: row ``i``'s first ``depths[i]`` entries drawn from its
    own generator (else ``generator``), the rest 0.5 (columns past a row's depth draft tokens that
    are cut). Drawn at once for a chain drafted on the device: a row uses as many draws as its
    depth allows, whatever the other rows in its batch."""
    flat = draw_uniforms([s.generator for s in seqs], generator, list(depths)).numpy()
    grid = np.full((len(seqs), width), 0.5)
    start = 0
    for i, n in enumerate(depths):
        grid[i, :n] = flat[start : start + n]
        start += n
    return torch.from_numpy(grid)


def draft_chains_on_device(
    requests: Sequence[DraftRequest],
    logits: torch.Tensor,
    generator: torch.Generator,
    forward: Callable[[int, torch.Tensor], torch.Tensor],
) -> list[DraftTree]:
    """Chains drafted without a read between forwards. ``logits`` score every request's first
    token; ``forward(d, tokens)`` runs the drafter on the ``[n]`` tokens at depth ``d - 1`` (a
    tensor on the device) and returns the logits for depth ``d``. Each forward's tokens (the
    argmax, or a sample with a uniform drawn beforehand, see :func:`chain_uniforms`) feed the next
    on the device; every request runs to the deepest chain, and the ``[n, depth]`` drafts are read
    once, then cut where :class:`ChainDrafts`' loop stops (a request's depth, or a stop token,
    kept). One wait for the device a step instead of one per forward, each of which would idle
    the host. A drafter that keeps K/V must count as held only the accepted prefix of what
    it wrote past a cut."""
    depth = max(r.max_depth for r in requests)
    seqs = [r.seq for r in requests]
    greedy = all(s.params.greedy for s in seqs)
    st, uniforms = None, None
    if not greedy:  # built once for every forward of the step
        st = BatchSamplingTensors.from_params([s.params for s in seqs], logits.device)
        uniforms = to_device(chain_uniforms(seqs, generator, [r.max_depth for r in requests], depth), logits.device)
    tokens, probs = [], []
    for d in range(depth):
        if d:
            logits = forward(d, tokens[-1])
        token, q = pick_draft_tokens(seqs, logits, None if greedy else uniforms[:, d], [d] * len(seqs), st)
        tokens.append(token)
        probs.append(q)
    (drafted,) = read_back(torch.stack(tokens, dim=1))
    trees = []
    for i, r in enumerate(requests):
        chain = drafted[i * depth : i * depth + r.max_depth]
        n = next((j for j, t in enumerate(chain) if t in r.seq.stop_ids), len(chain) - 1) + 1
        q_rows = torch.stack([p[i] for p in probs[:n]]) if not r.seq.params.greedy else None
        trees.append(DraftTree.chain(chain[:n], q_rows))
    return trees


class DeviceChainPicks:
    """The picks of a chain drafted from state on the device (``rollout/spec/device_step.py``), one
    :meth:`pick` per depth: each request's rule (:func:`pick_draft_tokens`) with the chain's uniforms
    drawn beforehand (``generator``: the drafter's stream) and, for position-keyed rows, completion
    indices from the device lengths ``cached``. :meth:`result` gives the drafts and (None for an
    all-greedy batch) their distributions."""

    def __init__(self, seqs: Sequence[EngineSequence], generator: torch.Generator, depth: int, cached: torch.Tensor):
        from ..rollout.model.device_inputs import completion_offsets

        self.seqs, device = seqs, cached.device
        self.st = self.uniforms = self.indices = None
        if not all(s.params.greedy for s in seqs):
            self.st = BatchSamplingTensors.from_params([s.params for s in seqs], device)
            self.uniforms = to_device(chain_uniforms(seqs, generator, [depth] * len(seqs), depth), device)
        if any(s.params.position_keyed for s in seqs):
            self.indices = cached + to_device(completion_offsets(seqs), device)
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor | None] = []

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next depth's tokens from ``logits`` (target vocabulary), kept and returned."""
        d = len(self.tokens)
        uniforms = None if self.uniforms is None else self.uniforms[:, d]
        at = None if self.indices is None else self.indices + d
        token, q = pick_draft_tokens(self.seqs, logits.float(), uniforms, (), self.st, at)
        self.tokens.append(token)
        self.probs.append(q)
        return token

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.stack(self.tokens, dim=1), None if self.st is None else torch.stack(self.probs, dim=1)


class ChainDrafts:
    """The chains a model drafter is growing, one per request: each :meth:`extend` picks the next
    token of every active chain from ``logits`` (rows in ``active`` order), then retires chains
    that reached their depth or drafted a stop token."""

    def __init__(self, requests: Sequence[DraftRequest], generator: torch.Generator) -> None:
        self.requests = list(requests)
        self.generator = generator
        self.tokens: list[list[int]] = [[] for _ in self.requests]
        self.probs: list[list[torch.Tensor]] = [[] for _ in self.requests]
        self.active = list(range(len(self.requests)))

    def extend(self, logits: torch.Tensor) -> list[int]:
        """Append a token to every active chain; return the rows (of the old ``active``) still going."""
        seqs = [self.requests[i].seq for i in self.active]
        depths = [len(self.tokens[i]) for i in self.active]
        chosen, q = choose_draft_tokens(seqs, logits, self.generator, depths)
        for row, i in enumerate(self.active):
            self.tokens[i].append(chosen[row])
            if q is not None:
                self.probs[i].append(q[row])
        keep = [
            row
            for row, i in enumerate(self.active)
            if len(self.tokens[i]) < self.requests[i].max_depth and self.tokens[i][-1] not in seqs[row].stop_ids
        ]
        self.active = [self.active[row] for row in keep]
        return keep

    def trees(self) -> list[DraftTree]:
        out = []
        for r, toks, ps in zip(self.requests, self.tokens, self.probs):
            q = torch.stack(ps) if ps and not r.seq.params.greedy else None
            out.append(DraftTree.chain(toks, q))
        return out
