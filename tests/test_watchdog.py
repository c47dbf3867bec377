"""The machine-side dead-man's switch: when its orchestrator disappears, a machine uploads its own
results (sha256-verified, into the campaign's prefix), leaves SELF_TERMINATED.json and is gone.

Real components: machines of the local provider (detached processes on this host), the watchdog
started detached by the bootstrap, moto's S3/STS server on 127.0.0.1, an orchestrator in its own
process frozen with SIGSTOP or killed with SIGKILL. Leases and times to live are seconds long.

A cloud that drops a VM's disk when it powers off is the real command provider driving
`python -m jex.infra.providers` (its `poweroff` verb wipes the VM's disk and lists it `stopped`), which
the watchdog runs as its poweroff command.
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
from jex.infra.cost_ledger import CostLedger
from jex.infra.machine import JobFailed, MachineSession, Policy, RemoteJob
from jex.infra.providers import CommandProvider, CommandTemplates, LocalProvider
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
from jex.infra.cost_ledger import CostLedger
from jex.settings import InfraSettings
from jex.infra.providers import CommandProvider, CommandTemplates, LocalProvider
from jex.infra.machine import MachineSession, Policy, RemoteJob
from jex.infra.s3 import S3Store
endpoint, bucket, tmp, policy = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
cloud = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None  # CommandTemplates of a cloud, or a local machine
s3 = S3Store(bucket, "jex", boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                         aws_access_key_id="test", aws_secret_access_key="test"))
store = SimpleNamespace(s3_region="us-east-1", s3_endpoint_url=endpoint, s3_bucket=bucket)
infra = InfraSettings(aws_access_key_id=SecretStr("test"), aws_secret_access_key=SecretStr("test"))
creds = lambda: scoped_credentials(store, infra, key_prefix=s3.key("campaigns", "c1"), ttl_s=60)
provider = CommandProvider(CommandTemplates(**cloud)) if cloud else LocalProvider(tmp / "machines")
session = MachineSession(provider, campaign="c1", ledger=CostLedger(tmp / "state/ledger.json"),
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


def _orchestrator(tmp_path, s3_server, bucket: str, cloud: CommandTemplates | None = None,
                  **policy) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, s3_server, bucket, str(tmp_path),
                          json.dumps({**FAST, "finish_grace_s": 15.0, **policy}),
                          *([json.dumps(cloud.__dict__)] if cloud else [])], cwd=ROOT, stdout=subprocess.PIPE,
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
    ledger = CostLedger(tmp_path / "state/ledger.json")
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
                          ledger=CostLedger(tmp_path / "state/ledger.json"), policy=Policy(**{**FAST, **policy}),
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


# -- a cloud that drops a VM's disk when it powers off ---------------------------------------------------

def _cloud(tmp_path) -> tuple[CommandTemplates, str]:
    """The templates of a cloud whose VMs lose their disk at power-off (the command provider's default),
    and the poweroff command its VMs' watchdogs run (`{id}`: the VM)."""
    cli = f"{sys.executable} -m jex.infra.providers --state {tmp_path / 'cloud'}"
    return (CommandTemplates(create=f"{cli} create --campaign {{campaign}} --label {{label}}",
                             describe=f"{cli} describe {{id}}", list_machines=f"{cli} list",
                             delete=f"{cli} delete {{id}}"),
            f"{cli} poweroff {{id}}")


def _cloud_session(tmp_path, s3=None, *, poweroff: str = "", **policy) -> MachineSession:
    templates, cloud_poweroff = _cloud(tmp_path)
    return MachineSession(CommandProvider(templates), campaign="c1", ledger=CostLedger(tmp_path / "state/ledger.json"),
                          policy=Policy(**{**FAST, "poweroff_command": poweroff or cloud_poweroff, **policy}),
                          python=sys.executable, state_dir=tmp_path / "state", s3=s3)


def test_a_campaign_on_a_cloud_that_drops_the_disk_needs_a_bucket_before_any_machine(tmp_path):
    """Refused by `jex run`'s pre-flight (one line, before any flow) and by the fleet itself (a run from the
    Prefect UI has no CLI): no VM was ever created."""
    from jex.errors import InputError
    from jex.flows.machines.fleet import GpuFleet
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec

    templates, _ = _cloud(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JEX_")}
    env.update({"JEX_INFRA__STATE_DIR": str(tmp_path / "state"), "PREFECT_API_URL": "http://127.0.0.1:9/api",
                "JEX_INFRA__COMMAND_CREATE": templates.create, "JEX_INFRA__COMMAND_DESCRIBE": templates.describe,
                "JEX_INFRA__COMMAND_LIST": templates.list_machines, "JEX_INFRA__COMMAND_DELETE": templates.delete})
    t0 = time.monotonic()
    p = subprocess.run([str(Path(sys.executable).with_name("jex")), "run", "--provider", "command", "--out",
                        str(tmp_path / "runs")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: --provider command: its machines lose their disk when they power off")
    assert "JEX_STORE__S3_BUCKET" in p.stderr and not (tmp_path / "runs").exists()
    assert took < 5 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)), took
    settings = load_settings(infra={"state_dir": tmp_path / "state", "command_create": templates.create,
                                    "command_describe": templates.describe, "command_list": templates.list_machines,
                                    "command_delete": templates.delete})
    assert settings.store.s3_bucket is None
    with pytest.raises(InputError, match="--provider command: .* set JEX_STORE__S3_BUCKET"):
        GpuFleet(MachinesSpec(provider="command"), campaign="c1", store=str(tmp_path / "store"), settings=settings)
    kept = load_settings(infra={**settings.infra.model_dump(), "command_keeps_disk": True})
    GpuFleet(MachinesSpec(provider="command"), campaign="c1", store=str(tmp_path / "store"), settings=kept)
    assert not (tmp_path / "cloud").exists()  # the cloud never saw a create


@pytest.mark.parametrize("after", ["sigcont", "new_orchestrator"])
def test_on_a_cloud_that_drops_the_disk_a_frozen_orchestrator_loses_nothing(tmp_path, s3_server, s3_bucket, after):
    """The lease-expiry path with a bucket: the VM uploads its results, powers off (its disk gone, the VM
    listed stopped), and the results are collected from S3; the stopped VM is deleted."""
    templates, poweroff = _cloud(tmp_path)
    orch, machine = _orchestrator(tmp_path, s3_server, s3_bucket.bucket, cloud=templates, poweroff_command=poweroff)
    provider = CommandProvider(templates)
    os.kill(orch.pid, signal.SIGSTOP)  # the laptop sleeps mid stage
    try:
        wait_until(lambda: s3_bucket.head(_marker_key(s3_bucket, machine)) is not None, 40, "SELF_TERMINATED.json")
        wait_until(lambda: [m.state for m in provider.list_machines("c1")] == ["stopped"], 20, "the VM powered off")
        assert not (tmp_path / "cloud" / machine / "work").exists()  # its disk went with it
    finally:
        os.kill(orch.pid, signal.SIGCONT if after == "sigcont" else signal.SIGKILL)
    ledger = CostLedger(tmp_path / "state/ledger.json")
    if after == "sigcont":  # the orchestrator wakes up, adopts from S3 and its teardown deletes the stopped VM
        outcome = json.loads(orch.communicate(timeout=120)[0].strip().splitlines()[-1])
        assert orch.returncode == 0 and outcome["status"] == "adopted" and not outcome["lost"]
    else:  # a new orchestrator: reconcile adopts what the VM uploaded and deletes the VM, stopped as it is
        orch.wait(timeout=30)
        report = reconcile(provider, ledger, policy=Policy(**FAST), s3=s3_bucket, campaign="c1")
        (entry,) = report["machines"]
        assert entry["action"] == "adopted" and entry["jobs"][0]["status"] == "adopted" and not report["errors"]
        assert entry["teardown"]["reason"].startswith("reconcile: powered off (stopped)")
    assert provider.list_machines() == []  # a stopped VM holds quota: deleted
    marker = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.bucket,
                                                    Key=_marker_key(s3_bucket, machine))["Body"].read())
    assert marker["uploaded"] and marker["reason"].startswith("lease expired") and not marker["errors"]
    for name, art in {a["path"]: a for a in marker["jobs"]["fast_pass"]["artifacts"]}.items():
        assert s3_bucket.head(art["s3_key"]).sha256 == art["sha256"]
        assert sha256_file(tmp_path / "collected" / name) == art["sha256"]
    assert {p.name for p in (tmp_path / "collected").iterdir()} == {"a.bin", "b.bin"}
    assert (tmp_path / "runs.txt").read_text() == "run\n"  # computed once
    assert ledger.get(machine).end_reason.startswith("self-terminated: lease expired")


def test_without_a_bucket_a_vm_that_would_lose_its_disk_stays_up_until_its_results_are_collected(tmp_path):
    session = _cloud_session(tmp_path, lease_s=1.5, ttl_s=120.0)
    session.start()  # the orchestrator starts the job, then disappears: nobody polls
    session.launch(_job(tmp_path, "echo x > a.bin; sleep 120"))
    workdir, machine = Path(session.machine.workdir), session.machine.id
    wait_until(lambda: "staying up until the hard time to live" in (workdir / "watchdog.log").read_text(), 30,
               "the watchdog holds the machine")
    time.sleep(1.0)
    # its lease expired and its job was stopped, but it did not power off with its results on its disk
    assert session.provider.describe(machine).state == "running" and (workdir / "jobs/j/a.bin").exists()
    assert _alive(workdir / "watchdog.pid") and not (workdir / "SELF_TERMINATED.json").exists()
    report = reconcile(session.provider, session.ledger, policy=Policy(**FAST), campaign="c1")
    (entry,) = report["machines"]
    assert entry["action"] == "collected" and entry["jobs"][0]["artifacts"] == 1 and not report["errors"]
    assert (tmp_path / "collected" / "a.bin").read_text() == "x\n"
    assert session.provider.list_machines() == [] and not _alive(workdir / "watchdog.pid")


def test_without_a_bucket_the_cost_ceiling_still_powers_the_vm_off_and_names_what_was_lost(tmp_path):
    console = tmp_path / "console.json"  # the cloud's serial console: what the VM showed last
    _, cloud_poweroff = _cloud(tmp_path)
    session = _cloud_session(tmp_path, poweroff=f"cp SELF_TERMINATED.json {console}; {cloud_poweroff}", lease_s=1.5,
                             ttl_s=8.0)
    session.start()
    session.launch(_job(tmp_path, "echo x > a.bin; sleep 120"))
    machine, t_ttl = session.machine.id, session.machine.created_at + 8.0
    wait_until(lambda: session.provider.describe(machine).state == "stopped", 40, "the VM powered off at its TTL")
    assert time.time() >= t_ttl - 0.5  # held until its hard time to live, not at its lease expiry
    marker = json.loads(console.read_text())
    assert not marker["uploaded"] and marker["time"] >= t_ttl - 0.5
    assert marker["errors"] == ["no bucket configured: lost with the machine's disk: j/a.bin"]
    assert [x["path"] for x in marker["jobs"]["j"]["lost"]] == ["a.bin"]
    assert not Path(session.machine.workdir).exists()  # the disk went with it
    report = reconcile(session.provider, session.ledger, policy=Policy(**FAST), campaign="c1")
    (entry,) = report["machines"]  # listed stopped, nothing of it in S3: deleted, its jobs named
    assert (entry["machine"], entry["action"]) == (machine, "stopped")
    assert entry["jobs"] == [{"job": "j", "status": "lost", "artifacts": 0, "lost": ["*.bin"],
                              "collect_to": str(tmp_path / "collected")}]
    assert session.provider.list_machines() == []
    assert session.ledger.get(machine).end_reason == "reconcile: powered off (stopped)"
