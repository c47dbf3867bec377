"""A job's side of the engine hosts: hand a request to a slot's host, starting one when none listens,
and wait for its reply, watching the host's progress.

A host that dies during a request: the client starts a new host and asks once more (shards already
written are reused), then gives up and the job fails under its marker. A host that stays alive but
makes no progress (no finished shard for `stall_s`, no finished start for `START_STALL_S`: a hung
kernel, a deadlock) is stopped by the waiting client and treated as dead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path

from jex.engine.compile_cache import cache_env
from jex.engine_spec import EngineSpec
from jex.tasks.execution.engine_host.protocol import (
    IDLE_EXIT_S,
    PGID,
    POLL_S,
    PROGRESS,
    STALL_S,
    HostLaunch,
    HostOptions,
    HostReply,
    HostRequest,
    JobSummary,
    address,
    authkey,
    flock,
    read_progress,
    slot_dir,
)
from jex.tasks.execution.engine_host.server import execute

START_TIMEOUT_S = 120.0
"""A new host must listen within this (it listens before it loads an engine)."""
START_STALL_S = 1800.0
"""An engine start that has not finished after this long means a wedged host."""


class EngineHostDied(RuntimeError):
    """The slot's host exited (or never listened) while a client needed it."""


@dataclass(frozen=True)
class HostPolicy:
    """How a job uses its machine's engine hosts (the per-request part of `HostOptions`)."""

    max_requests: int = 0
    """Requests a host this job starts serves before it exits (0: any; 1: each job loads its own engine)."""
    stall_s: float = STALL_S
    """A host that finishes no shard for this long is stopped and counted as dead."""
    restarts: int = 1
    """Hosts that die (or stall) during a request are replaced this many times before the job fails."""
    idle_exit_s: float = IDLE_EXIT_S
    """A host this job starts exits after this long with no request."""

    @classmethod
    def of(cls, options: HostOptions) -> HostPolicy:
        return cls(max_requests=options.max_requests, stall_s=options.stall_s, restarts=options.restarts,
                   idle_exit_s=options.idle_exit_s)


def _stop_group(pid_file: Path) -> None:
    """Kill the process group a pid file names (a previous host of the slot, and any children)."""
    try:
        os.killpg(int(pid_file.read_text().strip()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _connect(home: Path, slot: int, key: bytes) -> Connection | None:
    """A connection to the slot's host, or None when no live host listens (never started, or died)."""
    try:
        return Client(address(home, slot), family="AF_UNIX", authkey=key)
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError, EOFError):
        return None


def _start_host(home: Path, slot: int, key: bytes, device: str | None, policy: HostPolicy,
                warm: EngineSpec | None = None) -> Connection:
    sd = slot_dir(home, slot)
    sd.mkdir(parents=True, exist_ok=True)
    _stop_group(sd / PGID)  # a previous host of this slot that no longer listens, and its children
    (sd / PROGRESS).unlink(missing_ok=True)
    env = {**os.environ, **cache_env(home, slot)}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    launch = HostLaunch(home=str(home), slot=slot, max_requests=policy.max_requests, idle_exit_s=policy.idle_exit_s,
                        warm=warm)
    with open(sd / "host.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jex.tasks.execution.engine_host", "serve",
                                 launch.model_dump_json()], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=home, start_new_session=True)
    (sd / PGID).write_text(str(proc.pid))  # its own session: it outlives the job that started it
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if (conn := _connect(home, slot, key)) is not None:
            return conn
        if proc.poll() is not None:
            raise EngineHostDied(f"engine host slot {slot} exited {proc.returncode} at start; see {sd / 'host.log'}")
        time.sleep(0.1)
    _stop_group(sd / PGID)
    raise EngineHostDied(f"engine host slot {slot} did not listen within {START_TIMEOUT_S:.0f} s")


def _await_reply(conn: Connection, home: Path, slot: int, stall_s: float) -> HostReply:
    """The host's reply; a host whose last step is older than its phase allows (and than the
    request) is stopped, and `EngineHostDied` raised."""
    asked = time.time()
    while not conn.poll(POLL_S):
        progress = read_progress(home, slot)
        if progress is None:
            continue
        if progress.phase == "queued":  # alive, waiting for another engine's start (watched by its own client)
            continue
        budget = START_STALL_S if progress.phase == "starting" else stall_s
        quiet = time.time() - max(progress.time, asked)
        if quiet > budget:
            _stop_group(slot_dir(home, slot) / PGID)
            raise EngineHostDied(f"engine host slot {slot} made no progress for {quiet:.0f} s "
                                 f"({progress.phase}: {progress.detail or '-'}); stopped it")
    return HostReply.model_validate_json(conn.recv_bytes())


def _host(home: Path, slot: int, device: str | None, policy: HostPolicy, warm: EngineSpec | None = None
          ) -> Connection:
    """A connection to the slot's host, starting one when none listens (one host per slot, however
    many clients arrive)."""
    key = authkey(home)
    with flock(slot_dir(home, slot) / "start.lock"):
        return _connect(home, slot, key) or _start_host(home, slot, key, device, policy, warm=warm)


def _ask(home: Path, slot: int, request: HostRequest, device: str | None, policy: HostPolicy) -> HostReply:
    conn = _host(home, slot, device, policy)
    with conn:
        try:
            conn.send_bytes(request.model_dump_json().encode())
            return _await_reply(conn, home, slot, policy.stall_s)
        except (EOFError, OSError) as e:
            raise EngineHostDied(f"engine host slot {slot} died during {request.job}: {e}") from e


def _echo_log(log: Path, offset: int) -> None:
    if log.exists():
        with open(log, "rb") as f:
            f.seek(offset)
            sys.stdout.write(f.read().decode(errors="replace"))
            sys.stdout.flush()


def submit(home: Path, slot: int, request: HostRequest, *, device: str | None = None,
           policy: HostPolicy = HostPolicy()) -> HostReply:
    """Run `request` on the slot's host, starting one if none listens; a host that dies or stalls
    is replaced `policy.restarts` times before the error propagates. The host's log lines for the
    request are echoed."""
    log = slot_dir(home, slot) / "host.log"
    attempt = 0
    while True:
        offset = log.stat().st_size if log.exists() else 0
        try:
            return _ask(home, slot, request, device, policy)
        except EngineHostDied as e:
            if attempt == policy.restarts:
                raise
            attempt += 1
            print(f"{e}; starting a new engine host", flush=True)
        finally:
            _echo_log(log, offset)


def prestart(home: Path, engine: EngineSpec, slots: Sequence[int], devices: list[str] | None = None,
             policy: HostPolicy = HostPolicy()) -> None:
    """Start the hosts of `slots` (those not yet listening), each loading `engine` at once rather
    than at its first request; returns as soon as they listen."""
    for s in slots:
        _host(home, s, devices[s] if devices else None, policy, warm=engine).close()


def submit_slots(home: Path, request: HostRequest, *, slots: int, devices: list[str] | None = None,
                 policy: HostPolicy = HostPolicy()) -> list[HostReply]:
    """Share a stage job (worker w of W) among `slots` hosts: each claims w's next shard when it is
    free, so a host that starts late or runs slow takes fewer."""
    subs = [request.model_copy(update={"claim": True})] * slots if slots > 1 else [request]

    def one(s: int) -> HostReply:
        return submit(home, s, subs[s], device=devices[s] if devices else None, policy=policy)

    with ThreadPoolExecutor(len(subs)) as pool:
        return list(pool.map(one, range(len(subs))))


def run_request(request: HostRequest, options: HostOptions | None) -> list[JobSummary]:
    """A job's engine work: in this process (`options` None), else on the machine's engine hosts as
    `options` says. Returns each slot's summary; raises when a host reports a failure."""
    if options is None:
        return [execute(request)]
    replies = submit_slots(Path(options.home).resolve(), request, slots=options.slots, devices=options.devices,
                           policy=HostPolicy.of(options))
    failed = [f"slot {s}: {r.error}" for s, r in enumerate(replies) if not r.ok]
    if failed:
        raise RuntimeError(f"{request.job} failed on the engine host: " + "; ".join(failed))
    return [r.summary for r in replies if r.summary is not None]


__all__ = ["EngineHostDied", "HostPolicy", "prestart", "run_request", "submit", "submit_slots"]
