"""GRPO with tailspec rollouts on Ray workers; the entry point for ``ray job submit``.

    ray job submit --address http://127.0.0.1:8265 -- python examples/ray_job.py --config configs/ray_job_cpu.yaml

Inside a submitted job ``RAY_ADDRESS`` is set, so the workers start on that cluster; run directly,
it starts a local Ray. Prints a one-line JSON summary prefixed with ``tailspec-job-summary``.
"""

import argparse
import json
import logging
import sys

from tailspec.demo import DemoConfig, run_demo


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/ray_job_cpu.yaml")
    parser.add_argument("--steps", type=int, help="override max_steps")
    parser.add_argument("--workers", type=int, help="override workers")
    parser.add_argument("--no-wandb", action="store_true")
    parser.add_argument("--output-dir", help="override output_dir")
    parser.add_argument("--quick", action="store_true", help="tiny settings (2 steps, short completions)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = DemoConfig.from_yaml(args.config)
    overrides = {}
    if args.quick:
        problems = cfg.problems[:2] if cfg.problems else None
        overrides.update(
            max_steps=2, prompts_per_step=2, problems=problems, num_generations=2, max_completion_length=48
        )
    if args.steps is not None:
        overrides["max_steps"] = args.steps
    if args.workers is not None:
        overrides["rollout.workers.num_workers"] = args.workers
        if args.workers:  # the head then trains on idle workers, not in this process
            overrides["rollout.training.drafter_train_steps"] = 0
    if args.no_wandb:
        overrides["wandb"] = False
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    cfg = cfg.with_overrides(**overrides)
    summary = run_demo(cfg)
    print("tailspec-job-summary " + json.dumps(summary, default=str), flush=True)
    return 0 if summary["steps"] == cfg.max_steps else 1


if __name__ == "__main__":
    sys.exit(main())
