"""Shard progress: plain lines (no carriage returns) when stderr is not a terminal, a rich bar when it is."""

from __future__ import annotations

import io
import sys

from jex import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_without_carriage_returns_when_stderr_is_not_a_terminal(capsys):
    for done in range(21):
        progress.shard_progress("fast_pass", done, 20)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[0] == "fast_pass: 0/20 shards" and lines[-1] == "fast_pass: 20/20 shards"
    assert len(lines) == 11  # one line per tenth of the work, and the last


def test_a_rerun_of_the_stage_writes_again(capsys):
    progress.shard_progress("reason", 1, 1)
    progress.shard_progress("reason", 1, 1)
    assert capsys.readouterr().err.splitlines() == ["reason: 1/1 shards", "reason: 1/1 shards"]


def test_rich_bar_on_a_terminal_stops_when_every_stage_is_done(monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    progress.shard_progress("fast_pass", 1, 2)
    assert progress._bar is not None and progress._bar.live.is_started
    progress.shard_progress("fast_pass", 2, 2)
    assert progress._bar is None
    assert "2/2" in tty.getvalue() and "fast_pass" in tty.getvalue()
