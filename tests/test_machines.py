"""Machines owned by the orchestrator: providers, bootstrap, supervision, faults, reconciliation, budget.

Real components throughout: an OpenSSH server on 127.0.0.1 (`sshd` fixture), moto's S3/EC2 server on
127.0.0.1 (`s3_server`), detached processes under the worker protocol. After every fault: no
machine is left, and every artifact the worker wrote is in S3 with its sha256 or named as lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jex.infra.backoff import wait_until
from jex.infra.cost_ledger import BudgetExceeded, CostLedger
from jex.infra.machine import JobFailed, MachineSession, Policy, RemoteJob
from jex.infra.providers import CommandProvider, CommandTemplates, EC2Provider, LocalProvider, SSHProvider
from jex.infra.reaper import reconcile
from jex.infra.records import Lost, ObjectHead
from jex.infra.shell import ShellError, SSHShell

ROOT = Path(__file__).resolve().parent.parent
FAST = {"poll_s": 0.3, "heartbeat_s": 0.5, "heartbeat_timeout_s": 10.0, "backoff_s": 0.1}  # generous: CI is loaded


def ssh_provider(sshd, root: Path, cls=SSHProvider) -> SSHProvider:
    return cls(str(root), ["127.0.0.1"], port=sshd["port"], user="root", key_path=sshd["key_path"],
               known_hosts=sshd["known_hosts"])


def session_for(provider, tmp_path, s3=None, *, campaign="c1", **policy) -> MachineSession:
    state = tmp_path / "state"
    return MachineSession(provider, campaign=campaign, ledger=CostLedger(state / "ledger.json"),
                          policy=Policy(**{**FAST, **policy}), python=sys.executable, state_dir=state, s3=s3)


def shell_job(name: str, script: str, dest: Path, artifacts=("*.bin",)) -> RemoteJob:
    """A job whose process is `sh -c SCRIPT` (its parent is the worker-protocol wrapper)."""
    return RemoteJob(name, ["-c", f"import os; os.execvp('sh', ['sh', '-c', {script!r}])"], list(artifacts), dest)


def assert_no_machine_and_nothing_lost(provider, campaign, s3, outcome, written: set[str]):
    assert provider.list_machines(campaign) == [], "a machine was left running"
    in_s3 = set()
    for art in outcome.artifacts:
        assert s3.head(art.s3_key) == ObjectHead(sha256=art.sha256, bytes=art.bytes)
        assert art.s3_key.startswith(s3.key("campaigns", campaign) + "/")
        in_s3.add(art.path)
    lost = {x.path for x in outcome.lost}
    assert written <= in_s3 | lost, f"unaccounted artifacts: {written - in_s3 - lost}"


# -- providers ----------------------------------------------------------------------------------------

def _exercise(provider):
    a, b = provider.create("camp-a", "gpu"), provider.create("camp-b", "gpu")
    assert {m.id for m in provider.list_machines("camp-a")} == {a.id}
    assert {a.id, b.id} <= {m.id for m in provider.list_machines()}
    assert provider.describe(a.id).campaign == "camp-a"
    provider.delete(a.id)
    provider.delete(a.id)  # idempotent
    assert provider.describe(a.id) is None and [m.id for m in provider.list_machines("camp-a")] == []
    provider.delete(b.id)
    assert provider.list_machines("camp-b") == []


def test_local_provider_creates_lists_by_campaign_and_deletes_idempotently(tmp_path):
    _exercise(LocalProvider(tmp_path / "machines"))


def test_ssh_provider_creates_lists_by_campaign_and_deletes_idempotently(sshd, tmp_path):
    _exercise(ssh_provider(sshd, tmp_path / "remote"))


def test_command_provider_drives_a_cli_through_templates(tmp_path):
    cli = f"{sys.executable} -m jex.infra.providers --state {tmp_path / 'machines'}"
    _exercise(CommandProvider(CommandTemplates(create=f"{cli} create --campaign {{campaign}} --label {{label}}",
                                               describe=f"{cli} describe {{id}}", list_machines=f"{cli} list",
                                               delete=f"{cli} delete {{id}}")))


def test_ec2_provider_runs_tags_describes_and_terminates_through_boto3(s3_server):
    import boto3

    ec2 = boto3.client("ec2", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="test",
                       aws_secret_access_key="test")
    _exercise(EC2Provider(ec2, image_id="ami-12c6146b", instance_type="p5.48xlarge"))


def test_an_ec2_machine_that_powers_itself_off_is_terminated(s3_server):
    import boto3

    ec2 = boto3.client("ec2", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="test",
                       aws_secret_access_key="test")
    provider = EC2Provider(ec2, image_id="ami-12c6146b", instance_type="p5.48xlarge")
    m = provider.create("camp-ttl")
    attr = ec2.describe_instance_attribute(InstanceId=m.id, Attribute="instanceInitiatedShutdownBehavior")
    assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"  # the watchdog's poweroff ends it
    assert provider.self_shutdown == "poweroff"
    provider.delete(m.id)


def test_ssh_refuses_a_host_whose_key_is_not_pinned(sshd, tmp_path):
    (tmp_path / "empty").write_text("")
    shell = SSHShell("127.0.0.1", sshd["port"], "root", key_path=sshd["key_path"], known_hosts=tmp_path / "empty",
                     reconnect_attempts=1)
    with pytest.raises(ShellError, match="unknown host key"):
        shell.run("true")
    wrong = tmp_path / "wrong"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    kind, b64 = (tmp_path / "k.pub").read_text().split()[:2]
    wrong.write_text(f"[127.0.0.1]:{sshd['port']} {kind} {b64}\n")
    with pytest.raises(ShellError, match="does not match"):
        SSHShell("127.0.0.1", sshd["port"], "root", key_path=sshd["key_path"], known_hosts=wrong).run("true")


@pytest.mark.parametrize("kind", ["rsa", "ecdsa", "ed25519"])
def test_ssh_key_text_in_openssh_format_is_loaded_by_its_actual_type(sshd, tmp_path, kind):
    key = tmp_path / f"id_{kind}"
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(key)], check=True)  # OpenSSH format
    assert key.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    with open(sshd["dir"] / "authorized_keys", "a") as f:
        f.write((tmp_path / f"id_{kind}.pub").read_text())
    shell = SSHShell("127.0.0.1", sshd["port"], "root", key_text=key.read_text(), known_hosts=sshd["known_hosts"])
    assert shell.run("echo ok").stdout == "ok\n"
    shell.close()


def test_unreadable_ssh_key_text_is_a_clear_error_not_a_guess():
    from jex.errors import JexError
    from jex.infra.shell import load_private_key

    with pytest.raises(JexError, match="neither OpenSSH nor PEM"):
        load_private_key("ssh-ed25519 AAAA... (a public key pasted by mistake)")


# -- the lifecycle and its faults ----------------------------------------------------------------------

def test_job_survives_a_dropped_ssh_connection(sshd, tmp_path, s3_bucket):
    provider = ssh_provider(sshd, tmp_path / "remote")
    session = session_for(provider, tmp_path, s3_bucket)

    def drop_every_connection(s, job, poll):  # the server side of every SSH session dies
        if poll == 3:
            children = subprocess.run(["pgrep", "-P", str(sshd["pid"])], capture_output=True, text=True).stdout
            for pid in children.split():
                os.kill(int(pid), signal.SIGKILL)

    session.on_poll = drop_every_connection
    with session:
        outcome = session.run(shell_job("j", "sleep 2; head -c 300000 /dev/urandom > a.bin; echo b > b.bin",
                                        tmp_path / "got"))
    assert outcome.status == "success" and len(outcome.artifacts) == 2
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"a.bin", "b.bin"})


def test_killed_worker_process_is_salvaged_and_the_machine_deleted(sshd, tmp_path, s3_bucket):
    provider = ssh_provider(sshd, tmp_path / "remote")
    session = session_for(provider, tmp_path, s3_bucket)

    def kill_the_stage(s, job, poll):
        if poll == 4:
            subprocess.run(["pkill", "-KILL", "-f", r"^sh -c echo partial"])  # the stage process only

    session.on_poll = kill_the_stage
    with pytest.raises(JobFailed) as err, session:
        session.run(shell_job("j", "echo partial > part.bin; sleep 41.5; echo never > late.bin", tmp_path / "got"))
    outcome = err.value.outcome
    assert outcome.status == "failed" and outcome.exit_code != 0
    assert [a.path for a in outcome.artifacts] == ["part.bin"]
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"part.bin"})
    assert session.teardown_record.reason.startswith("JobFailed")


def test_success_without_a_marker_is_salvaged(sshd, tmp_path, s3_bucket):
    provider = ssh_provider(sshd, tmp_path / "remote")
    session = session_for(provider, tmp_path, s3_bucket)
    with pytest.raises(JobFailed) as err, session:  # the job finishes its work, then its wrapper dies
        session.run(shell_job("j", "echo done > out.bin; kill -9 $PPID; exit 0", tmp_path / "got"))
    outcome = err.value.outcome
    assert outcome.status == "no_marker"
    assert [a.path for a in outcome.artifacts] == ["out.bin"]
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"out.bin"})


def test_marker_naming_missing_artifacts_reports_them_lost(sshd, tmp_path, s3_bucket):
    provider = ssh_provider(sshd, tmp_path / "remote")
    session = session_for(provider, tmp_path, s3_bucket)

    def lose_a_file_after_the_marker(s, job, poll):  # SUCCESS.json lists it; the disk no longer has it
        rd = s.run_dir(job)
        s.started.shell.run(f"while [ ! -f {rd}/SUCCESS.json ]; do sleep 0.1; done; rm {rd}/gone.bin")

    session.on_poll = lose_a_file_after_the_marker
    with pytest.raises(JobFailed) as err, session:
        session.run(shell_job("j", "echo x > kept.bin; echo y > gone.bin", tmp_path / "got"))
    outcome = err.value.outcome
    assert outcome.status == "invalid_marker"
    assert outcome.lost == [Lost(path="gone.bin", reason="listed by the worker but absent on the machine")]
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"kept.bin", "gone.bin"})


def test_upload_failing_twice_then_succeeding_loses_nothing(sshd, tmp_path, s3_bucket):
    failures = []

    def fail_twice(**kw):
        if len(failures) < 2:
            failures.append(1)
            raise ConnectionResetError("injected upload failure")

    s3_bucket.client.meta.events.register("before-send.s3.PutObject", fail_twice)
    provider = ssh_provider(sshd, tmp_path / "remote")
    session = session_for(provider, tmp_path, s3_bucket)
    with session:
        outcome = session.run(shell_job("j", "echo payload > a.bin", tmp_path / "got"))
    assert len(failures) == 2 and outcome.ok
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"a.bin"})


def test_provider_delete_failing_once_is_retried_until_the_machine_is_gone(sshd, tmp_path, s3_bucket):
    class FlakyDelete(SSHProvider):
        fails = 1

        def _delete(self, machine_id):
            if self.fails:
                self.fails -= 1
                raise ShellError("injected: the provider's delete call failed")
            super()._delete(machine_id)

    provider = ssh_provider(sshd, tmp_path / "remote", FlakyDelete)
    session = session_for(provider, tmp_path, s3_bucket)
    with session:
        outcome = session.run(shell_job("j", "echo a > a.bin", tmp_path / "got"))
    assert session.teardown_record.attempts == 2
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"a.bin"})


def test_heartbeat_loss_tears_the_machine_down_after_the_timeout(sshd, tmp_path, s3_bucket):
    provider = ssh_provider(sshd, tmp_path / "remote")
    session = session_for(provider, tmp_path, s3_bucket, heartbeat_timeout_s=2.0)

    def freeze(s, job, poll):  # the machine hangs: every process of the job stops
        if poll == 3:
            pgid = s.started.shell.run(f"cat {s.run_dir(job)}/worker.pgid").stdout.strip()
            s.started.shell.run(f"kill -STOP -- -{pgid}")

    session.on_poll = freeze
    with pytest.raises(JobFailed) as err, session:
        session.run(shell_job("j", "echo early > early.bin; sleep 60", tmp_path / "got"))
    outcome = err.value.outcome
    assert outcome.status == "heartbeat_lost"
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"early.bin"})


def test_budget_tears_down_running_machines_and_refuses_new_ones(tmp_path, s3_bucket):
    provider = LocalProvider(tmp_path / "machines")
    # $10 a second: 6 s for the job to start and write s.bin (a loaded 2-core CI machine takes 2-3 s), then the budget
    session = session_for(provider, tmp_path, s3_bucket, price_per_hour=36_000.0, budget_usd=60.0)
    with pytest.raises(JobFailed) as err, session:
        session.run(shell_job("j", "echo started > s.bin; sleep 60", tmp_path / "got"))
    outcome = err.value.outcome
    assert outcome.status == "budget" and "cost budget" in outcome.reason
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"s.bin"})
    with pytest.raises(BudgetExceeded):
        session_for(provider, tmp_path, s3_bucket, price_per_hour=36_000.0, budget_usd=60.0).start()
    assert provider.list_machines() == []
    ledger = CostLedger(tmp_path / "state" / "ledger.json").usage("c1")
    assert len(ledger.machines) == 1 and ledger.total_usd >= 60.0



def test_a_job_the_machine_stops_at_its_cost_ceiling_is_a_budget_stop(tmp_path, s3_bucket):
    """The machine's watchdog (time to live: the budget at its price, 9 s) stops the job while the orchestrator's
    poll is under way, after its budget check passed: the outcome still says the budget ended it."""
    provider = LocalProvider(tmp_path / "machines")
    # the watchdog checks its time to live every 0.5 s (its default, 5 s, would add up to 5 s of waiting)
    session = session_for(provider, tmp_path, s3_bucket, price_per_hour=36_000.0, budget_usd=90.0,
                          watchdog_check_s=0.5)

    def slow_poll(job):  # the poll's answer comes once the machine has stopped the job itself
        assert wait_until(lambda: (Path(session.run_dir(job)) / "FAILED.json").exists(), timeout_s=60, every_s=0.2)
        return MachineSession.status(session, job)

    session.status = slow_poll
    with pytest.raises(JobFailed) as err, session:
        session.run(shell_job("j", "echo started > s.bin; sleep 60", tmp_path / "got"))
    outcome = err.value.outcome
    assert outcome.status == "budget" and "cost budget" in outcome.reason
    assert_no_machine_and_nothing_lost(provider, "c1", s3_bucket, outcome, {"s.bin"})

_ORCHESTRATOR = """
import sys, time
from pathlib import Path
from jex.infra.cost_ledger import CostLedger
from jex.infra.providers import SSHProvider
from jex.infra.machine import MachineSession, Policy, RemoteJob
tmp, port, key, known = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
p = SSHProvider(str(tmp / "remote"), ["127.0.0.1"], port=port, key_path=Path(key), known_hosts=Path(known))
s = MachineSession(p, campaign="c1", ledger=CostLedger(tmp / "state/ledger.json"), python=sys.executable,
                   state_dir=tmp / "state", policy=Policy(poll_s=0.3, heartbeat_s=0.5, heartbeat_timeout_s=10))
s.start()
job = RemoteJob("j", ["-c", "import os; os.execvp('sh', ['sh', '-c', 'sleep 3; echo result > r.bin'])"],
                ["*.bin"], tmp / "got")
s.launch(job)
print("launched", flush=True)
s.supervise(job)
"""


def test_orchestrator_killed_mid_run_then_reconcile_collects_and_deletes(sshd, tmp_path, s3_bucket):
    proc = subprocess.Popen([sys.executable, "-c", _ORCHESTRATOR, str(tmp_path), str(sshd["port"]),
                             str(sshd["key_path"]), str(sshd["known_hosts"])], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "launched"
    proc.kill()  # the laptop went to sleep
    proc.wait()
    provider = ssh_provider(sshd, tmp_path / "remote")
    orphan = provider.create(None, "stray")  # a machine nobody claims
    assert len(provider.list_machines("c1")) == 1
    report = reconcile(provider, CostLedger(tmp_path / "state" / "ledger.json"), policy=Policy(**FAST), s3=s3_bucket)
    by_id = {m["machine"]: m for m in report["machines"]}
    assert by_id[orphan.id]["action"] == "orphan"
    collected = next(m for m in report["machines"] if m["campaign"] == "c1")
    assert collected["jobs"] == [{"job": "j", "status": "success", "artifacts": 1, "lost": []}]
    assert (tmp_path / "got" / "r.bin").read_text() == "result\n"
    assert provider.list_machines() == [] and report["errors"] == []


# -- the campaign through the lifecycle -----------------------------------------------------------------

def _env(tmp_path, sshd=None, s3_server=None, bucket=None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "JEX_INFRA__STATE_DIR": str(tmp_path / "infra"),
           "JEX_INFRA__POLL_S": "0.5", "JEX_INFRA__HEARTBEAT_S": "1", "JEX_INFRA__WORKER_PYTHON": sys.executable}
    if sshd:
        env.update({"JEX_INFRA__SSH_PORT": str(sshd["port"]), "JEX_INFRA__SSH_KEY_PATH": str(sshd["key_path"]),
                    "JEX_INFRA__SSH_KNOWN_HOSTS": str(sshd["known_hosts"]),
                    "JEX_INFRA__REMOTE_ROOT": str(tmp_path / "remote")})
    if bucket:
        env.update({"JEX_STORE__S3_BUCKET": bucket.bucket, "JEX_STORE__S3_ENDPOINT_URL": s3_server,
                    "JEX_INFRA__AWS_ACCESS_KEY_ID": "test", "JEX_INFRA__AWS_SECRET_ACCESS_KEY": "s3cr3t-not-logged"})
    return env


@pytest.mark.slow
def test_jex_run_over_ssh_runs_the_gpu_stages_through_the_full_lifecycle(sshd, tmp_path, s3_server, s3_bucket,
                                                                         prefect_api_url):
    from jex.sample_suite import write_sample_suite

    suite = write_sample_suite(tmp_path / "suite", rows=36, seed=3)
    out = subprocess.run([sys.executable, "-m", "jex", "run", "--provider", "ssh", "--host", "127.0.0.1", "--suite",
                          str(suite), "--out", str(tmp_path / "runs"), "--shard-rows", "9", "--reason-max-tokens", "6",
                          "--name", "ssh"], env=_env(tmp_path, sshd, s3_server, s3_bucket) |
                         {"JEX_INFRA__PRICE_PER_HOUR": "2.5",  # a host of one's own is billed at the price set
                          "PREFECT_API_URL": prefect_api_url},
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    machines = json.loads((run_dir / "machines.json").read_text())
    (m,) = machines["machines"]
    assert m["machine"]["provider"] == "ssh" and m["teardown"]["reason"] == "campaign stages done"
    assert [j["status"] for j in m["jobs"]] == ["success"] * 3 and m["life_s"] > 0
    assert 0 < m["cost_usd"] <= 2.5 * (m["life_s"] + 60) / 3600, "billed at the price set, for its life"
    first = machines["golden"][0]  # a fresh store, one machine: no replay, the fast pass becomes the reference
    assert (first["rows"], first["ok"], first["established"]) == (0, True, True)
    assert m["engine_starts"] == 1, "one engine process served the golden replay, fast pass and reason jobs"
    (host_pid,) = [r["pid"] for r in m["engine_start_records"]]
    stat = Path(f"/proc/{host_pid}/stat")  # the machine's teardown stopped its engine host (a zombie counts)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    report = (run_dir / "report.md").read_text()
    assert "## Machines" in report and m["machine"]["id"] in report
    assert SSHProvider(str(tmp_path / "remote"), ["127.0.0.1"], port=sshd["port"], key_path=sshd["key_path"],
                       known_hosts=sshd["known_hosts"]).list_machines() == []
    keys = {o["Key"] for o in s3_bucket.client.list_objects_v2(Bucket=s3_bucket.bucket)["Contents"]}
    collected = [j for j in m["jobs"] if j["job"] == "fast_pass"][0]["artifacts"]
    shards = [a for a in collected if "/shard-" in a["s3_key"]]
    assert len(shards) == 4 and all(a["s3_key"] in keys for a in collected)
    assert len(collected) == 5, "the four shards and the machine's work record (its compute seconds)"
    for f in [*run_dir.rglob("*.json"), *run_dir.rglob("*.md"), tmp_path / "infra" / "ledger.json"]:
        assert "s3cr3t-not-logged" not in f.read_text()
    assert "s3cr3t-not-logged" not in out.stdout + out.stderr


@pytest.mark.slow
def test_golden_replay_mismatch_stops_the_machine_before_its_shards(tmp_path, monkeypatch, prefect_harness):
    import polars as pl

    from jex.engine_spec import EngineSpec
    from jex.flows.machines.fleet import GpuFleet
    from jex.flows.machines.golden import GoldenMismatch
    from jex.sample_suite import write_sample_suite
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.golden import reference_path
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.documents import GoldenVerdict
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore, write_parquet

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=write_sample_suite(tmp_path / "suite", rows=18, seed=1))
    job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(), shard_rows=9), store=str(store.root))
    spec = MachinesSpec(provider="local", golden_rows=6)
    with GpuFleet(spec, campaign="g", store=str(store.root), settings=load_settings(), echo=lambda s: None) as fleet:
        fleet.run_stage(job)  # the first machine replays nothing: its fast pass's first rows become the reference
    assert [g.rows for g in fleet.golden] == [0]
    ref_file = reference_path(store, bundle, fleet.engine_fp, 6)
    ref = pl.read_parquet(ref_file)
    write_parquet(ref.with_columns(pl.col("logprobs").list.eval(pl.element() + 0.01)), ref_file)  # a drifted machine
    for f in (tmp_path / "store" / "fast_pass").rglob("shard-*.parquet"):
        f.unlink()
    second = GpuFleet(spec, campaign="g2", store=str(store.root), settings=load_settings(), echo=lambda s: None)
    with pytest.raises(GoldenMismatch, match="worst rows") as err, second:
        second.run_stage(job)
    verdict = err.value.verdict
    assert isinstance(verdict, GoldenVerdict) and verdict.max_abs_dp > 1e-4 and len(verdict.worst) == 5
    assert second.report().golden == [verdict]  # machines.json lists it
    assert second.provider.list_machines() == []
    assert [j.job for j in second.sessions[0].outcomes] == ["golden"]  # no shard job was started
    assert not list((tmp_path / "store" / "fast_pass").rglob("shard-*.parquet"))


@pytest.mark.slow
def test_a_machine_life_whose_task_run_ends_without_its_steps_fails_the_stage_instead_of_waiting(
        tmp_path, monkeypatch, prefect_harness):
    """Prefect may fail a task run before its function runs (its database busy, say): the fleet's bootstrap order
    to that life must fail, not wait forever for a step nobody will take."""
    from prefect import task

    from jex.engine_spec import EngineSpec
    from jex.errors import InfraError
    from jex.flows.machines import fleet as fleet_module
    from jex.flows.machines.fleet import GpuFleet
    from jex.sample_suite import write_sample_suite
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    @task(name="machine")
    def never_begins(label: str, life: object) -> None:
        raise RuntimeError("the task run could not begin")

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(fleet_module, "machine_life", never_begins)
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=write_sample_suite(tmp_path / "suite", rows=18, seed=1))
    job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(), shard_rows=18), store=str(store.root))
    fleet = GpuFleet(MachinesSpec(provider="local"), campaign="b", store=str(store.root), settings=load_settings(),
                     echo=lambda s: None)
    with pytest.raises(InfraError, match="no bootstrap step, its life ended \\(its task run ended\\)"), fleet:
        fleet.run_stage(job)


@pytest.mark.slow
def test_golden_generation_is_token_identical_on_every_machine_or_the_machine_stops(tmp_path, monkeypatch,
                                                                                   prefect_harness):
    """The first machine's greedy generation becomes the reference of the bundle, engine and GPU models; the
    second machine's matches it token for token (the HF engine's lock-step decoder, the CPU twin of vLLM's
    batch invariance); a machine generating other tokens stops before its shards, naming the row."""
    import polars as pl

    from jex.engine_spec import EngineSpec
    from jex.flows.machines.fleet import GpuFleet
    from jex.flows.machines.golden import GoldenMismatch
    from jex.sample_suite import write_sample_suite
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.documents import GenerationVerdict
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore, write_parquet

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=write_sample_suite(tmp_path / "suite", rows=18, seed=1))
    job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(), shard_rows=9), store=str(store.root))
    spec = MachinesSpec(provider="local", workers=2, concurrent=False, golden_rows=4, golden_generation_rows=3,
                        golden_generation_tokens=5)
    with GpuFleet(spec, campaign="g", store=str(store.root), settings=load_settings(), echo=lambda s: None) as fleet:
        fleet.run_stage(job)
    first, second = (g.generation for g in fleet.golden)
    assert first is not None and second is not None
    assert (first.established, first.ok, first.rows, first.tokens) == (True, True, 3, 5)
    assert (second.established, second.ok, second.differing) == (False, True, [])
    assert second.reference == first.reference
    ref = pl.read_parquet(first.reference)
    assert ref["run_id"].to_list() == bundle_rows_head(store, bundle, 3)
    assert all(0 < len(t) <= 5 for t in ref["token_ids"].to_list())
    drifted = ref.with_columns(pl.when(pl.col("run_id") == ref["run_id"][1])
                               .then(pl.col("token_ids").list.eval(pl.element() + 1))
                               .otherwise(pl.col("token_ids")).alias("token_ids"))
    write_parquet(drifted, Path(first.reference))  # as if the reference machine had decoded otherwise
    for f in (tmp_path / "store" / "fast_pass").rglob("shard-*.parquet"):
        f.unlink()
    again = GpuFleet(spec.model_copy(update={"workers": 1}), campaign="g2", store=str(store.root),
                     settings=load_settings(), echo=lambda s: None)
    with pytest.raises(GoldenMismatch, match=f"{ref['run_id'][1]}: token 0") as err, again:
        again.run_stage(job)
    assert isinstance(err.value.verdict, GenerationVerdict) and not err.value.verdict.ok
    assert [j.job for j in again.sessions[0].outcomes] == ["golden"]  # no shard job was started
    assert not list((tmp_path / "store" / "fast_pass").rglob("shard-*.parquet"))


@pytest.mark.slow
def test_a_campaign_runs_only_with_settings_a_stored_passing_bake_off_covers(tmp_path, monkeypatch, prefect_harness):
    """The CPU twin of the vLLM audit (`machines.audit = "always"`: the HF engine through the same path): the
    first campaign's golden job probes the campaign's own engine (one engine start for audit and campaign)
    with the control arm beside it, and stores a proven audit; the next one on the same machine kind, stack
    and model shape reuses it; a stored failed audit refuses the campaign before its golden replay."""
    from jex.engine_spec import EngineSpec
    from jex.flows.machines.audit import SettingsAudit, SettingsNotAudited
    from jex.flows.machines.fleet import GpuFleet
    from jex.record import read_record
    from jex.sample_suite import write_sample_suite
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.invariance import PROBE_FILE, ProbeOutcome
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=write_sample_suite(tmp_path / "suite", rows=18, seed=1))
    job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(batch_size=2), shard_rows=18),
                    store=str(store.root))
    # 6 prompts x 12 tokens: the size at which the control arm diverges on this model (at 3 x 6 it stays quiet and the
    # probe is lengthened x2 to this size, a path test_settings_audit covers): one scale, not two
    spec = MachinesSpec(provider="local", golden_rows=2, golden_generation_rows=0, audit="always", audit_prompts=6,
                        audit_tokens=12)

    def fleet(name: str) -> GpuFleet:
        return GpuFleet(spec, campaign=name, store=str(store.root), settings=load_settings(), echo=lambda s: None)

    with fleet("a1") as first:
        first.run_stage(job)
    audit = first.audit
    assert audit is not None and (audit.arm, audit.control, audit.ladder) == ("hf-bi", "hf-control", [1, 2])
    assert audit.status == "proven" and audit.powered and not audit.reused and audit.gpus == []
    assert audit.shape is not None and audit.shape.layers == 30 and audit.effective is not None
    assert (Path(audit.folder) / "bakeoff.json").exists() and (Path(audit.folder) / "audit.json").exists()
    assert [j.job for j in first.sessions[0].outcomes][0] == "golden"  # the probe ran inside the golden job
    assert not any(j.job.startswith("lab") for j in first.sessions[0].outcomes)
    assert first.report().engine_starts == 1  # one engine start for the audit and the campaign
    first_probe = tmp_path / "store" / ".machines" / first.sessions[0].machine.id / "golden" / "audit" / PROBE_FILE
    assert read_record(ProbeOutcome, first_probe).control_beside_start  # the control started with it, not after
    assert first.report().audit == audit  # machines.json says which audit covers the settings
    for f in (tmp_path / "store" / "fast_pass").rglob("shard-*.parquet"):
        f.unlink()
    with fleet("a2") as second:
        second.run_stage(job)
    assert second.audit is not None and second.audit.reused and second.audit.key == audit.key
    probed = tmp_path / "store" / ".machines" / second.sessions[0].machine.id / "golden" / "audit" / "probe.json"
    assert not probed.exists()  # no probe ran again: its golden job only replayed
    failed = SettingsAudit.model_validate({**audit.model_dump(), "passed": False,
                                           "verdict": "NOT INVARIANT: hf-bi differ from their reference run"})
    (Path(audit.folder) / "audit.json").write_text(failed.model_dump_json())
    for f in (tmp_path / "store" / "fast_pass").rglob("shard-*.parquet"):
        f.unlink()
    third = fleet("a3")
    with pytest.raises(SettingsNotAudited, match="engine settings 'hf-bi' are not batch invariant on"), third:
        third.run_stage(job)
    assert not any(j.job.startswith("golden") for j in third.sessions[0].outcomes)
    assert third.provider.list_machines() == []


def bundle_rows_head(store, bundle, n: int) -> list[str]:
    from jex.tasks.bundle.reading import bundle_rows

    return bundle_rows(bundle, store).head(n)["run_id"].to_list()


def test_jex_infra_reconcile_deletes_orphans_from_the_command_line(tmp_path):
    state = tmp_path / "infra"
    orphan = LocalProvider(state / "machines").create(None, "stray")
    out = subprocess.run([sys.executable, "-m", "jex", "infra", "reconcile"], env=_env(tmp_path), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{orphan.id} (no campaign): orphan" in out.stdout
    assert LocalProvider(state / "machines").list_machines() == []
    ledger = CostLedger(state / "ledger.json").get(orphan.id)
    assert ledger.end_reason == "reconcile: orphan" and ledger.deleted_at is not None


def test_jobs_see_the_path_the_bootstrap_checked_the_engine_tools_on(tmp_path):
    """A build tool only in the stack's bin folder (as pip puts `ninja` beside the stack's python) passes the
    bootstrap's check, and the job finds it too: both look with that folder first on PATH."""
    import shutil

    stack = tmp_path / "stack" / "bin"
    stack.mkdir(parents=True)
    (stack / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (stack / "jex-test-build-tool").write_text("#!/bin/sh\necho built > built.bin\n")
    for tool in stack.iterdir():
        tool.chmod(0o755)
    assert shutil.which("jex-test-build-tool") is None  # on no other PATH
    provider = LocalProvider(tmp_path / "machines")
    session = MachineSession(provider, campaign="c1", ledger=CostLedger(tmp_path / "state" / "ledger.json"),
                             policy=Policy(**FAST, watchdog=False), python=str(stack / "python"),
                             state_dir=tmp_path / "state", tools=("jex-test-build-tool",))
    with session:
        outcome = session.run(shell_job("j", "jex-test-build-tool", tmp_path / "got"))
    assert outcome.status == "success" and (tmp_path / "got" / "built.bin").read_text() == "built\n"
    assert session.bin_dir == str(stack) and provider.list_machines() == []


# -- the stack install: uv where it can stand in for pip, pip the fallback ------------------------------

FAKE_UV = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("uv 0.0.0 (fake)")
    sys.exit(0)
with open(os.environ["FAKE_UV_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_UV_FAILS"):
    sys.exit(2)
# `uv pip install --python P [uv's own options] [pip's options] -r stack.lock`: pip does the install
python = args[args.index("--python") + 1]
own = {{"--python", python, "--index-strategy", "unsafe-best-match", "--compile-bytecode"}}
sys.exit(subprocess.call([python, "-m", "pip", "install", *[a for a in args[2:] if a not in own]]))
"""


def _tiny_wheel(folder: Path) -> None:
    """`jex-test-pin` 1.0, a wheel pip installs offline from `folder`."""
    import base64
    import hashlib
    import zipfile

    files = {"jex_test_pin/__init__.py": b"",
             "jex_test_pin-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: jex-test-pin\nVersion: 1.0\n",
             "jex_test_pin-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: jex-test\nRoot-Is-Purelib: true\n"
                                                 b"Tag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for p, d in files.items()) + "jex_test_pin-1.0.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "jex_test_pin-1.0-py3-none-any.whl", "w") as z:
        for p, d in {**files, "jex_test_pin-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(p, d)


def _bootstrap(tmp_path: Path, *, fake_uv: bool = True, uv_fails: bool = False,
               pip_conf: str | None = None) -> tuple[dict, str, list[list[str]]]:
    """Run bootstrap.sh on a stack.lock the interpreter does not satisfy (the pin `jex-test-pin==1.0`, offline
    from a folder); returns its JSON line, its log and the fake uv's calls."""
    import tarfile

    w, tools = tmp_path / "w", tmp_path / "tools"
    _tiny_wheel(tmp_path / "wheels")
    w.mkdir(exist_ok=True)
    tools.mkdir(exist_ok=True)
    with tarfile.open(w / "code-abc.tar.gz", "w:gz"):
        pass
    (w / "stack.lock").write_text("jex-test-pin==1.0\n")
    if fake_uv:
        (tools / "uv").write_text(FAKE_UV.format(python=sys.executable))
        (tools / "uv").chmod(0o755)
    conf = tmp_path / "pip.conf"
    conf.write_text(pip_conf or "")
    calls = tmp_path / "uv-calls"
    env = {"PATH": f"{tools}:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_CONFIG_FILE": str(conf) if pip_conf
           else os.devnull, "FAKE_UV_CALLS": str(calls), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "JEX_PIP_ARGS": "" if pip_conf else f"--no-index --find-links {tmp_path / 'wheels'}",
           **({"FAKE_UV_FAILS": "1"} if uv_fails else {})}
    out = subprocess.run(["bash", str(ROOT / "infra" / "bootstrap.sh"), str(w), "abc", sys.executable], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:] + (w / "bootstrap.log").read_text()[-2000:]
    uv_calls = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return json.loads(out.stdout.splitlines()[-1]), (w / "bootstrap.log").read_text(), uv_calls


def test_the_bootstrap_installs_a_missing_stack_with_uv_and_reuses_it(tmp_path):
    boot, log, calls = _bootstrap(tmp_path)
    assert boot["stack"] == "installed" and boot["python"] == str(tmp_path / "w" / "stack" / "bin" / "python")
    assert "stack installed with uv 0.0.0 (fake)" in log
    (call,) = calls
    assert call[:4] == ["pip", "install", "--python", boot["python"]] and call[-2:] == ["-r", "stack.lock"]
    assert f"--find-links {tmp_path / 'wheels'}" in " ".join(call)  # JEX_PIP_ARGS reach uv too
    again, _, calls = _bootstrap(tmp_path)  # the same pins: the stack is found, nothing installed
    assert again["stack"] == "reused" and again["python"] == boot["python"] and len(calls) == 1


def test_the_bootstrap_falls_back_to_pip_when_uv_fails(tmp_path):
    boot, log, calls = _bootstrap(tmp_path, uv_fails=True)
    assert boot["stack"] == "installed" and len(calls) == 1
    assert "failed; installing with pip" in log and log.rstrip().endswith("stack installed with pip")


def test_a_machine_whose_pip_is_configured_keeps_pip(tmp_path):
    """uv reads no pip.conf: where pip is configured (here its index and find-links), pip installs."""
    boot, log, calls = _bootstrap(tmp_path, pip_conf=f"[global]\nno-index = true\nfind-links = {tmp_path / 'wheels'}\n")
    assert boot["stack"] == "installed" and calls == [] and log.rstrip().endswith("stack installed with pip")
