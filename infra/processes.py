"""Server and worker processes jex starts on this host, recorded so that none outlives a crash.

A jex process that starts a long-lived child (Prefect's temporary API server: `jex.flows.local_api`)
records it in its state folder, `<state_dir>/processes/<pid>.json` (an `OwnedProcess`: PID, start time,
port, command, and the owner's PID and start time), and forgets it when it stops it. An owner killed
with SIGKILL forgets nothing: `stop_orphans` (run by `jex infra reconcile` and at the start of every
command that runs a flow) stops each recorded process whose owner is gone. A PID is trusted only with its
start time: a later process that reuses the PID of a recorded one (or of its owner) is never touched.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # (no stubs in the venv)
from pydantic import ValidationError

from jex.infra.records import OwnedProcess
from jex.record import write_record

__all__ = ["PROCESSES", "OwnedProcess", "forget_process", "orphans_line", "record_process", "stop_orphans"]

log = logging.getLogger(__name__)
PROCESSES = "processes"
"""The folder of the records, in the orchestrator's state folder (`JEX_INFRA__STATE_DIR`)."""
STOP_TIMEOUT_S = 5.0
"""How long a process may take to end after SIGTERM before it is killed."""


def _started_at(pid: int) -> float | None:
    """The start time of a running process `pid` (None: no such process, or one that has ended, a zombie)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def _is(pid: int, started_at: float) -> bool:
    """Whether `pid` is still the process that started at `started_at` (not one that reuses its PID)."""
    now = _started_at(pid)
    return now is not None and abs(now - started_at) < 0.05  # create_time is computed in clock ticks (10 ms)


def record_process(state_dir: Path, *, kind: str, pid: int, port: int | None, command: Sequence[str]) -> Path | None:
    """Record a process this one started (and owns); None when it has already ended."""
    started = _started_at(pid)
    owner = _started_at(os.getpid())
    if started is None or owner is None:
        return None
    path = Path(state_dir) / PROCESSES / f"{pid}.json"
    write_record(path, OwnedProcess(kind=kind, pid=pid, started_at=started, port=port, command=list(command),
                                    owner_pid=os.getpid(), owner_started_at=owner))
    return path


def forget_process(state_dir: Path, pid: int) -> None:
    """Drop the record of a process its owner stopped."""
    (Path(state_dir) / PROCESSES / f"{pid}.json").unlink(missing_ok=True)


def _stop(pid: int) -> None:
    """SIGTERM `pid` and its children, SIGKILL whichever still runs after `STOP_TIMEOUT_S`."""
    try:
        proc = psutil.Process(pid)
        procs = [*proc.children(recursive=True), proc]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and any(_started_at(p.pid) is not None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if _started_at(p.pid) is not None:
            try:
                p.kill()
            except psutil.Error:
                pass


def stop_orphans(state_dir: Path) -> list[OwnedProcess]:
    """Stop every recorded process whose owner is gone and forget it; returns those stopped. A record whose
    process has ended (or whose PID now belongs to another process) is forgotten without touching it; one
    that cannot be read is named in the log and left for a person."""
    stopped = []
    for path in sorted((Path(state_dir) / PROCESSES).glob("*.json")):
        try:
            rec = OwnedProcess.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as e:
            log.warning("file %s: not a process record (%s); left as it is", path, type(e).__name__)
            continue
        if _is(rec.owner_pid, rec.owner_started_at):
            continue  # its owner runs, and stops it itself
        if _is(rec.pid, rec.started_at):
            _stop(rec.pid)
            stopped.append(rec)
        path.unlink(missing_ok=True)
    return stopped


def orphans_line(stopped: Sequence[OwnedProcess]) -> str:
    """One line saying what `stop_orphans` stopped."""
    if not stopped:
        return "processes: none left running by a jex process that is gone"
    each = ", ".join(f"{p.kind} pid {p.pid}" + (f" port {p.port}" if p.port else "") + f" (owner pid {p.owner_pid})"
                     for p in stopped)
    return f"processes: stopped {len(stopped)} left running by a jex process that is gone: {each}"
