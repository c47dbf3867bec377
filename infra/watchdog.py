"""The machine-side dead-man's switch: no machine outlives its orchestrator by more than a lease.

Started detached by the bootstrap (`setsid nohup python -m jex.infra.watchdog WORKDIR`), it reads
`WORKDIR/watchdog.json` (lease, hard time to live, where to upload; no secret) and one line of
credentials from stdin (kept in memory only). The orchestrator touches `WORKDIR/lease` on every
poll. When the lease is older than `lease_s`, or the machine reached its hard time to live, the
watchdog:

1. lets a running job finish for `finish_grace_s` (lease expiry only), then stops it (its process group);
2. uploads every job's artifacts to S3 with their sha256, in the orchestrator's layout
   (`PREFIX/campaigns/<campaign>/machines/<machine>/<job>/<path>`), retrying until the hard time to live;
   a machine whose provider does not keep its disk after power-off (`keeps_disk` false: EC2, most command
   clouds) and that has no bucket waits there instead, up and billing, so an orchestrator or `reconcile`
   can still collect its results from its disk: it never powers off with results only on a disk that goes;
3. writes `SELF_TERMINATED.json` beside them (what it uploaded, what stays on the disk or, at the hard time
   to live on a machine that does not keep it, what is lost, and why), and a local copy;
4. shuts the machine down: `poweroff` (cloud machines, which terminate on shutdown) or, for a lease on
   a host, kills the machine's processes and removes its folder. When the upload failed the folder
   is kept, so `reconcile` can salvage the artifacts from disk.

The worst case in money is therefore the hard time to live times the machine's price: it is the cost
ceiling (`Policy.machine_ttl_s`: the wall budget, capped by the cost budget at the machine's price),
and nothing, a failing upload included, keeps a machine up past it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from jex.fileio import write_json
from jex.infra.backoff import retry, until_deadline, wait_until
from jex.infra.records import (
    Artifact,
    JobEnd,
    JobRecord,
    JobUpload,
    Lost,
    Record,
    SelfTerminated,
    UploadedArtifact,
)
from jex.infra.worker_protocol import DETACHED_PGIDS, PGID, alive_group, artifact_manifest, read_marker

if TYPE_CHECKING:
    from jex.infra.s3 import S3Store

log = logging.getLogger(__name__)
CONFIG, LEASE, PIDFILE, MARKER = "watchdog.json", "lease", "watchdog.pid", "SELF_TERMINATED.json"


class WatchdogConfig(Record):
    """What the orchestrator tells a machine's watchdog at bootstrap (no secrets: those come on stdin)."""

    machine: str
    campaign: str
    created_at: float
    lease_s: float = 900.0
    """The orchestrator renews the lease on every poll; this long without it, the machine stops."""
    ttl_s: float = 72 * 3600.0
    """Hard time to live from `created_at`: the machine is down by then, whatever happens."""
    finish_grace_s: float = 0.0
    """After a lease expiry, how long a running job may go on to finish before it is stopped."""
    check_s: float = 5.0
    shutdown: str = "host"
    """host: kill the machine's processes and remove `remove_dir` | poweroff: power the machine off."""
    keeps_disk: bool = True
    """The provider keeps the machine's disk after it powers off (`Provider.keeps_disk`). When it does not,
    results that did not reach S3 keep the machine up until the hard time to live, then are named lost."""
    poweroff_command: str | None = None
    """poweroff: the shell command that powers the machine off, run in its workdir; None: `shutdown -h now`."""
    remove_dir: str = ""
    bucket: str | None = None
    prefix: str = "jex"
    endpoint_url: str | None = None
    region: str = "us-east-1"
    upload_attempt_s: float = 5.0
    """Connect/read timeout of one S3 call, so a dead endpoint cannot hold the machine past its TTL."""

    @property
    def deadline(self) -> float:
        return self.created_at + self.ttl_s


class JobOnDisk(BaseModel):
    """A job as the watchdog finds it in its run folder: its record, how it ended, its artifacts."""

    model_config = ConfigDict(frozen=True)
    run_dir: Path
    record: JobRecord
    status: JobEnd
    artifacts: list[Artifact]


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return False
    except OSError:
        return True


def _job_ended(rd: Path) -> bool:
    return alive_group(rd / PGID) is None or read_marker(rd) is not None


def _stop_group(pgid: int, grace: float = 3.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it outlives `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except OSError:
            return
        if wait_until(lambda: _group_gone(pgid), timeout_s=grace, every_s=0.1):
            return


class Watchdog:
    def __init__(self, workdir: Path, cfg: WatchdogConfig, credentials: dict[str, str] | None = None):
        self.workdir, self.cfg, self.credentials = workdir, cfg, credentials or {}

    def lease_age(self, now: float) -> float:
        try:
            return now - (self.workdir / LEASE).stat().st_mtime
        except OSError:
            return now - self.cfg.created_at

    def due(self, now: float) -> str | None:
        """Why the machine must stop now, or None."""
        if now >= self.cfg.deadline:
            return f"hard time to live of {self.cfg.ttl_s:.0f} s reached"
        age = self.lease_age(now)
        if age > self.cfg.lease_s:
            return f"lease expired: no orchestrator for {age:.0f} s (lease {self.cfg.lease_s:.0f} s)"
        return None

    def run(self) -> SelfTerminated | None:
        """Watch until the lease or the time to live runs out (then stop the machine), or the machine is gone."""
        while True:
            if not (self.workdir / CONFIG).exists():  # the orchestrator deleted the machine: nothing to guard
                return None
            reason = self.due(time.time())
            if reason:
                return self.expire(reason)
            time.sleep(self.cfg.check_s)

    def jobs(self) -> list[Path]:
        return sorted(p.parent for p in (self.workdir / "jobs").glob("*/job.json"))

    def stop_detached(self) -> None:
        """Stop the process groups that outlive single jobs (`DETACHED_PGIDS`: engine hosts)."""
        for pid_file in sorted(self.workdir.glob(DETACHED_PGIDS)):
            if (pgid := alive_group(pid_file)) is not None:
                _stop_group(pgid, grace=1.0)

    def expire(self, reason: str) -> SelfTerminated:
        """Stop the jobs (after the grace on a lease expiry), upload what they left, write the marker, shut down."""
        log.warning("watchdog %s: %s", self.cfg.machine, reason)
        hard = time.time() >= self.cfg.deadline
        base = SelfTerminated(reason=reason, machine=self.cfg.machine, campaign=self.cfg.campaign, time=time.time(),
                              created_at=self.cfg.created_at)
        grace_end = time.time() + (0 if hard else self.cfg.finish_grace_s)
        for rd in self.jobs():  # let running jobs finish within the grace, then stop them
            wait_until(partial(_job_ended, rd), timeout_s=grace_end - time.time(), every_s=0.2)
            if (pgid := alive_group(rd / PGID)) is not None:
                _stop_group(pgid)
        self.stop_detached()  # engine hosts: no shard may land while the manifests are read
        jobs = [self._on_disk(rd) for rd in self.jobs()]
        if not self.cfg.bucket and not self.cfg.keeps_disk and any(job.artifacts for job in jobs) \
                and not self._hold(jobs):
            return base  # the machine was deleted while it waited: its results were collected from its disk
        out = self._upload_all(jobs, base).model_copy(update={"time": time.time()})  # it costs until now
        for error in out.errors:
            log.error("watchdog %s: %s", self.cfg.machine, error)
        write_json(self.workdir / MARKER, out.model_dump())
        self.shutdown(out)
        return out

    def _hold(self, jobs: list[JobOnDisk]) -> bool:
        """No bucket, and a disk the provider drops at power-off: stay up (billing) until the hard time to
        live, the cost ceiling, so an orchestrator that comes back or `reconcile` collects the results from
        this disk. False when the machine was deleted meanwhile (its `watchdog.json` is gone)."""
        files = sum(len(job.artifacts) for job in jobs)
        log.error("watchdog %s: no bucket configured and the provider does not keep this machine's disk: staying "
                  "up until the hard time to live (%.0f s from now) so %d artifact(s) can be collected from its "
                  "disk (jex infra reconcile); set JEX_STORE__S3_BUCKET", self.cfg.machine,
                  self.cfg.deadline - time.time(), files)
        while time.time() < self.cfg.deadline:
            if not (self.workdir / CONFIG).exists():
                return False
            time.sleep(max(0.0, min(self.cfg.check_s, self.cfg.deadline - time.time())))
        return True

    def _on_disk(self, rd: Path) -> JobOnDisk:
        record = JobRecord.model_validate_json((rd / "job.json").read_text())
        marker = read_marker(rd)
        if marker is not None and marker.ok:
            return JobOnDisk(run_dir=rd, record=record, status="success", artifacts=marker.artifacts)
        return JobOnDisk(run_dir=rd, record=record, status="failed" if marker else "stopped",
                         artifacts=artifact_manifest(rd, record.artifacts))

    def _store(self) -> S3Store:
        """An S3 client that gives up quickly (a dead endpoint must not hold the machine past its TTL)."""
        from jex.infra.aws import aws_client
        from jex.infra.s3 import S3Store

        client = aws_client("s3", region=self.cfg.region, endpoint_url=self.cfg.endpoint_url,
                            credentials=self.credentials, max_attempts=2, timeout_s=self.cfg.upload_attempt_s)
        return S3Store(self.cfg.bucket or "", self.cfg.prefix, client)

    def _upload_job(self, s3: S3Store, job: JobOnDisk) -> JobUpload:
        name = job.record.name
        uploaded = []
        for art in job.artifacts:
            key = s3.key("campaigns", self.cfg.campaign, "machines", self.cfg.machine, name, art.path)
            s3.put_file(job.run_dir / art.path, key)
            uploaded.append(UploadedArtifact(**art.model_dump(), s3_key=key))
        return JobUpload(status=job.status, record=job.record, artifacts=uploaded)

    def _upload_all(self, jobs: list[JobOnDisk], base: SelfTerminated) -> SelfTerminated:
        """Every artifact, then the marker, to S3; retried (with jitter) until the hard time to live.
        Returns the marker as uploaded, or (upload failed) naming what stays on the disk or is lost with it."""
        if not self.cfg.bucket:
            return self._not_uploaded(jobs, base, {}, "no bucket configured")
        done: dict[str, JobUpload] = {}

        def attempt() -> SelfTerminated:
            s3 = self._store()
            for job in jobs:
                done[job.record.name] = self._upload_job(s3, job)
            doc = base.model_copy(update={"jobs": dict(done), "uploaded": True, "time": time.time()})
            tmp = self.workdir / f".{MARKER}.upload"
            write_json(tmp, doc.model_dump())
            s3.put_file(tmp, s3.key("campaigns", self.cfg.campaign, "machines", self.cfg.machine, MARKER))
            tmp.unlink(missing_ok=True)
            return doc

        try:
            return retry(attempt, until_deadline(self.cfg.deadline - time.time()),
                         what=f"watchdog upload {self.cfg.machine}")
        except Exception as e:  # noqa: BLE001 - whatever S3 says, the machine still stops at its TTL
            return self._not_uploaded(jobs, base, done, f"upload failed until the hard time to live: "
                                      f"{type(e).__name__}: {str(e)[:300]}")

    def _not_uploaded(self, jobs: list[JobOnDisk], base: SelfTerminated, done: dict[str, JobUpload],
                      why: str) -> SelfTerminated:
        """The marker of results that did not all reach S3 (`done`: the jobs that did): the others stay on
        the disk (`on_disk`, for `reconcile`), or, on a machine whose provider drops its disk, are lost."""
        names: list[str] = []
        for job in jobs:
            if job.record.name in done:
                continue
            if self.cfg.keeps_disk:
                done[job.record.name] = JobUpload(status=job.status, record=job.record, on_disk=job.artifacts)
                continue
            gone = f"the machine powered off without it reaching S3 ({why}); its provider does not keep its disk"
            done[job.record.name] = JobUpload(status=job.status, record=job.record,
                                              lost=[Lost(path=a.path, reason=gone) for a in job.artifacts])
            names += [f"{job.record.name}/{a.path}" for a in job.artifacts]
        if self.cfg.keeps_disk:
            return base.model_copy(update={"jobs": done, "errors": [f"{why}: artifacts stay on the machine's disk"]})
        lost = f"lost with the machine's disk: {', '.join(names[:20])}" + (" ..." if len(names) > 20 else "") \
            if names else "nothing was left to lose"
        return base.model_copy(update={"jobs": done, "errors": [f"{why}: {lost}"]})

    def shutdown(self, out: SelfTerminated) -> None:
        """Power off, or end the host lease: kill its jobs; remove its folder unless artifacts remain only there."""
        log.warning("watchdog %s: shutting down (%s)", self.cfg.machine, self.cfg.shutdown)
        if self.cfg.shutdown == "poweroff":
            commands = ([["sh", "-c", self.cfg.poweroff_command]] if self.cfg.poweroff_command else
                        [["sudo", "-n", "shutdown", "-h", "now"], ["shutdown", "-h", "now"], ["poweroff"]])
            for cmd in commands:
                try:
                    if subprocess.run(cmd, capture_output=True, timeout=30, cwd=self.workdir).returncode == 0:
                        return
                except (OSError, subprocess.TimeoutExpired):
                    continue
            return
        for rd in self.jobs():
            if (pgid := alive_group(rd / PGID)) is not None:
                _stop_group(pgid, grace=1.0)
        self.stop_detached()
        if out.uploaded and self.cfg.remove_dir:
            shutil.rmtree(self.cfg.remove_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    workdir = Path(argv[0]).resolve()
    cfg = WatchdogConfig.model_validate_json((workdir / CONFIG).read_text())
    line = sys.stdin.readline() if not sys.stdin.isatty() else ""
    credentials = json.loads(line) if line.strip() else {}
    outcome = Watchdog(workdir, cfg, credentials).run()
    if outcome is not None:
        print(json.dumps({"reason": outcome.reason, "uploaded": outcome.uploaded, "errors": outcome.errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
