"""Stage ``correctness``: lossless on the device.

- greedy fp32: every strategy against batch-1 HF ``generate``, token for token, on two architectures
  (CUDA graphs and Triton kernels on, as ``auto`` chooses on CUDA; mirror on the ``stream`` executor),
  and ``chain:4`` with an EAGLE-3 head (its target's forwards replay graphs that return its features);
- sampled: the chi-square test of the joint of completion tokens 2 and 3 (the first speculative step)
  against the target's exact processed distribution;
- model families: gpt-oss (sinks), Gemma 2 (soft cap), Gemma 4 (per-layer head sizes), DeepSeek
  V3 (MLA), and Qwen3.5, Kimi-Linear and Falcon-H1 (Gated DeltaNet, KDA and Mamba-2 state in slots,
  rolled back past rejected drafts; graphs replay their one-token steps and Gated DeltaNet
  verifications) at tiny size, each
  strategy on the device's kernels and graphs against a no-cache recompute (greedy tokens and every
  sampled token's logprob); a Mamba hybrid (Jamba) refused;
- bf16: each strategy at full batch against a batch-1 bf16 control of ``none`` (the divergence method
  of "Batch Speculative Decoding Done Right"): where a completion first differs, the control's logit
  margin (top-1 minus top-2) says whether rounding could explain it.
"""

from __future__ import annotations

import torch

from ...drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from ...rollout.engine import RolloutEngine
from ...rollout.mirror.drafter import mirror_pipeline
from ...rollout.params import RolloutConfig, SamplingParams
from ...testing import (
    chi_square_pvalue,
    exact_joint_of_tokens_2_and_3,
    hf_greedy,
    perturbed_copy,
    random_prompts,
    tiny_random_model,
)
from .common import Stage, device, mirror_config
from .models import deep_policy, task_prompts

ARCHS = ("llama", "qwen2")
STRATEGIES = ("none", "chain:4", "tree:3,2,6", "suffix", "hybrid", "mirror:chain:4,k=2")
MARGIN_LIMIT = 1.0  # logits: a first divergence at a larger control margin is not rounding


def greedy_against_hf(stage: Stage, arch: str) -> None:
    dev = device()
    model = tiny_random_model(arch, seed=1, initializer_range=0.2)
    drafter = perturbed_copy(model, noise=0.3, seed=7).to(dev)
    model = model.to(dev)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(model.config)).to(dev).eval()
    prompts = random_prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    want = [hf_greedy(model, p, params.max_new_tokens) for p in prompts]
    # (label, strategy, the drafter of its engine): an EAGLE-3 head's target forwards tap features
    contenders = [(s, s, None if s in ("none", "suffix") else drafter) for s in STRATEGIES]
    contenders.append(("eagle3 chain:4", "chain:4", head))
    for label, strategy, spec in contenders:
        with stage.part(f"greedy {arch} {label}", 3) as ok:
            if not ok:
                continue
            config = RolloutConfig(strategy=strategy, mirror=mirror_config())
            engine_drafter = Eagle3Drafter(spec, model) if spec is head else spec
            engine = RolloutEngine(model, config, drafter=engine_drafter)
            got = [o.completion_ids for o in engine.generate(prompts, params)]
            same = sum(g == w for g, w in zip(got, want))
            pool = engine.runner.graph_pool
            extra = f", graph replays {pool.stats.hits}" if pool is not None else ", no graph pool"
            if pool is not None and spec is head:
                extra += f", graphs tapping features {sum(bool(k.taps) for k in pool.keys())}"
            if (pipeline := mirror_pipeline(engine.drafters)) is not None:
                extra += f", executor {type(pipeline.executor).__name__}, ready {pipeline.stats.ready}"
            engine.close()
            stage.check(f"greedy {arch} {label}", same == len(want), f"{same}/{len(want)} equal HF{extra}")


V, PROMPT = 12, [3, 7, 2, 9, 5]


def chi_square(stage: Stage, strategy: str, params: SamplingParams) -> None:
    n = stage.size.chi_square_samples
    dev = device()
    target = tiny_random_model("llama", seed=3, vocab_size=V, initializer_range=0.06)
    drafter = perturbed_copy(target, noise=0.5, seed=1).to(dev)
    target = target.to(dev)
    config = RolloutConfig(
        strategy=strategy, max_num_seqs=n, block_size=4, kv_cache_tokens=n * 16, mirror=mirror_config()
    )
    engine = RolloutEngine(target, config, drafter=drafter)
    outs = engine.generate([PROMPT] * n, params.with_updates(max_new_tokens=4, ignore_eos=True))
    engine.close()
    counts = torch.bincount(
        torch.tensor([o.completion_ids[1] * V + o.completion_ids[2] for o in outs]), minlength=V * V
    )
    p = chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(target, PROMPT, V, params))
    # with few samples (the rehearsal) the test has little power; the check is the same
    stage.check(f"chi-square {strategy} T={params.temperature}", p > 1e-3, f"p = {p:.3g}, {n} samples")


@torch.no_grad()
def logit_margin(model, ids: list[int]) -> float:
    logits = model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def bf16_divergence(stage: Stage) -> None:
    dev = device()
    dtype = torch.bfloat16
    policy, drafter, tokenizer = deep_policy(dtype, dev)
    prompts = task_prompts(tokenizer, stage.size.divergence_prompts, seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=stage.size.max_new_tokens)
    control_engine = RolloutEngine(policy, RolloutConfig(max_num_seqs=1), tokenizer=tokenizer)
    control = [o.completion_ids for o in control_engine.generate(prompts, params)]
    rows = []
    for strategy in ("none", "chain:4", "tree:3,2,6", "mirror:chain:4,k=0"):
        with stage.part(f"bf16 {strategy}", 10) as ok:
            if not ok:
                continue
            config = RolloutConfig(strategy=strategy, max_num_seqs=len(prompts), mirror=mirror_config())
            engine = RolloutEngine(policy, config, tokenizer=tokenizer, drafter=None if strategy == "none" else drafter)
            got = [o.completion_ids for o in engine.generate(prompts, params)]
            engine.close()
            margins = []
            for prompt, want, have in zip(prompts, control, got):
                if want == have:
                    continue
                first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
                margins.append(round(logit_margin(policy, prompt + want[:first]), 4))
            row = {"strategy": strategy, "prompts": len(prompts), "identical": len(prompts) - len(margins)}
            row["margins_at_first_divergence"] = sorted(margins)
            rows.append(row)
            stage.record("bf16_divergence", rows)
            worst = max(margins, default=0.0)
            stage.check(
                f"bf16 {strategy} divergences are rounding",
                worst <= MARGIN_LIMIT,
                f"{row['identical']}/{len(prompts)} identical to the batch-1 control; worst margin {worst:.3f}",
            )


# the last three keep a recurrent state: Gated DeltaNet, KDA, Mamba-2 beside attention
FAMILIES = ("gpt_oss", "gemma2", "gemma4_text", "deepseek_v3", "qwen3_5_text", "kimi_linear", "falcon_h1")
FAMILY_STRATEGIES = ("none", "chain:4", "tree:3,2,6", "suffix", "hybrid")


def families(stage: Stage, family: str) -> None:
    """One mechanism family, fp32 on the device: every strategy exact against a no-cache recompute,
    on the torch path and (on CUDA) forced onto the Triton kernels (sinks, soft caps, per-layer and
    MLA's unequal K/V sizes in them), CUDA graphs as the engine captures them."""
    from ...rollout.model.model_support import UnservableModel
    from ...testing.families import no_cache_greedy, oracle_logprobs, tiny_family_model

    dev = device()
    try:
        model = tiny_family_model(family).to(dev)
    except ValueError as e:  # a transformers without this family (the image's may be older)
        stage.skip(f"family {family}", f"transformers here cannot build it: {str(e).splitlines()[0][:120]}")
        return
    drafter = tiny_family_model("llama", seed=11).to(dev)
    prompts = random_prompts(4, seed=5, min_len=3, max_len=12)
    want = [no_cache_greedy(model, p, 12, eos_id=-1) for p in prompts]
    for kernels in ("torch", "triton") if dev.type == "cuda" else ("torch",):
        for strategy in FAMILY_STRATEGIES:
            name = f"family {family} {strategy} {kernels}"
            try:
                config = RolloutConfig(strategy=strategy, kernels=kernels)
                spec = None if strategy in ("none", "suffix") else drafter
                engine = RolloutEngine(model, config, eos_token_ids=[], drafter=spec)
            except UnservableModel as e:
                stage.check(name, False, f"refused: {e}")
                continue
            greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
            sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=2))
            pool = engine.runner.graph_pool
            engine.close()
            err = max(
                _logprob_error(o.logprobs, oracle_logprobs(model, p, o.completion_ids))
                for p, o in zip(prompts, sampled)
            )
            same = sum(o.completion_ids == w for o, w in zip(greedy, want))
            replays = f", graph replays {pool.stats.hits}" if pool is not None else ", no graph pool"
            stage.check(
                name,
                same == len(want) and err < 1e-3,
                f"{same}/{len(want)} greedy equal, logprob error {err:.1e}{replays}",
            )


def _logprob_error(got: list[float], want: torch.Tensor) -> float:
    return float((torch.tensor(got, dtype=torch.float64) - want).abs().max())


def hybrid_refused(stage: Stage) -> None:
    """A recurrent mixer the engine holds no state for (Jamba's Mamba) is refused, not decoded wrong."""
    from ...rollout.model.model_support import UnservableModel
    from ...testing.families import tiny_family_model

    try:
        model = tiny_family_model("jamba")
    except ValueError as e:
        stage.skip("hybrid refused", f"transformers here cannot build jamba: {str(e).splitlines()[0][:120]}")
        return
    try:
        RolloutEngine(model, RolloutConfig(), eos_token_ids=[])
    except UnservableModel as e:
        stage.check("hybrid refused", "keeps a recurrent state" in str(e), str(e))
        return
    stage.check("hybrid refused", False, "jamba was served")


def run(stage: Stage) -> None:
    for arch in ARCHS:
        greedy_against_hf(stage, arch)
    for family in FAMILIES:
        with stage.part(f"family {family}", 6) as ok:
            if ok:
                families(stage, family)
    with stage.part("hybrid refused", 2) as ok:
        if ok:
            hybrid_refused(stage)
    for strategy, params in (
        ("chain:2", SamplingParams(temperature=1.0)),
        ("tree:2,3,6", SamplingParams(temperature=0.7, top_k=6, top_p=0.9)),
        ("mirror:chain:2,k=2", SamplingParams(temperature=1.0)),
    ):
        with stage.part(f"chi-square {strategy}", 8) as ok:
            if ok:
                chi_square(stage, strategy, params)
    with stage.part("bf16 divergence", 20) as ok:
        if ok:
            bf16_divergence(stage)
