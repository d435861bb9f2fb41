"""The ``tailspec`` command line: ``tailspec demo``, ``tailspec bench``, ``tailspec train-tiny``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig.from_yaml(args.config) if args.config else DemoConfig()
    overrides: dict[str, object] = {}
    if args.steps is not None:
        overrides["max_steps"] = args.steps
    if args.strategy is not None:
        overrides["strategy"] = args.strategy
    if args.no_wandb:
        overrides["wandb"] = False
    run_demo(dataclasses.replace(cfg, **overrides))  # replace() re-runs validation
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .benchmarks.run import run_bench

    print(run_bench(Path(args.out), quick=args.quick))
    print(f"wrote {args.out}")
    return 0


def _train_tiny(args: argparse.Namespace) -> int:
    from .tasks.sft import main as sft_main

    return sft_main(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a short GRPO run with tailspec rollouts on the tiny task (CPU)")
    demo.add_argument("--config", help="YAML demo config (see configs/demo_cpu.yaml)")
    demo.add_argument("--steps", type=int, help="number of GRPO steps")
    demo.add_argument("--strategy", help="speculation strategy: none | chain:K | tree:D,K,B | suffix[:...]")
    demo.add_argument("--no-wandb", action="store_true", help="do not log to wandb (offline by default)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks side by side; writes docs/BENCHMARKS.md")
    bench.add_argument("--out", default="docs/BENCHMARKS.md")
    bench.add_argument("--quick", action="store_true", help="fewer prompts (for a smoke run)")
    bench.set_defaults(func=_bench)

    tiny = sub.add_parser(
        "train-tiny",
        help="SFT recipe for the shipped tiny policy and drafter (options: tailspec train-tiny --help)",
        add_help=False,
    )
    tiny.set_defaults(func=_train_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.func is _train_tiny:
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
