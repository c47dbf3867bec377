"""Typed records of what infra passes around and writes: markers, job records, outcomes, reports.

Every JSON file infra writes (`heartbeat.json`, `SUCCESS.json`/`FAILED.json`, `job.json`,
`SELF_TERMINATED.json`, `watchdog.json`, `ledger.json`, `s3.json`) is one of these records dumped,
with the keys and values it always had; a field listed in `omit_if_none` is left out while it is
None, as the dictionaries before these records left it out. Records are frozen and refuse unknown
fields where the JSON is ours; a machine record from a provider's command keeps only what it knows.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import Field

from jex.record import Record

# -- the worker protocol (written on the machine) -----------------------------------------------------

class Artifact(Record):
    """A file a job left in its run folder, checksummed where it lies."""

    path: str
    """Relative to the job's run folder, POSIX separators."""
    sha256: str
    bytes: int


class Heartbeat(Record):
    """`heartbeat.json`, rewritten while the job runs."""

    time: float
    pid: int
    command: str
    elapsed_s: float


class RunEnd(Record):
    """`SUCCESS.json` or `FAILED.json`: how the job ended and what it left (`reason` on failures only)."""

    exit_code: int
    artifacts: list[Artifact]
    seconds: float
    command: list[str]
    reason: str | None = None

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"reason"})


class Marker(RunEnd):
    """A completion marker as read back: `ok` says which of the two files it was."""

    ok: bool


class WorkerStatus(Record):
    """What one supervisor poll sees (`python -m jex.infra.worker_protocol status`). The last three
    fields are there only when the poll names the machine's workdir (a machine with a watchdog)."""

    now: float
    heartbeat: Heartbeat | None
    marker: Marker | None
    alive: bool
    log_bytes: int
    gone: bool | None = None
    self_terminated: bool | None = None
    watchdog: bool | None = None
    """Whether the watchdog lives; None when the machine has none."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"gone", "self_terminated", "watchdog"})


class JobRecord(Record):
    """`job.json`: what the orchestrator launched, so a later orchestrator (or the watchdog) can finish it."""

    name: str
    campaign: str
    machine: str
    collect_to: str
    """Local folder the artifacts belong in."""
    strip_prefix: str = ""
    artifacts: list[str]
    """Glob patterns, relative to the run folder."""
    python: str
    code: str
    heartbeat_timeout_s: float


# -- the watchdog (written on the machine when it stops itself) ----------------------------------------

class UploadedArtifact(Artifact):
    s3_key: str


class Lost(Record):
    """An artifact (or `*`: all of them) that did not reach the orchestrator, and why."""

    path: str
    reason: str


JobEnd = Literal["success", "failed", "stopped"]


class JobUpload(Record):
    """One job in `SELF_TERMINATED.json`: its record, how it ended, what went to S3 (or stayed on disk)."""

    status: JobEnd
    record: JobRecord
    artifacts: list[UploadedArtifact] = Field(default_factory=list)
    lost: list[Lost] = Field(default_factory=list)
    on_disk: list[Artifact] | None = None
    """Only when the upload failed: what is left on the machine's disk for `reconcile`."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"on_disk"})


class SelfTerminated(Record):
    """`SELF_TERMINATED.json`: why a machine stopped itself and what it handed over (in S3 and on disk)."""

    reason: str
    machine: str
    campaign: str
    time: float
    created_at: float = 0.0
    uploaded: bool = False
    jobs: dict[str, JobUpload] = Field(default_factory=dict)
    errors: list[str] = Field(default_factory=list)


# -- the orchestrator's side ----------------------------------------------------------------------------

class BootInfo(Record):
    """The last line `bootstrap.sh` prints: the interpreter and code folder jobs run with."""

    python: str
    code: str
    stack: str
    bin: str = ""
    """The folder the bootstrap put first on PATH to check the engine's tools (the stack's bin folder, beside
    `python`): the jobs get it first on theirs."""


class MachineProvenance(Record):
    """`provenance.json` the bootstrap leaves on the machine: what the jobs ran on."""

    host: str
    platform: str
    python: str
    executable: str
    code_sha256: str
    stack: str
    packages: dict[str, str | None]
    gpus: str


class CollectedArtifact(Artifact):
    """An artifact in the local store (sha256-verified), and in S3 when the session has a bucket."""

    local: str
    s3_key: str | None = None

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"s3_key"})


class Transfer(Record):
    """What one collection brought over, and what it could not."""

    artifacts: list[CollectedArtifact] = Field(default_factory=list)
    lost: list[Lost] = Field(default_factory=list)


JobStatus = Literal["success", "adopted", "failed", "heartbeat_lost", "no_marker", "invalid_marker", "budget",
                    "unreachable", "watchdog_lost", "self_terminated"]


class JobOutcome(Record):
    """How a job on a machine ended, and every artifact collected or named as lost."""

    job: str
    machine: str
    status: JobStatus
    """success | adopted (from S3, after the machine stopped itself) | failed | heartbeat_lost | no_marker |
    invalid_marker | budget | unreachable | watchdog_lost | self_terminated (stopped itself, incomplete)"""
    reason: str = ""
    exit_code: int | None = None
    artifacts: list[CollectedArtifact] = Field(default_factory=list)
    lost: list[Lost] = Field(default_factory=list)
    seconds: float = 0.0
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("success", "adopted") and not self.lost


class TeardownRecord(Record):
    """A machine's deletion: why, how many provider calls it took, its life and cost."""

    machine: str
    reason: str
    attempts: int
    teardown_s: float
    life_s: float | None
    cost_usd: float | None


class MachineReport(Record):
    """One machine of a campaign: what it was, ran on, did and cost (`machines.json`)."""

    machine: dict[str, Any] | None
    """The provider's machine record (`Machine`), as JSON."""
    provenance: MachineProvenance | None
    teardown: TeardownRecord | None
    jobs: list[JobOutcome]
    life_s: float | None
    cost_usd: float | None


# -- the ledger ---------------------------------------------------------------------------------------

class CostLedgerEntry(Record):
    """One machine's life in `ledger.json`."""

    machine_id: str
    campaign: str | None
    provider: str
    price_per_hour: float
    """USD/hour the machine is billed at (`jex.infra.machine.priced`: the one set, else its provider's)."""
    created_at: float
    deleted_at: float | None = None
    end_reason: str | None = None
    host: str | None = None
    """Where a host provider (local, ssh) leased it."""

    def life_s(self, now: float | None = None) -> float:
        """Seconds from creation to deletion (or to `now` while it runs)."""
        return max(0.0, (self.deleted_at or now or time.time()) - self.created_at)

    def cost(self, now: float | None = None) -> float:
        return self.life_s(now) / 3600.0 * self.price_per_hour


class ServedLedgerEntry(Record):
    """A served model's answers in `ledger.json` (`served`): the requests and tokens one answer journal (an engine
    stage's folder in the store) holds so far, cumulative (recorded again, a larger usage replaces the entry, never
    adds to it), and their cost, charged to the campaign that first recorded the journal."""

    served_id: str = Field(description="The entry's key: its answer journal's (sha256 of the folder's path)")
    campaign: str | None = Field(description="The campaign that first recorded the journal (that sent its answers)")
    journal: str = Field(description="The answer journal: an engine stage's folder in the store")
    endpoint: str | None = Field(description="The server's scheme://host:port")
    model: str | None = Field(description="The model id as the server's /v1/models reports it")
    requests: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    price_input_per_mtok: float | None = Field(description="USD per million prompt tokens; None: not set")
    price_output_per_mtok: float | None = Field(description="USD per million completion tokens; None: not set")
    cost_usd: float | None = Field(description="The usage at those prices; None: no price set (as `served.json`)")
    recorded_at: float = Field(description="When this usage was recorded (seconds since the epoch)")

    def cost(self) -> float:
        """What the campaign's running total counts (an unpriced model: nothing)."""
        return self.cost_usd or 0.0


class CostLedgerDoc(Record):
    """`ledger.json`: the machines, and the served models' usage (left out while there is none)."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"served"})
    machines: dict[str, CostLedgerEntry]
    served: dict[str, ServedLedgerEntry] | None = None


class CostLedgerRow(CostLedgerEntry):
    """An entry with its life and cost at the time of the report."""

    seconds: float
    cost_usd: float


class CostLedgerReport(Record):
    """Every machine of a campaign (or all) with its seconds and cost, its served models' usage, and the totals."""

    campaign: str | None
    machines: list[CostLedgerRow]
    total_usd: float = Field(description="The machines' cost and the served models' (an unpriced one: 0)")
    machine_seconds: float
    served: list[ServedLedgerEntry] = Field(default_factory=list, description="The served models' usage")


class ProjectedSpend(Record):
    """What the budget projection (`jex calibrate`, `flows/budget.py`) measured a campaign will need:
    `<state_dir>/projections/<campaign>.json`, read by the budget guard before each of its machines starts."""

    campaign: str = Field(description="The campaign's run folder name (the fleet's campaign)")
    coverage: float = Field(description="The campaign's coverage, which the machine-hours are projected at")
    machine_hours: float = Field(ge=0, description="Machine-hours of its engine stages, all machines together")
    measured_at: float = Field(description="When the projection was made (seconds since the epoch)")
    source: str = Field(description="The projection's budget.json")


# -- processes jex starts on this host ------------------------------------------------------------------

class OwnedProcess(Record):
    """A server or worker process a jex process started on this host (`<state_dir>/processes/<pid>.json`):
    stopped by `jex infra reconcile` (and the next run) once its owner is gone. Start times tell a process
    from a later one that reuses its PID."""

    kind: str = Field(description="What it is, e.g. 'prefect-server' (Prefect's temporary API server)")
    pid: int
    started_at: float = Field(description="Its start time as the OS reports it (psutil create_time)")
    port: int | None = Field(description="The port it listens on, if any")
    command: list[str]
    owner_pid: int = Field(description="The jex process that started it and stops it when it ends")
    owner_started_at: float = Field(description="The owner's start time (psutil create_time)")


# -- reconcile ----------------------------------------------------------------------------------------

class ReconciledJob(Record):
    """A job found on (or adopted from) a machine during reconcile."""

    job: str
    status: str
    artifacts: int
    """How many artifacts were collected."""
    lost: list[Lost]


class LostJob(Record):
    """A job of a machine that is gone: the artifact patterns it had not handed over."""

    job: str
    status: Literal["lost"] = "lost"
    artifacts: int = 0
    lost: list[str]
    collect_to: str


class ReconciledMachine(Record):
    machine: str
    campaign: str | None
    action: Literal["orphan", "collected", "adopted", "lost", "stopped", "error"]
    """stopped: listed powered off with nothing of it in S3, deleted; its jobs' results went with its disk."""
    jobs: list[ReconciledJob | LostJob] = Field(default_factory=list)
    teardown: TeardownRecord | None = None


class ReconcileReport(Record):
    machines: list[ReconciledMachine] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)


# -- S3 -----------------------------------------------------------------------------------------------

class ObjectHead(Record):
    """What a HEAD of an S3 object says: its size and the sha256 we put in its metadata."""

    sha256: str | None
    bytes: int


class S3Object(Record):
    key: str
    bytes: int


class S3Upload(Record):
    """One `put_file`: the object, its content's sha256, and whether bytes went up (False: identical)."""

    key: str
    sha256: str
    bytes: int
    uploaded: bool


class S3Manifest(Record):
    """`s3.json` in a run folder: every object a campaign's sync put (or found identical)."""

    bucket: str
    prefix: str
    objects: list[S3Upload]
