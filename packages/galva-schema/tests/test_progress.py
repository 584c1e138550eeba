"""galva_schema.progress: a redrawn bar only on a terminal; plain periodic lines in a file or pipe (issue #22)."""

from __future__ import annotations

import io

import pytest

from galva_schema.progress import LineProgress, NoProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_stream_that_is_not_a_terminal_gets_plain_lines_at_most_every_interval() -> None:
    out = io.StringIO()
    with progress_bar(30, "train", unit="step", stream=out, interval_s=600.0) as bar:
        assert isinstance(bar, LineProgress)
        for step in range(30):
            bar.set_postfix(loss=f"{1.0 / (step + 1):.3f}")  # the values of the step being counted, then the count
            bar.update(1)
            if step == 9:
                bar.write("step 10 | loss 0.100")
            if step in (14, 24):
                bar._last -= 600.0  # as if the interval went by: the next update writes a line (no timing here)
    text = out.getvalue()
    assert "\r" not in text and "\033" not in text
    lines = text.splitlines()
    assert lines[0] == "step 10 | loss 0.100"
    assert len(lines) == 4, lines  # the written line, two periodic lines, the last one
    assert lines[1].startswith("train: 16/30 step, ") and lines[1].endswith("loss=0.062")
    assert lines[-1].startswith("train: 30/30 step, ") and lines[-1].endswith("loss=0.033")


def test_bytes_are_shown_in_mib_and_an_unknown_total_as_a_count() -> None:
    out = io.StringIO()
    with progress_bar(3 * 2**20, "g2h", unit="B", stream=out) as bar:
        bar.update(2**20)
    with progress_bar(None, "tokenising c.jsonl", unit="doc", stream=out) as bar:
        bar.update(7)
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == [
        "g2h: 1.0/3.0 MiB", "tokenising c.jsonl: 7 doc"
    ]  # fmt: skip


def test_a_terminal_gets_a_redrawn_bar_and_disabled_progress_writes_only_lines() -> None:
    pytest.importorskip("tqdm")
    tty = Terminal()
    with progress_bar(5, "train", unit="step", stream=tty) as bar:
        for _ in range(5):
            bar.update(1)
        bar.write("step 5 | loss 1.0")
    assert "\r" in tty.getvalue() and "step 5 | loss 1.0\n" in tty.getvalue()
    off = io.StringIO()
    with progress_bar(5, "train", enabled=False, stream=off) as bar:
        assert isinstance(bar, NoProgress)
        bar.update(5)
        bar.write("only this")
    assert off.getvalue() == "only this\n"
