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
import io
import json
import logging
import shlex
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path, PurePosixPath
from typing import Any

from jex.errors import InfraError
from jex.fileio import sha256_bytes, sha256_file, write_json
from jex.infra.ledger import Ledger
from jex.infra.providers import Machine, Provider
from jex.infra.retry import Backoff, retry
from jex.infra.shell import Shell, ShellError
from jex.infra.watchdog import MARKER, WatchdogConfig

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
CODE_PACKAGES = {"jex": "jex", "engine": "jex/engine", "tasks": "jex/tasks", "overlays": "jex/overlays",
                 "infra": "jex/infra"}
"""Repository folder -> its place in the code bundle: the installed `jex` namespace (pyproject.toml)."""
STACK_PACKAGES = ("transformers", "gguf", "accelerate", "safetensors", "numpy", "polars", "pyarrow", "pydantic",
                  "pydantic-settings", "typer", "boto3")
"""`boto3`: the machine's watchdog uploads its own artifacts when the orchestrator is gone."""


@dataclass
class Policy:
    poll_s: float = 2.0
    heartbeat_s: float = 5.0
    heartbeat_timeout_s: float = 60.0
    wall_budget_s: float | None = None
    budget_usd: float = 100.0
    price_per_hour: float = 3.5
    teardown_attempts: int = 12
    upload_attempts: int = 5
    backoff_s: float = 0.5
    boot_timeout_s: float = 600.0
    watchdog: bool = True
    """Start the machine-side dead-man's switch (`jex.infra.watchdog`) at bootstrap."""
    lease_s: float = 900.0
    """The machine stops itself after this long without a poll from the orchestrator."""
    ttl_s: float | None = None
    """Hard time to live of a machine; None: the wall budget, else the cost budget at the machine's price."""
    finish_grace_s: float = 0.0
    """After a lease expiry, how long a running job may go on before the watchdog stops it."""
    watchdog_check_s: float = 5.0

    def machine_ttl_s(self) -> float:
        """The hard time to live: worst case in money = this x `price_per_hour`."""
        if self.ttl_s:
            return self.ttl_s
        caps = [self.wall_budget_s or 0, self.budget_usd / self.price_per_hour * 3600 if self.price_per_hour else 0]
        caps = [c for c in caps if c > 0]
        return min(caps) if caps else 72 * 3600.0


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


@dataclass
class JobOutcome:
    job: str
    machine: str
    status: str
    """success | adopted (from S3, after the machine stopped itself) | failed | heartbeat_lost | no_marker |
    invalid_marker | budget | unreachable | watchdog_lost | self_terminated (stopped itself, incomplete)"""
    reason: str = ""
    exit_code: int | None = None
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("success", "adopted") and not self.lost


class JobFailed(InfraError):
    def __init__(self, outcome: JobOutcome):
        super().__init__(f"job {outcome.job} on {outcome.machine}: {outcome.status}: {outcome.reason}"
                         + (f"; lost {[x['path'] for x in outcome.lost]}" if outcome.lost else ""))
        self.outcome = outcome


def code_bundle(dest_dir: Path) -> tuple[Path, str]:
    """A byte-reproducible tar.gz of the packages a worker imports; returns (path, sha256)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for folder, place in CODE_PACKAGES.items():
            for path in sorted((ROOT / folder).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".sh", ".toml"):
                    arcname = f"{place}/{path.relative_to(ROOT / folder).as_posix()}"
                    info = tar.gettarinfo(str(path), arcname=arcname)
                    info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
    data = buf.getvalue()
    sha = sha256_bytes(data)
    out = dest_dir / f"code-{sha}.tar.gz"
    if not out.exists():
        dest_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(out)
    return out, sha


def stack_lock(extra: dict[str, str] | None = None, *, with_torch: bool = True) -> str:
    """Pins of the worker's runtime stack: this orchestrator's versions, plus `extra` (e.g. vllm)."""
    names = (("torch",) if with_torch else ()) + STACK_PACKAGES
    pins = {}
    for name in names:
        try:
            pins[name] = version(name)
        except PackageNotFoundError:
            continue
    pins.update(extra or {})
    return "".join(f"{k}=={v}\n" for k, v in sorted(pins.items()))


def _safe_rel(path: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts:
        raise ValueError(f"artifact path {path!r} leaves its job folder")
    return p.as_posix()


class MachineSession:
    """Owns one machine from create to confirmed deletion; see the module docstring."""

    def __init__(self, provider: Provider, *, campaign: str, ledger: Ledger, policy: Policy | None = None,
                 label: str = "gpu", python: str = "python3", state_dir: Path | None = None,
                 stack: str | None = None, s3: Any = None, echo: Callable[[str], None] | None = None,
                 on_poll: Callable[[MachineSession, RemoteJob, int], None] | None = None,
                 machine: Machine | None = None, pip_args: str = "",
                 machine_credentials: Callable[[], dict[str, str]] | None = None):
        self.provider, self.campaign, self.ledger = provider, campaign, ledger
        self.policy = policy or Policy()
        self.label, self.python_hint = label, python
        self.state_dir = Path(state_dir or ledger.path.parent)
        self.stack = stack if stack is not None else stack_lock()
        self.s3, self.echo, self.on_poll = s3, echo or (lambda s: log.info("%s", s)), on_poll
        self.machine: Machine | None = machine
        self.shell: Shell | None = provider.shell(machine) if machine else None
        self.python = python
        self.code_dir = ""
        self.outcomes: list[JobOutcome] = []
        self.teardown_record: dict[str, Any] | None = None
        self.provenance_file: Path | None = None
        self.pip_args = pip_args
        self.machine_credentials = machine_credentials
        """Credentials for the watchdog's own uploads (scoped to the campaign's prefix); sent on stdin."""
        self.self_terminated: dict[str, Any] | None = None

    # -- life ---------------------------------------------------------------------------------------
    def __enter__(self) -> MachineSession:
        if self.machine is None:
            self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        reason = "completed" if exc is None else f"{type(exc).__name__}: {str(exc)[:200]}"
        self.teardown(reason)

    def start(self) -> Machine:
        self.ledger.guard(self.campaign, self.policy.budget_usd)
        self.machine = self.provider.create(self.campaign, self.label)
        self.ledger.open(self.machine.id, self.campaign, self.provider.name, self.policy.price_per_hour,
                         self.machine.created_at, host=self.machine.host)
        try:
            self.shell = self._wait_reachable()
            self.bootstrap()
        except BaseException as e:
            self.teardown(f"bootstrap failed: {e}")
            raise
        return self.machine

    def _wait_reachable(self) -> Shell:
        def probe() -> Shell:
            shell = self.provider.shell(self.machine)
            shell.run("true", timeout=30)
            return shell

        return retry(probe, self._backoff(attempts=None, deadline_s=self.policy.boot_timeout_s),
                     retry_on=(ShellError,), what=f"reach {self.machine.id}")

    def _backoff(self, **kw: Any) -> Backoff:
        return Backoff(**{"attempts": 5, "base_s": self.policy.backoff_s, "cap_s": 10.0, **kw})

    def bootstrap(self) -> dict[str, Any]:
        """Upload the code bundle, the stack pins and the bootstrap script; run it (idempotent)."""
        m, sh = self.machine, self.shell
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
            write_json(cfg, asdict(self.watchdog_config()))
            sh.put(cfg, f"{m.workdir}/watchdog.json")
            creds = json.dumps(self.machine_credentials() if self.machine_credentials else {})
            if self.provider.self_shutdown == "poweroff":
                poweroff = f"JEX_POWEROFF_AFTER_S={int(self.policy.machine_ttl_s())} "
        out = sh.run(f"{poweroff}JEX_PIP_ARGS={shlex.quote(self.pip_args)} bash {wd}/bootstrap.sh {wd} {sha} "
                     f"{shlex.quote(self.python_hint)}", timeout=self.policy.boot_timeout_s, input=creds + "\n")
        boot = json.loads(out.stdout.strip().splitlines()[-1])
        self.python, self.code_dir = boot["python"], boot["code"]
        self.provenance_file = self.state_dir / "machines-provenance" / f"{m.id}.json"
        sh.get(f"{m.workdir}/provenance.json", self.provenance_file)
        self.echo(f"machine {m.id}: bootstrapped (stack {boot['stack']}, code {sha[:12]})")
        return boot

    def watchdog_config(self) -> WatchdogConfig:
        m, p = self.machine, self.policy
        s3 = self.s3
        return WatchdogConfig(
            machine=m.id, campaign=self.campaign, created_at=m.created_at, lease_s=p.lease_s,
            ttl_s=p.machine_ttl_s(), finish_grace_s=p.finish_grace_s, check_s=min(p.watchdog_check_s, p.lease_s / 3),
            shutdown=self.provider.self_shutdown,
            remove_dir=str(PurePosixPath(m.workdir).parent) if self.provider.self_shutdown == "host" else "",
            bucket=s3.bucket if s3 else None, prefix=s3.prefix if s3 else "jex",
            endpoint_url=s3.client.meta.endpoint_url if s3 else None,
            region=s3.client.meta.region_name if s3 else "us-east-1")

    def teardown(self, reason: str) -> dict[str, Any]:
        """Delete the machine, retrying until the provider says it is gone; close its ledger entry."""
        if self.machine is None or self.teardown_record is not None:
            return self.teardown_record or {}
        m, t0 = self.machine, time.time()
        if self.shell is not None:
            self.shell.close()
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
            reason = f"self-terminated: {self.self_terminated.get('reason', '')}"
            ended = float(self.self_terminated.get("time") or ended)
        self.ledger.close(m.id, reason, ended)
        entry = self.ledger.get(m.id)
        self.teardown_record = {"machine": m.id, "reason": reason, "attempts": attempts,
                                "teardown_s": round(time.time() - t0, 3),
                                "life_s": round(entry.seconds(), 3) if entry else None,
                                "cost_usd": round(entry.cost(), 6) if entry else None}
        self.echo(f"machine {m.id}: deleted after {attempts} attempt(s) ({reason})")
        return self.teardown_record

    # -- jobs ---------------------------------------------------------------------------------------
    def run_dir(self, job: RemoteJob) -> str:
        return f"{self.machine.workdir}/jobs/{job.name}"

    def _py(self, args: str) -> str:
        return f"env PYTHONPATH={self._pythonpath()} {shlex.quote(self.python)} {args}"

    def _pythonpath(self) -> str:
        """The code bundle first, then whatever the machine's environment already puts on the path."""
        return shlex.quote(self.code_dir) + '${PYTHONPATH:+:$PYTHONPATH}'

    def launch(self, job: RemoteJob) -> None:
        """Start the job detached under the worker protocol; a second call is a no-op."""
        rd, sh = self.run_dir(job), self.shell
        dirs = {str(PurePosixPath(rd) / PurePosixPath(_safe_rel(n)).parent) for n in job.files} | {rd}
        sh.run("mkdir -p " + " ".join(shlex.quote(d) for d in sorted(dirs)))
        for name, local in job.files.items():
            sh.put(local, f"{rd}/{_safe_rel(name)}")
        record = self.state_dir / "jobs" / f"{self.machine.id}-{job.name}.json"
        write_json(record, {"name": job.name, "campaign": self.campaign, "machine": self.machine.id,
                            "collect_to": str(job.collect_to), "strip_prefix": job.strip_prefix,
                            "artifacts": job.artifacts, "python": self.python,
                            "code": self.code_dir, "heartbeat_timeout_s": self.policy.heartbeat_timeout_s})
        sh.put(record, f"{rd}/job.json")
        cmd = " ".join(shlex.quote(a) for a in [self.python, *job.argv])
        globs = " ".join(shlex.quote(a) for a in job.artifacts)
        wrapper = self._py(f"-m jex.infra.worker_protocol {shlex.quote(rd)} --heartbeat {self.policy.heartbeat_s} "
                           f"--artifacts {globs} -- env PYTHONPATH={self._pythonpath()} {cmd}")
        sh.run(f"cd {shlex.quote(rd)} && if [ -f worker.pgid ]; then exit 0; fi; "
               f"setsid nohup {wrapper} >/dev/null 2>&1 </dev/null & echo $! > {shlex.quote(rd)}/worker.pgid")
        self.echo(f"machine {self.machine.id}: job {job.name} started")

    def read_text(self, rel: str) -> str | None:
        """A small text file under the machine's workdir, or None when it is absent or unreachable."""
        try:
            out = self.shell.run(f"cat {shlex.quote(self.machine.workdir)}/{shlex.quote(_safe_rel(rel))} 2>/dev/null "
                                 "|| true", timeout=60)
        except ShellError:
            return None
        return out.stdout or None

    def status(self, job: RemoteJob) -> dict[str, Any]:
        """One poll; it also renews the machine's lease (the watchdog's dead-man's switch)."""
        guard = f" --workdir {shlex.quote(self.machine.workdir)}" if self.policy.watchdog else ""
        out = self.shell.run(self._py(f"-m jex.infra.worker_protocol status {shlex.quote(self.run_dir(job))}{guard}"),
                             timeout=60)
        return json.loads(out.stdout)

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
        p, t0 = self.policy, time.time()
        offset, polls, unreachable_since, dead_polls = 0, 0, None, 0
        tail: list[str] = []
        while True:
            polls += 1
            if self.on_poll:
                self.on_poll(self, job, polls)
            spent = self.ledger.total(self.campaign)
            if spent >= p.budget_usd:
                return self._salvage(job, "budget", f"cost budget reached: ${spent:.4f} of ${p.budget_usd:.4f}",
                                     t0, tail)
            if p.wall_budget_s is not None and time.time() - self.machine.created_at > p.wall_budget_s:
                return self._salvage(job, "budget", f"wall-clock budget of {p.wall_budget_s:.0f} s reached", t0, tail)
            try:
                st = self.status(job)
                offset = self._stream_log(job, offset, st["log_bytes"], tail)
                unreachable_since = None
            except (ShellError, ValueError) as e:
                if (adopted := self._adopt(job, t0, tail)) is not None:  # it stopped itself, results in S3
                    return adopted
                unreachable_since = unreachable_since or time.time()
                if time.time() - unreachable_since > p.heartbeat_timeout_s:
                    return self._finish(job, "unreachable", f"machine unreachable for {p.heartbeat_timeout_s:.0f} s: "
                                        f"{e}", t0, tail, lost_all=True)
                time.sleep(p.poll_s)
                continue
            if st.get("gone") or st.get("self_terminated"):  # its watchdog stopped it while nobody polled
                if (adopted := self._adopt(job, t0, tail)) is not None:
                    return adopted
                if st.get("self_terminated"):  # the upload failed: the artifacts are still on its disk
                    self.self_terminated = self._local_marker()
                    return self._salvage(job, "self_terminated", "the machine's watchdog stopped it and could not "
                                         "upload; salvaging from its disk", t0, tail)
                return self._finish(job, "unreachable", "the machine is gone and left no SELF_TERMINATED.json in "
                                    "S3", t0, tail, lost_all=True)
            if st["marker"] is not None:
                return self._collect(job, st["marker"], t0, tail)
            if st.get("watchdog") is False:
                return self._salvage(job, "watchdog_lost", "the machine's watchdog is not running (its dead-man's "
                                     "switch is gone); stopping the machine", t0, tail)
            beat = (st["heartbeat"] or {}).get("time")
            if not st["alive"]:
                dead_polls += 1
                if dead_polls >= 2:  # twice: the marker may land between two polls
                    return self._salvage(job, "no_marker", "the worker exited without writing a marker", t0, tail)
            elif beat is not None and st["now"] - beat > p.heartbeat_timeout_s:
                return self._salvage(job, "heartbeat_lost",
                                     f"no heartbeat for {st['now'] - beat:.0f} s "
                                     f"(timeout {p.heartbeat_timeout_s:.0f} s)",
                                     t0, tail)
            time.sleep(p.poll_s)

    def _stream_log(self, job: RemoteJob, offset: int, size: int, tail: list[str]) -> int:
        if size <= offset:
            return offset
        chunk = self.shell.run(f"tail -c +{offset + 1} {shlex.quote(self.run_dir(job))}/run.log | head -c 65536",
                               timeout=60).stdout
        for line in chunk.splitlines():
            self.echo(f"[{self.machine.id}/{job.name}] {line}")
        tail[:] = (tail + chunk.splitlines())[-40:]
        return offset + len(chunk.encode())

    def _collect(self, job: RemoteJob, marker: dict[str, Any], t0: float, tail: list[str]) -> JobOutcome:
        status = "success" if marker["ok"] else "failed"
        reason = marker.get("reason", "") if not marker["ok"] else ""
        if marker["ok"] and not marker.get("artifacts"):
            status, reason = "invalid_marker", "SUCCESS marker lists no artifact"
        outcome = JobOutcome(job.name, self.machine.id, status, reason, marker.get("exit_code"),
                             log_tail="\n".join(tail))
        self._download(job, marker.get("artifacts", []), outcome)
        if status == "success" and outcome.lost:
            outcome.status, outcome.reason = "invalid_marker", "SUCCESS marker names artifacts the machine lacks"
        outcome.seconds = round(time.time() - t0, 3)
        return outcome

    def _salvage(self, job: RemoteJob, status: str, reason: str, t0: float, tail: list[str]) -> JobOutcome:
        """Stop the worker, then fetch whatever artifacts exist, with checksums computed on the machine."""
        self.echo(f"machine {self.machine.id}: job {job.name}: {status}: {reason}; salvaging")
        rd = shlex.quote(self.run_dir(job))
        outcome = JobOutcome(job.name, self.machine.id, status, reason, log_tail="\n".join(tail))
        try:
            self.shell.run(f"[ -f {rd}/worker.pgid ] && kill -KILL -- -$(cat {rd}/worker.pgid) 2>/dev/null; true")
            globs = " ".join(shlex.quote(a) for a in job.artifacts)
            manifest = self._py(f"-m jex.infra.worker_protocol manifest {rd} --artifacts {globs}")
            found = json.loads(self.shell.run(manifest, timeout=600).stdout)
        except (ShellError, ValueError) as e:
            outcome.lost.append({"path": "*", "reason": f"machine unreachable during salvage: {e}"})
            found = []
        self._download(job, found, outcome)
        outcome.seconds = round(time.time() - t0, 3)
        return outcome

    def _local_marker(self) -> dict[str, Any]:
        """The SELF_TERMINATED.json the watchdog left on the machine (its upload failed)."""
        try:
            return json.loads(self.read_text(MARKER) or "")
        except ValueError as e:
            return {"reason": f"stopped itself (marker unreadable: {e})", "time": time.time()}

    def _adopt(self, job: RemoteJob, t0: float, tail: list[str]) -> JobOutcome | None:
        """When the machine's watchdog uploaded its results and stopped it: fetch them from S3 (verified)."""
        if self.s3 is None:
            return None
        doc = self_terminated_marker(self.s3, self.campaign, self.machine.id,
                                     self.state_dir / "self-terminated" / f"{self.machine.id}.json")
        if doc is None:
            return None
        self.self_terminated = doc
        self.echo(f"machine {self.machine.id}: stopped itself ({doc.get('reason')}); adopting its results from S3")
        entry = (doc.get("jobs") or {}).get(job.name)
        outcome = JobOutcome(job.name, self.machine.id, "self_terminated",
                             f"machine stopped itself: {doc.get('reason')}", log_tail="\n".join(tail))
        if entry is None:
            outcome.lost.append({"path": "*", "reason": "the machine's SELF_TERMINATED.json does not list this job"})
        else:
            adopt_artifacts(self.s3, entry, job.local_path, outcome)
            if entry.get("status") == "success" and not outcome.lost:
                outcome.status = "adopted"
        outcome.seconds = round(time.time() - t0, 3)
        return outcome

    def _finish(self, job: RemoteJob, status: str, reason: str, t0: float, tail: list[str],
                lost_all: bool = False) -> JobOutcome:
        outcome = JobOutcome(job.name, self.machine.id, status, reason, log_tail="\n".join(tail),
                             seconds=round(time.time() - t0, 3))
        if lost_all:
            outcome.lost.append({"path": "*", "reason": reason})
        return outcome

    def _download(self, job: RemoteJob, artifacts: list[dict[str, Any]], outcome: JobOutcome) -> None:
        rd = self.run_dir(job)
        for art in artifacts:
            rel = _safe_rel(art["path"])
            local = job.local_path(rel)
            try:
                if not (local.exists() and sha256_file(local) == art["sha256"]):
                    part = local.with_name(f".{local.name}.download")
                    for attempt in (1, 2):
                        self.shell.get(f"{rd}/{rel}", part)
                        if sha256_file(part) == art["sha256"]:
                            part.replace(local)  # only verified bytes ever carry the artifact's name
                            break
                        part.unlink(missing_ok=True)
                        if attempt == 2:
                            raise ValueError("downloaded bytes do not match the marker's sha256")
            except (FileNotFoundError, OSError, ShellError, ValueError) as e:
                reason = ("listed by the worker but absent on the machine" if isinstance(e, FileNotFoundError)
                          else str(e))
                outcome.lost.append({"path": rel, "reason": reason})
                continue
            rec = {"path": rel, "sha256": art["sha256"], "bytes": art["bytes"], "local": str(local)}
            if self.s3 is not None:
                try:
                    rec["s3_key"] = self._upload(local, job, rel)
                except Exception as e:  # noqa: BLE001 - recorded as lost from S3, the local copy stays
                    outcome.lost.append({"path": rel, "reason": f"S3 upload failed: {e}"})
            outcome.artifacts.append(rec)

    def _upload(self, local: Path, job: RemoteJob, rel: str) -> str:
        """Upload under the campaign's prefix only, retrying with backoff; verified by sha256."""
        key = self.s3.key("campaigns", self.campaign, "machines", self.machine.id, job.name, rel)
        retry(lambda: self.s3.put_file(local, key), self._backoff(attempts=self.policy.upload_attempts),
              what=f"upload {key}")
        return key

    def report(self) -> dict[str, Any]:
        m = self.machine
        entry = self.ledger.get(m.id) if m else None
        prov = json.loads(self.provenance_file.read_text()) if self.provenance_file else None
        return {"machine": asdict(m) if m else None, "provenance": prov, "teardown": self.teardown_record,
                "jobs": [asdict(o) for o in self.outcomes],
                "life_s": round(entry.seconds(), 3) if entry else None,
                "cost_usd": round(entry.cost(), 6) if entry else None}



def self_terminated_marker(s3: Any, campaign: str, machine_id: str, dest: Path) -> dict[str, Any] | None:
    """The SELF_TERMINATED.json a machine's watchdog left in S3 (verified download), or None."""
    key = s3.key("campaigns", campaign, "machines", machine_id, MARKER)
    if s3.head(key) is None:
        return None
    s3.get_file(key, dest)
    return json.loads(dest.read_text())


def adopt_artifacts(s3: Any, entry: dict[str, Any], local_path: Callable[[str], Path], outcome: JobOutcome) -> None:
    """Download the artifacts a watchdog uploaded (each checked against the sha256 it recorded)."""
    for art in entry.get("artifacts", []):
        rel = _safe_rel(art["path"])
        local = local_path(rel)
        try:
            if not (local.exists() and sha256_file(local) == art["sha256"]):
                s3.get_file(art["s3_key"], local)
                if sha256_file(local) != art["sha256"]:
                    local.unlink(missing_ok=True)
                    raise ValueError("the object in S3 does not match the sha256 the machine recorded")
        except Exception as e:  # noqa: BLE001 - recorded as lost, never silently dropped
            outcome.lost.append({"path": rel, "reason": f"adoption from S3 failed: {e}"})
            continue
        outcome.artifacts.append({"path": rel, "sha256": art["sha256"], "bytes": art["bytes"], "local": str(local),
                                  "s3_key": art["s3_key"]})
    for art in entry.get("on_disk", []):
        outcome.lost.append({"path": art["path"], "reason": "left on the machine's disk (its upload failed)"})
