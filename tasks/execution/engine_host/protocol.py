"""What crosses the engine hosts' boundaries: the options a job gets, a host's launch record, the
socket's request and reply, and the files a host leaves in its slot folder; the socket's address and key.

A machine's engine folder (HOME) holds `authkey` (the sockets' key), `starts.jsonl` (one `EngineStart`
per engine start) and one folder per slot, `slot-S/`: the host's log, pid file (`host.pgid`), progress
record (`progress.json`) and compile cache (`jex.engine.compile_cache`).
"""

from __future__ import annotations

import fcntl
import hashlib
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from jex.engine.compile_cache import slot_dir
from jex.engine_identity import EffectiveSettings
from jex.engine_spec import EngineSpec
from jex.fileio import atomic_path
from jex.record import Record
from jex.tasks.capture.invariance import InvarianceProbe
from jex.tasks.inputs import EngineJob
from jex.tasks.records import FastPassSummary, GenerateSummary, PartialSummary, ReasonSummary

STARTS = "starts.jsonl"
PGID = "host.pgid"
"""Matches `jex.infra.worker_protocol.DETACHED_PGIDS`, through which a machine's teardown finds the hosts."""
PROGRESS = "progress.json"
POLL_S = 2.0
IDLE_EXIT_S = 1800.0
"""Default `idle_exit_s`: a host with no request for this long exits (its machine is normally torn down
long before)."""
STALL_S = 600.0
"""Default `stall_s`: a request with no finished shard for this long means a wedged host."""


class HostOptions(Record):
    """How a machine's jobs use its engine hosts: built by the orchestrator (`MachinesSpec.host_options`),
    read by `jex stage run|golden --host-options FILE` (JSON). Every setting of the hosts is here: a
    host reads none from the environment (a job hands the host it starts a `HostLaunch`)."""

    home: str = Field(description="The machine's engine folder (HOME); a relative path is taken against the job's "
                                  "working folder")
    slots: int = Field(1, ge=1, description="The machine's engine slots, one host each; a stage job's shards are "
                                            "shared among them, each claiming the next free one")
    devices: list[str] | None = Field(None, description="CUDA_VISIBLE_DEVICES of each slot's host, one per slot "
                                                        "(empty: the job's own)")
    max_requests: int = Field(0, ge=0, description="Requests a host that a job starts serves before it exits (0: any; "
                                                   "1: each job loads its own engine)")
    stall_s: float = Field(STALL_S, gt=0, description="Seconds a host may go without finishing a shard before the "
                                                      "waiting job stops it and starts a new one")
    restarts: int = Field(1, ge=0, description="Hosts that die (or stall) during a request are replaced this many "
                                               "times before the job fails")
    idle_exit_s: float = Field(IDLE_EXIT_S, gt=0, description="A host with no request for this long exits")

    @model_validator(mode="after")
    def _one_device_per_slot(self) -> HostOptions:
        if self.devices is not None and len(self.devices) != self.slots:
            raise ValueError(f"{len(self.devices)} devices for {self.slots} engine slot(s): give one per slot")
        return self

    def first_slots(self, n: int) -> HostOptions:
        """These options for the first `n` slots only (the golden replay runs on slot 0)."""
        return self.model_copy(update={"slots": n, "devices": self.devices[:n] if self.devices else None})


class HostLaunch(Record):
    """What a job hands the host it starts (`python -m jex.tasks.execution.engine_host serve LAUNCH`, as
    JSON): where and which slot it serves, its settings, and the engine to load as soon as it listens."""

    home: str
    slot: int = Field(ge=0)
    max_requests: int = Field(0, ge=0, description="Requests to serve before exiting (0: any)")
    idle_exit_s: float = Field(IDLE_EXIT_S, gt=0)
    warm: EngineSpec | None = Field(None, description="Load this engine at once (`prestart`), not at the first request")


class HostRequest(Record):
    """One piece of engine work for a host: the golden replay of the job's rows, or the job's stage.
    Paths in `engine_job` are absolute."""

    job: Literal["golden", "fast_pass", "reason", "generate"]
    engine_job: EngineJob
    worker: int = 0
    workers: int = 1
    claim: bool = Field(False, description="Share this worker's shards with the machine's other engine hosts, "
                                           "first come first served")
    golden_rows: int = 0
    golden_out: str = ""
    fingerprint_out: str = ""
    generation_rows: int = Field(0, description="golden: rows whose rationale prompts are decoded greedily")
    generation_tokens: int = 0
    generation_out: str = ""
    probe: InvarianceProbe | None = Field(None, description="golden: the settings audit's probe, run first on the "
                                                           "same engine (`tasks/capture/invariance.py`)")
    probe_out: str = ""


class GoldenDone(BaseModel):
    stage: Literal["golden"] = "golden"
    rows: int


JobSummary = FastPassSummary | ReasonSummary | GenerateSummary | PartialSummary | GoldenDone
"""What a host returns for one request: the stage's summary, this worker's share of it, or the replay."""


class HostReply(BaseModel):
    ok: bool
    summary: JobSummary | None = None
    error: str = ""
    host_pid: int
    engine_starts: int = Field(description="Engines this host has loaded so far")
    seconds: float


Phase = Literal["starting", "queued", "computing", "idle"]
"""`queued`: waiting for the machine's start lock (no stall limit: the start it waits on is watched)."""


class HostProgress(BaseModel):
    """`slot-S/progress.json`, rewritten at each step a host makes: a waiting client reads it to tell a
    slow host from a wedged one."""

    pid: int
    phase: Phase
    time: float
    detail: str = ""


class EngineStart(BaseModel):
    """One line of `starts.jsonl`."""

    slot: int
    pid: int
    kind: str
    seconds: float
    time: float
    queued_s: float = Field(0.0, description="Waited for the machine's start lock (engines that start alone)")
    alone: bool = Field(True, description="Started under the start lock; False: alongside other engines")
    compile_cache: str = Field("cold", description="cold | warm (this machine compiled before) | restored "
                                                   "(from an earlier machine's compile-cache artifact)")
    import_s: float = Field(0.0, description="Importing the engine's libraries before the start (vLLM, torch)")
    effective: EffectiveSettings | None = Field(None, description="What the started engine runs with, read back")


def parse_starts(text: str) -> list[EngineStart]:
    """The records of a `starts.jsonl`; a line that does not parse (torn by a crash) is skipped."""
    starts = []
    for line in text.splitlines():
        try:
            starts.append(EngineStart.model_validate_json(line))
        except ValidationError:
            continue
    return starts


def read_starts(home: Path) -> list[EngineStart]:
    path = home / STARTS
    return parse_starts(path.read_text()) if path.exists() else []


def read_progress(home: Path, slot: int) -> HostProgress | None:
    try:
        return HostProgress.model_validate_json((slot_dir(home, slot) / PROGRESS).read_text())
    except (OSError, ValidationError):
        return None


@contextmanager
def flock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock on `path`; while another process holds it, `on_wait()` every `POLL_S`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if on_wait is None:
            fcntl.flock(f, fcntl.LOCK_EX)
        else:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    on_wait()
                    time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def authkey(home: Path) -> bytes:
    """The machine's key for the hosts' sockets (mode 0600). Never empty: with an empty key
    `multiprocessing` would skip authentication altogether."""
    path = home / "authkey"
    with flock(home / "authkey.lock"):
        key = path.read_text().strip() if path.exists() else ""
        if len(key) != 64:
            with atomic_path(path) as tmp:  # mkstemp: created 0600
                tmp.write_text(secrets.token_hex(32))
            key = path.read_text().strip()
    return key.encode()


def address(home: Path, slot: int) -> str:
    """The slot's socket: an abstract socket name (Linux), so no file to go stale and no 108-byte path limit."""
    return f"\0jex-engine-{hashlib.sha256(str(home).encode()).hexdigest()[:16]}-{slot}"


__all__ = ["PGID", "POLL_S", "PROGRESS", "STARTS", "EngineStart", "GoldenDone", "HostLaunch", "HostOptions",
           "HostProgress", "HostReply", "HostRequest", "JobSummary", "Phase", "address", "authkey",
           "flock", "parse_starts", "read_progress", "read_starts", "slot_dir"]
