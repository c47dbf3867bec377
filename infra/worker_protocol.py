"""The worker protocol on a machine: heartbeat, log, and a completion marker written last.

`python -m jex.infra.worker_protocol RUN_DIR [--heartbeat S] [--artifacts GLOB ...] -- COMMAND ...` runs
COMMAND as a child, rewrites `RUN_DIR/heartbeat.json` every S seconds while it runs, appends its
output to `RUN_DIR/run.log`, and when it exits writes exactly one marker, atomically:

    SUCCESS.json   exit code 0 and at least one artifact: the artifact list with sha256 and size
    FAILED.json    otherwise: the exit code, the reason, and whatever artifacts exist (salvage)

Started detached (`setsid nohup ... &`), it outlives the SSH session that started it. A supervisor
trusts only the marker plus checksums it verifies itself, never an SSH exit status.

`python -m jex.infra.worker_protocol status RUN_DIR` and `... manifest RUN_DIR --artifacts GLOB ...`
print what a supervisor polls (heartbeat, marker, liveness, log size) and what it can salvage.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jex.fileio import sha256_file, write_json

if TYPE_CHECKING:
    from jex.infra.records import Artifact, Heartbeat, Marker, WorkerStatus

HEARTBEAT, SUCCESS, FAILED, LOG = "heartbeat.json", "SUCCESS.json", "FAILED.json", "run.log"
PGID = "worker.pgid"
"""Written by whoever starts the wrapper detached: its process group, which teardown kills."""
DETACHED_PGIDS = "engines/*/host.pgid"
"""Under a machine's workdir: process groups that outlive single jobs (the engine hosts of
`jex.tasks.execution.engine_host`); a machine's teardown and its watchdog stop them with the jobs."""
POWEROFF_PID = "poweroff.pid"
"""Under a machine's workdir: the bootstrap's detached backstop that runs a custom poweroff command at the
hard time to live (`JEX_INFRA__POWEROFF_COMMAND`); a host lease's teardown kills it with the jobs."""
# The records (pydantic) are imported inside the functions: the wrapper starts its child first and
# a poll pays for them only when it runs (about a second on a loaded machine, against a 1.5 s lease in tests).


def artifact_manifest(run_dir: Path, patterns: list[str]) -> list[Artifact]:
    """Every file under `run_dir` matching one of `patterns`, with its sha256 and size."""
    from jex.infra.records import Artifact

    files = sorted({p for pat in patterns for p in run_dir.glob(pat) if p.is_file()})
    return [Artifact(path=p.relative_to(run_dir).as_posix(), sha256=sha256_file(p), bytes=p.stat().st_size)
            for p in files]


def read_marker(run_dir: Path) -> Marker | None:
    """The completion marker, or None while the run has not finished (or died without one)."""
    from jex.infra.records import Marker

    for name, ok in ((SUCCESS, True), (FAILED, False)):
        path = run_dir / name
        if path.exists():
            return Marker.model_validate({**json.loads(path.read_text()), "ok": ok})
    return None


def read_heartbeat(run_dir: Path) -> Heartbeat | None:
    """The last heartbeat, or None before the first one (or when it cannot be read)."""
    from jex.infra.records import Heartbeat

    try:
        return Heartbeat.model_validate_json((run_dir / HEARTBEAT).read_text())
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def run(run_dir: Path, command: list[str], *, heartbeat_s: float, artifacts: list[str]) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (SUCCESS, FAILED):  # a re-run starts clean; its marker will be written last
        (run_dir / stale).unlink(missing_ok=True)
    started = time.time()
    with open(run_dir / LOG, "ab") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir)
        signal.signal(signal.SIGTERM, lambda *_: child.terminate())
        from jex.infra.records import Heartbeat, RunEnd

        stop = threading.Event()

        def beat() -> None:
            while not stop.is_set():
                now = time.time()
                write_json(run_dir / HEARTBEAT, Heartbeat(time=now, pid=child.pid, command=command[0],
                                                          elapsed_s=now - started).model_dump())
                stop.wait(heartbeat_s)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        code = child.wait()
        stop.set()
        thread.join()
    found = artifact_manifest(run_dir, artifacts)
    end = RunEnd(exit_code=code, artifacts=found, seconds=time.time() - started, command=command)
    if code == 0 and found:
        write_json(run_dir / SUCCESS, end.model_dump())
    else:
        reason = f"exit code {code}" if code != 0 else "exit code 0 but no artifact matched " + ", ".join(artifacts)
        write_json(run_dir / FAILED, end.model_copy(update={"reason": reason}).model_dump())
    return code


def alive_group(pid_file: Path) -> int | None:
    """The process group named in `pid_file` while it lives; None when it is gone or unreadable."""
    try:
        pgid = int(pid_file.read_text().strip())
        os.killpg(pgid, 0)
        return pgid
    except (OSError, ValueError):
        return None


def status(run_dir: Path, *, workdir: Path | None = None) -> WorkerStatus:
    """What a supervisor polls: the machine's clock, heartbeat, marker, whether the worker lives, log size.

    With `workdir` (a machine guarded by `jex.infra.watchdog`) the poll also renews the machine's lease
    and reports whether its watchdog lives and whether it stopped the machine (`self_terminated`).
    """
    from jex.infra.records import WorkerStatus

    return WorkerStatus.model_validate(status_json(run_dir, workdir=workdir))


def status_json(run_dir: Path, *, workdir: Path | None = None) -> dict[str, object]:
    """`status` as the JSON a poll prints, built without loading the records: a poll runs every few
    seconds on a busy machine, and the supervisor validates what it reads (`WorkerStatus`)."""
    def load(path: Path) -> object:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    marker = next(({**doc, "ok": ok} for name, ok in ((SUCCESS, True), (FAILED, False))
                   if isinstance(doc := load(run_dir / name), dict)), None)
    log = run_dir / LOG
    poll: dict[str, object] = {"now": time.time(), "heartbeat": load(run_dir / HEARTBEAT), "marker": marker,
                               "alive": alive_group(run_dir / PGID) is not None,
                               "log_bytes": log.stat().st_size if log.exists() else 0}
    if workdir is None:
        return poll
    guarded = (workdir / "watchdog.json").exists()
    stopped = (workdir / "SELF_TERMINATED.json").exists()
    if guarded and not stopped:
        (workdir / "lease").touch()
    return poll | {"gone": not workdir.exists(), "self_terminated": stopped,
                   "watchdog": alive_group(workdir / "watchdog.pid") is not None if guarded else None}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["status"], ["manifest"]):  # supervisor queries: print JSON, change nothing
        q = argparse.ArgumentParser(prog=f"python -m jex.infra.worker_protocol {argv[0]}")
        q.add_argument("run_dir", type=Path)
        q.add_argument("--artifacts", nargs="+", default=["**/*.parquet"])
        q.add_argument("--workdir", type=Path, default=None, help="status: renew this machine's lease")
        a = q.parse_args(argv[1:])
        doc = (status_json(a.run_dir, workdir=a.workdir) if argv[0] == "status"
               else [x.model_dump() for x in artifact_manifest(a.run_dir, a.artifacts)])
        print(json.dumps(doc))
        return 0
    if "--" not in argv:
        raise SystemExit("usage: python -m jex.infra.worker_protocol RUN_DIR [--heartbeat S] [--artifacts GLOB ...] "
                         "-- CMD")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m jex.infra.worker_protocol")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--heartbeat", type=float, default=10.0)
    p.add_argument("--artifacts", nargs="+", default=["**/*.parquet"])
    args = p.parse_args(argv[:split])
    return run(args.run_dir.resolve(), argv[split + 1:], heartbeat_s=args.heartbeat, artifacts=args.artifacts)


if __name__ == "__main__":
    sys.exit(main())
