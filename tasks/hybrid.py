"""Recipe for the hybrid policy: the deep policy's task on a Qwen3.5-shaped model (three Gated
DeltaNet layers to every attention layer), with a drafter LM distilled to it.

Training a 24-layer hybrid from scratch takes hours on a CPU; this recipe starts it near the deep
policy instead (:func:`hybrid_from_deep`) and distills it from there:

- embeddings, every layer's norms and MLP, and the final norm are the deep policy's (Qwen3.5's
  RMSNorm scales by ``1 + weight``: the weight is the deep one's minus one);
- six of the 24 layers keep their attention (:data:`ATTENTION_LAYERS`: the tiny policy's four
  layers that the deep one grew from, and two of their copies), as Qwen3.5 attention: its output
  gate starts at zero (a gate of one half, so ``o_proj`` is doubled), its rotary embedding covers
  the whole head as the deep policy's does, and its per-head q/k RMSNorm is calibrated to the RMS
  the deep policy's queries and keys have on task text (the one thing surgery cannot copy);
- the other 18 are Gated DeltaNet layers whose output projection starts at zero: at first they add
  nothing, and distillation (KL to the deep policy's next-token distributions on the task stream)
  teaches them what the attention they replace did.

Its drafter LM is the deep policy's drafter distilled onto it. Run it with::

    tailspec train-hybrid --out outputs/hybrid

The weights are not shipped (the tracked tree stays within its size); the benchmarks that need
the hybrid policy train it once into ``outputs/hybrid`` (:func:`load_hybrid`).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..safe_files import load_causal_lm
from .chain_sum import ChainSumConfig, sample_problems
from .sft import SFTConfig, _write_metrics, check_recipe_fields, evaluate_accuracy, fit_model, load_shipped, recipe_sft
from .tokenizer import chat_ids, save_beside

logger = logging.getLogger(__name__)

ATTENTION_LAYERS = (0, 3, 6, 12, 18, 21)  # the tiny policy's layers sit at 0, 6, 12 and 18 of the deep one


def hybrid_config(deep_config, attention_layers=ATTENTION_LAYERS):
    """A Qwen3.5 text config of the deep policy's shape: its attention layers at ``attention_layers``,
    Gated DeltaNet layers elsewhere (2 key heads and 4 value heads of 64)."""
    layers = deep_config.num_hidden_layers
    if not set(attention_layers) <= set(range(layers)):
        raise ValueError(f"attention_layers must be within 0..{layers - 1}, got {attention_layers}")
    return AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=deep_config.vocab_size,
        hidden_size=deep_config.hidden_size,
        intermediate_size=deep_config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=deep_config.num_attention_heads,
        num_key_value_heads=deep_config.num_key_value_heads,
        head_dim=deep_config.hidden_size // deep_config.num_attention_heads,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        layer_types=["full_attention" if i in attention_layers else "linear_attention" for i in range(layers)],
        max_position_embeddings=deep_config.max_position_embeddings,
        rope_parameters={**deep_config.rope_parameters, "partial_rotary_factor": 1.0},
        attention_bias=True,  # the deep policy's q/k/v carry biases
        rms_norm_eps=deep_config.rms_norm_eps,
        tie_word_embeddings=deep_config.tie_word_embeddings,
        eos_token_id=deep_config.eos_token_id,
        bos_token_id=deep_config.bos_token_id,
        pad_token_id=deep_config.pad_token_id,
    )


def task_texts(tokenizer, num: int, seed: int) -> list[torch.Tensor]:
    """``num`` fresh chain-sum conversations, question and reference solution, as ``[1, T]`` token ids."""
    problems = sample_problems(num, seed=seed, cfg=ChainSumConfig())
    return [
        torch.tensor(
            [
                chat_ids(
                    tokenizer, [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}]
                )
            ]
        )
        for p in problems
    ]


@torch.no_grad()
def _qk_rms(deep, tokenizer, layers, num_prompts: int = 32, seed: int = 40_000) -> dict[int, tuple[float, float]]:
    """Each of ``layers``' mean per-head RMS of the deep policy's queries and keys on task text
    (``num_prompts`` fresh problems with their solutions)."""
    head_dim = deep.config.hidden_size // deep.config.num_attention_heads
    seen: dict[tuple[int, str], list[torch.Tensor]] = {}
    hooks = []
    for i in layers:
        attention = deep.model.layers[i].self_attn
        for name in ("q_proj", "k_proj"):

            def keep(module, args, out, key=(i, name)):
                seen.setdefault(key, []).append(out.reshape(-1, head_dim).pow(2).mean(-1).sqrt())

            hooks.append(getattr(attention, name).register_forward_hook(keep))
    try:
        for ids in task_texts(tokenizer, num_prompts, seed):
            deep(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return {i: tuple(float(torch.cat(seen[(i, n)]).mean()) for n in ("q_proj", "k_proj")) for i in layers}


@torch.no_grad()
def hybrid_from_deep(deep, tokenizer, attention_layers=ATTENTION_LAYERS, seed: int = 0) -> torch.nn.Module:
    """A Qwen3.5 hybrid that starts near ``deep`` (see the module doc), fp32, in train mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(deep.config, attention_layers), dtype=torch.float32)
    rms = _qk_rms(deep, tokenizer, attention_layers)
    model.model.embed_tokens.weight.copy_(deep.model.embed_tokens.weight)
    if not deep.config.tie_word_embeddings:
        model.lm_head.weight.copy_(deep.lm_head.weight)
    model.model.norm.weight.copy_(deep.model.norm.weight - 1)
    head_dim = model.config.head_dim
    for i, (layer, source) in enumerate(zip(model.model.layers, deep.model.layers)):
        layer.input_layernorm.weight.copy_(source.input_layernorm.weight - 1)
        layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight - 1)
        layer.mlp.load_state_dict(source.mlp.state_dict())
        if i not in attention_layers:
            layer.linear_attn.out_proj.weight.zero_()
            continue
        attention, original = layer.self_attn, source.self_attn
        query_and_gate = attention.q_proj.weight.view(-1, 2, head_dim, original.q_proj.in_features)
        query_and_gate[:, 0] = original.q_proj.weight.view(-1, head_dim, original.q_proj.in_features)
        query_and_gate[:, 1] = 0  # the output gate: sigmoid(0) = 1/2 whatever the input
        bias = attention.q_proj.bias.view(-1, 2, head_dim)
        bias[:, 0], bias[:, 1] = original.q_proj.bias.view(-1, head_dim), 0
        for name in ("k_proj", "v_proj"):
            getattr(attention, name).load_state_dict(getattr(original, name).state_dict())
        attention.o_proj.weight.copy_(2 * original.o_proj.weight)
        if attention.o_proj.bias is not None:
            attention.o_proj.bias.zero_()
        q_rms, k_rms = rms[i]
        attention.q_norm.weight.fill_(q_rms - 1)
        attention.k_norm.weight.fill_(k_rms - 1)
    return model


@dataclass
class HybridRecipe:
    """How ``tailspec train-hybrid`` distills the hybrid policy and its drafter LM."""

    distill_steps: int = 200
    distill_lr: float = 5e-4
    drafter_steps: int = 100
    drafter_lr: float = 5e-4
    batch_size: int = 16
    eval_problems: int = 100
    max_new_tokens: int = 512
    threads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        counts = ("batch_size", "eval_problems", "max_new_tokens", "threads")
        check_recipe_fields(self, counts, ("distill_steps", "drafter_steps"), ("distill_lr", "drafter_lr"))

    def sft(self, steps: int, lr: float) -> SFTConfig:
        return recipe_sft(self, steps, lr, max_warmup=20)


STAGES = ("policy", "drafter", "eval")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "outputs" / "hybrid"


def _distilled(student, teacher, recipe: HybridRecipe, steps: int, lr: float, tokenizer, out: Path, desc: str):
    metrics: dict[str, Any] = {"steps": 0}
    if steps:
        metrics = fit_model(student, recipe.sft(steps, lr), tokenizer, None, desc=desc, teacher=teacher)
    student.eval().save_pretrained(out, safe_serialization=True)
    save_beside(out)
    _write_metrics(out, {**metrics, "recipe": asdict(recipe)})


def run_hybrid_recipe(recipe: HybridRecipe, out: Path, stages: tuple[str, ...] = STAGES) -> dict[str, Any]:
    """Run ``stages`` in order (a stage left out reuses what an earlier run saved in ``out``):
    build the hybrid from the deep policy and distill it, distill the deep policy's drafter LM onto
    it, then evaluate both (greedy, the tiny card's task set) into ``out/eval.json``."""
    unknown = set(stages) - set(STAGES)
    if unknown or not stages:
        raise ValueError(f"stages must be a non-empty subset of {STAGES}, got {list(stages)}")
    needs = {"policy": "policy" not in stages, "drafter": "eval" in stages and "drafter" not in stages}
    for name in (n for n, needed in needs.items() if needed and not (out / n / "config.json").exists()):
        raise FileNotFoundError(f"{out / name} is missing: run `tailspec train-hybrid` (its stage that makes it) first")
    torch.set_num_threads(recipe.threads)
    start = time.perf_counter()
    deep, tokenizer = load_shipped("deep", "policy")
    if "policy" in stages:
        student = hybrid_from_deep(deep, tokenizer, seed=recipe.seed)
        _distilled(student, deep, recipe, recipe.distill_steps, recipe.distill_lr, tokenizer, out / "policy", "hybrid")
    policy = _load(out / "policy")
    if "drafter" in stages:
        drafter = load_shipped("deep", "drafter")[0]
        _distilled(
            drafter, policy, recipe, recipe.drafter_steps, recipe.drafter_lr, tokenizer, out / "drafter", "drafter"
        )
    if "eval" in stages:
        problems = sample_problems(recipe.eval_problems, seed=10_000, cfg=ChainSumConfig())
        models = {"hybrid policy": policy, "drafter LM": _load(out / "drafter"), "deep policy": deep}
        evals = {
            name: evaluate_accuracy(model, tokenizer, problems, max_new_tokens=recipe.max_new_tokens, backend="engine")
            for name, model in models.items()
        }
        (out / "eval.json").write_text(json.dumps(evals, indent=2) + "\n")
    return {"wall_s": time.perf_counter() - start}


def _load(path: Path):
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is missing: run `tailspec train-hybrid` (its stage that makes it) first")
    return load_causal_lm(path, dtype=torch.float32).eval()


def load_hybrid(out: Path = DEFAULT_OUT, recipe: HybridRecipe | None = None):
    """The hybrid policy, its tokenizer and its drafter LM from ``out``, made there first (about 20
    minutes on 2 CPU cores) if an earlier run did not."""
    from transformers import AutoTokenizer

    if not (out / "drafter" / "config.json").exists():
        logger.warning("no hybrid policy at %s: training it (tailspec train-hybrid), about 20 minutes", out)
        run_hybrid_recipe(recipe or HybridRecipe(), out, ("policy", "drafter"))
    return _load(out / "policy"), AutoTokenizer.from_pretrained(out / "policy"), _load(out / "drafter")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailspec train-hybrid", description=__doc__.split("\n\n")[0])
    defaults = HybridRecipe()
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    for name in ("distill_steps", "drafter_steps", "eval_problems", "threads", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("distill_lr", "drafter_lr"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--stages", default=",".join(STAGES), help=f"a comma-separated subset of {STAGES}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k in HybridRecipe.__dataclass_fields__}
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    result = run_hybrid_recipe(HybridRecipe(**fields), args.out, stages)
    print(f"wrote stages {', '.join(stages)} to {args.out} in {result['wall_s'] / 60:.1f} min")
    return 0
