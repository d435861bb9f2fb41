"""Run the GPU check: ``python -m tailspec.benchmarks.gpu --out DIR [--rehearse] [--stages a,b]``."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from .common import CheckSize, Stage
from .stage_process import ask_cuda_without_initialising_it, preload, run_forked

# stage -> seconds it may take on a lent GPU: together with the children's start-up they fit the
# 7 minutes that leave room for a rerun inside a 15-minute lease
BUDGETS = {
    "env": 35,
    "correctness": 80,
    "graphs": 40,
    "kernels": 35,
    "speed": 200,
    "gpu_tests": 80,
    "selector": 190,
    "training": 330,  # the long-tailed policy, its head, 8 GRPO steps of 4 rollouts each and a twin
    "attention": 150,
    "fast_path": 400,
}
PACK = (
    "env",
    "correctness",
    "graphs",
    "kernels",
    "speed",
    "gpu_tests",
)  # make gpu-check; `selector`: make gpu-selector; `training`: make gpu-train; `attention`: make gpu-attention;
# `fast_path`: make gpu-speed;
# the rehearsal runs every stage
GRACE_S = 25  # past its budget a stage's child is killed (the budget itself is checked between parts)
# --within: a stage gets the seconds left less its grace and its child's start-up (imports, the
# device's context), and is skipped when that leaves it less than this
START_S = 15
SHORTEST_STAGE_S = 30


def run_stage(name: str, size: CheckSize, work: Path, budget: float) -> None:
    """One stage, in this process (the driver starts one child per stage)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    module = importlib.import_module(f"{__package__}.{name}")
    stage = Stage(name, size, budget, work)
    try:
        module.run(stage)
    except Exception:  # the whole stage failed: the report says how
        import traceback

        stage.report.errors.append({"part": "stage", "error": "uncaught", "traceback": traceback.format_exc()})
        logging.exception("stage %s failed", name)
    stage.finish()


def stage_seconds(own: float, within: float | None, elapsed: float) -> float | None:
    """A stage's budget: its own, or with ``within`` seconds for the whole run (``elapsed`` gone)
    what is left less the stage's grace and start-up, whichever is less; None when that is under
    ``SHORTEST_STAGE_S`` (the stage is left out)."""
    if within is None:
        return own
    left = within - elapsed - GRACE_S - START_S
    return None if left < SHORTEST_STAGE_S else min(own, left)


def left_out(name: str, why: str) -> dict:
    """The report of a stage that did not start: no time was left for it (``--within``)."""
    return {"stage": name, "status": "left out", "checks": [], "skipped": [{"name": name, "why": why}], "errors": []}


def _summary_row(report: dict) -> str:
    checks = report.get("checks", [])
    passed = sum(c["passed"] for c in checks)
    failed = [c["name"] for c in checks if not c["passed"]] + [e["part"] for e in report.get("errors", [])]
    notes = "; ".join(failed)[:90] if failed else ", ".join(s["name"] for s in report.get("skipped", []))[:90]
    return (
        f"| {report['stage']} | {report['status']} | {report.get('seconds', 0):.0f} | {passed}/{len(checks)} | "
        f"{len(report.get('skipped', []))} | {notes} |"
    )


def headline(reports: dict[str, dict]) -> list[str]:
    """The figures the issues' targets are about, where a stage (speed, fast_path) recorded them."""
    lines = []
    for name, report in reports.items():
        figures = report.get("results", {}).get("headline", {})
        if figures:
            lines += [f"{name}:", *(f"- {k}: {v}" for k, v in figures.items())]
    return lines


def write_outputs(out: Path, work: Path, reports: dict[str, dict], started: float) -> str:
    table = [
        "| stage | status | s | checks passed | skipped | failed (else skipped) |",
        "|---|---|---:|---:|---:|---|",
    ] + [_summary_row(r) for r in reports.values()]
    text = "\n".join(
        [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - started:.0f} s)", ""]
        + table
        + [""]
        + headline(reports)
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(reports, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(text + "\n")
    logs = [f"===== {p.stem} =====\n{p.read_text(errors='replace')}" for p in sorted(work.glob("*.log"))]
    (out / "log.txt").write_text("\n".join(logs))
    return text


def run_stages(
    stages: list[str], args: argparse.Namespace, size: CheckSize, budget: dict[str, float], out: Path, work: Path
) -> tuple[dict[str, dict], str]:
    """Each stage in a child process of its own (forked from this one once it has imported what
    the stages import: ``stage_process``), its report and log in ``work``; ``out`` rewritten
    after every stage. Returns the reports and the summary's text."""
    started = time.time()
    ask_cuda_without_initialising_it()
    import torch

    if not torch.cuda.is_available():  # set before the stages' kernels are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    reports: dict[str, dict] = {}
    preloaded = False
    for name in stages:
        seconds = stage_seconds(budget[name], args.within, time.time() - started)
        if seconds is None:
            reports[name] = left_out(name, f"--within {args.within:g}: {time.time() - started:.0f} s gone")
            print(f"[gpu-check] stage {name}: left out", flush=True)
            continue
        command = [sys.executable, "-m", __package__, "--stage", name, "--work", str(work)]
        command += ["--rehearse"] if args.rehearse else []
        command += ["--budget", f"{seconds:g}"] if seconds != BUDGETS[name] else []
        print(f"[gpu-check] stage {name} (budget {seconds:g} s) ...", flush=True)
        if not preloaded:  # once, before the first stage that runs
            preload([f"{__package__}.{later}" for later in stages[stages.index(name) :]])
            preloaded = True
        stopped = run_forked(
            lambda name=name, seconds=seconds: run_stage(name, size, work, seconds),
            command,
            work / f"{name}.log",
            timeout_s=seconds + GRACE_S,
        )
        path = work / f"{name}.json"
        report = json.loads(path.read_text()) if path.exists() else {"stage": name, "checks": [], "skipped": []}
        if stopped or report.get("status") in (None, "running"):
            report["status"] = "killed" if stopped else "crashed"
            report.setdefault("errors", []).append({"part": "stage", "error": stopped or "the child exited early"})
        reports[name] = report
        write_outputs(out, work, reports, started)  # after every stage: a cut-off run keeps what it did
        print(f"[gpu-check] stage {name}: {report['status']}", flush=True)
    return reports, write_outputs(out, work, reports, started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tailspec.benchmarks.gpu", description=__doc__)
    parser.add_argument("--out", default="outputs/gpu-check", help="where results.json, log.txt, summary.md go")
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes on whatever device there is (CI, CPU)")
    parser.add_argument(
        "--stages", help=f"comma-separated, from {list(BUDGETS)} (default: the pack; with --rehearse, every stage)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds each named stage may take instead of its own budget (a shorter lease: later parts are "
        "skipped and named, what ran is kept)",
    )
    parser.add_argument(
        "--within",
        type=float,
        help="seconds the whole run may take (a lease's one call): each stage gets its budget or what is left, "
        f"whichever is less; a stage left under {SHORTEST_STAGE_S} s is skipped and named",
    )
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = CheckSize.of("tiny" if args.rehearse else "full")
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget}")
    if args.within is not None and args.within <= 0:
        parser.error(f"--within must be > 0 seconds, got {args.within}")
    budget = dict.fromkeys(BUDGETS, args.budget) if args.budget is not None else BUDGETS
    if args.stage:
        run_stage(args.stage, size, Path(args.work), budget[args.stage])
        return 0
    named = (args.stages or ",".join(BUDGETS if args.rehearse else PACK)).split(",")
    stages = [s for name in named if name for s in (PACK if name == "pack" else (name,))]
    unknown = sorted(set(stages) - set(BUDGETS))
    if unknown:
        parser.error(f"--stages: unknown {unknown}; allowed: {list(BUDGETS)} and 'pack' (the stages of make gpu-check)")
    with tempfile.TemporaryDirectory(prefix="tailspec-gpu-check-") as work:  # its logs end up in --out
        reports, text = run_stages(stages, args, size, budget, Path(args.out), Path(work))
    for report in reports.values():  # what failed, with its traceback, before the table
        for error in report.get("errors", []):
            print(f"\n--- {report['stage']} / {error['part']}: {error['error']}\n{error.get('traceback', '')[-1500:]}")
    print("\n" + text)
    return 0 if all(r["status"] in ("ok", "partial", "left out") for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
