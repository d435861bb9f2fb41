"""GRPO end to end: stock ``trl.GRPOTrainer`` (its own ``generate``) against
``tailspec.GRPOTrainer(rollout=SpecRollout(...))`` on the same configuration and seeds.

Both runs train the shipped tiny chain-sum policy from the same weights, on the same prompts,
in fp32 on CPU, one after the other in one process. A callback times every RL step (generation,
scoring and the optimizer step) and records the reward TRL logs. The rollout is lossless, so the
reward curves should differ only by sampling noise: a two-sided permutation test on the per-step
mean rewards says whether they do.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import plot_panels

logger = logging.getLogger(__name__)


@dataclass
class E2ERun:
    name: str
    step_s: list[float]
    rewards: list[float]
    total_s: float
    generation_s: list[float] = field(default_factory=list)  # per step: generating and scoring the batch

    def mean_step_s(self, skip_first: bool = True) -> float:
        return _mean_after_first(self.step_s, skip_first)

    def mean_generation_s(self, skip_first: bool = True) -> float:
        return _mean_after_first(self.generation_s, skip_first) if self.generation_s else float("nan")


def _mean_after_first(xs: list[float], skip_first: bool) -> float:
    xs = xs[1:] if skip_first and len(xs) > 1 else xs
    return sum(xs) / len(xs)


def _time_generation(trainer) -> list[float]:
    """Per call of TRL's ``_generate_and_score_completions`` (generation, rewards, advantages and
    any logprob forwards TRL runs there), its wall time."""
    seconds: list[float] = []
    original = trainer._generate_and_score_completions

    def timed(inputs):
        start = time.perf_counter()
        out = original(inputs)
        seconds.append(time.perf_counter() - start)
        return out

    trainer._generate_and_score_completions = timed
    return seconds


class _Turns:
    """Whose turn it is among ``n`` trainers running in threads (one RL step per turn)."""

    def __init__(self, n: int) -> None:
        self.n, self.turn, self.done = n, 0, set()
        self.cv = threading.Condition()

    def wait(self, i: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == i)

    def pass_on(self, i: int, finished: bool = False) -> None:
        with self.cv:
            if finished:
                self.done.add(i)
            if self.turn == i:
                later = [(i + k) % self.n for k in range(1, self.n + 1)]
                self.turn = next((j for j in later if j not in self.done), i)
            self.cv.notify_all()


def _lockstep_timer(turns: _Turns, index: int):
    """Times each RL step of one trainer, taking turns with the others: a step starts only when the
    previous trainer's step has ended, so every trainer's step k runs next to the others' step k
    and the machine's speed drift (minutes on a shared VM) hits them alike."""
    from transformers import TrainerCallback

    class LockstepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.rewards: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            turns.wait(index)
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._start)
            turns.pass_on(index)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    return LockstepTimer()


def _train_in_lockstep(trainers: list, turns: _Turns) -> list[float]:
    """``trainer.train()`` for each, in threads taking turns step by step (their timers wait on
    ``turns``); wall seconds of each."""
    errors: list[BaseException] = []
    walls = [0.0] * len(trainers)

    def run(i: int) -> None:
        start = time.perf_counter()
        try:
            trainers[i].train()
        except BaseException as e:  # re-raised in the caller
            errors.append(e)
        finally:
            walls[i] = time.perf_counter() - start
            turns.pass_on(i, finished=True)

    threads = [threading.Thread(target=run, args=(i,), name=f"e2e-{i}") for i in range(len(trainers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return walls


def permutation_pvalue(a: list[float], b: list[float], rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided permutation test of equal means."""
    rng = random.Random(seed)
    observed = abs(sum(a) / len(a) - sum(b) / len(b))
    pooled = a + b
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        x, y = pooled[: len(a)], pooled[len(a) :]
        hits += abs(sum(x) / len(x) - sum(y) / len(y)) >= observed - 1e-12
    return (hits + 1) / (rounds + 1)


def measure_e2e(steps: int, seed: int = 0, quick: bool = False, strategy: str = "adaptive") -> list[E2ERun]:
    import os

    import trl

    from ..tasks.chain_sum import ChainSumConfig, chain_sum_reward, make_grpo_dataset
    from ..tasks.sft import load_tiny, load_tiny_eagle3
    from ..trainer_hooks.grpo_trainer import GRPOTrainer
    from ..trainer_hooks.spec_rollout import SpecRollout

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    prompts, generations, length = (2, 4, 96) if quick else (4, 8, 384)
    names = ("stock TRL (generate)", f"tailspec ({strategy}, EAGLE-3)")
    turns = _Turns(len(names))
    trainers, timers, generation_s = [], [], []
    for index, name in enumerate(names):
        model, tokenizer = load_tiny("policy")
        args = trl.GRPOConfig(
            output_dir=f"outputs/bench_e2e/{index}",
            per_device_train_batch_size=prompts * generations,
            num_generations=generations,
            max_completion_length=length,
            temperature=1.0,
            learning_rate=2e-5,
            beta=0.0,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=seed,
            disable_tqdm=True,
        )
        timers.append(_lockstep_timer(turns, index))
        common: dict[str, Any] = dict(
            model=model,
            reward_funcs=chain_sum_reward,
            args=args,
            train_dataset=make_grpo_dataset(2000, seed=seed, cfg=ChainSumConfig()),
            processing_class=tokenizer,
            callbacks=[timers[-1]],
        )
        if name.startswith("stock"):
            trainer = trl.GRPOTrainer(**common)
        else:
            trainer = GRPOTrainer(**common, rollout=SpecRollout(strategy=strategy, drafter=load_tiny_eagle3()))
        generation_s.append(_time_generation(trainer))
        trainers.append(trainer)
    walls = _train_in_lockstep(trainers, turns)
    runs = []
    for name, timer, gen, wall in zip(names, timers, generation_s, walls):
        runs.append(E2ERun(name, timer.step_s, timer.rewards, sum(timer.step_s), gen))
        logger.info(
            "%s: %.2f s/step, reward %.3f (wall %.1f s)", name, runs[-1].mean_step_s(), sum(timer.rewards) / steps, wall
        )
    return runs


def e2e_table(runs: list[E2ERun]) -> str:
    stock, ours = runs

    def stats(xs: list[float]) -> str:
        mean = sum(xs) / len(xs)
        sd = (sum((x - mean) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5
        return f"{mean:.3f} ± {sd:.3f}"

    lines = [
        "| run | RL steps | total s | s / step (steps 2+) | of which generation s | training s | "
        "speedup per step | mean reward per step ± sd |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        speedup = stock.mean_step_s() / r.mean_step_s()
        generation = r.mean_generation_s()
        lines.append(
            f"| {r.name} | {len(r.step_s)} | {r.total_s:.1f} | {r.mean_step_s():.2f} | {generation:.2f} | "
            f"{r.mean_step_s() - generation:.2f} | {speedup:.2f}x | {stats(r.rewards)} |"
        )
    p = permutation_pvalue(stock.rewards, ours.rewards)
    lines += ["", f"Reward curves: two-sided permutation test of equal mean per-step reward, p = {p:.2f}."]
    return "\n".join(lines)


def plot_e2e(runs: list[E2ERun], path: Path) -> None:
    def steps(n: int) -> list[int]:
        return list(range(1, n + 1))

    plot_panels(
        path,
        [
            ("Wall time per GRPO step", "seconds", [(r.name, steps(len(r.step_s)), r.step_s) for r in runs]),
            ("Reward", "mean reward", [(r.name, steps(len(r.rewards)), r.rewards) for r in runs]),
        ],
    )


def e2e_section(runs: list[E2ERun], plot_name: str) -> str:
    return (
        "The same GRPO configuration (shipped tiny chain-sum policy, 4 prompts x 8 generations per step, "
        "max 384 completion tokens, T = 1, lr 2e-5, fp32 on CPU, the same seeds) with stock "
        "`trl.GRPOTrainer` (its default `generate`) and with `tailspec.GRPOTrainer(rollout=SpecRollout("
        "strategy='adaptive', drafter=<shipped EAGLE-3 head>))`, which also runs TRL's importance-sampling "
        "correction (stock TRL without vLLM has none); its trainer logprobs come from the loss forward, so it "
        "costs no extra forward (`fuse_importance_forward`, on by default). Step 1 is left out of the "
        "per-step means (model warm-up). The two trainers run in lockstep (two threads taking turns: step k of "
        "one, then step k of the other), so the machine's speed drift hits both alike; *total s* sums a run's "
        "step times. *Generation s* is the time in TRL's `_generate_and_score_completions` "
        "(generation, rewards, advantages); *training s* the rest of the step (loss forward, backward, "
        "optimizer). tailspec runs its policy forwards per group of similar completion lengths, each trimmed "
        "to its longest row (`length_grouped_forward`, on by default: the same logprobs and gradients); stock "
        "TRL runs them on the batch padded to its longest completion.\n\n"
        f"{e2e_table(runs)}\n\n![end to end]({plot_name})"
    )
