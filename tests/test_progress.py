"""The progress bar export-llm draws on stderr: a line that redraws, then 'done in'."""
from __future__ import annotations

import io
import time

from execupy.progress import ProgressBar


def test_a_stage_with_a_total_fills_the_bar_and_ends_with_its_time():
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream)
    with bar.stage("capturing", total=4) as stage:
        stage.advance(3)
        assert "[" + "#" * 22 + "." * 8 + "] 3/4" in bar.line()
        time.sleep(0.5)  # long enough for the background redraw
    text = stream.getvalue()
    assert "\rcapturing [" in text.replace("\033[K", "") and text.endswith("\n")
    assert text.replace("\033[K", "").splitlines()[-1].split("\r")[-1].startswith("capturing: done in ")


def test_a_stage_without_a_total_shows_a_spinner_and_bytes_show_as_mib():
    bar = ProgressBar(enabled=True, stream=io.StringIO())
    with bar.stage("lowering"):
        assert bar.line().startswith("lowering ") and bar.line().endswith(" s")
    with bar.stage("writing", total=512 << 20) as stage:
        stage.advance(128 << 20)
        assert "128/512 MiB" in bar.line()


def test_disabled_or_not_a_terminal_writes_nothing():
    stream = io.StringIO()  # not a terminal: off unless asked
    for bar in (ProgressBar(stream=stream), ProgressBar(enabled=False, stream=stream)):
        with bar.stage("capturing", total=2) as stage:
            stage.advance()
    assert stream.getvalue() == ""
