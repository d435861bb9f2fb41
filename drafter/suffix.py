"""Model-free drafting from text already seen: an n-gram (variable-order suffix) index.

GRPO samples several completions per prompt and they share much of their text; reasoning
traces also repeat themselves (restating numbers, recurring phrases). The suffix drafter
predicts the next tokens from what followed the same context elsewhere:

* a **group index** per prompt group: the prompt plus every completion generated so far for it
  (a request without a group has its own);
* a **history index** over completions of earlier calls, bounded to ``history_tokens`` tokens
  (oldest forgotten first);
* a **per-prompt history** (DAS-style): the last ``prompt_history`` completions of each prompt,
  over earlier calls (RL revisits a prompt every epoch). A new group of a prompt seen before
  starts with them in its group index, so they count with the group's weight.

For a context it uses the longest suffix of up to ``max_order`` tokens seen in either index;
counts from the group index weigh ``group_weight`` times more. Drafts are trees built best-first
by estimated path probability (the product of next-token frequencies), so the most frequent
continuation comes first among siblings; ``topk == 1`` gives a chain. Everything is CPU-side
Python dicts; drafts are deterministic (verified as one-hot).

It drafts from the host's text, so its steps commit the step before them first (the engine's
``rollout/host_step.py``): drafting from text one step old would match on a context missing up to
a step's tokens. The cost: the device idles while the host drafts, verifies and commits, once a
step.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from ..draft_contract import Drafter, DraftRequest, DraftShape, DraftStep, DraftTree, SequenceView, draft_from_text


class NgramIndex:
    """Next-token counts after every context of 1..``max_order`` tokens."""

    def __init__(self, max_order: int) -> None:
        self.max_order = max_order
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: Seq[int], start: int = 0, sign: int = 1) -> None:
        """Count the n-grams that end at positions ``start..len(tokens)-1`` (``sign=-1`` uncounts)."""
        for pos in range(max(1, start), len(tokens)):
            nxt = tokens[pos]
            for order in range(1, min(self.max_order, pos) + 1):
                key = tuple(tokens[pos - order : pos])
                bucket = self.counts.get(key)
                if bucket is None:
                    if sign < 0:
                        continue
                    bucket = self.counts[key] = {}
                count = bucket.get(nxt, 0) + sign
                if count > 0:
                    bucket[nxt] = count
                else:
                    bucket.pop(nxt, None)
                    if not bucket:
                        del self.counts[key]

    def next_counts(self, context: Seq[int], order: int) -> dict[int, int] | None:
        if order > len(context):
            return None
        return self.counts.get(tuple(context[len(context) - order :]))

    def __len__(self) -> int:
        return len(self.counts)


@dataclass
class _Group:
    index: NgramIndex
    members: set[int]


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(
        self,
        *,
        max_order: int = 8,
        history_tokens: int = 1 << 20,
        group_weight: int = 4,
        prompt_history: int = 32,
        max_prompts: int = 4096,
    ) -> None:
        if not (isinstance(max_order, int) and 1 <= max_order <= 32):
            raise ValueError(f"max_order must be an int in [1, 32], got {max_order!r}")
        if not (isinstance(history_tokens, int) and history_tokens >= 0):
            raise ValueError(f"history_tokens must be an int >= 0, got {history_tokens!r}")
        if not (isinstance(group_weight, int) and group_weight >= 1):
            raise ValueError(f"group_weight must be an int >= 1, got {group_weight!r}")
        if not (isinstance(prompt_history, int) and prompt_history >= 0):
            raise ValueError(f"prompt_history must be an int >= 0, got {prompt_history!r}")
        self.max_order = max_order
        self.history_tokens = history_tokens
        self.group_weight = group_weight
        self._history = NgramIndex(max_order)
        self._history_docs: deque[list[int]] = deque()
        self._history_size = 0
        self._unindexed = 0  # the last docs of _history_docs, remembered and not yet counted
        self.prompt_history = prompt_history
        self.max_prompts = max_prompts
        self._by_prompt: OrderedDict[tuple[int, ...], deque[list[int]]] = OrderedDict()  # least recent first
        self._groups: dict[object, _Group] = {}
        self._indexed: dict[int, int] = {}  # seq_id -> output tokens already in its group index
        self._group_of: dict[int, object] = {}

    # -- indexing ------------------------------------------------------------------------
    def _group_key(self, seq: SequenceView) -> object:
        return ("group", seq.group) if seq.group is not None else ("seq", seq.seq_id)

    def _sync(self, seq: SequenceView) -> NgramIndex:
        """Bring ``seq``'s group index up to date with its tokens; return the index."""
        key = self._group_key(seq)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(NgramIndex(self.max_order), set())
            group.index.add(seq.prompt_ids)
            tail = seq.prompt_ids[-self.max_order :]
            for doc in self._by_prompt.get(tuple(seq.prompt_ids), ()):  # this prompt's earlier completions
                group.index.add(tail + doc, start=len(tail))
        if seq.seq_id not in group.members:
            group.members.add(seq.seq_id)
            self._group_of[seq.seq_id] = key
        done = self._indexed.get(seq.seq_id, 0)
        if done < len(seq.output_ids):
            tokens = seq.prompt_ids[-self.max_order :] + seq.output_ids
            offset = len(tokens) - len(seq.output_ids)
            group.index.add(tokens, start=offset + done)
            self._indexed[seq.seq_id] = len(seq.output_ids)
        return group.index

    @property
    def history(self) -> NgramIndex:
        """The index of earlier completions, brought up to date with every one remembered."""
        if self._unindexed:
            docs = self._history_docs
            for i in range(len(docs) - self._unindexed, len(docs)):
                self._history.add(docs[i])
            self._unindexed = 0
        return self._history

    def remember(self, tokens: Seq[int]) -> None:
        """Add a completion to the history, forgetting the oldest beyond ``history_tokens``. It is
        counted into the index when a draft next reads it (:attr:`history`): a finished sequence
        costs the step loop a list copy, and a run that never drafts from suffixes no indexing
        (counting a completion costs ``max_order`` dict updates a token)."""
        if self.history_tokens == 0 or not tokens:
            return
        doc = list(tokens[-self.history_tokens :])
        self._history_docs.append(doc)
        self._history_size += len(doc)
        self._unindexed += 1
        while self._history_size > self.history_tokens:
            old = self._history_docs.popleft()
            if self._unindexed > len(self._history_docs):  # it was never counted
                self._unindexed -= 1
            else:
                self._history.add(old, sign=-1)
            self._history_size -= len(old)

    def finished(self, seq: SequenceView) -> None:
        self.remember(seq.output_ids)
        self._remember_for_prompt(seq.prompt_ids, seq.output_ids)

    def _remember_for_prompt(self, prompt: Seq[int], tokens: Seq[int]) -> None:
        if self.prompt_history == 0 or not tokens:
            return
        key = tuple(prompt)
        docs = self._by_prompt.setdefault(key, deque(maxlen=self.prompt_history))
        docs.append(list(tokens))
        self._by_prompt.move_to_end(key)
        while len(self._by_prompt) > self.max_prompts:
            self._by_prompt.popitem(last=False)

    def state_dict(self) -> dict:
        """The remembered completions, oldest first (the indexes are rebuilt from them on load)."""
        return {
            "history": [list(doc) for doc in self._history_docs],
            "by_prompt": [[list(k), [list(d) for d in docs]] for k, docs in self._by_prompt.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self._history = NgramIndex(self.max_order)
        self._history_docs = deque()
        self._history_size = 0
        self._unindexed = 0
        for doc in state["history"]:
            self.remember(doc)
        self._by_prompt = OrderedDict()
        for prompt, docs in state.get("by_prompt", []):
            for doc in docs:
                self._remember_for_prompt(prompt, doc)

    def release(self, seq_id: int) -> None:
        self._indexed.pop(seq_id, None)
        key = self._group_of.pop(seq_id, None)
        group = self._groups.get(key) if key is not None else None
        if group is not None:
            group.members.discard(seq_id)
            if not group.members:
                del self._groups[key]

    # -- drafting ------------------------------------------------------------------------
    def candidates(self, local: NgramIndex, context: Seq[int]) -> list[tuple[float, int]]:
        """``(probability, token)`` of next tokens after the longest known suffix of ``context``,
        most likely first."""
        history = self.history
        for order in range(min(self.max_order, len(context)), 0, -1):
            here = local.next_counts(context, order)
            there = history.next_counts(context, order)
            if not here and not there:
                continue
            merged: dict[int, int] = {}
            for tok, c in (here or {}).items():
                merged[tok] = c * self.group_weight
            for tok, c in (there or {}).items():
                merged[tok] = merged.get(tok, 0) + c
            total = sum(merged.values())
            return sorted(((c / total, tok) for tok, c in merged.items()), key=lambda x: (-x[0], x[1]))
        return []

    def draft(self, step: DraftStep) -> list[DraftTree]:
        """From the host's text: its n-gram index reads every token, so the step before is committed
        first (the device idles while the host drafts, verifies and commits, once a step)."""
        return draft_from_text(self, step)

    def propose(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        return [self._draft(r, shape) for r in requests]

    def _draft(self, request: DraftRequest, shape: DraftShape) -> DraftTree:
        seq = request.seq
        local = self._sync(seq)
        context = seq.prompt_ids[-self.max_order :] + seq.output_ids[-self.max_order :]
        context = context[-self.max_order :]
        tokens: list[int] = []
        parents: list[int] = []
        paths: list[list[int]] = []  # tokens from the root to each node
        heap: list[tuple[float, int, int, int]] = []  # (-score, tie, token, parent)
        tie = 0
        for prob, tok in self.candidates(local, context)[: shape.topk]:
            heap.append((-prob, tie, tok, -1))
            tie += 1
        heapq.heapify(heap)
        while heap and len(tokens) < shape.max_nodes:
            neg_score, _, tok, parent = heapq.heappop(heap)
            path = (paths[parent] if parent >= 0 else []) + [tok]
            tokens.append(tok)
            parents.append(parent)
            paths.append(path)
            node = len(tokens) - 1
            if len(path) >= request.max_depth or tok in seq.stop_ids:
                continue
            for prob, child in self.candidates(local, (context + path)[-self.max_order :])[: shape.topk]:
                heapq.heappush(heap, (neg_score * prob, tie, child, node))
                tie += 1
        return DraftTree(tokens, parents)
