"""SFT recipe for the shipped tiny models: a policy (~3M parameters) and a drafter LM (~8x smaller).

Both are Qwen2-architecture models trained from scratch on chain-sum solutions, deterministic
given a seed (CPU, fp32). The policy is meant to be good but imperfect (long sums are harder),
so RL has something to improve. Run it with::

    python -m tailspec.tasks.sft --out assets/tiny --policy-steps N --drafter-steps M --seed 0 --threads 1

(``tailspec train-tiny ...`` is the same command). The results ship in ``assets/tiny`` with a
model card; :func:`load_tiny` loads them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import shlex
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from ..packed_weights import unpacked_dir
from ..progress import progress_bar
from ..safe_files import load_causal_lm
from .chain_sum import LAYOUTS, ChainSumConfig, ChainSumProblem, extract_answer, sample_problem, sample_problems
from .tokenizer import build_tokenizer, chat_ids, save_beside

logger = logging.getLogger(__name__)

SHORT_MAX_TERMS = 5  # "short" problems in the accuracy split: n <= 5
LONG_MIN_TERMS = 15  # "long" problems: n >= 15


@dataclass(frozen=True)
class TinyModelSpec:
    """Size of a tiny Qwen2 causal LM; the vocabulary and special ids come from the tokenizer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True

    def config(self, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
        return Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )

    def build(self, tokenizer: PreTrainedTokenizerBase) -> Qwen2ForCausalLM:
        """A freshly initialised model (seed torch first for a deterministic init)."""
        model = Qwen2ForCausalLM(self.config(tokenizer))
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = None
        return model

    def describe(self) -> str:
        return (
            f"Qwen2, hidden {self.hidden_size}, {self.num_layers} layers, {self.num_heads} heads "
            f"({self.num_kv_heads} KV), MLP {self.intermediate_size}, "
            f"{'tied' if self.tie_word_embeddings else 'untied'} embeddings"
        )


POLICY = TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768)
DRAFTER = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX, as oneDNN reports it); without
    it, bf16 autocast is emulated and a training step is several times slower than in fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class SFTConfig:
    """One SFT run. ``batch_size`` counts sequences; batches are length-bucketed to limit padding."""

    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decay from lr to lr * min_lr_ratio
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    max_len: int = 512  # longer examples are truncated (the default task never needs it)
    threads: int = 1
    # bf16 autocast for forward/backward on CPU (weights, optimizer and saved model stay fp32); None:
    # where the CPU computes bf16 natively (:func:`native_bf16`), elsewhere it is ~5x slower than fp32
    bf16: bool | None = None
    uniform_fraction: float = 0.5  # share of examples with n uniform on [min_terms, max_terms] (the long tail)
    bucket_batches: int = 8  # batches drawn at once, sorted by length and cut into batches
    log_every: int = 50
    task: ChainSumConfig = field(default_factory=ChainSumConfig)
    layout: str = "chain"  # the response format trained on (chain_sum.LAYOUTS)

    def __post_init__(self) -> None:
        checks = {
            "steps": (self.steps >= 1, ">= 1"),
            "batch_size": (self.batch_size >= 1, ">= 1"),
            "lr": (self.lr > 0, "> 0"),
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "grad_clip": (self.grad_clip > 0, "> 0"),
            "max_len": (self.max_len >= 16, ">= 16"),
            "threads": (self.threads >= 1, ">= 1"),
            "uniform_fraction": (0 <= self.uniform_fraction <= 1, "in [0, 1]"),
            "bucket_batches": (self.bucket_batches >= 1, ">= 1"),
            "log_every": (self.log_every >= 1, ">= 1"),
            "layout": (self.layout in LAYOUTS, f"one of {LAYOUTS}"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

    def uses_bf16(self, device: torch.device) -> bool:
        """Whether the fit on ``device`` runs under bf16 autocast (``bf16`` None: on CUDA, or on a
        CPU that computes bf16 natively, :func:`native_bf16`)."""
        if self.bf16 is not None:
            return self.bf16
        return device.type == "cuda" or native_bf16()

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def encode_example(
    tokenizer: PreTrainedTokenizerBase, problem: ChainSumProblem, layout: str = "chain"
) -> tuple[list[int], int]:
    """Ids of ``<|user|>question<|assistant|>solution<|eos|>`` (the solution in ``layout``) and
    the number of prompt ids (not trained on)."""
    prompt = [{"role": "user", "content": problem.question}]
    prompt_ids = chat_ids(tokenizer, prompt, add_generation_prompt=True)
    full = chat_ids(tokenizer, [*prompt, {"role": "assistant", "content": problem.solution_in(layout)}])
    if full[: len(prompt_ids)] != prompt_ids:
        raise RuntimeError("the chat template does not render the prompt as a prefix of the dialogue")
    return full, len(prompt_ids)


def collate(
    examples: list[tuple[list[int], int]], pad_token_id: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on prompt and padding)."""
    examples = [(ids[:max_len], min(prompt_len, max_len)) for ids, prompt_len in examples]
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (ids, prompt_len) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, prompt_len : len(ids)] = input_ids[row, prompt_len : len(ids)]
    return input_ids, attention_mask, labels


class SFTBatches:
    """An endless, seeded stream of length-bucketed training batches.

    Examples come from the task distribution, except that a ``uniform_fraction`` of them have a
    uniform number of terms, so the model sees enough long sums. ``bucket_batches`` batches are
    drawn at once, sorted by length, cut into batches and shuffled.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)

    def problem(self) -> ChainSumProblem:
        task = self.cfg.task
        if self.rng.random() < self.cfg.uniform_fraction:
            return sample_problem(self.rng, task, num_terms=self.rng.randint(task.min_terms, task.max_terms))
        return sample_problem(self.rng, task)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        size = self.cfg.batch_size
        while True:
            n = size * self.cfg.bucket_batches
            pool = [encode_example(self.tokenizer, self.problem(), self.cfg.layout) for _ in range(n)]
            pool.sort(key=lambda ex: len(ex[0]))
            batches = [pool[i : i + size] for i in range(0, len(pool), size)]
            self.rng.shuffle(batches)
            for batch in batches:
                yield collate(batch, self.tokenizer.pad_token_id, self.cfg.max_len)


def check_recipe_fields(recipe: Any, counts: tuple[str, ...], steps: tuple[str, ...], rates: tuple[str, ...]) -> None:
    """Refuse, naming the field, a recipe whose ``counts`` are below 1, ``steps`` below 0 or
    ``rates`` not above 0."""
    for names, ok, allowed in (
        (counts, lambda v: v >= 1, ">= 1"),
        (steps, lambda v: v >= 0, ">= 0"),
        (rates, lambda v: v > 0, "> 0"),
    ):
        for name in names:
            if not ok(getattr(recipe, name)):
                raise ValueError(f"{name} must be {allowed}, got {getattr(recipe, name)!r}")


def recipe_sft(recipe: Any, steps: int, lr: float, max_warmup: int) -> SFTConfig:
    """The SFT run of a model recipe's stage (``recipe``: its ``batch_size``, ``seed`` and ``threads``):
    ``steps`` at peak ``lr``, a tenth of them warming up (at most ``max_warmup``), fp32 (bf16 autocast
    is ~10x slower on CPUs without native bf16)."""
    return SFTConfig(
        steps=max(1, steps),
        batch_size=recipe.batch_size,
        lr=lr,
        warmup_steps=min(max_warmup, max(1, steps // 10)),
        seed=recipe.seed,
        threads=recipe.threads,
        bf16=False,
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def train_model(
    spec: TinyModelSpec,
    sft_cfg: SFTConfig,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path | None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a fresh ``spec`` model with ``sft_cfg``; save it to ``out_dir`` (safetensors) and return metrics."""
    torch.set_num_threads(sft_cfg.threads)
    torch.manual_seed(sft_cfg.seed)
    model = spec.build(tokenizer)
    metrics = fit_model(model, sft_cfg, tokenizer, out_dir, progress=progress, desc=f"sft hidden={spec.hidden_size}")
    if out_dir is not None:
        _write_metrics(out_dir, {**metrics, "spec": asdict(spec), "config": sft_cfg.to_dict()})
    return metrics


def _write_metrics(out_dir: str | Path, record: dict[str, Any]) -> None:
    (Path(out_dir) / "sft_metrics.json").write_text(json.dumps(record, indent=2) + "\n")


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions at the positions ``labels`` trains
    on (the same shift as the LM loss): what a drafter must match for its drafts to be accepted."""
    mask = labels[:, 1:] != -100
    s = torch.log_softmax(student_logits[:, :-1][mask].float(), dim=-1)
    t = torch.log_softmax(teacher_logits[:, :-1][mask].float(), dim=-1)
    return torch.sum(t.exp() * (t - s), dim=-1).mean()


def fit_model(
    model: torch.nn.Module,
    sft_cfg: SFTConfig,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path | None,
    progress: bool = True,
    desc: str = "sft",
    teacher: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place for ``sft_cfg.steps`` steps on the task's solutions, on the device
    its weights are on; save it to ``out_dir`` (safetensors) and return metrics.

    Without a ``teacher`` the loss is cross-entropy on the response tokens; with one it is
    :func:`distillation_loss` against the teacher's logits on the same batches (the teacher runs
    without gradients). Metrics: parameters, steps, first/final loss, a loss curve (mean per
    ``log_every`` steps), trained (assistant) and processed tokens, wall time and tokens/s.
    """
    torch.set_num_threads(sft_cfg.threads)
    torch.manual_seed(sft_cfg.seed)
    model.train()
    optimizer = _adamw(model, sft_cfg)
    batches = iter(SFTBatches(tokenizer, sft_cfg))
    losses: list[float] = []
    curve: list[dict[str, float]] = []
    seq_tokens = loss_tokens = 0
    start = time.perf_counter()
    bar = progress_bar(range(sft_cfg.steps), desc=desc, disable=not progress, mininterval=5)
    device = next(model.parameters()).device
    bf16 = sft_cfg.uses_bf16(device)  # asks the CPU: once, not every step
    for step in bar:
        input_ids, attention_mask, labels = (t.to(device) for t in next(batches))
        for group in optimizer.param_groups:
            group["lr"] = sft_cfg.lr_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = _sft_loss(model, teacher, input_ids, attention_mask, labels)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), sft_cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        seq_tokens += int(attention_mask.sum())
        loss_tokens += int((labels != -100).sum())
        if (step + 1) % sft_cfg.log_every == 0 or step + 1 == sft_cfg.steps:
            curve.append(_curve_point(sft_cfg, step, losses, seq_tokens / (time.perf_counter() - start), bar))
    wall = time.perf_counter() - start
    model.eval()
    metrics = _fit_metrics(model, sft_cfg, losses, curve, seq_tokens, loss_tokens, wall)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        save_beside(out_dir)
    return metrics


def _fit_metrics(model, sft_cfg: SFTConfig, losses, curve, seq_tokens: int, loss_tokens: int, wall: float) -> dict:
    """What :func:`fit_model` reports of a finished fit."""
    tail = losses[-min(len(losses), 50) :]
    return {
        "parameters": count_parameters(model),
        "steps": sft_cfg.steps,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "loss_curve": curve,
        "sequence_tokens": seq_tokens,
        "trained_tokens": loss_tokens,
        "wall_s": wall,
        "tokens_per_s": seq_tokens / wall,
    }


def _adamw(model: torch.nn.Module, sft_cfg: SFTConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": sft_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=sft_cfg.lr,
        betas=(0.9, 0.98),
    )


def _sft_loss(model, teacher, input_ids, attention_mask, labels) -> torch.Tensor:
    """Cross-entropy on the response tokens, or without a teacher distillation against its logits."""
    if teacher is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    with torch.no_grad():
        teacher_logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return distillation_loss(logits, teacher_logits, labels)


def _curve_point(sft_cfg: SFTConfig, step: int, losses: list[float], tokens_per_s: float, bar) -> dict[str, float]:
    """The loss curve's point at ``step`` (mean over the last ``log_every`` steps), shown and logged."""
    window = losses[-sft_cfg.log_every :]
    point = {"step": step + 1, "loss": sum(window) / len(window), "lr": sft_cfg.lr_at(step)}
    bar.set_postfix(loss=f"{point['loss']:.4f}", tok_s=f"{tokens_per_s:.0f}")
    logger.info(
        "step %d/%d loss %.4f lr %.2e %.0f tok/s", step + 1, sft_cfg.steps, point["loss"], point["lr"], tokens_per_s
    )
    return point


@torch.no_grad()
def _greedy_hf(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int, progress: bool):
    """Greedy completions (EOS kept, nothing after it) with HF ``generate`` on left-padded batches."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    out_rows: list[list[int]] = []
    for start in progress_bar(range(0, len(prompts), batch_size), desc="eval", disable=not progress):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        out_rows += [row[: row.index(eos) + 1] if eos in row else row for row in out[:, width:].tolist()]
    return out_rows


def _greedy_engine(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy completions with tailspec's engine (token-identical to HF greedy in fp32, and faster)."""
    from ..rollout.engine import RolloutEngine
    from ..rollout.params import RolloutConfig, SamplingParams

    engine = RolloutEngine(model, RolloutConfig(), eos_token_ids=[tokenizer.eos_token_id])
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    return [list(o.completion_ids) for o in outs]


@torch.no_grad()
def evaluate_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[ChainSumProblem],
    max_new_tokens: int = 512,
    batch_size: int = 32,
    progress: bool = False,
    return_completions: bool = False,
    backend: str = "hf",
) -> dict[str, Any]:
    """Greedy accuracy, overall and split by length, generated with HF ``generate`` (``backend="hf"``,
    left-padded batches of ``batch_size``) or tailspec's engine (``"engine"``, all at once).

    Returns ``accuracy`` (final answer correct), ``exact_match`` (the whole response equals the
    reference solution), ``accuracy_short`` (n <= 5), ``accuracy_long`` (n >= 15; NaN when there
    are none), their counts, and the mean / max completion length in tokens (EOS included);
    with ``return_completions`` also ``completions``, the decoded responses in problem order.
    """
    if not problems:
        raise ValueError("problems must not be empty")
    if backend not in ("hf", "engine"):
        raise ValueError(f"backend must be 'hf' or 'engine', got {backend!r}")
    completions = _greedy_completions(model, tokenizer, problems, max_new_tokens, batch_size, progress, backend)
    eos = tokenizer.eos_token_id
    results = []
    for i, p in enumerate(problems):
        ids = completions[i]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        results.append((p, extract_answer(text) == p.answer, text == p.solution and ids[-1] == eos, len(ids)))

    def rate(rows: list[tuple[ChainSumProblem, bool, bool, int]]) -> float:
        return sum(r[1] for r in rows) / len(rows) if rows else float("nan")

    short = [r for r in results if len(r[0].terms) <= SHORT_MAX_TERMS]
    long = [r for r in results if len(r[0].terms) >= LONG_MIN_TERMS]
    lengths = [r[3] for r in results]
    extra: dict[str, Any] = {}
    if return_completions:
        extra["completions"] = [
            tokenizer.decode(completions[i], skip_special_tokens=True) for i in range(len(problems))
        ]
    return {
        "num_problems": len(results),
        "accuracy": rate(results),
        "exact_match": sum(r[2] for r in results) / len(results),
        "num_short": len(short),
        "accuracy_short": rate(short),
        "num_long": len(long),
        "accuracy_long": rate(long),
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "max_completion_tokens": max(lengths),
        "mean_reference_tokens": sum(len(p.solution) + 1 for p in problems) / len(problems),
        **extra,
    }


def _greedy_completions(model, tokenizer, problems, max_new_tokens, batch_size, progress, backend) -> dict[int, list]:
    """Each problem's greedy completion ids (EOS kept), by problem index; the model's mode kept."""
    was_training = model.training
    model.eval()
    # Similar lengths in a batch: the batch runs until its longest response ends.
    order = sorted(range(len(problems)), key=lambda i: len(problems[i].terms))
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": problems[i].question}], True) for i in order]
    if backend == "hf":
        rows = _greedy_hf(model, tokenizer, prompts, max_new_tokens, batch_size, progress)
    else:
        rows = _greedy_engine(model, tokenizer, prompts, max_new_tokens)
    if was_training:
        model.train()
    return dict(zip(order, rows))


def long_problems(num: int, seed: int, task: ChainSumConfig) -> list[ChainSumProblem]:
    """Problems with n uniform on [15, max_terms]: a larger sample of the long tail for evaluation."""
    rng = random.Random(seed)
    low = min(LONG_MIN_TERMS, task.max_terms)
    return [sample_problem(rng, task, num_terms=rng.randint(low, task.max_terms)) for _ in range(num)]


SHIPPED_POLICIES = ("tiny", "deep")  # assets/<name>/: tiny = 4 x 256 (tests), deep = 24 x 256 (benchmarks, demo)


def assets_dir(name: str = "tiny") -> Path:
    """``assets/<name>`` in the installed package (the repository root is the package root)."""
    if name not in SHIPPED_POLICIES:
        raise ValueError(f"name must be one of {SHIPPED_POLICIES}, got {name!r}")
    return Path(__file__).resolve().parent.parent / "assets" / name


def tiny_assets_dir() -> Path:
    return assets_dir("tiny")


_RECIPES = {"tiny": "tailspec train-tiny", "deep": "tailspec train-deep"}


def load_shipped(name: str = "tiny", kind: str = "policy", dtype: torch.dtype = torch.float32):
    """A shipped model (``kind`` ``"policy"`` or ``"drafter"``, in eval mode, as ``dtype`` whatever
    it is stored in) and its tokenizer."""
    from transformers import AutoTokenizer

    if kind not in ("policy", "drafter"):
        raise ValueError(f"kind must be 'policy' or 'drafter', got {kind!r}")
    root = assets_dir(name)
    if not (root / kind / "config.json").exists():
        raise FileNotFoundError(f"no shipped {kind} at {root / kind}; make it with `{_RECIPES[name]}`")
    folder = unpacked_dir(root / kind)  # a whole checkpoint: config, tokenizer, weights
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_causal_lm(folder, dtype=dtype)
    return model.eval(), tokenizer


def load_shipped_eagle3(name: str = "tiny"):
    """The shipped EAGLE-3 head for policy ``name`` (warmed up on its rollouts; see the model card), fp32."""
    from ..drafter.eagle3.checkpoint import load_checkpoint

    path = assets_dir(name) / "eagle3"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no shipped EAGLE-3 head at {path}; make it with `{_RECIPES[name]}`")
    return load_checkpoint(path).head.float().eval()


def load_tiny(kind: str = "policy", dtype: torch.dtype = torch.float32):
    """The shipped tiny model (``"policy"`` or ``"drafter"``, in eval mode) and its tokenizer."""
    return load_shipped("tiny", kind, dtype)


def load_tiny_eagle3():
    """The shipped EAGLE-3 head for the tiny policy (warmed up on its rollouts; see the model card)."""
    return load_shipped_eagle3("tiny")


MODEL_CARD = """# Tiny chain-sum models: policy and drafter

Made from scratch on a CPU by tailspec's SFT recipe (`tasks/sft.py`), with no model hub and no
external data, by:

    {command}

(seed {seed}, {threads} CPU thread(s), {precision}, torch {torch_version}, transformers {tf_version};
wall times on {machine}).
Files: `policy/`, `drafter/` (each a whole checkpoint: `model.safetensors`, `config.json`, the tokenizer,
`generation_config.json`, `sft_metrics.json` with the loss curve and config, `eval.json`).
Load them with `tailspec.tasks.sft.load_tiny("policy")` / `load_tiny("drafter")`; `tailspec pack-assets`
stores them for shipping (fp16, packed losslessly as `model.safetensors.planes.xz`).

## Task and tokenizer

Chain-sum (`tasks/chain_sum.py`): the user message `add 3 5 2 7`, the response
`3+5=8 8+2=10 10+7=17 answer 17`, then `<|eos|>`. The number of terms is heavy-tailed:
P(n) ∝ n^-{tail_exponent} on [{min_terms}, {body_max}] with probability {body_prob}, else n uniform on
[{long_min}, {max_terms}] (P(n <= 5) = {p_short:.0%}, P(n >= 15) = {p_long:.0%}); responses are 14 to
{max_solution} characters. Character-level tokenizer, {vocab} tokens, chat template
`<|user|>{{question}}<|assistant|>{{response}}<|eos|>`.

## Training

Loss on the response tokens only (prompt masked); {uniform_pct}% of the training examples have n
uniform on [{min_terms}, {max_terms}] (the long tail), the rest come from the task distribution.
AdamW (betas 0.9/0.98, weight decay {weight_decay}), {warmup} warmup steps then cosine decay to
{min_lr_ratio}x the peak learning rate, gradient clipping {grad_clip}, batches of {batch_size}
sequences bucketed by length.

| model | architecture | parameters | steps | peak lr | tokens seen | final loss | wall time |
|---|---|---:|---:|---:|---:|---:|---:|
{train_rows}

## Greedy accuracy

HF `generate`, greedy, max {max_new_tokens} new tokens. "task" = {num_problems} held-out problems
from the task distribution (seed {eval_seed}; {num_short} with n <= 5, {num_long} with n >= 15 —
a small sample, see "long set"); "long set" = {num_long_set} problems with n uniform on
[{long_min}, {max_terms}] (seed {long_seed}). Short problems are few (e.g. only 100 distinct ones
with n = 2), so many of them also occur in the training data; long ones are unseen.

| model | eval set | accuracy | n <= 5 | n >= 15 | exact response | mean completion tokens (reference) | max |
|---|---|---:|---:|---:|---:|---:|---:|
{eval_rows}
"""


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def _eval_row(name: str, set_name: str, ev: dict[str, Any]) -> str:
    return (
        f"| {name} | {set_name} | {_pct(ev['accuracy'])} | {_pct(ev['accuracy_short'])} | "
        f"{_pct(ev['accuracy_long'])} | {_pct(ev['exact_match'])} | "
        f"{ev['mean_completion_tokens']:.1f} ({ev['mean_reference_tokens']:.1f}) | {ev['max_completion_tokens']} |"
    )


def _machine() -> str:
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        model = names[0] if names else model
    return f"{os.cpu_count()} CPUs, {model}"


def _command(args: argparse.Namespace) -> str:
    parts = ["python", "-m", "tailspec.tasks.sft", "--out", args.out]
    for flag in ("policy_steps", "drafter_steps", "policy_lr", "drafter_lr", "batch_size", "seed", "threads"):
        parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("bf16", "no_bf16", "quick"):
        if getattr(args, flag):
            parts.append(f"--{flag.replace('_', '-')}")
    return shlex.join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tailspec.tasks.sft",
        description="Train the tiny chain-sum policy and drafter from scratch and write a model card.",
    )
    parser.add_argument("--out", default=str(tiny_assets_dir()), help="output directory (default: the shipped assets)")
    parser.add_argument("--policy-steps", type=int, default=2200)
    parser.add_argument("--drafter-steps", type=int, default=2000)
    parser.add_argument("--policy-lr", type=float, default=3e-3)
    parser.add_argument("--drafter-lr", type=float, default=5e-3)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 autocast even where the CPU emulates bf16")
    precision.add_argument(
        "--no-bf16",
        action="store_true",
        help="plain fp32 (default: bf16 autocast where the CPU computes bf16 natively)",
    )
    parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems from the task distribution")
    parser.add_argument("--long-eval-problems", type=int, default=100, help="extra held-out problems with n >= 15")
    parser.add_argument("--quick", action="store_true", help="a few steps and problems (smoke test)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _train_and_evaluate(name, spec, cfg: SFTConfig, tokenizer, out: Path, eval_sets, max_new_tokens: int, args):
    """Train one model of the recipe, evaluate what was saved on both problem sets (written to its
    ``eval.json``); its row of the card's training table and its two evaluation rows."""
    problems, long_set = eval_sets
    logger.info("training %s (%s) for %d steps", name, spec.describe(), cfg.steps)
    metrics = train_model(spec, cfg, tokenizer, out / name, progress=not args.no_progress)
    model = load_causal_lm(out / name)  # evaluate what was saved
    ev_start = time.perf_counter()
    ev = evaluate_accuracy(model, tokenizer, problems, max_new_tokens, progress=not args.no_progress)
    ev_long = evaluate_accuracy(model, tokenizer, long_set, max_new_tokens, progress=not args.no_progress)
    ev_wall = time.perf_counter() - ev_start
    (out / name / "eval.json").write_text(
        json.dumps({"task": ev, "long_set": ev_long, "eval_wall_s": ev_wall}, indent=2) + "\n"
    )
    logger.info("%s: train %s", name, {k: v for k, v in metrics.items() if k != "loss_curve"})
    logger.info("%s: eval task %s; long set %s (%.0f s)", name, ev, ev_long, ev_wall)
    train_row = (
        f"| {name} | {spec.describe()} | {metrics['parameters']:,} | {cfg.steps} | {cfg.lr:g} | "
        f"{metrics['sequence_tokens']:,} | {metrics['final_loss']:.4f} | {metrics['wall_s'] / 60:.1f} min |"
    )
    return train_row, [_eval_row(name, "task", ev), _eval_row(name, "long set", ev_long)]


def _model_card(args, cfg: SFTConfig, tokenizer, train_rows, eval_rows, eval_sets, max_new_tokens: int) -> str:
    """The tiny models' card: the command, the task's distribution, the recipe and the tables."""
    problems, long_set = eval_sets
    task = cfg.task
    probs = task.probabilities()
    return MODEL_CARD.format(
        command=_command(args),
        seed=args.seed,
        threads=args.threads,
        machine=_machine(),
        precision="fp32 weights, bf16 autocast" if cfg.uses_bf16(torch.device("cpu")) else "fp32",
        torch_version=torch.__version__,
        tf_version=transformers.__version__,
        tail_exponent=f"{task.tail_exponent:g}",
        min_terms=task.min_terms,
        body_max=task.long_min_terms - 1 if task.long_fraction > 0 else task.max_terms,
        body_prob=f"{1 - task.long_fraction:g}",
        long_min=task.long_min_terms,
        max_terms=task.max_terms,
        p_short=sum(p for n, p in probs.items() if n <= SHORT_MAX_TERMS),
        p_long=sum(p for n, p in probs.items() if n >= LONG_MIN_TERMS),
        max_solution=len(ChainSumProblem((9,) * task.max_terms).solution),
        vocab=len(tokenizer),
        uniform_pct=round(cfg.uniform_fraction * 100),
        weight_decay=cfg.weight_decay,
        warmup="min(100, steps / 10)",
        min_lr_ratio=cfg.min_lr_ratio,
        grad_clip=cfg.grad_clip,
        batch_size=cfg.batch_size,
        train_rows="\n".join(train_rows),
        max_new_tokens=max_new_tokens,
        num_problems=len(problems),
        eval_seed=10_000 + args.seed,
        num_short=sum(len(p.terms) <= SHORT_MAX_TERMS for p in problems),
        num_long=sum(len(p.terms) >= LONG_MIN_TERMS for p in problems),
        num_long_set=len(long_set),
        long_seed=20_000 + args.seed,
        eval_rows="\n".join(eval_rows),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.policy_steps = args.drafter_steps = 3
        args.batch_size = 4
        args.eval_problems, args.long_eval_problems = 4, 2
    max_new_tokens = 24 if args.quick else 512
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    task = ChainSumConfig()
    tokenizer = build_tokenizer()

    # evaluation streams of their own (training streams use args.seed); the card names them
    problems = sample_problems(args.eval_problems, seed=10_000 + args.seed, cfg=task)
    long_set = long_problems(args.long_eval_problems, seed=20_000 + args.seed, task=task)
    eval_sets = (problems, long_set)
    runs = (
        ("policy", POLICY, args.policy_steps, args.policy_lr),
        ("drafter", DRAFTER, args.drafter_steps, args.drafter_lr),
    )
    train_rows, eval_rows, cfg = [], [], None
    for name, spec, steps, lr in runs:
        cfg = SFTConfig(
            steps=steps,
            batch_size=args.batch_size,
            lr=lr,
            warmup_steps=min(100, max(1, steps // 10)),
            seed=args.seed,
            threads=args.threads,
            bf16=True if args.bf16 else False if args.no_bf16 else None,
            task=task,
        )
        train_row, evals = _train_and_evaluate(
            name, spec, cfg, tokenizer, out, (problems, long_set), max_new_tokens, args
        )
        train_rows.append(train_row)
        eval_rows += evals
    card = _model_card(args, cfg, tokenizer, train_rows, eval_rows, eval_sets, max_new_tokens)
    (out / "MODEL_CARD.md").write_text(card)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
