"""One machine's whole life, owned by the orchestrator: create, bootstrap, run jobs, supervise, collect, tear down.

    with MachineSession(provider, campaign="c1", ledger=..., policy=...) as m:
        outcome = m.run(RemoteJob(...))      # launch detached, poll, stream the log, download, verify, upload

A job runs on the machine under `jex.infra.worker_protocol` (heartbeat, atomic SUCCESS/FAILED marker
with sha256s), started with `setsid nohup` so no SSH drop can stop it. The supervisor trusts only
the marker plus checksums it verifies itself; it salvages what exists when a job fails, goes quiet
(heartbeat lost), dies without a marker, or the budget runs out. Teardown runs on every exit path
and is retried until the provider confirms the machine is gone.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import logging
import shlex
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import TypeAdapter, ValidationError

from jex.errors import InfraError, InputError
from jex.fileio import atomic_open, sha256_bytes, sha256_file, write_json
from jex.infra.backoff import MACHINE_CALL, VERIFY_DOWNLOAD, Backoff, retry
from jex.infra.cost_ledger import CostLedger
from jex.infra.providers import Machine, Provider
from jex.infra.records import (
    Artifact,
    BootInfo,
    CollectedArtifact,
    JobOutcome,
    JobRecord,
    JobStatus,
    JobUpload,
    Lost,
    MachineProvenance,
    MachineReport,
    Marker,
    SelfTerminated,
    TeardownRecord,
    Transfer,
    WorkerStatus,
)
from jex.infra.s3 import S3Store
from jex.infra.shell import Shell, ShellError
from jex.infra.watchdog import MARKER, WatchdogConfig
from jex.settings import InfraSettings, infra_default

__all__ = ["JobFailed", "JobOutcome", "MachineSession", "Policy", "RemoteJob", "StartedMachine", "adopt_artifacts",
           "code_bundle", "priced", "self_terminated_marker", "stack_lock"]

log = logging.getLogger(__name__)
CODE_PACKAGES = {"jex": "jex", "jex.engine": "jex/engine", "jex.tasks": "jex/tasks", "jex.lab": "jex/lab",
                 "jex.overlays": "jex/overlays", "jex.infra": "jex/infra"}
"""Installed package -> its place in the code bundle: what a worker imports (a lab job: `jex.lab`), never
flows or deployments."""
ROOMS = ("engine", "tasks", "lab", "flows", "infra", "overlays", "deployments")
"""The rooms: installed from a wheel they lie inside `jex/`, and come into the bundle as their own package."""
STACK_PACKAGES = ("transformers", "gguf", "accelerate", "safetensors", "numpy", "polars", "pyarrow", "pydantic",
                  "pydantic-settings", "typer", "boto3")
"""`boto3`: the machine's watchdog uploads its own artifacts when the orchestrator is gone."""


FIRST_POLL_S = 0.25
"""The wait before a job's second poll (`MachineSession._poll_wait`)."""


@dataclass
class Policy:
    poll_s: float = infra_default("poll_s")
    heartbeat_s: float = infra_default("heartbeat_s")
    heartbeat_timeout_s: float = infra_default("heartbeat_timeout_s")
    budget_hours: float | None = None
    """The longest a machine may live (wall clock); with `budget_usd` and `price_per_hour`, one policy whose
    names are the settings' (`JEX_INFRA__BUDGET_HOURS`, ...) and the campaign's (`machines.budget_hours`)."""
    budget_usd: float = infra_default("budget_usd")
    price_per_hour: float | None = infra_default("price_per_hour")
    """USD/hour of one machine; None: its provider's (`Provider.hourly_price`), which a session fills in (`priced`)."""
    teardown_attempts: int = 12
    upload_attempts: int = 5
    backoff_s: float = 0.5
    boot_timeout_s: float = 600.0
    watchdog: bool = infra_default("watchdog")
    """Start the machine-side dead-man's switch (`jex.infra.watchdog`) at bootstrap."""
    lease_s: float = infra_default("lease_s")
    """The machine stops itself after this long without a poll from the orchestrator."""
    ttl_s: float | None = None
    """Hard time to live of a machine; None: the wall budget, else the cost budget at the machine's price."""
    finish_grace_s: float = infra_default("finish_grace_s")
    """After a lease expiry, how long a running job may go on before the watchdog stops it."""
    watchdog_check_s: float = 5.0
    poweroff_command: str = infra_default("poweroff_command")
    """How the watchdog of a cloud machine powers it off, run on the machine (`{id}`: the machine's id);
    empty: `shutdown -h now`. Also what the bootstrap's backstop runs at the hard time to live."""

    def machine_ttl_s(self) -> float:
        """The hard time to live: worst case in money = this x `price_per_hour`."""
        if self.ttl_s:
            return self.ttl_s
        by_cost = self.budget_usd / self.price_per_hour * 3600 if self.price_per_hour else 0
        caps = [(self.budget_hours or 0) * 3600, by_cost]
        caps = [c for c in caps if c > 0]
        return min(caps) if caps else infra_default("budget_hours") * 3600.0


def priced(policy: Policy, provider: Provider, *, adopting: bool = False) -> Policy:
    """`policy` with a price: its own, else the provider's (`Provider.hourly_price`: an EC2 instance type the
    catalogue does not price is an InputError, before any machine starts). A machine being adopted (a
    reconcile) is never refused: billed at 0 then, as its ledger entry keeps the price it started at."""
    if policy.price_per_hour is not None:
        return policy
    try:
        return replace(policy, price_per_hour=provider.hourly_price())
    except InputError:
        if adopting:
            return replace(policy, price_per_hour=0.0)
        raise


POLICY_SETTINGS = tuple(f.name for f in fields(Policy) if f.name in InfraSettings.model_fields)
"""The Policy fields that are settings of the same name (`JEX_INFRA__*`): `policy_from_settings` reads them."""


@dataclass
class RemoteJob:
    """A command for the machine's python (`argv` after the interpreter) and what it must leave behind."""

    name: str
    argv: list[str]
    artifacts: list[str]
    collect_to: Path
    files: dict[str, Path] = field(default_factory=dict)
    """Local files uploaded into the job folder first (name in the folder -> local path)."""
    strip_prefix: str = ""
    """Removed from an artifact's path before it is placed under `collect_to` (e.g. 'store/')."""

    def local_path(self, rel: str) -> Path:
        return Path(self.collect_to) / rel.removeprefix(self.strip_prefix)

    @classmethod
    def from_record(cls, rec: JobRecord) -> RemoteJob:
        """The job a `job.json` describes, to supervise and collect it (not to launch it again)."""
        return cls(rec.name, [], rec.artifacts, Path(rec.collect_to), strip_prefix=rec.strip_prefix)


class JobFailed(InfraError):
    def __init__(self, outcome: JobOutcome):
        super().__init__(f"job {outcome.job} on {outcome.machine}: {outcome.status}: {outcome.reason}"
                         + (f"; lost {[x.path for x in outcome.lost]}" if outcome.lost else ""))
        self.outcome = outcome


class ChecksumMismatch(ValueError):
    """Downloaded bytes do not match the sha256 the machine recorded."""


ARTIFACTS = TypeAdapter(list[Artifact])


def package_folder(package: str) -> Path:
    """The folder the installed `package` is imported from: in site-packages after a wheel install, the
    room's folder in the checkout after an editable one (pyproject's package-dir)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise InfraError(f"package {package} is not installed: the machines' code bundle needs it")
    return Path(spec.origin).resolve().parent


def bundle_files() -> list[tuple[Path, str]]:
    """(file, its name in the code bundle) of every module, script and data file a worker imports."""
    files = []
    for package, place in CODE_PACKAGES.items():
        folder = package_folder(package)
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if package == "jex" and rel.parts[0] in ROOMS:
                continue  # a room installed inside jex/ (a wheel): its own package brings it, if a worker needs it
            if path.is_file() and "__pycache__" not in rel.parts and path.suffix in (".py", ".sh", ".toml"):
                files.append((path, f"{place}/{rel.as_posix()}"))
    return files


def code_bundle(dest_dir: Path) -> tuple[Path, str]:
    """A byte-reproducible tar.gz of the packages a worker imports, from where they are installed;
    returns (path, sha256)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for path, arcname in bundle_files():
            info = tar.gettarinfo(str(path), arcname=arcname)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    data = buf.getvalue()
    sha = sha256_bytes(data)
    out = dest_dir / f"code-{sha}.tar.gz"
    if not out.exists():
        with atomic_open(out, "wb") as f:
            f.write(data)
    return out, sha


ENGINE_TOOLS = {"vllm": ("ninja", "cc|gcc|clang")}
"""Executables an engine kind needs on the machine's PATH ("a|b": any one of them): vLLM compiles kernels
at start-up with ninja and a C compiler (the seeds lost a run for want of ninja)."""


def required_tools(engine_kind: str) -> tuple[str, ...]:
    """The executables `engine_kind` (e.g. 'vllm', 'vllm-control', 'hf') needs on PATH (ENGINE_TOOLS)."""
    return next((tools for prefix, tools in ENGINE_TOOLS.items() if engine_kind.startswith(prefix)), ())


STACK_LOCKS = {"hf": "stack-hf.lock", "vllm": "stack-vllm.lock"}
"""The machines' stacks, one lock file each beside this module (package data): the project's pins, never
the orchestrator's installed versions (upgrading a library where the orchestrator runs must not change
what a machine computes with). `make lock` writes them from constraints.txt (`render_stack_locks`)."""
ENGINE_PINS = {"hf": {}, "vllm": {"vllm": "0.22.1", "torch": "2.11.0", "transformers": "5.17.0"}}
"""The pins of an engine's stack that are not constraints.txt's (the CPU orchestrator's): for vLLM the
stack its audit and the side-by-side runs were measured on (H200, 2026-12-04: vLLM 0.22.1, the torch its
release pins, 2.11.0, and transformers 5.17.0; `bench/results/h200-gpu-peer-text-2026-12-04.json`). The
engine's own pin (`VLLM_PIN`) must agree."""


def stack_lock(engine_kind: str = "hf") -> str:
    """The pip requirement pins of the stack a machine runs `engine_kind` ('hf', 'vllm', 'vllm-control'...) on."""
    name = STACK_LOCKS["vllm" if engine_kind.startswith("vllm") else "hf"]
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


def render_stack_locks(constraints: str) -> dict[str, str]:
    """Each stack lock's text from the project's constraints (`name==version` lines): the stack packages'
    pins, torch's on the HF stack, and the engine's own pins (`ENGINE_PINS`)."""
    pinned = {}
    for line in constraints.splitlines():
        name, sep, ver = line.strip().partition("==")
        if sep and not name.startswith(("-", "#")):
            pinned[name.lower()] = ver
    missing = [n for n in (*STACK_PACKAGES, "torch") if n not in pinned]
    if missing:
        raise ValueError(f"constraints.txt pins none of {missing}")
    out = {}
    for kind, name in STACK_LOCKS.items():
        pins = {n: pinned[n] for n in STACK_PACKAGES} | {"torch": pinned["torch"]} | ENGINE_PINS[kind]
        out[name] = "".join(f"{k}=={v}\n" for k, v in sorted(pins.items()))
    return out


def _safe_rel(path: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts:
        raise ValueError(f"artifact path {path!r} leaves its job folder")
    return p.as_posix()


@dataclass(frozen=True)
class StartedMachine:
    """A machine the provider created (or that a reconcile found), and the shell that reaches it: what a
    session holds from `start` (or adoption) until the machine is deleted."""

    machine: Machine
    shell: Shell


class MachineSession:
    """Owns one machine from create to confirmed deletion; see the module docstring."""

    def __init__(self, provider: Provider, *, campaign: str, ledger: CostLedger, policy: Policy | None = None,
                 label: str = "gpu", python: str = "python3", state_dir: Path | None = None,
                 stack: str | None = None, s3: S3Store | None = None, echo: Callable[[str], None] | None = None,
                 on_poll: Callable[[MachineSession, RemoteJob, int], None] | None = None,
                 machine: Machine | None = None, pip_args: str = "",
                 machine_credentials: Callable[[], dict[str, str]] | None = None, tools: Sequence[str] = ()):
        self.provider, self.campaign, self.ledger = provider, campaign, ledger
        self.tools = tuple(tools)
        """Executables the bootstrap checks on PATH (`required_tools`); a missing one fails it in one line."""
        self.policy = priced(policy or Policy(), provider, adopting=machine is not None)
        self.label, self.python_hint = label, python
        self.state_dir = Path(state_dir or ledger.path.parent)
        self.stack = stack if stack is not None else stack_lock("hf")
        self.s3, self.echo, self.on_poll = s3, echo or (lambda s: log.info("%s", s)), on_poll
        self._started = StartedMachine(machine, provider.shell(machine)) if machine is not None else None
        """None until `start` (a session given a `machine` adopts it: a reconcile)."""
        self.python = python
        self.code_dir = ""
        self.bin_dir = ""
        """The folder first on the jobs' PATH (`BootInfo.bin`); empty before the bootstrap."""
        self.outcomes: list[JobOutcome] = []
        self.teardown_record: TeardownRecord | None = None
        self.provenance_file: Path | None = None
        self.pip_args = pip_args
        self.machine_credentials = machine_credentials
        """Credentials for the watchdog's own uploads (scoped to the campaign's prefix); sent on stdin."""
        self.self_terminated: SelfTerminated | None = None

    @property
    def started(self) -> StartedMachine:
        """The machine and its shell; an error before `start`."""
        if self._started is None:
            raise InfraError(f"machine session of campaign {self.campaign}: no machine yet (call start() first)")
        return self._started

    @property
    def price_per_hour(self) -> float:
        """USD/hour this session's machine is billed at (`priced`)."""
        return self.policy.price_per_hour or 0.0

    @property
    def machine(self) -> Machine | None:
        """The machine, None before `start`."""
        return self._started.machine if self._started is not None else None

    # -- life ---------------------------------------------------------------------------------------
    def __enter__(self) -> MachineSession:
        if self._started is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        reason = "completed" if exc is None else f"{type(exc).__name__}: {str(exc)[:200]}"
        self.teardown(reason)

    def start(self) -> Machine:
        self.ledger.guard(self.campaign, self.policy.budget_usd, self.price_per_hour)
        machine = self.provider.create(self.campaign, self.label)
        self._started = StartedMachine(machine, self.provider.shell(machine))
        self.ledger.open(machine.id, self.campaign, self.provider.name, self.price_per_hour,
                         machine.created_at, host=machine.host)
        try:
            self._wait_reachable()
            self.bootstrap()
        except BaseException as e:
            self.teardown(f"bootstrap failed: {e}")
            raise
        return machine

    def _wait_reachable(self) -> None:
        shell = self.started.shell

        def probe() -> None:
            shell.run("true", timeout=30)

        retry(probe, self._backoff(attempts=None, deadline_s=self.policy.boot_timeout_s), retry_on=(ShellError,),
              what=f"reach {self.started.machine.id}")

    def _backoff(self, **kw: Any) -> Backoff:
        """`MACHINE_CALL` with this session's base (`Policy.backoff_s`) and `kw` replaced."""
        return replace(MACHINE_CALL, **{"base_s": self.policy.backoff_s, **kw})

    def bootstrap(self) -> BootInfo:
        """Upload the code bundle, the stack pins and the bootstrap script; run it (idempotent)."""
        m, sh = self.started.machine, self.started.shell
        code, sha = code_bundle(self.state_dir / "code")
        lock = self.state_dir / "code" / "stack.lock"
        lock.write_text(self.stack)
        sh.run(f"mkdir -p {shlex.quote(m.workdir)}")
        sh.put(code, f"{m.workdir}/{code.name}")
        sh.put(lock, f"{m.workdir}/stack.lock")
        sh.put(Path(__file__).with_name("bootstrap.sh"), f"{m.workdir}/bootstrap.sh")
        wd = shlex.quote(m.workdir)
        creds, poweroff = "", ""
        if self.policy.watchdog:
            cfg = self.state_dir / "watchdog" / f"{m.id}.json"
            write_json(cfg, self.watchdog_config().model_dump())
            sh.put(cfg, f"{m.workdir}/watchdog.json")
            creds = json.dumps(self.machine_credentials() if self.machine_credentials else {})
            if self.provider.self_shutdown == "poweroff":
                poweroff = f"JEX_POWEROFF_AFTER_S={int(self.policy.machine_ttl_s())} "
                if command := self._poweroff_command():
                    poweroff += f"JEX_POWEROFF_COMMAND={shlex.quote(command)} "
        tools = f"JEX_REQUIRED_TOOLS={shlex.quote(' '.join(self.tools))} " if self.tools else ""
        out = sh.run(f"{poweroff}{tools}JEX_PIP_ARGS={shlex.quote(self.pip_args)} bash {wd}/bootstrap.sh {wd} {sha} "
                     f"{shlex.quote(self.python_hint)}", timeout=self.policy.boot_timeout_s, input=creds + "\n")
        boot = BootInfo.model_validate_json(out.stdout.strip().splitlines()[-1])
        self.python, self.code_dir, self.bin_dir = boot.python, boot.code, boot.bin
        self.provenance_file = self.state_dir / "machines-provenance" / f"{m.id}.json"
        sh.get(f"{m.workdir}/provenance.json", self.provenance_file)
        self.echo(f"machine {m.id}: bootstrapped (stack {boot.stack}, code {sha[:12]})")
        return boot

    def _poweroff_command(self) -> str | None:
        """`Policy.poweroff_command` for this machine (`{id}` filled in), None for the default."""
        command = self.policy.poweroff_command.replace("{id}", shlex.quote(self.started.machine.id))
        return command or None

    def watchdog_config(self) -> WatchdogConfig:
        m, p = self.started.machine, self.policy
        s3 = self.s3
        return WatchdogConfig(
            machine=m.id, campaign=self.campaign, created_at=m.created_at, lease_s=p.lease_s,
            ttl_s=p.machine_ttl_s(), finish_grace_s=p.finish_grace_s, check_s=min(p.watchdog_check_s, p.lease_s / 3),
            shutdown=self.provider.self_shutdown, keeps_disk=self.provider.keeps_disk,
            poweroff_command=self._poweroff_command(),
            remove_dir=str(PurePosixPath(m.workdir).parent) if self.provider.self_shutdown == "host" else "",
            bucket=s3.bucket if s3 else None, prefix=s3.prefix if s3 else "jex",
            endpoint_url=s3.client.meta.endpoint_url if s3 else None,
            region=s3.client.meta.region_name if s3 else "us-east-1")

    def teardown(self, reason: str) -> TeardownRecord | None:
        """Delete the machine, retrying until the provider says it is gone; close its ledger entry.
        None when there was no machine; the first record again when it was torn down before."""
        if self._started is None or self.teardown_record is not None:
            return self.teardown_record
        m, t0 = self._started.machine, time.time()
        self._started.shell.close()
        attempts = 0

        def delete() -> None:
            nonlocal attempts
            attempts += 1
            self.provider.delete(m.id)
            if self.provider.describe(m.id) is not None:
                raise InfraError(f"provider still lists {m.id} after delete")

        try:  # any provider error is retried
            retry(delete, self._backoff(attempts=self.policy.teardown_attempts), what=f"teardown {m.id}")
        except Exception as e:
            raise InfraError(f"machine {m.id} could not be deleted after {attempts} attempts; "
                             "`jex infra reconcile` will retry") from e
        ended = time.time()
        if self.self_terminated is not None:  # the machine stopped itself (its watchdog); it cost until then
            reason = f"self-terminated: {self.self_terminated.reason}"
            ended = self.self_terminated.time or ended
        self.ledger.close(m.id, reason, ended)
        entry = self.ledger.get(m.id)
        self.teardown_record = TeardownRecord(machine=m.id, reason=reason, attempts=attempts,
                                              teardown_s=round(time.time() - t0, 3),
                                              life_s=round(entry.life_s(), 3) if entry else None,
                                              cost_usd=round(entry.cost(), 6) if entry else None)
        self.echo(f"machine {m.id}: deleted after {attempts} attempt(s) ({reason})")
        return self.teardown_record

    # -- jobs ---------------------------------------------------------------------------------------
    def run_dir(self, job: RemoteJob) -> str:
        return f"{self.started.machine.workdir}/jobs/{job.name}"

    def _py(self, args: str) -> str:
        """`args` for the machine's python, with the environment every job gets (`_env`)."""
        return f"{self._env()} {shlex.quote(self.python)} {args}"

    def _env(self) -> str:
        """`env ...` of what runs on the machine: the code bundle on PYTHONPATH and, first on PATH, the
        folder the bootstrap checked the engine's tools in (`BootInfo.bin`), so jobs find what it found."""
        path = f'PATH={shlex.quote(self.bin_dir)}:"$PATH" ' if self.bin_dir else ""
        return f"env {path}PYTHONPATH={self._pythonpath()}"

    def _pythonpath(self) -> str:
        """The code bundle first, then whatever the machine's environment already puts on the path."""
        return shlex.quote(self.code_dir) + '${PYTHONPATH:+:$PYTHONPATH}'

    def launch(self, job: RemoteJob) -> None:
        """Start the job detached under the worker protocol; a second call is a no-op."""
        m, sh, rd = self.started.machine, self.started.shell, self.run_dir(job)
        dirs = {str(PurePosixPath(rd) / PurePosixPath(_safe_rel(n)).parent) for n in job.files} | {rd}
        sh.run("mkdir -p " + " ".join(shlex.quote(d) for d in sorted(dirs)))
        for name, local in job.files.items():
            sh.put(local, f"{rd}/{_safe_rel(name)}")
        record = self.state_dir / "jobs" / f"{m.id}-{job.name}.json"
        write_json(record, JobRecord(name=job.name, campaign=self.campaign, machine=m.id,
                                     collect_to=str(job.collect_to), strip_prefix=job.strip_prefix,
                                     artifacts=job.artifacts, python=self.python, code=self.code_dir,
                                     heartbeat_timeout_s=self.policy.heartbeat_timeout_s).model_dump())
        sh.put(record, f"{rd}/job.json")
        cmd = " ".join(shlex.quote(a) for a in [self.python, *job.argv])
        globs = " ".join(shlex.quote(a) for a in job.artifacts)
        wrapper = self._py(f"-m jex.infra.worker_protocol {shlex.quote(rd)} --heartbeat {self.policy.heartbeat_s} "
                           f"--artifacts {globs} -- {self._env()} {cmd}")
        sh.run(f"cd {shlex.quote(rd)} && if [ -f worker.pgid ]; then exit 0; fi; "
               f"setsid nohup {wrapper} >/dev/null 2>&1 </dev/null & echo $! > {shlex.quote(rd)}/worker.pgid")
        self.echo(f"machine {m.id}: job {job.name} started")

    def read_text(self, rel: str) -> str | None:
        """A small text file under the machine's workdir, or None when it is absent or unreachable."""
        try:
            m, sh = self.started.machine, self.started.shell
            out = sh.run(f"cat {shlex.quote(m.workdir)}/{shlex.quote(_safe_rel(rel))} 2>/dev/null || true",
                         timeout=60)
        except ShellError:
            return None
        return out.stdout or None

    def status(self, job: RemoteJob) -> WorkerStatus:
        """One poll; it also renews the machine's lease (the watchdog's dead-man's switch)."""
        guard = f" --workdir {shlex.quote(self.started.machine.workdir)}" if self.policy.watchdog else ""
        status = self._py(f"-m jex.infra.worker_protocol status {shlex.quote(self.run_dir(job))}{guard}")
        out = self.started.shell.run(status, timeout=60)
        return WorkerStatus.model_validate_json(out.stdout)

    def run(self, job: RemoteJob, *, relaunch: bool = True) -> JobOutcome:
        """Launch (unless already running), supervise to the end, collect; raises JobFailed unless all is well."""
        if relaunch:
            self.launch(job)
        outcome = self.supervise(job)
        self.outcomes.append(outcome)
        if not outcome.ok:
            raise JobFailed(outcome)
        return outcome

    def supervise(self, job: RemoteJob) -> JobOutcome:
        """Poll the job until it ends, goes quiet, dies, runs out of budget or its machine stops itself."""
        p, t0 = self.policy, time.time()
        offset, polls, unreachable_since, dead_polls = 0, 0, None, 0
        tail: list[str] = []
        while True:
            polls += 1
            if self.on_poll:
                self.on_poll(self, job, polls)
            if (over := self._over_budget()) is not None:
                return self._salvage(job, "budget", over, t0, tail)
            try:
                st = self.status(job)
                offset = self._stream_log(job, offset, st.log_bytes, tail)
                unreachable_since = None
            except (ShellError, ValueError) as e:
                if (adopted := self._adopt(job, t0, tail)) is not None:  # it stopped itself, results in S3
                    return adopted
                unreachable_since = unreachable_since or time.time()
                if time.time() - unreachable_since > p.heartbeat_timeout_s:
                    return self._finish(job, "unreachable", f"machine unreachable for {p.heartbeat_timeout_s:.0f} s: "
                                        f"{e}", t0, tail, lost_all=True)
                time.sleep(self._poll_wait(polls))
                continue
            if st.gone or st.self_terminated:  # its watchdog stopped it while nobody polled
                return self._as_budget_stop(self._stopped_itself(job, st, t0, tail))
            if st.marker is not None:
                return self._as_budget_stop(self._collect(job, st.marker, t0, tail))
            if st.watchdog is False:
                return self._salvage(job, "watchdog_lost", "the machine's watchdog is not running (its dead-man's "
                                     "switch is gone); stopping the machine", t0, tail)
            beat = st.heartbeat.time if st.heartbeat else None
            if not st.alive:
                dead_polls += 1
                if dead_polls >= 2:  # twice: the marker may land between two polls
                    return self._salvage(job, "no_marker", "the worker exited without writing a marker", t0, tail)
            elif beat is not None and st.now - beat > p.heartbeat_timeout_s:
                return self._salvage(job, "heartbeat_lost",
                                     f"no heartbeat for {st.now - beat:.0f} s (timeout {p.heartbeat_timeout_s:.0f} s)",
                                     t0, tail)
            time.sleep(self._poll_wait(polls))

    def _poll_wait(self, polls: int) -> float:
        """The wait before the next poll of a job: FIRST_POLL_S doubling up to the policy's `poll_s`, so that a
        short job (a bootstrap, a teardown, a small stage) is seen to end within a fraction of a second and a
        long one is polled at `poll_s`."""
        return min(self.policy.poll_s, FIRST_POLL_S * 2 ** (polls - 1))

    def _over_budget(self) -> str | None:
        """Why the campaign's cost or this machine's wall-clock budget is spent, or None."""
        p = self.policy
        spent = self.ledger.total(self.campaign)
        if spent >= p.budget_usd:
            return f"cost budget reached: ${spent:.4f} of ${p.budget_usd:.4f}"
        if p.budget_hours is not None and time.time() - self.started.machine.created_at > p.budget_hours * 3600:
            return f"wall-clock budget of {p.budget_hours * 3600:.0f} s reached"
        return None

    def _as_budget_stop(self, outcome: JobOutcome) -> JobOutcome:
        """A job that ended badly once the budget was spent was stopped by the machine's own cost ceiling (its
        watchdog's time to live is the budget at the machine's price), whichever side noticed first."""
        if outcome.ok or (over := self._over_budget()) is None:
            return outcome
        return outcome.model_copy(update={"status": "budget", "reason": f"{over}; the machine stopped the job "
                                                                         f"itself ({outcome.reason})"})

    def _stopped_itself(self, job: RemoteJob, st: WorkerStatus, t0: float, tail: list[str]) -> JobOutcome:
        """The machine's watchdog stopped it: adopt its results from S3, else salvage them from its disk."""
        if (adopted := self._adopt(job, t0, tail)) is not None:
            return adopted
        if st.self_terminated:  # the upload failed: the artifacts are still on its disk
            self.self_terminated = self._local_marker()
            return self._salvage(job, "self_terminated", "the machine's watchdog stopped it and could not "
                                 "upload; salvaging from its disk", t0, tail)
        return self._finish(job, "unreachable", "the machine is gone and left no SELF_TERMINATED.json in "
                            "S3", t0, tail, lost_all=True)

    def _stream_log(self, job: RemoteJob, offset: int, size: int, tail: list[str]) -> int:
        if size <= offset:
            return offset
        chunk = self.started.shell.run(f"tail -c +{offset + 1} {shlex.quote(self.run_dir(job))}/run.log "
                                       "| head -c 65536", timeout=60).stdout
        for line in chunk.splitlines():
            self.echo(f"[{self.started.machine.id}/{job.name}] {line}")
        tail[:] = (tail + chunk.splitlines())[-40:]
        return offset + len(chunk.encode())

    def _outcome(self, job: RemoteJob, status: JobStatus, reason: str, t0: float, tail: list[str], *,
                 transfer: Transfer | None = None, lost: list[Lost] | None = None,
                 exit_code: int | None = None) -> JobOutcome:
        transfer = transfer or Transfer()
        return JobOutcome(job=job.name, machine=self.started.machine.id, status=status, reason=reason,
                          exit_code=exit_code, artifacts=transfer.artifacts, lost=[*(lost or []), *transfer.lost],
                          seconds=round(time.time() - t0, 3), log_tail="\n".join(tail))

    def _collect(self, job: RemoteJob, marker: Marker, t0: float, tail: list[str]) -> JobOutcome:
        status: JobStatus = "success" if marker.ok else "failed"
        reason = (marker.reason or "") if not marker.ok else ""
        if marker.ok and not marker.artifacts:
            status, reason = "invalid_marker", "SUCCESS marker lists no artifact"
        transfer = self._download(job, marker.artifacts)
        if status == "success" and transfer.lost:
            status, reason = "invalid_marker", "SUCCESS marker names artifacts the machine lacks"
        return self._outcome(job, status, reason, t0, tail, transfer=transfer, exit_code=marker.exit_code)

    def _salvage(self, job: RemoteJob, status: JobStatus, reason: str, t0: float, tail: list[str]) -> JobOutcome:
        """Stop the worker, then fetch whatever artifacts exist, with checksums computed on the machine."""
        m, sh = self.started.machine, self.started.shell
        self.echo(f"machine {m.id}: job {job.name}: {status}: {reason}; salvaging")
        rd = shlex.quote(self.run_dir(job))
        lost: list[Lost] = []
        try:
            sh.run(f"[ -f {rd}/worker.pgid ] && kill -KILL -- -$(cat {rd}/worker.pgid) 2>/dev/null; true")
            globs = " ".join(shlex.quote(a) for a in job.artifacts)
            manifest = self._py(f"-m jex.infra.worker_protocol manifest {rd} --artifacts {globs}")
            found = ARTIFACTS.validate_json(sh.run(manifest, timeout=600).stdout)
        except (ShellError, ValueError) as e:
            lost.append(Lost(path="*", reason=f"machine unreachable during salvage: {e}"))
            found = []
        return self._outcome(job, status, reason, t0, tail, transfer=self._download(job, found), lost=lost)

    def _local_marker(self) -> SelfTerminated:
        """The SELF_TERMINATED.json the watchdog left on the machine (its upload failed)."""
        try:
            return SelfTerminated.model_validate_json(self.read_text(MARKER) or "")
        except ValidationError as e:
            return SelfTerminated(reason=f"stopped itself (marker unreadable: {e})", machine=self.started.machine.id,
                                  campaign=self.campaign, time=time.time())

    def _adopt(self, job: RemoteJob, t0: float, tail: list[str]) -> JobOutcome | None:
        """When the machine's watchdog uploaded its results and stopped it: fetch them from S3 (verified)."""
        if self.s3 is None:
            return None
        m = self.started.machine
        doc = self_terminated_marker(self.s3, self.campaign, m.id, self.state_dir / "self-terminated" / f"{m.id}.json")
        if doc is None:
            return None
        self.self_terminated = doc
        self.echo(f"machine {m.id}: stopped itself ({doc.reason}); adopting its results from S3")
        entry = doc.jobs.get(job.name)
        reason = f"machine stopped itself: {doc.reason}"
        if entry is None:
            return self._outcome(job, "self_terminated", reason, t0, tail, lost=[
                Lost(path="*", reason="the machine's SELF_TERMINATED.json does not list this job")])
        transfer = adopt_artifacts(self.s3, entry, job.local_path)
        status: JobStatus = "adopted" if entry.status == "success" and not transfer.lost else "self_terminated"
        return self._outcome(job, status, reason, t0, tail, transfer=transfer)

    def _finish(self, job: RemoteJob, status: JobStatus, reason: str, t0: float, tail: list[str],
                lost_all: bool = False) -> JobOutcome:
        return self._outcome(job, status, reason, t0, tail, lost=[Lost(path="*", reason=reason)] if lost_all else [])

    def _fetch_verified(self, remote: str, local: Path, sha256: str) -> None:
        """Download `remote` to `local`, fetched once more when the bytes do not match `sha256`; only
        verified bytes ever carry the artifact's name."""
        part = local.with_name(f".{local.name}.download")

        def fetch() -> None:
            self.started.shell.get(remote, part)
            if sha256_file(part) != sha256:
                part.unlink(missing_ok=True)
                raise ChecksumMismatch("downloaded bytes do not match the marker's sha256")
            part.replace(local)

        retry(fetch, VERIFY_DOWNLOAD, retry_on=(ChecksumMismatch,), what=f"download {remote}")

    def _download(self, job: RemoteJob, artifacts: list[Artifact]) -> Transfer:
        """Fetch each artifact into the local store (sha256-verified), then upload it to S3 when there is one."""
        rd, got, lost = self.run_dir(job), [], []
        for art in artifacts:
            rel = _safe_rel(art.path)
            local = job.local_path(rel)
            try:
                if not (local.exists() and sha256_file(local) == art.sha256):
                    self._fetch_verified(f"{rd}/{rel}", local, art.sha256)
            except (FileNotFoundError, OSError, ShellError, ValueError) as e:
                reason = ("listed by the worker but absent on the machine" if isinstance(e, FileNotFoundError)
                          else str(e))
                lost.append(Lost(path=rel, reason=reason))
                continue
            s3_key = None
            if self.s3 is not None:
                try:
                    s3_key = self._upload(self.s3, local, job, rel)
                except Exception as e:  # noqa: BLE001 - recorded as lost from S3, the local copy stays
                    lost.append(Lost(path=rel, reason=f"S3 upload failed: {e}"))
            got.append(CollectedArtifact(path=rel, sha256=art.sha256, bytes=art.bytes, local=str(local),
                                         s3_key=s3_key))
        return Transfer(artifacts=got, lost=lost)

    def _upload(self, s3: S3Store, local: Path, job: RemoteJob, rel: str) -> str:
        """Upload under the campaign's prefix only, retrying with backoff; verified by sha256."""
        key = s3.key("campaigns", self.campaign, "machines", self.started.machine.id, job.name, rel)
        retry(lambda: s3.put_file(local, key), self._backoff(attempts=self.policy.upload_attempts),
              what=f"upload {key}")
        return key

    def record(self) -> MachineReport:
        """What this machine was, ran on, did and cost."""
        m = self.machine
        entry = self.ledger.get(m.id) if m else None
        prov = (MachineProvenance.model_validate_json(self.provenance_file.read_text())
                if self.provenance_file else None)
        return MachineReport(machine=m.model_dump() if m else None, provenance=prov, teardown=self.teardown_record,
                             jobs=list(self.outcomes), life_s=round(entry.life_s(), 3) if entry else None,
                             cost_usd=round(entry.cost(), 6) if entry else None)


def self_terminated_marker(s3: S3Store, campaign: str, machine_id: str, dest: Path) -> SelfTerminated | None:
    """The SELF_TERMINATED.json a machine's watchdog left in S3 (verified download), or None."""
    key = s3.key("campaigns", campaign, "machines", machine_id, MARKER)
    if s3.head(key) is None:
        return None
    s3.get_file(key, dest)
    return SelfTerminated.model_validate_json(dest.read_text())


def adopt_artifacts(s3: S3Store, entry: JobUpload, local_path: Callable[[str], Path]) -> Transfer:
    """Download the artifacts a watchdog uploaded (each checked against the sha256 it recorded); what
    it left on the machine's disk (its upload failed), or lost with it, is named as lost."""
    got, lost = [], []
    for art in entry.artifacts:
        rel = _safe_rel(art.path)
        local = local_path(rel)
        try:
            if not (local.exists() and sha256_file(local) == art.sha256):
                s3.get_file(art.s3_key, local)
                if sha256_file(local) != art.sha256:
                    local.unlink(missing_ok=True)
                    raise ChecksumMismatch("the object in S3 does not match the sha256 the machine recorded")
        except Exception as e:  # noqa: BLE001 - recorded as lost, never silently dropped
            lost.append(Lost(path=rel, reason=f"adoption from S3 failed: {e}"))
            continue
        got.append(CollectedArtifact(path=rel, sha256=art.sha256, bytes=art.bytes, local=str(local),
                                     s3_key=art.s3_key))
    lost += [Lost(path=art.path, reason="left on the machine's disk (its upload failed)")
             for art in entry.on_disk or []]
    return Transfer(artifacts=got, lost=[*lost, *entry.lost])
