"""The machine-side dead-man's switch: no machine outlives its orchestrator by more than a lease.

Started detached by the bootstrap (`setsid nohup python -m jex.infra.watchdog WORKDIR`), it reads
`WORKDIR/watchdog.json` (lease, hard time to live, where to upload; no secret) and one line of
credentials from stdin (kept in memory only). The orchestrator touches `WORKDIR/lease` on every
poll. When the lease is older than `lease_s`, or the machine reached its hard time to live, the
watchdog:

1. lets a running job finish for `finish_grace_s` (lease expiry only), then stops it (its process group);
2. uploads every job's artifacts to S3 with their sha256, in the orchestrator's layout
   (`PREFIX/campaigns/<campaign>/machines/<machine>/<job>/<path>`), retrying until the hard time to live;
3. writes `SELF_TERMINATED.json` beside them (what it uploaded, what it lost, why), and a local copy;
4. shuts the machine down: `poweroff` (cloud machines, which terminate on shutdown) or, for a lease on
   a host, kills the machine's processes and removes its folder. When the upload failed the folder
   is kept, so `reconcile` can salvage the artifacts from disk.

The worst case in money is therefore the hard time to live times the machine's price.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jex.infra.retry import Backoff, retry
from jex.infra.worker_protocol import DETACHED_PGIDS, PGID, artifact_manifest, read_marker

log = logging.getLogger(__name__)
CONFIG, LEASE, PIDFILE, MARKER = "watchdog.json", "lease", "watchdog.pid", "SELF_TERMINATED.json"


@dataclass(frozen=True)
class WatchdogConfig:
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


@dataclass
class Outcome:
    reason: str
    machine: str
    campaign: str
    time: float
    created_at: float = 0.0
    uploaded: bool = False
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _alive_group(pgid_file: Path) -> int | None:
    try:
        pgid = int(pgid_file.read_text().strip())
        os.killpg(pgid, 0)
        return pgid
    except (OSError, ValueError):
        return None


def _stop_group(pgid: int, grace: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except OSError:
            return
        end = time.time() + grace
        while time.time() < end:
            try:
                os.killpg(pgid, 0)
            except OSError:
                return
            time.sleep(0.1)


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

    def run(self) -> Outcome | None:
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
            if (pgid := _alive_group(pid_file)) is not None:
                _stop_group(pgid, grace=1.0)

    def expire(self, reason: str) -> Outcome:
        log.warning("watchdog %s: %s", self.cfg.machine, reason)
        hard = time.time() >= self.cfg.deadline
        out = Outcome(reason, self.cfg.machine, self.cfg.campaign, time.time(), created_at=self.cfg.created_at)
        grace_end = time.time() + (0 if hard else self.cfg.finish_grace_s)
        for rd in self.jobs():  # let running jobs finish within the grace, then stop them
            while _alive_group(rd / PGID) and read_marker(rd) is None and time.time() < grace_end:
                time.sleep(0.2)
            if (pgid := _alive_group(rd / PGID)) is not None:
                _stop_group(pgid)
        self.stop_detached()  # engine hosts: no shard may land while the manifests are read
        manifests = {rd: self._manifest(rd) for rd in self.jobs()}
        out.uploaded = self._upload_all(manifests, out)
        self._write_local(out)
        self.shutdown(out)
        return out

    def _manifest(self, rd: Path) -> dict[str, Any]:
        rec = json.loads((rd / "job.json").read_text())
        marker = read_marker(rd)
        arts = marker["artifacts"] if marker and marker.get("ok") else artifact_manifest(rd, rec["artifacts"])
        return {"record": rec, "status": "success" if marker and marker.get("ok") else
                ("failed" if marker else "stopped"), "artifacts": arts}

    def _store(self) -> Any:
        import boto3
        from botocore.config import Config

        from jex.infra.s3 import S3Store

        t = self.cfg.upload_attempt_s
        kw: dict[str, Any] = {"region_name": self.cfg.region, "config": Config(
            retries={"mode": "standard", "total_max_attempts": 2}, connect_timeout=t, read_timeout=t)}
        if self.cfg.endpoint_url:
            kw["endpoint_url"] = self.cfg.endpoint_url
        kw.update({k: v for k, v in self.credentials.items() if k in (
            "aws_access_key_id", "aws_secret_access_key", "aws_session_token") and v})
        return S3Store(self.cfg.bucket or "", self.cfg.prefix, boto3.client("s3", **kw))

    def _upload_all(self, manifests: dict[Path, dict[str, Any]], out: Outcome) -> bool:
        """Every artifact, then the marker, to S3; retried (with jitter) until the hard time to live."""
        if not self.cfg.bucket:
            out.errors.append("no bucket configured: artifacts stay on the machine")
            return False

        def attempt() -> bool:
            s3 = self._store()
            base = ("campaigns", self.cfg.campaign, "machines", self.cfg.machine)
            for rd, m in manifests.items():
                name = m["record"]["name"]
                entry = {"status": m["status"], "record": m["record"], "artifacts": [], "lost": []}
                for art in m["artifacts"]:
                    key = s3.key(*base, name, art["path"])
                    s3.put_file(rd / art["path"], key)
                    entry["artifacts"].append({**art, "s3_key": key})
                out.jobs[name] = entry
            doc = {**asdict(out), "uploaded": True}
            tmp = self.workdir / f".{MARKER}.upload"
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str))
            s3.put_file(tmp, s3.key(*base, MARKER))
            tmp.unlink(missing_ok=True)
            return True

        left = self.cfg.deadline - time.time()
        policy = Backoff(attempts=None, base_s=1.0, cap_s=min(30.0, max(left / 4, 0.5)), deadline_s=max(left, 0.001))
        try:
            return retry(attempt, policy, what=f"watchdog upload {self.cfg.machine}")
        except Exception as e:  # noqa: BLE001 - whatever S3 says, the machine still stops at its TTL
            out.errors.append(f"upload failed until the hard time to live: {type(e).__name__}: {str(e)[:300]}")
            for m in manifests.values():
                out.jobs.setdefault(m["record"]["name"], {"status": m["status"], "record": m["record"],
                                                          "artifacts": [], "on_disk": m["artifacts"],
                                                          "lost": []})
            return False

    def _write_local(self, out: Outcome) -> None:
        tmp = self.workdir / f".{MARKER}.part"
        tmp.write_text(json.dumps(asdict(out), indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.workdir / MARKER)

    def shutdown(self, out: Outcome) -> None:
        """Power off, or end the host lease: kill its jobs; remove its folder unless artifacts remain only there."""
        log.warning("watchdog %s: shutting down (%s)", self.cfg.machine, self.cfg.shutdown)
        if self.cfg.shutdown == "poweroff":
            for cmd in (["sudo", "-n", "shutdown", "-h", "now"], ["shutdown", "-h", "now"], ["poweroff"]):
                try:
                    if subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0:
                        return
                except (OSError, subprocess.TimeoutExpired):
                    continue
            return
        for rd in self.jobs():
            if (pgid := _alive_group(rd / PGID)) is not None:
                _stop_group(pgid, grace=1.0)
        self.stop_detached()
        if out.uploaded and self.cfg.remove_dir:
            shutil.rmtree(self.cfg.remove_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    workdir = Path(argv[0]).resolve()
    cfg = WatchdogConfig(**json.loads((workdir / CONFIG).read_text()))
    line = sys.stdin.readline() if not sys.stdin.isatty() else ""
    credentials = json.loads(line) if line.strip() else {}
    outcome = Watchdog(workdir, cfg, credentials).run()
    if outcome is not None:
        print(json.dumps({"reason": outcome.reason, "uploaded": outcome.uploaded, "errors": outcome.errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
