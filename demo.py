"""``tailspec demo``: a short GRPO run on the tiny chain-sum task with tailspec rollouts, on CPU.

Starts from the shipped SFT policy (assets/tiny), prints reward and rollout tokens/s per step,
and logs to wandb in offline mode unless told not to.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .config_tree import ConfigError, apply_overrides, coerce_subtrees, int_at_least, require
from .extras import need
from .progress import is_terminal, quiet_library_bars
from .rollout.strategy import parse_strategy
from .trainer_hooks.config import SpecRolloutConfig, WithRollout
from .trainer_hooks.paired_rollout import PairedRollout

if TYPE_CHECKING:
    from .drafter.eagle3.train import DrafterTrainingConfig

logger = logging.getLogger(__name__)


def demo_rollout() -> SpecRolloutConfig:
    """The demo's rollout unless its config says otherwise: adaptive speculation in-process, the
    EAGLE-3 head trained online after every rollout; on workers, at most 64 spot steps per rollout."""
    return SpecRolloutConfig().with_overrides(strategy="adaptive", drafter_train_steps=8, max_spot_steps=64)


@dataclass
class DemoConfig(WithRollout):
    policy: str = "tiny"  # a shipped policy with its drafters: tiny (4 x 256, quick) | deep (24 x 256, realistic)
    # a directory of other weights for that policy (save_pretrained, same tokenizer), e.g. fine-tuned to
    # another response format; None: the shipped weights
    policy_dir: str | None = None
    device: str = "cpu"  # cpu | cuda: where the trainer runs (cuda: fp32 master weights under bf16 autocast)
    max_steps: int = 20
    num_generations: int = 8
    prompts_per_step: int = 4
    max_completion_length: int = 384
    learning_rate: float = 2e-5
    temperature: float = 1.0
    # TRL's importance-sampling correction with the rollout's logprobs (tailspec.GRPOTrainer); off, the
    # loss reads no rollout logprob, whose last bits depend on how the verification forward was packed
    importance_sampling: bool = True
    beta: float = 0.0
    seed: int = 0
    num_train_prompts: int = 2000
    # a fixed problem set ("add 7 7 8", ...) trained on in order, prompts_per_step of them a step (its size
    # a multiple of prompts_per_step; equal to it: the whole set every step, so the reward is comparable
    # from step to step). None: num_train_prompts sampled ones
    problems: list[str] | None = None
    output_dir: str = "outputs/demo"
    wandb: bool = True
    wandb_project: str = "tailspec-demo"
    # eagle3: the shipped EAGLE-3 head, trained online | small_lm: the shipped drafter LM |
    # self:L: the policy's own first L layers (self-speculative: moves with the policy, never trained)
    drafter: str = "eagle3"
    # DrafterFromTrainer: EAGLE-3 steps on the trainer's own loss forwards after every optimizer step (0 = off)
    drafter_from_trainer: int = 0
    # the rest of the story around the GRPO run
    warmup_steps: int = 0  # EAGLE-3 warm-up steps on the policy's rollouts before RL (0 = use the shipped head as is)
    warmup_prompts: int = 48
    baseline: bool = False  # a plain-decoding twin rolls out every step's prompts too: same-step ratios (PairedRollout)
    # other drafters (names as `drafter` takes them) rolling out every step's prompts on the same weights
    # beside the main rollout and the twin (needs baseline): which drafter pays on this workload, step by
    # step; the trainer trains on the main rollout's completions only
    compare_drafters: list[str] = field(default_factory=list)
    export: str | None = None  # export the trained head for "sglang" or "vllm" into output_dir
    deepspeed: str | None = None  # "zero2" | "zero3" | a DeepSpeed JSON path (needs tailspec[deepspeed])
    # the rollout, passed to SpecRollout as it is (tailspec.SpecRolloutConfig): the strategy
    # (engine.strategy; model arms draft with `drafter`), Ray workers (workers.num_workers: 0 = the
    # in-process engine; N = N engines in Ray actors, the EAGLE-3 head trained on workers idle in the
    # tail), in-process online training of the EAGLE-3 head (training.drafter_train_steps, workers 0),
    # position-keyed sampling (position_noise: completions that do not depend on the strategy or
    # drafter, so runs that differ only in those follow one policy trajectory)
    rollout: SpecRolloutConfig = field(default_factory=demo_rollout)

    def __post_init__(self) -> None:
        from .tasks.sft import SHIPPED_POLICIES

        coerce_subtrees(self)
        require(self.policy in SHIPPED_POLICIES, "policy", f"one of {list(SHIPPED_POLICIES)}", self.policy)
        require(
            self.policy_dir is None or (Path(self.policy_dir) / "config.json").is_file(),
            "policy_dir",
            "None or a model directory with a config.json",
            self.policy_dir,
        )
        for name, low in (("max_steps", 1), ("num_generations", 2), ("prompts_per_step", 1), ("warmup_prompts", 1)):
            require(int_at_least(getattr(self, name), low), name, f"an int >= {low}", getattr(self, name))
        for name in ("drafter_from_trainer", "warmup_steps"):
            require(int_at_least(getattr(self, name), 0), name, "an int >= 0", getattr(self, name))
        require(self.device in ("cpu", "cuda"), "device", "'cpu' or 'cuda'", self.device)
        self._check_problems()
        self._check_drafter()
        require(self.export in (None, "sglang", "vllm"), "export", "null, 'sglang' or 'vllm'", self.export)
        if self.deepspeed is not None:
            from .trainer_hooks.deepspeed import deepspeed_config

            deepspeed_config(self.deepspeed)  # raises ValueError naming the field

    def _check_problems(self) -> None:
        if self.problems is None:
            return
        from .tasks.chain_sum import ChainSumProblem

        require(
            isinstance(self.problems, list) and bool(self.problems),
            "problems",
            "null or a non-empty list of questions",
            self.problems,
        )
        for question in self.problems:
            try:
                ChainSumProblem.from_question(question)
            except ValueError as e:
                raise ConfigError("problems", f"holds {question!r}: {e}") from None
        require(
            len(self.problems) % self.prompts_per_step == 0,
            "prompts_per_step",
            f"a divisor of the number of problems ({len(self.problems)}) when problems is set",
            self.prompts_per_step,
        )

    def _check_drafter(self) -> None:
        require(
            isinstance(self.compare_drafters, list),
            "compare_drafters",
            "a list of drafter names",
            self.compare_drafters,
        )
        for name, value in (("drafter", self.drafter), *(("compare_drafters", d) for d in self.compare_drafters)):
            require(
                value in ("eagle3", "small_lm") or _is_self_drafter(value),
                name,
                "'eagle3', 'small_lm' or 'self:L'",
                value,
            )
        if self.compare_drafters:
            require(
                self.baseline,
                "baseline",
                "true when compare_drafters is set (they are judged against the twin)",
                self.baseline,
            )
            names = [self.drafter, *self.compare_drafters]
            require(
                len(set(names)) == len(names),
                "compare_drafters",
                f"drafters other than each other and drafter {self.drafter!r}",
                self.compare_drafters,
            )
            require(
                self.rollout.workers.num_workers == 0,
                "rollout.workers.num_workers",
                "0 when compare_drafters is set (the drafters compared roll out in-process)",
                self.rollout.workers.num_workers,
            )

    def with_overrides(self, **overrides: Any) -> DemoConfig:
        """A copy with ``overrides`` set: the demo's own fields by name, the rollout's by dotted path
        (``rollout.engine.strategy``) or by a name only one of its fields has (``strategy``,
        ``num_workers``; ``workers=N`` is short for ``rollout.workers.num_workers=N``)."""
        own_names = {f.name for f in fields(self)} - {"rollout"}
        own: dict[str, Any] = {}
        rollout: dict[str, Any] = {}
        for key, value in overrides.items():
            head, _, rest = key.partition(".")
            if head == "rollout" and rest:
                rollout[rest] = value
            elif head in own_names or key == "rollout":
                own[key] = value
            elif SpecRolloutConfig.takes(key):
                rollout[key] = value
            else:
                raise ConfigError(key, "is not a field of DemoConfig or of any config below it")
        try:
            moved = self.rollout.with_overrides(**rollout)
        except ConfigError as e:
            raise e.under("rollout") from None
        return apply_overrides(replace(self, rollout=moved) if rollout else self, own)

    @classmethod
    def from_yaml(cls, path: str | Path) -> DemoConfig:
        """The demo config a YAML file describes (keys as :meth:`with_overrides` takes them)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        try:
            return cls().with_overrides(**data)
        except ConfigError as e:
            raise ConfigError(e.path, f"{e.problem} (in {path})") from None


def _step_printer():
    from transformers import TrainerCallback

    class StepPrinter(TrainerCallback):
        """One line per GRPO step: reward, completion lengths, rollout throughput, and the share of
        prompt groups whose rewards differ (only those carry a GRPO gradient)."""

        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            row = {
                "step": state.global_step,
                "reward": logs["reward"],
                "mean_len": logs.get("completions/mean_length", float("nan")),
                "max_len": logs.get("completions/max_length", float("nan")),
                "rollout_s": logs.get("rollout/time_s", float("nan")),
                "rollout_tok_s": logs.get("rollout/tokens_per_s", float("nan")),
                "accept_len": logs.get("rollout/accept_length"),
                "drafter_loss": logs.get("drafter/loss"),
                "groups_with_signal": 1.0 - logs.get("frac_reward_zero_std", float("nan")),
            }
            self.rows.append(row)
            print(
                f"step {row['step']:>3}  reward {row['reward']:.3f}  groups with signal "
                f"{row['groups_with_signal']:.2f}  completion len mean {row['mean_len']:.0f} "
                f"max {row['max_len']:.0f}  rollout {row['rollout_s']:.2f}s  {row['rollout_tok_s']:.0f} tok/s"
                + (f"  accept len {row['accept_len']:.2f}" if row["accept_len"] is not None else "")
                + (f"  drafter loss {row['drafter_loss']:.3f}" if row["drafter_loss"] is not None else ""),
                flush=True,
            )

    return StepPrinter()


def _quiet_progress():
    """TRL's progress bar without its raw dict of every metric per step: the demo prints its own
    line per step, and wandb (or ``trainer.state.log_history``) keeps every metric."""
    from transformers.trainer_callback import ProgressCallback

    class QuietProgress(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    return QuietProgress


def _is_self_drafter(name: str) -> bool:
    kind, _, layers = str(name).partition(":")
    return kind == "self" and layers.isdigit() and int(layers) >= 1


def _make_rollout(cfg: DemoConfig, start: Any = None):
    """The demo's ``SpecRollout``: the drafter ``cfg.drafter`` names, from ``start`` (an EAGLE-3
    head or a drafter LM to continue from) instead of the shipped one when given."""
    from .drafter.eagle3.train import DrafterTrainingConfig
    from .drafter.lm_trainer import DraftLMTrainingConfig
    from .tasks.sft import load_shipped, load_shipped_eagle3
    from .trainer_hooks.spec_rollout import SpecRollout

    rollout = cfg.rollout
    if cfg.device == "cuda" and rollout.engine.dtype == "auto":
        # the trainer computes in bf16 (autocast) on fp32 weights: the engine decodes a bf16 copy
        # (RolloutConfig.dtype; on the fp32 weights speculation gains little over plain decoding)
        rollout = rollout.with_overrides(**{"engine.dtype": "bfloat16"})
    if not parse_strategy(cfg.strategy).wants_model_drafter:  # adaptive wants one: its chain/tree/mirror arms
        return SpecRollout(config=rollout.with_overrides(drafter_train_steps=0))  # no drafter to train
    if cfg.drafter == "small_lm":  # distilled on the policy's completions: in-process or on idle workers
        lm = start if start is not None else load_shipped(cfg.policy, "drafter")[0]
        lm = lm.to(cfg.device)  # drafts and trains beside the policy
        return SpecRollout(config=rollout, drafter=lm, drafter_training=DraftLMTrainingConfig(seed=cfg.seed))
    if _is_self_drafter(cfg.drafter):
        return SpecRollout(config=rollout, drafter=cfg.drafter)
    # A spot chunk yields to a rollout before its next step, so one step is the longest it can hold
    # a worker up: smaller steps there (~0.3 s on a 2-core CPU instead of ~0.8 s), and a lower
    # learning rate, as they continue from an already warmed-up head.
    offline = DrafterTrainingConfig(batch_size=8, max_tokens=512, seed=cfg.seed)
    training = _online_training(cfg) if cfg.num_workers else offline
    head = (start if start is not None else load_shipped_eagle3(cfg.policy)).to(cfg.device)  # beside the policy
    return SpecRollout(config=rollout, drafter=head, drafter_training=training)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo; returns its printed summary."""
    return run_demo_with_rollout(cfg)[0]


def _prepare_environment(cfg: DemoConfig) -> Path:
    need("trl", "trl", "tailspec demo")  # before any work: a missing extra is one line
    if cfg.wandb:
        need("wandb", "wandb", "the demo's wandb logging (--no-wandb turns it off)")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # TRL 1.16 calls the gradient-checkpointing API transformers 5 renamed: a warning every step
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)
    quiet_library_bars()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(out))
        os.environ.setdefault("WANDB_PROJECT", cfg.wandb_project)
        os.environ.setdefault("WANDB_SILENT", "true")
    return out


def _policy(cfg: DemoConfig):
    """(policy model, tokenizer): the shipped policy, with ``policy_dir``'s weights when given."""
    from .tasks.sft import load_shipped

    model, tokenizer = load_shipped(cfg.policy, "policy")
    if cfg.policy_dir is not None:
        import torch

        from .packed_weights import weights_location
        from .safe_files import load_causal_lm

        model = load_causal_lm(weights_location(cfg.policy_dir), dtype=torch.float32)
    return model, tokenizer


def _warm_up(cfg: DemoConfig):
    """Continue the shipped EAGLE-3 head on the shipped policy's rollouts of fresh prompts."""
    from .drafter.eagle3.train import DrafterTrainingConfig
    from .drafter.eagle3_warmup import WarmupConfig, warmup_head
    from .tasks.chain_sum import ChainSumConfig, make_grpo_dataset
    from .tasks.sft import load_shipped_eagle3
    from .trainer_hooks.spec_rollout import SpecRollout

    model, tokenizer = _policy(cfg)
    rows = make_grpo_dataset(cfg.warmup_prompts, seed=cfg.seed + 7919, cfg=ChainSumConfig())
    prompts = SpecRollout.tokenize_prompts([r["prompt"] for r in rows], tokenizer)
    warm = WarmupConfig(
        rounds=1,
        steps_per_round=cfg.warmup_steps,
        max_new_tokens=cfg.max_completion_length,
        training=DrafterTrainingConfig(batch_size=8, max_tokens=512, learning_rate=1e-4, seed=cfg.seed),
        seed=cfg.seed,
    )
    head, _, rounds = warmup_head(model, prompts, warm, head=load_shipped_eagle3(cfg.policy), progress=True)
    r = rounds[-1]
    print(
        f"drafter warm-up: {r.completions} rollouts ({r.tokens} tokens) of the policy, {cfg.warmup_steps} steps, "
        f"loss {r.loss_first:.3f} -> {r.loss_last:.3f}",
        flush=True,
    )
    return head


def train_dataset(cfg: DemoConfig):
    """The GRPO prompts: ``cfg.problems`` whole and in order once per step (the trainer does not
    shuffle them), else ``num_train_prompts`` sampled problems."""
    from .tasks.chain_sum import ChainSumConfig, ChainSumProblem, grpo_dataset_of, make_grpo_dataset

    if cfg.problems:
        rounds = -(-cfg.max_steps * cfg.prompts_per_step // len(cfg.problems))  # the set, as often as the steps take
        return grpo_dataset_of([ChainSumProblem.from_question(q) for q in cfg.problems] * rounds)
    return make_grpo_dataset(cfg.num_train_prompts, seed=cfg.seed, cfg=ChainSumConfig())


def _for_drafter(cfg: DemoConfig, drafter: str) -> DemoConfig:
    """``cfg`` for the rollout drafting with ``drafter`` (the main one, or one of
    ``compare_drafters``): ``rollout.training.self_adapter_rank`` belongs to the ``self:L`` rollout
    among them, so the others leave it unset."""
    others_self = any(_is_self_drafter(d) for d in (cfg.drafter, *cfg.compare_drafters) if d != drafter)
    keep_rank = _is_self_drafter(drafter) or not others_self
    rank = {} if keep_rank else {"self_adapter_rank": None}
    return cfg.with_overrides(drafter=drafter, compare_drafters=[], **rank)  # the one rollout's config


def _plain_twin(cfg: DemoConfig) -> Any:
    """The baseline's plain-decoding rollout, placed as the main one (its workers reserve no cores:
    they idle while the main one's run), logging nothing to the trainer."""
    overrides: dict[str, Any] = {
        "strategy": "none",
        "log_metrics": False,
        "drafter_train_steps": 0,
        "self_adapter_rank": None,  # no drafter, so no exit adapter to train
    }
    if cfg.num_workers:
        overrides["num_cpus_per_worker"] = 0.0
    return _make_rollout(cfg.with_overrides(**overrides))


def _grpo_run(
    cfg: DemoConfig,
    out: Path,
    start: Any = None,
    label: str = "tailspec",
    callbacks: list | None = None,
    catch_up: dict | None = None,
    starts: dict[str, Any] | None = None,
):
    """One GRPO run: (printed rows per step, the SpecRollout, its PairedRollout with the plain twin
    when ``cfg.baseline`` (else None), wall seconds, wandb run name);
    ``callbacks`` join the trainer's (benchmarks measure through them); ``catch_up``: a catch-up
    rule's state to continue from (``SpecRollout.catch_up.state_dict()`` of an earlier run);
    ``starts``: by name, the drafters of ``cfg.compare_drafters`` to start from (else the shipped ones)."""
    from transformers.trainer_callback import ProgressCallback

    from .tasks.chain_sum import chain_sum_reward
    from .trainer_hooks.grpo_trainer import GRPOTrainer

    model, tokenizer = _policy(cfg)
    run_name = f"demo-{label.replace(' ', '-')}-{int(time.time())}"
    args, dataset = _grpo_config(cfg, out, run_name), train_dataset(cfg)
    printer = _step_printer()
    rollout = _make_rollout(_for_drafter(cfg, cfg.drafter), start)
    rollout.catch_up.load_state_dict(catch_up)
    paired = None
    if cfg.baseline:
        beside = {
            name: _make_rollout(_for_drafter(cfg, name).with_overrides(log_metrics=False), (starts or {}).get(name))
            for name in cfg.compare_drafters
        }
        paired = PairedRollout(rollout, _plain_twin(cfg), beside)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=chain_sum_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout=paired or rollout,
        callbacks=[printer],
        importance_sampling=cfg.importance_sampling,
    )
    if trainer.pop_callback(ProgressCallback) is not None and is_terminal(sys.stderr):
        trainer.add_callback(_quiet_progress())  # in a log file the step lines are the progress
    for callback in callbacks or []:
        trainer.add_callback(callback)
    if cfg.drafter_from_trainer:
        _attach_drafter_from_trainer(cfg, trainer, rollout)
    print(
        f"\n== GRPO ({label}): strategy {cfg.strategy}, {cfg.max_steps} steps, workers {cfg.num_workers} ==", flush=True
    )
    start = time.perf_counter()
    exit_code = 1  # an exception (or Ctrl-C: 130) marks the wandb run failed
    try:
        trainer.train()
        exit_code = 0
    except KeyboardInterrupt:
        exit_code = 130
        raise
    finally:
        (paired or rollout).close(wait=exit_code == 0)
        if cfg.wandb:
            need("wandb", "wandb", "the demo's wandb logging").finish(exit_code=exit_code)
    return printer.rows, rollout, paired, time.perf_counter() - start, run_name


def _grpo_config(cfg: DemoConfig, out: Path, run_name: str):
    """TRL's GRPOConfig for the demo's run."""
    from .trainer_hooks.config import grpo_args

    GRPOConfig = need("trl", "trl", "tailspec demo").GRPOConfig

    return GRPOConfig(
        **grpo_args(cfg, str(out)),
        run_name=run_name,
        use_cpu=cfg.device == "cpu",
        # TRL defaults to bf16 autocast: on a GPU that is what users run; on CPUs without native bf16
        # it is ~10x slower than fp32
        bf16=cfg.device == "cuda",
        seed=cfg.seed,
        shuffle_dataset=not cfg.problems,
    )


def _attach_drafter_from_trainer(cfg: DemoConfig, trainer, rollout) -> None:
    from .drafter.eagle3 import Eagle3Head
    from .trainer_hooks.drafter_from_trainer import DrafterFromTrainer

    if not isinstance(rollout.drafter, Eagle3Head):
        raise ValueError("drafter_from_trainer needs the EAGLE-3 head as the drafter (drafter: eagle3)")
    DrafterFromTrainer(rollout.drafter, trainer, train_steps=cfg.drafter_from_trainer, training=_online_training(cfg))


def _online_training(cfg: DemoConfig) -> DrafterTrainingConfig:
    """Head training while RL runs (spot chunks, ``DrafterFromTrainer``): small steps, a low rate
    (it continues from a trained head), and samples drawn where the head fails (``focus``; a
    sample not trained on yet counts at the highest loss, so the newest rollouts come first)."""
    from .drafter.eagle3.train import DrafterTrainingConfig

    return DrafterTrainingConfig(batch_size=4, max_tokens=256, learning_rate=1e-4, focus=1.0, seed=cfg.seed)


def _window(num_steps: int) -> int:
    """Steps averaged at each end of a run for its first-vs-last comparisons."""
    return max(1, min(5, num_steps // 2))


def _first_last(values: list[float], k: int) -> tuple[float, float]:
    """Means of the first and of the last ``k`` values."""
    return sum(values[:k]) / len(values[:k]), sum(values[-k:]) / len(values[-k:])


def _summarize(cfg: DemoConfig, rows: list[dict[str, Any]], rollout: Any, wall: float) -> dict[str, Any]:
    k = _window(len(rows))
    first, last = _first_last([r["reward"] for r in rows], k)
    tokens = sum(s.completion_tokens for s in rollout.history)
    rollout_time = sum(s.time_s for s in rollout.history)
    summary: dict[str, Any] = {
        "steps": len(rows),
        "wall_s": wall,
        f"reward_first_{k}": first,
        f"reward_last_{k}": last,
        "groups_with_signal": sum(r["groups_with_signal"] for r in rows) / len(rows),
        "rollout_tokens": tokens,
        "rollout_time_s": rollout_time,
        "rollout_tokens_per_s": tokens / rollout_time if rollout_time else 0.0,
        "strategy": cfg.strategy,
        "reward_per_step": [r["reward"] for r in rows],
    }
    drafted = sum(s.drafted_tokens for s in rollout.history)
    if drafted:
        summary["draft_acceptance_rate"] = sum(s.accepted_tokens for s in rollout.history) / drafted
        summary[f"accept_length_first_{k}"], summary[f"accept_length_last_{k}"] = _first_last(
            [s.mean_accept_length for s in rollout.history], k
        )
    if cfg.num_workers:
        summary["workers"] = cfg.num_workers
        summary["spot_train_steps"] = sum(s.spot_train_steps for s in rollout.history)
        summary["spot_shipped"] = sum(s.spot_shipped for s in rollout.history)
        summary["drafter_version_per_step"] = [s.drafter_version for s in rollout.history]
        summary["policy_syncs"] = rollout.policy_syncs
        summary["workers_died"] = sum(s.workers_died for s in rollout.history)
    losses = [s.drafter_loss for s in rollout.history if s.drafter_loss is not None]
    if rollout.history and rollout.history[-1].drafter_version is not None:
        summary["drafter_version"] = rollout.history[-1].drafter_version
    if losses:
        summary[f"drafter_loss_first_{k}"], summary[f"drafter_loss_last_{k}"] = _first_last(losses, k)
    return summary


def strategy_mix(steps: dict[str, int], top: int = 3) -> str:
    """The decode steps' strategies, most used first, as shares: ``chain:4 81% tree:4,2,8 12% ...``."""
    total = sum(steps.values())
    if not total:
        return "-"
    ranked = sorted(steps.items(), key=lambda kv: -kv[1])
    shown = " ".join(f"{name} {100 * n / total:.0f}%" for name, n in ranked[:top])
    return shown + (" ..." if len(ranked) > top else "")


def _drafter_cell(stats: Any) -> str:
    """The drafting version after a rollout, and how many training chunks shipped during it (``v12 +2``)."""
    if stats.drafter_version is None:
        return "-"
    return f"v{stats.drafter_version}" + (f" +{stats.spot_shipped}" if stats.spot_shipped else "")


def _print_comparison(
    rows: list[dict[str, Any]], paired: PairedRollout, strategy: str, drafter: str, rollout: Any = None
) -> None:
    """Per step, a rollout (the main one unless given) against its plain-decoding twin of the same
    step: times, throughput, their ratio, how many completions were the same, the accept length
    and the strategy mix."""
    ours = rollout or paired.main
    alike = paired.identical_completions if rollout is None else paired.identical_beside[drafter]
    print(f"\n== per step: {strategy} ({drafter}) vs no speculation (the same step's prompts and policy weights) ==")
    print(
        f"{'step':>4}  {'reward':>7}  {'rollout s':>9} {'(none)':>7}  {'tok/s':>6} {'(none)':>6}  "
        f"{'ratio':>6}  {'same':>7}  {'accept':>6}  {'drafter':>7}  strategies"
    )
    steps = zip(rows, ours.history, paired.twin.history, paired.step_ratios(ours))
    for i, (r, main, twin, ratio) in enumerate(steps):
        accept = f"{main.mean_accept_length:>6.2f}" if main.drafted_tokens else f"{'-':>6}"
        same = "{}/{}".format(*alike[i])  # completions alike / all
        print(
            f"{r['step']:>4}  {r['reward']:>7.3f}  {main.time_s:>9.2f} {twin.time_s:>7.2f}  "
            f"{main.tokens_per_s:>6.0f} {twin.tokens_per_s:>6.0f}  {ratio:>5.2f}x  {same:>7}  {accept}  "
            f"{_drafter_cell(main):>7}  {strategy_mix(main.strategy_steps)}"
        )


def run_demo_with_rollout(
    cfg: DemoConfig,
    callbacks: list | None = None,
    start: Any = None,
    catch_up: dict | None = None,
    starts: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], Any, PairedRollout | None]:
    """:func:`run_demo`, also returning the ``SpecRollout`` of the main run (its per-call
    ``history``, coordinator) and, with ``baseline``, the ``PairedRollout`` the trainer drove (the
    twin's and ``compare_drafters``' rollouts; else None). With ``warmup_steps``, ``baseline`` and
    ``export`` it is the whole story: warm the drafter up, train, compare with no speculation, export
    the drafter. ``start``:
    the drafter (an EAGLE-3 head, a drafter LM) to start from instead of the shipped one,
    ``catch_up`` the catch-up rule's state (benchmarks carry both across runs, as one continuing
    run would); ``starts`` the same for each of ``cfg.compare_drafters``, by name."""
    out = _prepare_environment(cfg)
    print(f"tailspec demo: GRPO on the chain-sum task, config {asdict(cfg)}", flush=True)
    uses_head = parse_strategy(cfg.strategy).wants_model_drafter and cfg.drafter == "eagle3"
    if start is None and uses_head and cfg.warmup_steps:
        start = _warm_up(cfg)
    rows, rollout, paired, wall, run_name = _grpo_run(
        cfg, out, start, callbacks=callbacks, catch_up=catch_up, starts=starts
    )
    summary = _summarize(cfg, rows, rollout, wall)
    if paired is not None:
        summary |= _against_twin(cfg, rows, paired, wall)
    exported = _export_drafter(cfg, rollout, out, uses_head)
    if exported is not None:
        summary["exported_drafter"] = exported
    _print_summary(cfg, rows, summary, paired, out, run_name, uses_head)
    return summary, rollout, paired


def _against_twin(cfg: DemoConfig, rows: list[dict[str, Any]], paired: PairedRollout, wall: float) -> dict:
    """Per step (printed) and over the run, the main rollout (and each beside it) against its
    plain-decoding twin."""
    _print_comparison(rows, paired, cfg.strategy, cfg.drafter)
    for name, rollout in paired.beside.items():
        _print_comparison(rows, paired, cfg.strategy, name, rollout)
    return paired.compare(wall)


def _export_drafter(cfg: DemoConfig, rollout: Any, out: Path, uses_head: bool) -> str | None:
    """The trained drafter, exported where ``cfg.export`` asks (None: nothing exported)."""
    if cfg.export and uses_head:
        from .drafter.eagle3.checkpoint import export_checkpoint

        return str(export_checkpoint(rollout.drafter, out / f"drafter_{cfg.export}", format=cfg.export))
    if cfg.export and cfg.drafter == "small_lm" and rollout.drafter is not None:
        # the drafter LM as it learned the policy: a Hugging Face checkpoint (safetensors), the
        # draft model SGLang's and vLLM's draft-model speculative decoding load
        path = out / "drafter_lm"
        rollout.drafter.save_pretrained(path, safe_serialization=True)
        return str(path)
    return None


def _print_summary(cfg, rows, summary: dict, paired, out: Path, run_name: str, uses_head: bool) -> None:
    k = _window(len(rows))
    first, last = summary[f"reward_first_{k}"], summary[f"reward_last_{k}"]
    rise = f"reward, mean of the first vs last {k} steps: {first:.3f} -> {last:.3f}"
    if paired is not None:
        alike = summary["same_completions_steps"].split(" of ")
        rise += (
            (
                f" (plain decoding emitted the same completions at {summary['same_completions_steps']} steps, "
                f"{summary['same_completions']} completions: "
                + (
                    "what is learned is what plain decoding would teach)"
                    if alike[0] == alike[1]
                    else "on a GPU, kernels of other shapes round differently and can flip a near-tied draw; "
                    "docs/GPU.md)"
                )
            )
            if cfg.rollout.position_noise
            else " (position_noise off: plain decoding draws other completions, compared by tokens/s)"
        )
    print("\n== tailspec demo summary ==")
    print(rise)
    width = max(len(key) for key in summary)
    for key, value in summary.items():
        if isinstance(value, list):
            value = " ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in value)
        print(f"{key:>{width}}: {value:.3f}" if isinstance(value, float) else f"{key:>{width}}: {value}")
    if cfg.wandb:
        print(f"{'wandb runs (offline)':>{width}}: {run_name} in {out / 'wandb'}  (upload with `wandb sync`)")
    if "exported_drafter" in summary:
        layout = (
            f"{cfg.export} EAGLE-3 layout" if uses_head else "Hugging Face checkpoint, a draft model for SGLang or vLLM"
        )
        print(f"{'exported drafter':>{width}}: {summary['exported_drafter']}  ({layout})")
