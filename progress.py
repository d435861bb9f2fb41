"""Progress bars that redraw on a terminal and stay quiet in a file.

On a terminal :func:`progress_bar` is plain ``tqdm``. When its stream is not a terminal (``make
demo > log``, a Ray job's log, CI) a bar shows nothing for its first ``FILE_INTERVAL_S`` seconds
(short bars never appear), then at most one plain line every ``FILE_INTERVAL_S`` seconds, with no
carriage returns or cursor movement, so a log stays one readable line per update.
"""

from __future__ import annotations

import os
import re
import sys
from typing import IO, Any

from tqdm.auto import tqdm

FILE_INTERVAL_S = 30.0

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class LineWriter:
    """A stream for tqdm that turns each redraw into one line and drops cursor movement."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        for piece in _ANSI.sub("", text).replace("\n", "\r").split("\r"):
            if piece.strip():
                self.stream.write(piece.rstrip() + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """``tqdm(iterable, **kwargs)``, redrawn on a terminal, throttled to plain lines elsewhere."""
    stream = kwargs.pop("file", None) or sys.stderr
    if not is_terminal(stream) and not kwargs.get("disable", False):
        kwargs.update(
            file=LineWriter(stream),
            mininterval=max(float(kwargs.get("mininterval", 0.1)), FILE_INTERVAL_S),
            delay=max(float(kwargs.get("delay", 0.0)), FILE_INTERVAL_S),
            dynamic_ncols=False,
            ncols=kwargs.get("ncols", 100),
            position=None,
        )
    else:
        kwargs["file"] = stream
    return tqdm(iterable, **kwargs)


def quiet_library_bars(stream: Any = None) -> None:
    """Turn off the progress bars of Hugging Face libraries (weight loading, datasets) unless
    ``stream`` (default: stderr) is a terminal: those already imported are told now, the others
    start quiet (their environment switches), so a command that stops at a bad argument has
    imported none of them."""
    if is_terminal(stream if stream is not None else sys.stderr):
        return
    for switch in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(switch, "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
