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
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from jex.fileio import sha256_file

HEARTBEAT, SUCCESS, FAILED, LOG = "heartbeat.json", "SUCCESS.json", "FAILED.json", "run.log"
PGID = "worker.pgid"
"""Written by whoever starts the wrapper detached: its process group, which teardown kills."""
DETACHED_PGIDS = "engines/*/host.pgid"
"""Under a machine's workdir: process groups that outlive single jobs (the engine hosts of
`tasks.engine_host`); a machine's teardown and its watchdog stop them with the jobs."""


def _atomic_json(path: Path, doc: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def artifact_manifest(run_dir: Path, patterns: list[str]) -> list[dict[str, Any]]:
    files = sorted({p for pat in patterns for p in run_dir.glob(pat) if p.is_file()})
    return [{"path": p.relative_to(run_dir).as_posix(), "sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in files]


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    """The completion marker, or None while the run has not finished (or died without one)."""
    for name, ok in ((SUCCESS, True), (FAILED, False)):
        path = run_dir / name
        if path.exists():
            return {**json.loads(path.read_text()), "ok": ok}
    return None


def read_heartbeat(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / HEARTBEAT).read_text())
    except (OSError, ValueError):
        return None


def run(run_dir: Path, command: list[str], *, heartbeat_s: float, artifacts: list[str]) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (SUCCESS, FAILED):  # a re-run starts clean; its marker will be written last
        (run_dir / stale).unlink(missing_ok=True)
    started = time.time()
    with open(run_dir / LOG, "ab") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir)
        stop = threading.Event()

        def beat() -> None:
            while not stop.is_set():
                _atomic_json(run_dir / HEARTBEAT, {"time": time.time(), "pid": child.pid, "command": command[0],
                                                   "elapsed_s": time.time() - started})
                stop.wait(heartbeat_s)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        signal.signal(signal.SIGTERM, lambda *_: child.terminate())
        code = child.wait()
        stop.set()
        thread.join()
    found = artifact_manifest(run_dir, artifacts)
    doc = {"exit_code": code, "artifacts": found, "seconds": time.time() - started, "command": command}
    if code == 0 and found:
        _atomic_json(run_dir / SUCCESS, doc)
    else:
        reason = f"exit code {code}" if code != 0 else "exit code 0 but no artifact matched " + ", ".join(artifacts)
        _atomic_json(run_dir / FAILED, {**doc, "reason": reason})
    return code


def _group_alive(pid_file: Path) -> bool:
    try:
        os.killpg(int(pid_file.read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def status(run_dir: Path, *, workdir: Path | None = None) -> dict[str, Any]:
    """What a supervisor polls: the machine's clock, heartbeat, marker, whether the worker lives, log size.

    With `workdir` (a machine guarded by `jex.infra.watchdog`) the poll also renews the machine's lease
    and reports whether its watchdog lives and whether it stopped the machine (`self_terminated`).
    """
    log = run_dir / LOG
    doc: dict[str, Any] = {"now": time.time(), "heartbeat": read_heartbeat(run_dir), "marker": read_marker(run_dir),
                           "alive": _group_alive(run_dir / PGID), "log_bytes": log.stat().st_size if log.exists()
                           else 0}
    if workdir is not None:
        guarded = (workdir / "watchdog.json").exists()
        doc["gone"] = not workdir.exists()
        doc["self_terminated"] = (workdir / "SELF_TERMINATED.json").exists()
        if guarded and not doc["self_terminated"]:
            (workdir / "lease").touch()
        doc["watchdog"] = _group_alive(workdir / "watchdog.pid") if guarded else None
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["status"], ["manifest"]):  # supervisor queries: print JSON, change nothing
        q = argparse.ArgumentParser(prog=f"python -m jex.infra.worker_protocol {argv[0]}")
        q.add_argument("run_dir", type=Path)
        q.add_argument("--artifacts", nargs="+", default=["**/*.parquet"])
        q.add_argument("--workdir", type=Path, default=None, help="status: renew this machine's lease")
        a = q.parse_args(argv[1:])
        doc: Any = (status(a.run_dir, workdir=a.workdir) if argv[0] == "status"
                    else artifact_manifest(a.run_dir, a.artifacts))
        print(json.dumps(doc, default=str))
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
