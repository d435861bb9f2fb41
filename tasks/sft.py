"""SFT recipe for the shipped tiny models: a policy (~3M parameters) and a drafter LM (~8x smaller).

Both are Qwen2-architecture models trained from scratch on chain-sum solutions, deterministic
from a seed. The policy is meant to be good but imperfect (long sums are harder), so RL has
something to improve. ``tailspec train-tiny`` runs this recipe; the results ship in assets/tiny.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .chain_sum import ChainSumConfig, ChainSumProblem, extract_answer, sample_problem, sample_problems
from .tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024

    def config(self, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
        return Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )


POLICY = TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768)
DRAFTER = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384)


@dataclass
class SFTConfig:
    steps: int = 3000
    tokens_per_batch: int = 6144
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 1
    uniform_fraction: float = 0.5  # share of examples with a uniform number of terms (teaches long sums)
    task: ChainSumConfig = field(default_factory=ChainSumConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.tokens_per_batch < 512:
            raise ValueError(f"tokens_per_batch must be >= 512, got {self.tokens_per_batch}")
        if not 0 <= self.uniform_fraction <= 1:
            raise ValueError(f"uniform_fraction must be in [0, 1], got {self.uniform_fraction}")


def encode_example(tokenizer: PreTrainedTokenizerFast, problem: ChainSumProblem) -> tuple[list[int], int]:
    """Token ids of the templated dialogue and the number of prompt tokens (not trained on)."""
    prompt = [{"role": "user", "content": problem.question}]
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    full = tokenizer.apply_chat_template(
        prompt + [{"role": "assistant", "content": problem.solution}], tokenize=True, return_dict=True
    )["input_ids"]
    return list(full), len(prompt_ids)


class BatchSampler:
    """Draws length-bucketed batches under a token budget (little padding despite the long tail)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, cfg: SFTConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)

    def _problem(self) -> ChainSumProblem:
        task = self.cfg.task
        if self.rng.random() < self.cfg.uniform_fraction:
            return sample_problem(self.rng, task, num_terms=self.rng.randint(task.min_terms, task.max_terms))
        return sample_problem(self.rng, task)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool = sorted((encode_example(self.tokenizer, self._problem()) for _ in range(64)), key=lambda e: len(e[0]))
        start = self.rng.randrange(len(pool))
        width = len(pool[start][0])
        rows = [pool[start]]
        for ex in pool[start + 1 :] + pool[:start][::-1]:
            width = max(width, len(ex[0]))
            if width * (len(rows) + 1) > self.cfg.tokens_per_batch:
                break
            rows.append(ex)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (seq, prompt_len) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, prompt_len : len(seq)] = ids[i, prompt_len : len(seq)]
        return ids, mask, labels


def _lr_at(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_model(
    spec: TinyModelSpec,
    cfg: SFTConfig,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: Path | None = None,
    progress: bool = True,
) -> tuple[Qwen2ForCausalLM, dict]:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model = Qwen2ForCausalLM(spec.config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sampler = BatchSampler(tokenizer, cfg)
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"sft h={spec.hidden_size}", disable=not progress)
    for step in bar:
        ids, mask, labels = sampler.batch()
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        tokens += int(mask.sum())
        if step % 20 == 0:
            bar.set_postfix(
                loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}",
                tok_s=f"{tokens / (time.perf_counter() - start):.0f}",
            )
    model.eval()
    metrics = {
        "steps": cfg.steps,
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "first_loss": losses[0],
        "train_tokens": tokens,
        "wall_s": time.perf_counter() - start,
        "parameters": count_parameters(model),
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        (out_dir / "sft_metrics.json").write_text(json.dumps({**metrics, "config": _jsonable(cfg)}, indent=2))
    return model, metrics


def _jsonable(cfg: SFTConfig) -> dict:
    d = asdict(cfg)
    d["task"] = asdict(cfg.task)
    return d


def evaluate_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[ChainSumProblem],
    max_new_tokens: int = 400,
) -> dict:
    """Greedy accuracy overall and on short (n <= 5) / long (n >= 15) problems, via the tailspec engine."""
    from ..rollout.engine import RolloutEngine
    from ..rollout.params import RolloutConfig, SamplingParams

    engine = RolloutEngine(model, RolloutConfig(), eos_token_ids=[tokenizer.eos_token_id])
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p.question}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p in problems
    ]
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    correct = [
        extract_answer(tokenizer.decode(o.completion_ids, skip_special_tokens=True)) == p.answer
        for o, p in zip(outputs, problems)
    ]

    def acc(sel):
        picked = [c for c, p in zip(correct, problems) if sel(p)]
        return sum(picked) / len(picked) if picked else float("nan")

    lengths = [len(o.completion_ids) for o in outputs]
    return {
        "accuracy": acc(lambda p: True),
        "accuracy_short": acc(lambda p: len(p.terms) <= 5),
        "accuracy_long": acc(lambda p: len(p.terms) >= 15),
        "num_problems": len(problems),
        "num_long": sum(len(p.terms) >= 15 for p in problems),
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "max_completion_tokens": max(lengths),
    }


def tiny_assets_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "tiny"


def load_tiny(kind: str = "policy", dtype: torch.dtype = torch.float32):
    """The shipped tiny model (``policy`` or ``drafter``) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if kind not in ("policy", "drafter"):
        raise ValueError(f"kind must be 'policy' or 'drafter', got {kind!r}")
    root = tiny_assets_dir()
    if not (root / kind / "config.json").exists():
        raise FileNotFoundError(f"no shipped {kind} at {root / kind}; run `tailspec train-tiny --out {root}`")
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(root / kind, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), tokenizer


MODEL_CARD = """# Tiny chain-sum models

Made locally by tailspec's SFT recipe (no model hub, no external data):

    {command}

Task: chain-sum (`tailspec/tasks/chain_sum.py`): `add 3 5 2 7` → `3+5=8 8+2=10 10+7=17 answer 17`,
number of terms heavy-tailed on [2, {max_terms}] (P(n) ∝ n^-{tail_exponent}). Character-level
tokenizer ({vocab} tokens) with a chat template (`<|user|>…<|assistant|>…<|eos|>`).
Training data: {uniform_pct}% of examples with a uniform number of terms, the rest from the task
distribution; loss on assistant tokens only; AdamW, cosine schedule, fp32, seed {seed},
{threads} CPU thread(s).

| model | architecture | parameters | SFT steps | train tokens | wall time |
|---|---|---:|---:|---:|---:|
{train_rows}

Greedy accuracy on {num_problems} held-out problems from the task distribution (seed {eval_seed};
{num_long} of them have >= 15 terms), measured with the tailspec engine:

| model | overall | short (n <= 5) | long (n >= 15) | mean completion tokens | max |
|---|---:|---:|---:|---:|---:|
{eval_rows}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tailspec train-tiny", description=__doc__)
    parser.add_argument("--out", default=str(tiny_assets_dir()))
    parser.add_argument("--policy-steps", type=int, default=3000)
    parser.add_argument("--drafter-steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a few steps (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.policy_steps, args.drafter_steps, args.eval_problems = 3, 3, 4
    logging.basicConfig(level=logging.INFO)
    out = Path(args.out)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    task = ChainSumConfig()
    eval_seed = 10_000 + args.seed
    problems = sample_problems(args.eval_problems, seed=eval_seed, cfg=task)
    train_rows, eval_rows = [], []
    for name, spec, steps in (("policy", POLICY, args.policy_steps), ("drafter", DRAFTER, args.drafter_steps)):
        cfg = SFTConfig(
            steps=steps, seed=args.seed, threads=args.threads, task=task, warmup_steps=min(100, max(1, steps // 10))
        )
        model, m = train_model(spec, cfg, tokenizer, out / name)
        ev = evaluate_accuracy(model, tokenizer, problems)
        (out / name / "eval.json").write_text(json.dumps(ev, indent=2))
        logger.info("%s: %s %s", name, m, ev)
        arch = f"Qwen2, hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads}/{spec.num_kv_heads} heads"
        train_rows.append(
            f"| {name} | {arch} | {m['parameters']:,} | {steps} | {m['train_tokens']:,} | {m['wall_s'] / 60:.1f} min |"
        )
        eval_rows.append(
            f"| {name} | {ev['accuracy']:.1%} | {ev['accuracy_short']:.1%} | {ev['accuracy_long']:.1%} | "
            f"{ev['mean_completion_tokens']:.1f} | {ev['max_completion_tokens']} |"
        )
    command = "tailspec train-tiny " + " ".join(argv if argv is not None else [])
    (out / "MODEL_CARD.md").write_text(
        MODEL_CARD.format(
            command=command.strip(),
            max_terms=task.max_terms,
            tail_exponent=task.tail_exponent,
            vocab=len(tokenizer),
            uniform_pct=int(SFTConfig().uniform_fraction * 100),
            seed=args.seed,
            threads=args.threads,
            train_rows="\n".join(train_rows),
            num_problems=len(problems),
            eval_seed=eval_seed,
            num_long=sum(len(p.terms) >= 15 for p in problems),
            eval_rows="\n".join(eval_rows),
        )
    )
    print(f"wrote {out}")
    return 0
