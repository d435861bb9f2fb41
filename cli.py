"""The ``tailspec`` command line: ``demo``, ``bench``, ``atts``, ``drafter warmup|export``, ``train-tiny``,
``train-deep``."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


class UserError(Exception):
    """A mistake in what the user asked for (a path, a file, a value): one line, exit status 2."""


# what a user's mistake surfaces as below the CLI: config and parameter validation (ValueError),
# files that are missing or unreadable (OSError), YAML that does not parse, an extra not installed
def _user_error_types() -> tuple[type[BaseException], ...]:
    import yaml

    from .extras import MissingExtra

    return (UserError, ValueError, OSError, yaml.YAMLError, MissingExtra)


def _existing_file(value: str, what: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists():
        raise UserError(f"{what}: no such file: {value}")
    if not path.is_file():
        raise UserError(f"{what}: {value} is a directory, not a file")
    return path


def _writable_parent(value: str, what: str) -> Path:
    """An output path whose folder exists (checked before long work, not after it)."""
    path = Path(value).expanduser()
    if not path.parent.is_dir():
        raise UserError(f"{what}: the folder {path.parent} of {value} does not exist")
    return path


def _from_checkout(what: str) -> None:
    """Refuse, in one line, what needs the repository's checkout: the built wheel holds the library
    (engine, drafters, workers, TRL glue, kernels, configs), not the chain-sum task and its recipes,
    the shipped models or the benchmark harness."""
    from importlib.util import find_spec

    if find_spec("tailspec.tasks") is None or find_spec("tailspec.benchmarks") is None:
        raise UserError(
            f"{what} runs from a checkout of the tailspec repository (the installed package holds the library, "
            "not the chain-sum task, the shipped models or the benchmark harness): clone it and run "
            "`make demo` / `make bench` there"
        )


# a Hugging Face hub repo id: ``namespace/name`` (anything else that is not on disk is a bad path)
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _model_location(value: str, what: str) -> str:
    """A local model/tokenizer directory, or a hub repo id; a local path that does not exist is
    reported as such rather than handed to the hub loader."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{what}: {value} is a file; give a Hugging Face model directory")
        return str(path)
    if _HUB_REPO_ID.match(value) and not value.startswith((".", "~")):
        return value
    raise UserError(f"{what}: no such directory: {value}")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


POSITIVE = _int_at_least(1)
NON_NEGATIVE = _int_at_least(0)


def _demo(args: argparse.Namespace) -> int:
    _from_checkout("`tailspec demo`")
    from .config_tree import parse_assignments
    from .configs import configs_dir

    # the user's mistakes first: the trainer stack takes seconds to import
    config = _existing_file(args.config, "--config") if args.config else configs_dir() / "demo_cpu.yaml"
    overrides = parse_assignments(args.set or [])
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig.from_yaml(config)
    flags = {
        "max_steps": args.steps,
        "strategy": args.strategy,
        "seed": args.seed,
        "wandb": False if args.no_wandb else None,
        "rollout.workers.num_workers": args.workers,
        "rollout.workers.address": args.ray_address,
        "deepspeed": args.deepspeed,
        "baseline": False if args.no_baseline else None,
    }
    overrides |= {key: value for key, value in flags.items() if value is not None}
    if args.workers:  # with workers the head trains on idle workers, not in this process
        overrides.setdefault("rollout.training.drafter_train_steps", 0)
    run_demo(cfg.with_overrides(**overrides))
    return 0


def _bench_sections() -> dict:
    """The registered benchmark sections; none in a wheel, which leaves benchmarks/ out (there
    ``tailspec bench`` says in one line that it needs the checkout)."""
    try:
        from .benchmarks.sections import SECTIONS
    except ImportError:
        return {}
    return SECTIONS


def _bench(args: argparse.Namespace) -> int:
    _from_checkout("`tailspec bench`")
    from .benchmarks.sections import SECTIONS, run_bench

    _writable_parent(args.out, "--out")
    out = Path(args.out)
    if args.section == "all":
        print(run_bench(out, quick=args.quick, threads=args.threads))
    else:
        print(SECTIONS[args.section].run(out, args))
    print(f"wrote {args.out}")
    return 0


def _atts(args: argparse.Namespace) -> int:
    _from_checkout("`tailspec atts`")
    from .atts import ATTSConfig
    from .benchmarks.atts import ATTSBenchConfig, atts_table, measure_atts
    from .benchmarks.run import write_atts_section
    from .tasks.tokenizer import build_tokenizer

    if args.out:
        _writable_parent(args.out, "--out")
    alphas = tuple(sorted({*args.alphas, args.alpha}))
    delimiters = tuple(build_tokenizer().encode(args.delimiter)) if args.delimiter else ()
    atts = ATTSConfig(
        alpha=args.alpha,
        num_samples=args.samples,
        chunk_tokens=args.chunk_tokens,
        delimiter_ids=delimiters,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    cfg = ATTSBenchConfig(
        questions=args.questions,
        calibration_questions=args.calibration_questions,
        alphas=alphas,
        main_alpha=args.alpha,
        atts=atts,
        ray=args.ray,
        seed=args.seed,
        policy=args.policy,
        max_num_seqs=args.max_num_seqs,
    )
    rows, calibration = measure_atts(cfg, progress=True)
    print(atts_table(rows))
    if args.out:
        write_atts_section(Path(args.out), rows, calibration, cfg, command="tailspec " + " ".join(args.argv))
        print(f"wrote {args.out}")
    return 0


def _train_tiny(args: argparse.Namespace) -> int:
    _from_checkout("`tailspec train-tiny`")
    from .tasks.sft import main as sft_main

    return sft_main(args.rest) or 0


def _train_deep(args: argparse.Namespace) -> int:
    _from_checkout("`tailspec train-deep`")
    from .tasks.deep import main as deep_main

    return deep_main(args.rest) or 0


def _train_hybrid(args: argparse.Namespace) -> int:
    _from_checkout("`tailspec train-hybrid`")
    from .tasks.hybrid import main as hybrid_main

    return hybrid_main(args.rest) or 0


def _load_policy(spec: str, tokenizer_path: str | None):
    """``tiny`` / ``deep`` (a shipped policy), a local Hugging Face model directory or a hub id."""
    from transformers import AutoTokenizer

    from .packed_weights import weights_location
    from .safe_files import load_causal_lm

    tokenizer = _model_location(tokenizer_path, "--tokenizer") if tokenizer_path else None
    if not Path(spec).expanduser().exists() and not _HUB_REPO_ID.match(spec):  # a shipped policy's name
        _from_checkout(f"--policy {spec}")
        from .tasks.sft import SHIPPED_POLICIES, load_shipped

        if spec in SHIPPED_POLICIES:
            model, shipped_tokenizer = load_shipped(spec, "policy")
            return model, AutoTokenizer.from_pretrained(tokenizer) if tokenizer else shipped_tokenizer
    policy = _model_location(spec, "--policy (a shipped policy tiny, deep or a model directory)")
    model = load_causal_lm(weights_location(policy), dtype="auto").eval()
    return model, AutoTokenizer.from_pretrained(tokenizer or policy)


def _load_prompts(spec: str, tokenizer, num: int, seed: int) -> list[list[int]]:
    """Token ids of ``num`` prompts: the built-in ``chain-sum`` task, or a JSONL file whose lines
    hold ``{"prompt": "text"}`` or ``{"prompt": [chat messages]}``."""
    import json

    if spec == "chain-sum":
        _from_checkout("--prompts chain-sum")
        from .tasks.chain_sum import ChainSumConfig, make_grpo_dataset

        rows = [r["prompt"] for r in make_grpo_dataset(num, seed=seed, cfg=ChainSumConfig())]
    else:
        path = _existing_file(spec, "--prompts ('chain-sum' or a JSONL file)")
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if len(rows) == num:
                break
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, TypeError, KeyError):
                raise UserError(f'--prompts: line {number} of {spec} is not a JSON object with a "prompt"') from None
    if not rows:
        raise UserError(f"--prompts: no prompts in {spec}")
    from .trainer_hooks.spec_rollout import SpecRollout

    return SpecRollout.tokenize_prompts(rows, tokenizer)  # exactly as the rollouts in training will


def _drafter_warmup(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .drafter.eagle3.train import DrafterTrainingConfig
    from .drafter.eagle3_warmup import WarmupConfig, warmup_head

    if args.prompts != "chain-sum":  # every path is checked before the policy loads
        _existing_file(args.prompts, "--prompts ('chain-sum' or a JSONL file)")
    _writable_parent(args.out, "--out")
    model, tokenizer = _load_policy(args.policy, args.tokenizer)
    prompts = _load_prompts(args.prompts, tokenizer, args.num_prompts, args.seed)
    cfg = WarmupConfig(
        rounds=args.rounds,
        steps_per_round=args.steps,
        max_new_tokens=args.max_new_tokens,
        draft_vocab_size=args.draft_vocab_size,
        training=DrafterTrainingConfig(batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed),
        seed=args.seed,
    )
    _, trainer, rounds = warmup_head(model, prompts, cfg, eos_token_ids=None)
    for r in rounds:
        print(
            f"round {r.round}: {r.completions} completions, {r.tokens} tokens, rollout accept length "
            f"{r.accept_length:.2f}, loss {r.loss_first:.3f} -> {r.loss_last:.3f}"
        )
    metadata = {"policy": args.policy, "prompts": args.prompts, "rounds": [asdict(r) for r in rounds]}
    path = trainer.save(args.out, metadata=metadata, include_optimizer=not args.weights_only)
    print(f"wrote {path}")
    return 0


def _drafter_export(args: argparse.Namespace) -> int:
    from .drafter.eagle3.checkpoint import export_checkpoint, load_checkpoint

    _writable_parent(args.out, "--out")
    ckpt = load_checkpoint(args.checkpoint)
    print(f"wrote {export_checkpoint(ckpt.head, args.out, format=args.format)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_atts(sub)
    _add_drafter(sub)
    _add_models(sub)
    return parser


def _add_demo(sub) -> None:
    """The `demo` command."""
    demo = sub.add_parser("demo", help="a short GRPO run with tailspec rollouts on the tiny task (CPU)")
    demo.add_argument("--config", help="YAML demo config (default: the shipped configs/demo_cpu.yaml)")
    demo.add_argument("--steps", type=POSITIVE, help="number of GRPO steps")
    demo.add_argument(
        "--strategy",
        help="speculation strategy: adaptive (the config's) | none | chain:K | tree:D,K,B | suffix[:...] | hybrid",
    )
    demo.add_argument("--seed", type=int, help="seed of the GRPO runs (trainer and rollout sampling)")
    demo.add_argument("--no-wandb", action="store_true", help="do not log to wandb (offline by default)")
    demo.add_argument(
        "--workers",
        type=NON_NEGATIVE,
        help="Ray rollout workers (0: the in-process engine; with workers the EAGLE-3 head trains on idle ones)",
    )
    demo.add_argument("--ray-address", help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    demo.add_argument("--deepspeed", help="train under DeepSpeed: zero2 | zero3 | a DeepSpeed JSON path")
    demo.add_argument("--no-baseline", action="store_true", help="skip the no-speculation comparison run")
    demo.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="set any config field by its dotted path, e.g. rollout.engine.length_budget=0.5 or "
        "rollout.workers.schedule=static (or by a name only one field has: length_budget=0.5); repeatable",
    )
    demo.set_defaults(func=_demo)


def _add_bench(sub) -> None:
    """The `bench` command."""
    bench = sub.add_parser("bench", help="benchmarks side by side; writes docs/BENCHMARKS.md")
    bench.add_argument("--out", default="docs/BENCHMARKS.md")
    bench.add_argument("--quick", action="store_true", help="fewer prompts (for a smoke run)")
    sections = _bench_sections()
    bench.add_argument(
        "--section",
        choices=["all", *sections] if sections else None,
        default="all",
        help="all: every section, as `make bench` runs them; any other: only that section, in place ("
        + "; ".join(f"{s.name}: {s.about}" for s in sections.values())
        + ")",
    )
    bench.add_argument(
        "--policy",
        choices=["tiny", "deep"],
        default="deep",
        help="shipped policy of the sections that take one (all but spot_training and e2e; default: deep)",
    )
    bench.add_argument("--threads", type=POSITIVE, default=1, help="torch threads for the sweep and adaptive sections")
    bench.add_argument(
        "--drafter", choices=["eagle3", "lm"], default="eagle3", help="model drafter of the adaptive section"
    )
    bench.set_defaults(func=_bench)


def _add_atts(sub) -> None:
    """The `atts` command."""
    atts = sub.add_parser(
        "atts",
        help="ATTS on the chain-sum task: draft chunks, conformal takeover by the target, vs target-only and sync",
    )
    atts.add_argument("--alpha", type=float, default=0.2, help="takeover rate to ask for, in (0, 1)")
    atts.add_argument("--alphas", type=float, nargs="*", default=[0.1, 0.4], help="more alphas to sweep (split)")
    atts.add_argument("--questions", type=POSITIVE, default=32)
    atts.add_argument("--calibration-questions", type=POSITIVE, default=32, help="held-out questions for calibration")
    atts.add_argument("--samples", type=POSITIVE, default=8, help="samples per question")
    atts.add_argument("--chunk-tokens", type=POSITIVE, default=32)
    atts.add_argument("--delimiter", default="", help="text whose tokens end a chunk early (e.g. ' ' = one step)")
    atts.add_argument("--max-new-tokens", type=POSITIVE, default=384)
    atts.add_argument(
        "--max-num-seqs",
        type=POSITIVE,
        default=256,
        help="sequences each engine batches at most (a few: the target decodes memory-bound, as on a GPU)",
    )
    atts.add_argument("--temperature", type=float, default=1.0)
    atts.add_argument("--seed", type=int, default=0)
    atts.add_argument("--ray", action="store_true", help="draft and target engines as Ray actors (local Ray)")
    atts.add_argument(
        "--policy", choices=["tiny", "deep"], default="tiny", help="target: a shipped policy (draft: its LM)"
    )
    atts.add_argument("--out", help="also write the ATTS section of this report (e.g. docs/BENCHMARKS.md)")
    atts.set_defaults(func=_atts)


def _add_drafter(sub) -> None:
    """The `drafter warmup` and `drafter export` commands."""
    drafter = sub.add_parser("drafter", help="EAGLE-3 drafter heads: warm-up training and export")
    dsub = drafter.add_subparsers(dest="drafter_command", required=True)
    warm = dsub.add_parser("warmup", help="train a head offline from a policy's rollouts before RL starts")
    warm.add_argument(
        "--policy", default="tiny", help="'tiny' / 'deep' (a shipped policy) or a local HF model directory"
    )
    warm.add_argument("--tokenizer", help="tokenizer directory (default: the policy's)")
    warm.add_argument("--prompts", default="chain-sum", help="'chain-sum' or a JSONL file of {\"prompt\": ...}")
    warm.add_argument("--num-prompts", type=POSITIVE, default=192)
    warm.add_argument("--rounds", type=POSITIVE, default=3)
    warm.add_argument("--steps", type=POSITIVE, default=200, help="training steps per round")
    warm.add_argument("--max-new-tokens", type=POSITIVE, default=384)
    warm.add_argument("--draft-vocab-size", type=POSITIVE, help="reduced draft vocabulary (most frequent tokens)")
    warm.add_argument("--batch-size", type=POSITIVE, default=8)
    warm.add_argument("--lr", type=float, default=1e-3)
    warm.add_argument("--seed", type=int, default=0)
    warm.add_argument("--out", required=True, help="checkpoint directory to write")
    warm.add_argument("--weights-only", action="store_true", help="leave the optimizer state out (to ship)")
    warm.set_defaults(func=_drafter_warmup)
    export = dsub.add_parser("export", help="write the LlamaForCausalLMEagle3 layout SGLang / vLLM load")
    export.add_argument("--checkpoint", required=True, help="a tailspec EAGLE-3 checkpoint directory")
    export.add_argument("--format", required=True, choices=["sglang", "vllm"])
    export.add_argument("--out", required=True)
    export.set_defaults(func=_drafter_export)


def _add_models(sub) -> None:
    """The `train-tiny`, `train-deep`, `train-hybrid` and `pack-assets` commands."""
    tiny = sub.add_parser(
        "train-tiny",
        help="SFT recipe for the shipped tiny policy and drafter (options: tailspec train-tiny --help)",
        add_help=False,
    )
    tiny.set_defaults(func=_train_tiny)
    deep = sub.add_parser(
        "train-deep",
        help="recipe for the shipped deep policy: grow the tiny one to 24 layers, fine-tune, distill a drafter LM, "
        "warm an EAGLE-3 head (options: tailspec train-deep --help)",
        add_help=False,
    )
    deep.set_defaults(func=_train_deep)
    hybrid = sub.add_parser(
        "train-hybrid",
        help="recipe for the hybrid policy (Qwen3.5-shaped, distilled from the deep one) and its drafter LM "
        "(options: tailspec train-hybrid --help)",
        add_help=False,
    )
    hybrid.set_defaults(func=_train_hybrid)
    pack = sub.add_parser(
        "pack-assets",
        help="store the shipped weights in 16 bits, packed losslessly (after a recipe rewrote them)",
    )
    pack.add_argument("--assets", default=None, help="the assets directory (default: the shipped one)")
    pack.set_defaults(func=_pack_assets)


def _pack_assets(args: argparse.Namespace) -> int:
    from .packed_weights import pack_shipped

    if not args.assets:
        _from_checkout("`tailspec pack-assets` without --assets")
    root = Path(args.assets) if args.assets else Path(__file__).resolve().parent / "assets"
    packed = pack_shipped(root)
    for path in packed:
        print(f"{path}: {path.stat().st_size / 1e6:.2f} MB")
    if not packed:
        print(f"nothing to pack under {root}: every model directory is packed already")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user's mistake prints ``tailspec: error: ...`` on one line and returns
    2 (``TAILSPEC_DEBUG=1`` raises it with its traceback instead); Ctrl-C returns 130."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.func in (_train_tiny, _train_deep, _train_hybrid):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from .progress import quiet_library_bars

    quiet_library_bars()
    debug = os.environ.get("TAILSPEC_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("tailspec: interrupted", file=sys.stderr)
        return 130
    except _user_error_types() as e:
        if debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"tailspec: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
