"""Recipe for the shipped policy of realistic shape (``assets/deep``): depth where speculation pays.

The tiny policy (4 layers) has cost ratios unlike a real model's: one decoder layer is ~25% of
a forward, so a one-layer EAGLE-3 head costs a third of a target step. The deep policy is the
tiny one grown to 24 layers by *block expansion* (as LLaMA Pro does): every layer is followed
by copies of itself whose output projections (``o_proj``, ``down_proj``) start at zero, so the
grown model computes exactly the tiny one's function; a short SFT run then makes the new blocks
carry signal. Its drafter LM is the tiny policy distilled onto it (KL to the deep policy's
next-token distributions), and an EAGLE-3 head is warmed up on its rollouts. Run it with::

    tailspec train-deep --out assets/deep

Weights are stored in fp16 (the repository stays small) and load as fp32.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shlex
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from ..packed_weights import unpacked_dir
from ..safe_files import load_causal_lm
from .chain_sum import ChainSumConfig, sample_problems
from .sft import (
    SFTConfig,
    _eval_row,
    _machine,
    _write_metrics,
    check_recipe_fields,
    count_parameters,
    evaluate_accuracy,
    fit_model,
    load_shipped,
    long_problems,
    recipe_sft,
)
from .tokenizer import chat_ids, save_beside

logger = logging.getLogger(__name__)

OUTPUT_PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")  # what a decoder layer writes to the residual with


def grow_depth(model: torch.nn.Module, num_layers: int, noise: float = 0.01, seed: int = 0) -> torch.nn.Module:
    """A copy of ``model`` with ``num_layers`` decoder layers that computes the same function.

    Layer ``i`` of the original becomes layer ``i * f`` (``f = num_layers / old layers``), followed by
    ``f - 1`` copies of it whose output projections are zero: a zero-output block adds nothing to
    the residual stream. The copies' other weights get Gaussian noise of relative size ``noise`` so
    that they do not all learn the same update (the function is unchanged by it).
    """
    layers = model.model.layers
    old = len(layers)
    if num_layers < old or num_layers % old:
        raise ValueError(f"num_layers must be a multiple of the model's {old} layers, got {num_layers}")
    factor = num_layers // old
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i // factor] for i in range(num_layers)]
    grown = type(model)(config).to(next(model.parameters()).dtype)
    state = {k: v for k, v in model.state_dict().items() if ".layers." not in k}
    g = torch.Generator().manual_seed(seed)
    for i in range(num_layers):
        source = layers[i // factor].state_dict()
        for name, tensor in source.items():
            value = tensor.clone()
            if i % factor:
                if name.removesuffix(".weight").removesuffix(".bias") in OUTPUT_PROJECTIONS:
                    value.zero_()
                elif value.ndim >= 2:
                    value += noise * value.std() * torch.randn(value.shape, generator=g, dtype=value.dtype)
            state[f"model.layers.{i}.{name}"] = value
    missing, unexpected = grown.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"cannot grow this architecture: missing {missing}, unexpected {unexpected}")
    for i in range(num_layers):
        if i % factor:
            for proj in OUTPUT_PROJECTIONS:
                if grown.get_submodule(f"model.layers.{i}.{proj}").weight.abs().sum() != 0:
                    raise ValueError(f"layer {i}: {proj} did not start at zero")
    grown.generation_config = copy.deepcopy(model.generation_config)
    return grown.eval()


@dataclass
class ShapeCosts:
    """Cost ratios of one model on this machine (HF forward, batch 1, over ``context`` cached tokens)."""

    one_token_ms: float
    five_tokens_ms: float
    layer_ms: float  # one decoder layer called on its own, inside a one-token forward
    batch16_one_token_ms: float
    batch16_five_tokens_ms: float
    threads: int
    context: int

    @property
    def verify5_ratio(self) -> float:
        return self.five_tokens_ms / self.one_token_ms

    @property
    def layer_share(self) -> float:
        return self.layer_ms / self.one_token_ms

    @property
    def batch16_verify5_ratio(self) -> float:
        return self.batch16_five_tokens_ms / self.batch16_one_token_ms


@torch.no_grad()
def measure_shape_costs(model: torch.nn.Module, threads: int = 1, context: int = 128, repeats: int = 40) -> ShapeCosts:
    """Median forward times of ``model`` for 1 and 5 new tokens at batch 1 and 16, and of one
    decoder layer (timed by hooks on the middle layer during the one-token forwards)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    vocab = model.config.vocab_size
    layer = model.model.layers[len(model.model.layers) // 2]
    layer_times: list[float] = []
    started: list[float] = []
    pre = layer.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    post = layer.register_forward_hook(lambda *_: layer_times.append(time.perf_counter() - started[-1]))

    def median_ms(batch: int, tokens: int) -> float:
        gen = torch.Generator().manual_seed(batch * 100 + tokens)
        cache = DynamicCache(config=model.config)
        model(torch.randint(0, vocab, (batch, context), generator=gen), past_key_values=cache)
        new = torch.randint(0, vocab, (batch, tokens), generator=gen)
        times = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            model(new, past_key_values=cache)
            times.append(time.perf_counter() - start)
            cache.crop(-tokens)
        return statistics.median(times[3:]) * 1000

    try:
        one = median_ms(1, 1)
        layer_ms = statistics.median(layer_times[4:]) * 1000
        costs = ShapeCosts(one, median_ms(1, 5), layer_ms, median_ms(16, 1), median_ms(16, 5), threads, context)
    finally:
        pre.remove()
        post.remove()
        torch.set_num_threads(previous)
    return costs


@dataclass
class DeepRecipe:
    """How ``tailspec train-deep`` grows, fine-tunes and accompanies the deep policy."""

    num_layers: int = 24
    finetune_steps: int = 400
    finetune_lr: float = 1e-3
    distill_steps: int = 250
    distill_lr: float = 5e-4
    batch_size: int = 16
    warmup_prompts: int = 192
    warmup_rounds: int = 3
    warmup_steps: int = 150
    warmup_max_new_tokens: int = 384
    eval_problems: int = 200
    long_eval_problems: int = 100
    max_new_tokens: int = 512
    cost_repeats: int = 40  # timed forwards per shape of the card's cost table (their median)
    cost_context: int = 128  # tokens of context those forwards attend to
    threads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        counts = (
            "num_layers", "batch_size", "warmup_prompts", "warmup_rounds", "eval_problems", "cost_repeats",
            "cost_context", "threads",
        )  # fmt: skip
        steps = ("finetune_steps", "distill_steps", "warmup_steps", "long_eval_problems")
        check_recipe_fields(self, counts, steps, ("finetune_lr", "distill_lr"))

    def sft(self, steps: int, lr: float) -> SFTConfig:
        return recipe_sft(self, steps, lr, max_warmup=50)


def _save_fp16(model: torch.nn.Module, out: Path) -> None:
    """Weights on disk in fp16 (half the bytes); :func:`load_shipped` loads them as fp32."""
    copy.deepcopy(model).to(torch.float16).save_pretrained(out, safe_serialization=True)
    save_beside(out)


def _finetune(model, recipe: DeepRecipe, steps: int, lr: float, tokenizer, out: Path, desc: str, teacher=None) -> None:
    """Train ``model`` (distill it from ``teacher`` if given) and save it in fp16 with its metrics;
    later stages load what was saved (:func:`_load_fp32`), so they see exactly what ships."""
    metrics: dict[str, Any] = {"steps": 0}
    if steps:
        metrics = fit_model(model, recipe.sft(steps, lr), tokenizer, None, desc=desc, teacher=teacher)
    _save_fp16(model, out)
    _write_metrics(out, {**metrics, "recipe": asdict(recipe)})


STAGES = ("policy", "drafter", "head", "eval")


def _warm_head(policy, tokenizer, recipe: DeepRecipe, out: Path, continue_head: bool) -> list[dict[str, Any]]:
    """Warm a fresh head (or, with ``continue_head``, the one at ``out``) on ``policy``'s rollouts;
    returns every warm-up round the saved head has been through."""
    from ..drafter.eagle3.checkpoint import load_checkpoint
    from ..drafter.eagle3.train import DrafterTrainingConfig
    from ..drafter.eagle3_warmup import WarmupConfig, warmup_head

    head, earlier, seed = None, [], recipe.seed
    if continue_head and (out / "config.json").exists():
        ckpt = load_checkpoint(out)
        head, earlier = ckpt.head.float(), list(ckpt.metadata.get("rounds", []))
        seed += len(earlier)  # fresh prompts and draws for the new rounds
    problems = sample_problems(recipe.warmup_prompts, seed=30_000 + seed, cfg=ChainSumConfig())
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p.question}], True) for p in problems]
    cfg = WarmupConfig(
        rounds=recipe.warmup_rounds,
        steps_per_round=recipe.warmup_steps,
        max_new_tokens=recipe.warmup_max_new_tokens,
        training=DrafterTrainingConfig(batch_size=8, learning_rate=1e-3 if head is None else 5e-4, seed=seed),
        seed=seed,
    )
    _, trainer, rounds = warmup_head(policy, prompts, cfg, head=head, eos_token_ids=[tokenizer.eos_token_id])
    history = earlier + [{**asdict(r), "round": len(earlier) + r.round} for r in rounds]
    trainer.save(out, metadata={"policy": "deep", "prompts": "chain-sum", "rounds": history}, include_optimizer=False)
    return history


def _log_command(out: Path, command: str, stages: tuple[str, ...]) -> list[dict[str, Any]]:
    """Append this run to ``out/recipe_log.json`` (the card lists every command that made the assets)."""
    path = out / "recipe_log.json"
    log = json.loads(path.read_text()) if path.exists() else []
    log.append({"command": command, "stages": list(stages)})
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(log, indent=2) + "\n")
    return log


def _load_fp32(path: Path):
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is missing: run the stage that makes it first (--stages)")
    return load_causal_lm(unpacked_dir(path), dtype=torch.float32).eval()


def _check_inputs(out: Path, stages: tuple[str, ...], continue_head: bool) -> None:
    """Refuse, before anything is written, a run whose stages need what no earlier run saved."""
    needs = {
        "policy": "policy" not in stages,
        "drafter": "eval" in stages and "drafter" not in stages,
        "eagle3": ("eval" in stages and "head" not in stages) or ("head" in stages and continue_head),
    }
    for name, needed in needs.items():
        if needed and not (out / name / "config.json").exists():
            raise FileNotFoundError(f"{out / name} is missing: run the stage that makes it first (--stages)")


def run_recipe(
    recipe: DeepRecipe,
    out: Path,
    command: str,
    stages: tuple[str, ...] = STAGES,
    continue_head: bool = False,
) -> dict[str, Any]:
    """Run ``stages`` in order: grow and fine-tune the policy, distill the drafter LM, warm the
    head, then evaluate, measure costs and write the card. A stage left out reuses what an earlier
    run saved in ``out``."""
    unknown = set(stages) - set(STAGES)
    if unknown or not stages:
        raise ValueError(f"stages must be a non-empty subset of {STAGES}, got {list(stages)}")
    _check_inputs(out, stages, continue_head)
    torch.set_num_threads(recipe.threads)
    start = time.perf_counter()
    log = _log_command(out, command, stages)
    tiny, tokenizer = load_shipped("tiny", "policy")
    if "policy" in stages:
        grown = grow_depth(tiny, recipe.num_layers, seed=recipe.seed)
        _finetune(grown, recipe, recipe.finetune_steps, recipe.finetune_lr, tokenizer, out / "policy", "fine-tune deep")
    policy = _load_fp32(out / "policy")
    if "drafter" in stages:
        student = load_shipped("tiny", "policy")[0]
        _finetune(
            student,
            recipe,
            recipe.distill_steps,
            recipe.distill_lr,
            tokenizer,
            out / "drafter",
            "distill drafter",
            teacher=policy,
        )
    if "head" in stages:
        _warm_head(policy, tokenizer, recipe, out / "eagle3", continue_head)
    if "eval" not in stages:
        return {"wall_s": time.perf_counter() - start}
    drafter = _load_fp32(out / "drafter")
    from ..drafter.eagle3.checkpoint import load_checkpoint

    rounds = load_checkpoint(out / "eagle3").metadata.get("rounds", [])
    ft = json.loads((out / "policy" / "sft_metrics.json").read_text())
    dist = json.loads((out / "drafter" / "sft_metrics.json").read_text())

    evals, sizes = _evaluate(recipe, tokenizer, {"deep policy": policy, "drafter LM": drafter, "tiny policy": tiny})
    for kind, key in (("policy", "deep policy"), ("drafter", "drafter LM")):
        (out / kind / "eval.json").write_text(json.dumps(evals[key], indent=2) + "\n")
    models = (("deep policy", policy), ("tiny policy", tiny))
    measure = dict(threads=1, context=recipe.cost_context, repeats=recipe.cost_repeats)
    costs = {name: measure_shape_costs(m, **measure) for name, m in models}
    (out / "costs.json").write_text(json.dumps({k: asdict(v) for k, v in costs.items()}, indent=2) + "\n")
    wall = time.perf_counter() - start
    (out / "MODEL_CARD.md").write_text(_card(recipe, log, policy, ft, dist, rounds, evals, costs, *sizes))
    return {"evals": evals, "costs": costs, "wall_s": wall}


def _evaluate(recipe: DeepRecipe, tokenizer, models: dict) -> tuple[dict[str, dict[str, Any]], tuple[int, int]]:
    """Each model's greedy accuracy on the tiny card's task set and long set (the engine decodes);
    and the two sets' sizes."""
    task = ChainSumConfig()
    problems = sample_problems(recipe.eval_problems, seed=10_000 + recipe.seed, cfg=task)  # the tiny card's sets
    long_set = (
        long_problems(recipe.long_eval_problems, seed=20_000 + recipe.seed, task=task)
        if recipe.long_eval_problems
        else []
    )
    evals: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        evals[name] = {"task": evaluate_accuracy(model, tokenizer, problems, recipe.max_new_tokens, backend="engine")}
        if long_set:
            evals[name]["long set"] = evaluate_accuracy(
                model, tokenizer, long_set, recipe.max_new_tokens, backend="engine"
            )
        logger.info("%s: %s", name, evals[name])
    return evals, (len(problems), len(long_set))


def _card(recipe, log, policy, ft, dist, rounds, evals, costs, n_task, n_long) -> str:
    cfg = policy.config
    round_rows = [
        f"| {r['round']} | {r['completions']} | {r['tokens']:,} | {r['accept_length']:.2f} | "
        f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['train_s'] / 60:.1f} |"
        for r in rounds
    ]
    commands = "\n".join(f"    {entry['command']}" for entry in log)
    ft_recipe, dist_recipe = ft.get("recipe", {}), dist.get("recipe", {})

    def loss(m):
        return f"{m['first_loss']:.4f} -> {m['final_loss']:.4f}" if m.get("steps") else "n/a"

    return f"""# Deep chain-sum policy: a target of realistic shape

A {cfg.num_hidden_layers}-layer Qwen2 policy (hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads /
{cfg.num_key_value_heads} KV heads, MLP {cfg.intermediate_size}, {count_parameters(policy):,} parameters) for the
chain-sum task, with a drafter LM and an EAGLE-3 head. It exists for its cost ratios: one decoder layer is a
small share of a forward and verifying a few tokens costs little more than one, as for a real model on a
GPU, so speculation can pay (the tiny 4-layer policy, where a one-layer head costs a third of a forward,
stays for tests). Made on a CPU with no model hub and no external data by (in order):

{commands}

(on {_machine()}; torch {torch.__version__}, transformers {transformers.__version__}; fine-tuning
{ft.get("wall_s", 0) / 60:.0f} min, distillation {dist.get("wall_s", 0) / 60:.0f} min, head warm-up
{sum(r["rollout_s"] + r["train_s"] for r in rounds) / 60:.0f} min). Files: `policy/`,
`drafter/` (whole checkpoints with the tiny task's tokenizer; fp16 safetensors, packed losslessly as
`model.safetensors.planes.xz` by `tailspec pack-assets`,
loaded as fp32 by `tailspec.tasks.sft.load_shipped("deep", "policy" | "drafter")`),
`eagle3/` (tailspec EAGLE-3 checkpoint, `load_shipped_eagle3("deep")`), `costs.json`, `recipe_log.json`, and per
model `eval.json` and `sft_metrics.json` (loss curve and recipe).

## How it was made

1. **Grown from the tiny policy** (`assets/tiny/policy`) by block expansion: tiny layer i became layer
   {cfg.num_hidden_layers // 4}i, followed by {cfg.num_hidden_layers // 4 - 1} copies of it whose `o_proj` and
   `down_proj` start at zero (a block that writes nothing to the residual stream), their other weights
   perturbed by 1% noise; the grown model computes exactly the tiny policy's function.
2. **Fine-tuned** {ft.get("steps", 0)} steps on the tiny recipe's training stream (batches of
   {ft_recipe.get("batch_size")}, AdamW, peak lr {ft_recipe.get("finetune_lr")}, warmup then cosine decay to 0.1x,
   fp32): loss {loss(ft)}.
3. **Drafter LM**: a copy of the tiny policy distilled {dist.get("steps", 0)} steps onto the deep policy
   (KL(deep || drafter) of the next-token distributions on the same stream, peak lr
   {dist_recipe.get("distill_lr")}): KL {loss(dist)}. It shares the tokenizer.
4. **EAGLE-3 head** (one decoder layer, taps the SGLang/vLLM default layers (2, L/2, L-3)), warmed up from
   random init in rounds: each rolls the policy out on fresh chain-sum prompts (T = 1, at most
   {recipe.warmup_max_new_tokens} tokens; once the head has trained, with `chain:4` drafts from it) and then
   trains it on what the rollouts recorded (features and top-8 soft labels, no extra target pass).

| round | completions | tokens | rollout accept length | head loss first -> last | train min |
|---:|---:|---:|---:|---|---:|
{chr(10).join(round_rows)}

{_card_results(recipe, evals, costs, n_task, n_long)}"""


def _card_results(recipe, evals, costs, n_task, n_long) -> str:
    """The card's accuracy and cost tables."""
    eval_rows = [_eval_row(name, set_name, ev) for name, sets in evals.items() for set_name, ev in sets.items()]
    cost_rows = [
        f"| {name} | {c.one_token_ms:.2f} | {c.five_tokens_ms:.2f} ({c.verify5_ratio:.2f}x) | "
        f"{c.layer_ms:.3f} ({c.layer_share:.1%}) | {c.batch16_one_token_ms:.2f} | "
        f"{c.batch16_five_tokens_ms:.2f} ({c.batch16_verify5_ratio:.2f}x) |"
        for name, c in costs.items()
    ]
    return f"""## Greedy accuracy

tailspec's engine, greedy (token-identical to HF `generate` in fp32), at most {recipe.max_new_tokens} new
tokens, on the tiny model card's sets: "task" = {n_task} held-out problems from the task distribution (seed
{10_000 + recipe.seed}), "long set" = {n_long} problems with 15-40 terms (seed {20_000 + recipe.seed}).

| model | eval set | accuracy | n <= 5 | n >= 15 | exact response | mean completion tokens (reference) | max |
|---|---|---:|---:|---:|---:|---:|---:|
{chr(10).join(eval_rows)}

## Cost ratios on this machine

HF forward over {costs["deep policy"].context} cached tokens, median of {recipe.cost_repeats},
{costs["deep policy"].threads} torch thread; *one layer* is the middle decoder layer timed by hooks inside the
one-token forward.

| model | batch 1, 1 token ms | batch 1, 5 tokens ms | one layer ms (share) | batch 16, 1 tok. ms | 16, 5 tok. ms |
|---|---:|---:|---:|---:|---:|
{chr(10).join(cost_rows)}
"""


def _command(args: argparse.Namespace) -> str:
    parts = ["tailspec", "train-deep", "--out", str(args.out)]
    for name in ("finetune_steps", "distill_steps", "warmup_rounds", "warmup_steps", "threads", "seed"):
        parts += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    parts += ["--stages", args.stages] if args.stages != ",".join(STAGES) else []
    parts += ["--continue-head"] if args.continue_head else []
    return shlex.join(parts + (["--quick"] if args.quick else []))


def build_parser() -> argparse.ArgumentParser:
    d = DeepRecipe()
    parser = argparse.ArgumentParser(
        prog="tailspec train-deep",
        description="Grow the tiny policy to a deep one, fine-tune it, distill a drafter LM, warm an EAGLE-3 head.",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "deep")
    parser.add_argument("--finetune-steps", type=int, default=d.finetune_steps)
    parser.add_argument("--distill-steps", type=int, default=d.distill_steps)
    parser.add_argument("--warmup-rounds", type=int, default=d.warmup_rounds)
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="head training steps per round")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--quick", action="store_true", help="a few steps and problems (smoke test)")
    parser.add_argument(
        "--stages",
        default=",".join(STAGES),
        help=f"comma-separated subset of {','.join(STAGES)}; a stage left out reuses what --out holds",
    )
    parser.add_argument("--continue-head", action="store_true", help="head stage: train the head in --out further")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    recipe = DeepRecipe(
        finetune_steps=args.finetune_steps,
        distill_steps=args.distill_steps,
        warmup_rounds=args.warmup_rounds,
        warmup_steps=args.warmup_steps,
        threads=args.threads,
        seed=args.seed,
    )
    if args.quick:
        recipe = DeepRecipe(
            num_layers=8,
            finetune_steps=2,
            distill_steps=2,
            batch_size=4,
            warmup_prompts=4,
            warmup_rounds=2,
            warmup_steps=2,
            warmup_max_new_tokens=16,
            eval_problems=4,
            long_eval_problems=0,
            max_new_tokens=24,
            cost_repeats=3,
            cost_context=16,
            threads=args.threads,
            seed=args.seed,
        )
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    result = run_recipe(recipe, args.out, _command(args), stages, continue_head=args.continue_head)
    if "costs" not in result:
        print(f"wrote stages {', '.join(stages)} to {args.out} in {result['wall_s'] / 60:.1f} min")
        return 0
    c = result["costs"]["deep policy"]
    print(
        f"wrote {args.out} in {result['wall_s'] / 60:.1f} min; deep policy greedy accuracy "
        f"{result['evals']['deep policy']['task']['accuracy']:.1%} (tiny "
        f"{result['evals']['tiny policy']['task']['accuracy']:.1%}); one layer {c.layer_share:.1%} of a forward, "
        f"5 tokens {c.verify5_ratio:.2f}x one"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
