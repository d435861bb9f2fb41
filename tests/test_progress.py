"""Bars redraw on a terminal; in a file short bars never show and long ones write plain lines."""

import io

from tailspec import progress
from tailspec.progress import LineWriter, progress_bar


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_a_short_bar_in_a_file_writes_nothing():
    out = io.StringIO()
    for _ in progress_bar(range(10_000), desc="rollout", file=out):
        pass
    assert out.getvalue() == ""


def test_a_long_bar_in_a_file_writes_plain_lines_at_most_every_interval(monkeypatch):
    clock = iter(range(0, 10_000, 1))  # every tqdm clock read moves one second on
    monkeypatch.setattr(progress, "FILE_INTERVAL_S", 30.0)
    out = io.StringIO()
    bar = progress_bar(total=300, desc="train", file=out)
    bar._time = lambda: float(next(clock))
    bar.start_t = bar.last_print_t = bar._time()
    for _ in range(300):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 1 <= len(lines) <= 300 // 30 + 2
    assert all("\r" not in line and "\x1b" not in line and line.startswith("train") for line in lines)


def test_on_a_terminal_the_bar_redraws():
    out = FakeTerminal()
    for _ in progress_bar(range(3), desc="x", file=out, mininterval=0):
        pass
    assert "\r" in out.getvalue()


def test_the_line_writer_drops_cursor_movement():
    out = io.StringIO()
    LineWriter(out).write("\rdrafter:  50%|#    | 1/2\x1b[A\r\x1b[A   \r")
    assert out.getvalue() == "drafter:  50%|#    | 1/2\n"
