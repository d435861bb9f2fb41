"""Writes docs/BENCHMARKS.md (tables + plots) from the results of one ``tailspec bench`` run."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from .throughput import ThroughputResult


def machine_line() -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {device}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}"
    )


def throughput_table(results: Sequence[ThroughputResult]) -> str:
    by_size: dict[int, dict[str, ThroughputResult]] = {}
    for r in results:
        by_size.setdefault(r.batch_size, {})[r.backend] = r
    lines = [
        "| batch size | prompts | HF generate tok/s | tailspec tok/s | tailspec / HF |",
        "|---:|---:|---:|---:|---:|",
    ]
    for bs, row in sorted(by_size.items()):
        hf, ts = row["hf_generate"], row["tailspec"]
        lines.append(
            f"| {bs} | {hf.num_prompts} | {hf.tokens_per_s:,.0f} | {ts.tokens_per_s:,.0f} | "
            f"{ts.tokens_per_s / hf.tokens_per_s:.2f}x |"
        )
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Lay out, write (creating the folder) and close a benchmark figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def plot_panels(path: Path, panels: list[tuple[str, str, list[tuple[str, list[int], list[float]]]]]) -> None:
    """Line plots side by side over RL steps: each panel is ``(title, y label, [(label, xs, ys)])``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, ylabel, series) in zip(axes[0], panels):
        for label, xs, ys in series:
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_throughput(results: Sequence[ThroughputResult], path: Path) -> None:
    plt = pyplot()

    sizes = sorted({r.batch_size for r in results})
    backends = ["hf_generate", "tailspec"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for j, backend in enumerate(backends):
        vals = [next(r.tokens_per_s for r in results if r.batch_size == s and r.backend == backend) for s in sizes]
        ax.bar([i + (j - 0.5) * width for i in range(len(sizes))], vals, width, label=backend)
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("completion tokens / s")
    ax.set_title("Rollout throughput, tiny-task policy (CPU)")
    ax.legend()
    save_figure(fig, path)


def replace_section(out: Path, title: str, body: str, command: str) -> None:
    """Write one ``## title`` section of an existing report in place (appended if absent), noting
    the command that measured it; the other sections are left as they were."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    block = f"## {title}\n\nMeasured by `{command}` on {stamp}. Machine: {machine_line()}.\n\n{body}\n"
    text = out.read_text() if out.exists() else "# Benchmarks\n"
    header = f"## {title}\n"
    if header in text:
        start = text.index(header)
        nxt = text.find("\n## ", start + len(header))
        text = text[:start] + block + ("\n" + text[nxt + 1 :] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
