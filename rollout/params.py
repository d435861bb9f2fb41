"""User-facing parameter dataclasses: how to sample, and how the engine is sized.

Both validate themselves on construction and raise ``ValueError`` naming the field and the
allowed range, so bad input is refused before it can reach a running batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..config_tree import ConfigError, build, coerce_subtrees, is_int, number_at_least, require
from ..kernels.dispatch import BACKEND_CHOICES
from .strategy import parse_strategy
from .token_ids import token_id_list

ROLLOUT_DTYPES = ("auto", "bfloat16", "float16", "float32")  # RolloutConfig.dtype

EXECUTORS = ("auto", "inline", "thread", "stream", "device", "process", "ray")  # rollout/mirror/executors.py

DEFAULT_ARMS = ("none", "chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid:4,2,12")


@dataclass
class SelectorConfig:
    arms: tuple[str, ...] = DEFAULT_ARMS
    optimism: float = 0.25  # sequence-steps of evidence an arm's best case weighs (0: point estimates only)
    version_weight: float = 0.5  # what a drafter's earlier versions measured counts this x at each new one
    calibration_rows: int = 64  # without graphs, calibration times forwards of up to this many rows (linear beyond)
    calibration_repeats: int = 3  # timings per calibrated shape (their median)
    recalibrate_at: float = 2.0  # recalibrate (between rollouts) once the arms run this x off the table
    # leave the last step's arm only for one predicted faster by this many standard errors of the
    # two predictions' difference (StrategySelector.margin); 0: the point estimates alone
    switch_margin: float = 1.0

    def __post_init__(self) -> None:
        self.arms = tuple(self.arms)
        require(bool(self.arms), "arms", "at least one strategy", self.arms)
        for arm in self.arms:
            try:
                adaptive = parse_strategy(arm).adaptive
            except ValueError as e:
                raise ConfigError("arms", f"holds {arm!r}, which is not valid: {e}") from None
            require(not adaptive, "arms", "strategies other than 'adaptive'", self.arms)
        checks = [
            ("optimism", number_at_least(self.optimism, 0), "a float >= 0"),
            ("version_weight", 0 <= self.version_weight <= 1, "a float in [0, 1]"),
            ("calibration_rows", isinstance(self.calibration_rows, int) and self.calibration_rows >= 1, "an int >= 1"),
            (
                "calibration_repeats",
                isinstance(self.calibration_repeats, int) and 1 <= self.calibration_repeats <= 20,
                "an int in [1, 20]",
            ),
            ("recalibrate_at", self.recalibrate_at > 1, "a float > 1"),
            ("switch_margin", number_at_least(self.switch_margin, 0), "a float >= 0"),
        ]
        for name, ok, allowed in checks:
            require(ok, name, allowed, getattr(self, name))


# what torch.Generator.manual_seed accepts; checked here so a bad seed is refused up front
SEED_RANGE = "an int in [-2**63, 2**64)"


def valid_seed(value: Any) -> bool:
    return is_int(value) and -(2**63) <= value < 2**64


NOISE_SOURCES = ("stream", "position")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    The *processed distribution* is the target's softmax after temperature, top-k, top-p and
    min-p (applied in that order, as Hugging Face ``generate`` does). Every token is sampled
    from it and its returned logprob is the log-probability under it. ``temperature == 0`` means
    greedy decoding; the logprob returned for a greedy token is then taken from the unscaled,
    unfiltered softmax.

    ``prompt_logprobs = n`` also returns the log-probabilities of the prompt's last ``n`` tokens,
    each given everything before it, under the model's *unprocessed* softmax (temperature 1, no
    filters), computed in the request's prefill: one forward scores a span (how ATTS scores a
    drafted chunk). ``n`` must be smaller than the prompt (the first token has no prediction).

    ``seed`` makes the request's draws reproducible on their own: two requests with the same prompt
    and the same seed draw the same completion (as in vLLM). Leave it ``None`` for independent
    samples of one prompt (GRPO groups); the engine then draws from its own seeded stream.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: int = 0
    noise: str = "stream"

    def __post_init__(self) -> None:
        t = self.temperature
        require(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0,
            "temperature",
            "a finite number >= 0 (0 = greedy)",
            t,
        )
        require(is_int(self.top_k) and self.top_k >= 0, "top_k", "an int >= 0 (0 = off)", self.top_k)
        p = self.top_p
        require(isinstance(p, (int, float)) and 0 < p <= 1, "top_p", "in (0, 1]", p)
        m = self.min_p
        require(isinstance(m, (int, float)) and 0 <= m <= 1, "min_p", "in [0, 1]", m)
        require(
            is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens",
            "an int >= 1",
            self.max_new_tokens,
        )
        try:
            stops = tuple(token_id_list(self.stop_token_ids, "stop_token_ids"))
        except ValueError:  # not integer ids (or not a sequence): refused below, naming the field
            stops = None
        require(
            stops is not None and all(s >= 0 for s in stops),
            "stop_token_ids",
            "a sequence of integer token ids >= 0",
            self.stop_token_ids,
        )
        object.__setattr__(self, "stop_token_ids", stops)
        require(self.seed is None or valid_seed(self.seed), "seed", f"None or {SEED_RANGE}", self.seed)
        require(self.noise in NOISE_SOURCES, "noise", f"one of {NOISE_SOURCES}", self.noise)
        require(
            self.noise != "position" or self.seed is not None or self.temperature == 0,
            "seed",
            'set (an int) when noise="position" samples (temperature > 0)',
            self.seed,
        )
        require(
            is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0,
            "prompt_logprobs",
            "an int >= 0 (0 = off)",
            self.prompt_logprobs,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def position_keyed(self) -> bool:
        """Sampled with position-keyed noise: its tokens are the argmax of perturbed logprobs."""
        return self.noise == "position" and self.temperature > 0

    def with_updates(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)


@dataclass
class MirrorConfig:
    """How mirror strategies (``mirror:S,k=N``, ``rollout/mirror/pipeline.py``) draft beside the target.

    ``exit_layer``: decoder layers the target runs before its early exit (None = half of them).
    ``executor``: where the drafter runs beside it (``rollout/mirror/executors.py``): ``auto``
    (``stream``/``device`` on CUDA, ``process`` on CPU), ``inline``, ``thread``, ``stream``,
    ``device``, ``process`` or ``ray`` (an actor on the running Ray cluster).
    ``draft_threads``: torch threads of the ``process`` and ``ray`` executors.
    ``threads``: CPU threads the engine owns; when set, a step that runs a mirror strategy gives
    the target ``threads - draft_threads`` of them and any other step gives it all (the spare
    core goes to the draft in the tail and to the target in the bulk). None leaves torch's setting.
    """

    exit_layer: int | None = None
    executor: str = "auto"
    draft_threads: int = 1
    threads: int | None = None

    def __post_init__(self) -> None:
        require(
            self.exit_layer is None or (is_int(self.exit_layer) and self.exit_layer >= 1),
            "exit_layer",
            "None or an int >= 1 (below the target's layer count)",
            self.exit_layer,
        )
        require(self.executor in EXECUTORS, "executor", f"one of {EXECUTORS}", self.executor)
        require(
            is_int(self.draft_threads) and self.draft_threads >= 1,
            "draft_threads",
            "an int >= 1",
            self.draft_threads,
        )
        require(
            self.threads is None or (is_int(self.threads) and self.threads > self.draft_threads),
            "threads",
            f"None or an int > draft_threads ({self.draft_threads})",
            self.threads,
        )


@dataclass
class RolloutConfig:
    """Sizing and behaviour of a :class:`tailspec.rollout.RolloutEngine`.

    The KV pool holds ``num_blocks * block_size`` tokens; when ``num_blocks`` is None it is
    derived from ``kv_cache_tokens``. Sequences are preempted (and later recomputed) when the
    pool runs out, so a small pool is slow but never wrong.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_tokens: int = 65536
    max_num_seqs: int = 256
    max_prefill_tokens: int = 8192
    max_model_len: int | None = None
    strategy: str = "none"  # see tailspec.rollout.strategy for the forms
    draft_kv_cache_tokens: int | None = None  # the model drafter's own KV pool; None = kv_cache_tokens
    suffix_history_tokens: int = 1 << 20  # completions of earlier calls the suffix drafter remembers
    selector: SelectorConfig | None = None  # strategy="adaptive": a SelectorConfig (or its dict); None = defaults
    mirror: MirrorConfig | None = None  # mirror strategies: a MirrorConfig (or its dict); None = defaults
    # waiting prompts join the running sequences' decode forward (one forward, no decode stall);
    # applies to non-speculative strategies (speculative steps keep prefill and verify apart)
    mixed_batches: bool = False
    # keep full KV blocks after their requests finish and reuse them for requests that start with
    # the same tokens (multi-turn, ATTS); dropped whenever the model's parameters change
    prefix_caching: bool = False
    tail_fraction: float = 0.25  # a step is "in the tail" when active sequences <= this x the wave's peak
    # length-aware draft budget (rollout/spec/length_budget.py): in a speculative step only sequences whose
    # expected remaining length is >= this x the batch's longest draft (0 = every sequence drafts);
    # needs predicted lengths (the Ray coordinator sends its length predictor's with every request)
    length_budget: float = 0.0
    graph_backend: str = "auto"  # auto: CUDA graphs on CUDA, none on CPU | cuda_graph | eager | none
    graph_memory_mb: int = 2048  # budget of the graph pool
    kernels: str = "auto"  # auto: on CUDA Triton verification, 16-bit decode attention | triton | torch (kernels/)
    # the dtype the engine decodes in: auto = the model's; bfloat16 | float16 | float32 on a model whose
    # parameters are in another: a copy in that dtype, refreshed when they change (rollout/model/cast_copy.py)
    dtype: str = "auto"
    compile: bool = False  # torch.compile the decoder layers' own ops (rollout/model/compiled.py)
    # QKV and gate-up projections as one GEMM each, over merged copies of their weights (memory: about two
    # thirds of the decoder's weights again; rollout/model/merged_projections.py)
    merge_projections: bool = False
    seed: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_behaviour()

    def _check_sizes(self) -> None:
        require(isinstance(self.mixed_batches, bool), "mixed_batches", "a bool", self.mixed_batches)
        require(isinstance(self.prefix_caching, bool), "prefix_caching", "a bool", self.prefix_caching)
        require(
            is_int(self.block_size) and 1 <= self.block_size <= 1024,
            "block_size",
            "an int in [1, 1024]",
            self.block_size,
        )
        require(
            self.num_blocks is None or (is_int(self.num_blocks) and self.num_blocks >= 1),
            "num_blocks",
            "None or an int >= 1",
            self.num_blocks,
        )
        require(
            is_int(self.kv_cache_tokens) and self.kv_cache_tokens >= self.block_size,
            "kv_cache_tokens",
            f"an int >= block_size ({self.block_size})",
            self.kv_cache_tokens,
        )
        require(is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", "an int >= 1", self.max_num_seqs)
        require(
            is_int(self.max_prefill_tokens) and self.max_prefill_tokens >= 1,
            "max_prefill_tokens",
            "an int >= 1",
            self.max_prefill_tokens,
        )
        require(
            self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len >= 2),
            "max_model_len",
            "None or an int >= 2",
            self.max_model_len,
        )

    def _check_behaviour(self) -> None:
        try:
            parse_strategy(self.strategy)
        except ValueError as e:
            raise ConfigError("strategy", f"is not valid: {e}") from None
        require(
            self.draft_kv_cache_tokens is None
            or (is_int(self.draft_kv_cache_tokens) and self.draft_kv_cache_tokens >= self.block_size),
            "draft_kv_cache_tokens",
            f"None or an int >= block_size ({self.block_size})",
            self.draft_kv_cache_tokens,
        )
        require(
            is_int(self.suffix_history_tokens) and self.suffix_history_tokens >= 0,
            "suffix_history_tokens",
            "an int >= 0",
            self.suffix_history_tokens,
        )
        require(valid_seed(self.seed), "seed", SEED_RANGE, self.seed)
        require(0 < self.tail_fraction <= 1, "tail_fraction", "a float in (0, 1]", self.tail_fraction)
        require(
            isinstance(self.length_budget, (int, float)) and 0 <= self.length_budget <= 1,
            "length_budget",
            "a number in [0, 1] (0 = off)",
            self.length_budget,
        )
        require(
            self.graph_backend in ("auto", "cuda_graph", "eager", "none"),
            "graph_backend",
            "'auto', 'cuda_graph', 'eager' or 'none'",
            self.graph_backend,
        )
        require(self.kernels in BACKEND_CHOICES, "kernels", "'auto', 'triton' or 'torch'", self.kernels)
        require(self.dtype in ROLLOUT_DTYPES, "dtype", "'auto', 'bfloat16', 'float16' or 'float32'", self.dtype)
        require(isinstance(self.compile, bool), "compile", "True or False", self.compile)
        require(isinstance(self.merge_projections, bool), "merge_projections", "True or False", self.merge_projections)
        require(
            is_int(self.graph_memory_mb) and self.graph_memory_mb >= 1,
            "graph_memory_mb",
            "an int >= 1",
            self.graph_memory_mb,
        )
        coerce_subtrees(self)

    @property
    def total_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, self.kv_cache_tokens // self.block_size)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutConfig:
        """From a dict of its fields (YAML's nested dicts for ``selector`` and ``mirror``)."""
        return build(cls, data)
