"""The benchmark sections ``tailspec bench --section NAME`` rewrites in place, registered once.

Each entry names the function that measures the section and rewrites its part of the report
(``run(out, **options) -> table``), the command-line options it takes, what it measures, and the
options of each of its runs in ``make bench``; the CLI's choices, its help and its dispatch, and
:func:`run_bench`, are loops over :data:`SECTIONS`. The functions are imported when a section
runs, so ``tailspec --help`` stays cheap.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Section:
    name: str
    function: str  # "module:function", the module relative to tailspec.benchmarks
    options: tuple[str, ...]  # the CLI options it reads (of --quick, --policy, --threads, --drafter)
    about: str
    fixed: dict[str, Any] = field(default_factory=dict)  # arguments of its own
    bench: tuple[dict[str, Any], ...] = ({},)  # its runs in `make bench`: options over BENCH_DEFAULTS

    def run(self, out: Path, args: argparse.Namespace) -> str:
        module, function = self.function.split(":")
        run = getattr(import_module(f"{__package__}.{module}"), function)
        return run(out, **{name: getattr(args, name) for name in self.options}, **self.fixed)


SECTIONS: dict[str, Section] = {}
BENCH_DEFAULTS: dict[str, Any] = {"quick": False, "policy": "deep", "threads": 1, "drafter": "eagle3"}  # the CLI's


def register(section: Section) -> Section:
    if section.name in SECTIONS:
        raise ValueError(f"benchmark section {section.name!r} is registered twice")
    SECTIONS[section.name] = section
    return section


POLICY = ("quick", "policy")
DEEP_AND_TINY = ({"policy": "deep"}, {"policy": "tiny"})
for _section in (
    Section(
        "sweep",
        "run:run_sweep_section",
        (*POLICY, "threads"),
        "every drafter against plain decoding",
        bench=DEEP_AND_TINY,
    ),
    Section(
        "adaptive",
        "run:run_adaptive_section",
        (*POLICY, "threads", "drafter"),
        "adaptive on a long-tail rollout",
        bench=({"policy": "deep"}, {"policy": "deep", "drafter": "lm"}, {"policy": "tiny"}),
    ),
    Section(
        "atts", "run:run_atts_section", POLICY, "ATTS against target-only and synchronous sampling", bench=DEEP_AND_TINY
    ),
    Section("schedule", "run:run_schedule_section", POLICY, "the long tail across 2 Ray workers: divided rollout"),
    Section("drift", "run:run_drift_section", POLICY, "a frozen EAGLE-3 head against online ones as GRPO moves"),
    Section("drift_lm", "run:run_drift_section", POLICY, "the same with the drafter LM", {"drafter": "small_lm"}),
    Section("throughput", "run:run_throughput_section", ("quick",), "the engine against HF generate (tiny policy)"),
    Section("speculative", "run:run_speculative_section", ("quick",), "every strategy against none (tiny policy)"),
    Section("eagle3", "run:run_eagle3_section", ("quick",), "an EAGLE-3 head before and after online training"),
    Section("kernels", "run:run_kernels_section", ("quick",), "the Triton kernels against their references (CUDA)"),
    Section("spot_training", "run:run_spot_training_section", ("quick",), "spot drafter training on 2 Ray workers"),
    Section("e2e", "run:run_e2e_section", ("quick",), "GRPO end to end: stock TRL against tailspec"),
    Section("mirror", "run:run_mirror_section", POLICY, "mirror speculative decoding against serial arms"),
    Section("draft_hosts", "run:run_draft_hosts_section", POLICY, "a finished worker drafting for a busy one"),
    Section("grpo_path", "grpo_path:run_grpo_path_section", POLICY, "adaptive on the GRPO path, per step"),
    Section("user_path", "user_path:run_user_path_section", ("quick",), "what a user's first run measures"),
    Section("selector_sim", "selector_sim:run_selector_sim_section", ("quick",), "the selector's simulator"),
    Section("host", "host:run_host_section", ("quick",), "host work before each captured replay"),
    Section("step_host", "step_host:run_step_host_section", ("quick",), "host time of one decode step per strategy"),
    Section("hybrid_state", "hybrid_state:run_hybrid_state_section", ("quick",), "what recurrent state costs a step"),
    Section("hybrid_policy", "hybrid_policy:run_hybrid_policy_section", ("quick",), "speculation on a hybrid policy"),
):
    register(_section)


def run_bench(out: Path, quick: bool = False, threads: int = 1) -> str:
    """``make bench``: every registered section, once for each of its ``bench`` option sets, each
    rewriting its own part of ``out`` in place; their tables, joined."""
    tables = []
    for section in SECTIONS.values():
        for options in section.bench:
            args = argparse.Namespace(**{**BENCH_DEFAULTS, "quick": quick, "threads": threads, **options})
            tables.append(section.run(out, args))
    return "\n\n".join(tables)
