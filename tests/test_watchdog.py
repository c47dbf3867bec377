"""The machine-side dead-man's switch: when its orchestrator disappears, a machine uploads its own
results (sha256-verified, into the campaign's prefix), leaves SELF_TERMINATED.json and is gone.

Real components: machines of the local provider (detached processes on this host), the watchdog
started detached by the bootstrap, moto's S3/STS server on 127.0.0.1, an orchestrator in its own
process frozen with SIGSTOP or killed with SIGKILL. Leases and times to live are seconds long.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jex.fileio import sha256_file
from jex.infra.ledger import Ledger
from jex.infra.machine import JobFailed, MachineSession, Policy, RemoteJob
from jex.infra.providers import LocalProvider
from jex.infra.reaper import reconcile
from jex.infra.s3 import S3Store

ROOT = Path(__file__).resolve().parent.parent
FAST = {"poll_s": 0.3, "heartbeat_s": 0.5, "heartbeat_timeout_s": 30.0, "backoff_s": 0.1, "lease_s": 2.0,
        "watchdog_check_s": 0.3}


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def _marker_key(s3: S3Store, machine: str, campaign: str = "c1") -> str:
    return s3.key("campaigns", campaign, "machines", machine, "SELF_TERMINATED.json")


ORCHESTRATOR = r'''
import json, sys
from pathlib import Path
from types import SimpleNamespace
import boto3
from pydantic import SecretStr
from jex.infra.aws import scoped_credentials
from jex.infra.ledger import Ledger
from jex.settings import InfraSettings
from jex.infra.providers import LocalProvider
from jex.infra.machine import MachineSession, Policy, RemoteJob
from jex.infra.s3 import S3Store
endpoint, bucket, tmp, policy = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
s3 = S3Store(bucket, "jex", boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                         aws_access_key_id="test", aws_secret_access_key="test"))
store = SimpleNamespace(s3_region="us-east-1", s3_endpoint_url=endpoint, s3_bucket=bucket)
infra = InfraSettings(aws_access_key_id=SecretStr("test"), aws_secret_access_key=SecretStr("test"))
creds = lambda: scoped_credentials(store, infra, key_prefix=s3.key("campaigns", "c1"), ttl_s=60)
session = MachineSession(LocalProvider(tmp / "machines"), campaign="c1", ledger=Ledger(tmp / "state/ledger.json"),
                         policy=Policy(**policy), python=sys.executable, state_dir=tmp / "state", s3=s3,
                         machine_credentials=creds)
script = f"echo run >> {tmp}/runs.txt; sleep 3; head -c 200000 /dev/urandom > a.bin; echo b > b.bin"
job = RemoteJob("fast_pass", ["-c", f"import os; os.execvp('sh', ['sh', '-c', {script!r}])"], ["*.bin"],
                tmp / "collected")
with session:
    print(json.dumps({"machine": session.machine.id}), flush=True)
    outcome = session.run(job)
print(outcome.model_dump_json(), flush=True)
'''


def _orchestrator(tmp_path, s3_server, bucket: str, **policy) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, s3_server, bucket, str(tmp_path),
                          json.dumps({**FAST, "finish_grace_s": 15.0, **policy})], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    machine = json.loads(p.stdout.readline())["machine"]
    wait_until(lambda: (tmp_path / "runs.txt").exists(), 60, "the job started")
    return p, machine


@pytest.mark.parametrize("after", ["sigcont", "new_orchestrator"])
def test_frozen_orchestrator_its_machine_uploads_stops_itself_and_the_results_are_adopted(tmp_path, s3_server,
                                                                                          s3_bucket, after):
    orch, machine = _orchestrator(tmp_path, s3_server, s3_bucket.bucket)
    provider = LocalProvider(tmp_path / "machines")
    os.kill(orch.pid, signal.SIGSTOP)  # the laptop sleeps mid stage
    try:
        wait_until(lambda: s3_bucket.head(_marker_key(s3_bucket, machine)) is not None, 40, "SELF_TERMINATED.json")
        wait_until(lambda: provider.list_machines("c1") == [], 10, "the machine is gone")
    finally:
        os.kill(orch.pid, signal.SIGCONT if after == "sigcont" else signal.SIGKILL)
    ledger = Ledger(tmp_path / "state/ledger.json")
    if after == "sigcont":  # the orchestrator wakes up, finds the machine gone and its results in S3
        outcome = json.loads(orch.communicate(timeout=120)[0].strip().splitlines()[-1])
        assert orch.returncode == 0 and outcome["status"] == "adopted" and not outcome["lost"]
    else:  # a new orchestrator: reconcile adopts what the machine uploaded
        orch.wait(timeout=30)
        report = reconcile(provider, ledger, policy=Policy(**FAST), s3=s3_bucket, campaign="c1")
        (entry,) = report["machines"]
        assert entry["action"] == "adopted" and entry["jobs"][0]["status"] == "adopted" and not report["errors"]
    marker = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.bucket,
                                                    Key=_marker_key(s3_bucket, machine))["Body"].read())
    assert marker["uploaded"] and marker["reason"].startswith("lease expired")
    arts = {a["path"]: a for a in marker["jobs"]["fast_pass"]["artifacts"]}
    assert set(arts) == {"a.bin", "b.bin"}
    for name, art in arts.items():  # in S3 with the sha256 in metadata, and here, byte for byte
        assert s3_bucket.head(art["s3_key"]).sha256 == art["sha256"]
        assert sha256_file(tmp_path / "collected" / name) == art["sha256"]
    assert (tmp_path / "runs.txt").read_text() == "run\n"  # computed once: nothing re-run
    assert ledger.get(machine).end_reason.startswith("self-terminated: lease expired")


SECRET = "s3cr3t-for-the-watchdog-only"


def _session(tmp_path, s3, **policy) -> MachineSession:
    creds = {"aws_access_key_id": "AKIAWATCHDOG", "aws_secret_access_key": SECRET, "aws_session_token": "tok"}
    return MachineSession(LocalProvider(tmp_path / "machines"), campaign="c1",
                          ledger=Ledger(tmp_path / "state/ledger.json"), policy=Policy(**{**FAST, **policy}),
                          python=sys.executable, state_dir=tmp_path / "state", s3=s3,
                          machine_credentials=lambda: creds)


def _job(tmp_path, script: str) -> RemoteJob:
    return RemoteJob("j", ["-c", f"import os; os.execvp('sh', ['sh', '-c', {script!r}])"], ["*.bin"],
                     tmp_path / "collected")


def test_a_killed_watchdog_is_noticed_at_the_next_poll_and_the_machine_torn_down(tmp_path, s3_bucket):
    session = _session(tmp_path, s3_bucket, lease_s=60.0)

    def kill_watchdog(s, job, poll):
        if poll == 2:
            pgid = int(Path(s.machine.workdir, "watchdog.pid").read_text())
            os.killpg(pgid, signal.SIGKILL)

    session.on_poll = kill_watchdog
    with pytest.raises(JobFailed) as err, session:
        session.run(_job(tmp_path, "echo x > a.bin; sleep 60"))
    assert err.value.outcome.status == "watchdog_lost"
    assert LocalProvider(tmp_path / "machines").list_machines("c1") == []
    assert [a.path for a in err.value.outcome.artifacts] == ["a.bin"]  # salvaged before the teardown


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_s3_unreachable_at_lease_expiry_keeps_artifacts_on_disk_stops_at_ttl_and_reconcile_salvages(tmp_path,
                                                                                                   s3_bucket):
    import boto3

    dead = S3Store("nowhere", "jex", boto3.client("s3", endpoint_url=_dead_endpoint(), region_name="us-east-1",
                                                  aws_access_key_id="test", aws_secret_access_key="test"))
    session = _session(tmp_path, dead, lease_s=1.5, ttl_s=9.0)
    session.start()  # the orchestrator starts the job, then disappears: nobody polls
    job = _job(tmp_path, "echo x > a.bin; sleep 120")
    session.launch(job)
    workdir = Path(session.machine.workdir)
    t_ttl = session.machine.created_at + 9.0
    wait_until(lambda: (workdir / "SELF_TERMINATED.json").exists(), 30, "the watchdog stopped the machine")
    assert time.time() >= t_ttl - 1.0  # it kept retrying the upload until its hard time to live
    local = json.loads((workdir / "SELF_TERMINATED.json").read_text())
    assert not local["uploaded"] and "upload failed" in local["errors"][0]
    assert time.time() - t_ttl < 10  # and stopped there
    wait_until(lambda: not _alive(workdir / "watchdog.pid") and not _alive(workdir / "jobs/j/worker.pgid"), 10,
               "every process of the machine is gone")
    assert (workdir / "jobs/j/a.bin").exists()  # kept on disk for reconcile
    for f in tmp_path.rglob("*"):  # the watchdog's credentials came on stdin: on no disk, in no log
        assert not f.is_file() or SECRET not in f.read_text(errors="ignore"), f
    report = reconcile(session.provider, session.ledger, policy=Policy(**FAST), s3=s3_bucket, campaign="c1")
    (entry,) = report["machines"]
    assert entry["jobs"][0]["status"] == "self_terminated" and entry["jobs"][0]["artifacts"] == 1
    assert s3_bucket.head(s3_bucket.key("campaigns", "c1", "machines", session.machine.id, "j", "a.bin"))
    assert session.provider.list_machines("c1") == []
    assert session.ledger.get(session.machine.id).end_reason.startswith("self-terminated")


def _alive(pid_file: Path) -> bool:
    try:
        os.killpg(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def test_a_machine_gone_before_its_results_reached_s3_is_reported_lost_by_name(tmp_path, s3_bucket):
    session = _session(tmp_path, s3_bucket, lease_s=60.0)
    session.start()
    session.launch(_job(tmp_path, "echo x > a.bin; sleep 120"))
    session.provider.delete(session.machine.id)  # its disk went with it (an instance terminated at its TTL)
    fresh = reconcile(session.provider, session.ledger, policy=Policy(**FAST), s3=s3_bucket, campaign="c1")
    assert fresh["machines"] == []  # younger than the grace a cloud's listing may lag: not judged yet
    report = reconcile(session.provider, session.ledger, policy=Policy(**FAST), s3=s3_bucket, campaign="c1",
                       lost_after_s=0)
    (entry,) = report["machines"]
    assert (entry["machine"], entry["action"]) == (session.machine.id, "lost")
    assert entry["jobs"] == [{"job": "j", "status": "lost", "artifacts": 0, "lost": ["*.bin"],
                              "collect_to": str(tmp_path / "collected")}]
    assert session.ledger.get(session.machine.id).end_reason.startswith("lost")
    again = reconcile(session.provider, session.ledger, policy=Policy(**FAST), s3=s3_bucket, campaign="c1",
                      lost_after_s=0)
    assert again["machines"] == []  # a loss is reported once, then the ledger holds it
