"""Shard progress on stderr: a rich bar on a terminal, plain lines in logs and CI.

`shard_progress(stage, done, total)` is the engine stages' progress callback. When stderr is a
terminal, one rich `Progress` shows a bar per stage and stops when every stage it shows is done (or
at exit, so a failed stage never leaves the cursor hidden). Otherwise it writes one line per tenth
of the work and one at the end, never a carriage return.
"""

from __future__ import annotations

import atexit
import sys
import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

_lock = threading.Lock()
_bar: Progress | None = None
_tasks: dict[str, TaskID] = {}
_last_tenth: dict[str, int] = {}


def shard_progress(stage: str, done: int, total: int) -> None:
    """Report that `done` of `total` shards of `stage` are written."""
    with _lock:
        if sys.stderr.isatty():
            _draw(stage, done, total)
        else:
            _write_line(stage, done, total)


def _draw(stage: str, done: int, total: int) -> None:
    global _bar
    if _bar is None:
        _bar = Progress(TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("shards"), TimeElapsedColumn(), console=Console(file=sys.stderr),
                        auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
        _bar.start()
    if stage not in _tasks:
        _tasks[stage] = _bar.add_task(stage, total=total)
    _bar.update(_tasks[stage], completed=done, total=total)
    _bar.refresh()
    if all(t.finished for t in _bar.tasks):
        _stop()


def _stop() -> None:
    global _bar
    if _bar is not None:
        _bar.stop()
    _bar = None
    _tasks.clear()


def _write_line(stage: str, done: int, total: int) -> None:
    tenth = 10 * done // max(total, 1)
    if done >= total or tenth > _last_tenth.get(stage, -1):
        sys.stderr.write(f"{stage}: {done}/{total} shards\n")
        sys.stderr.flush()
    _last_tenth[stage] = -1 if done >= total else tenth


atexit.register(_stop)
