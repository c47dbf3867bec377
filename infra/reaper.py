"""Build providers from settings, and reconcile: no machine outlives the orchestrator that started it.

After a restart (the laptop-sleep case) `reconcile` lists every machine the provider tags as jex's:
those still running are supervised to the end, those that finished while nobody watched are
collected, orphans without a campaign are torn down, those that powered off (their watchdog's doing)
have their results adopted from S3. Every machine it touches ends deleted.

`check_results_survive` is the one rule that a campaign on a provider whose machines lose their disk
when they power off needs a bucket: the CLI's pre-flight and the fleet both apply it.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from jex.errors import InputError
from jex.infra.cost_ledger import CostLedger
from jex.infra.machine import (
    POLICY_SETTINGS,
    JobFailed,
    MachineSession,
    Policy,
    RemoteJob,
    adopt_artifacts,
    self_terminated_marker,
)
from jex.infra.providers import (
    CommandProvider,
    CommandTemplates,
    EC2Provider,
    LocalProvider,
    Machine,
    Provider,
    SSHAuth,
    SSHProvider,
)
from jex.infra.records import JobRecord, LostJob, ReconciledJob, ReconciledMachine, ReconcileReport, SelfTerminated
from jex.infra.s3 import S3Store
from jex.infra.shell import LocalShell, Shell, ShellError
from jex.infra.watchdog import MARKER

if TYPE_CHECKING:
    from jex.settings import InfraSettings

log = logging.getLogger(__name__)
Echo = Callable[[str], None]


def make_provider(infra: InfraSettings, *, name: str | None = None, hosts: list[str] | None = None) -> Provider:
    """The provider named in settings (or `name`), configured from `JEX_INFRA__*`; secrets stay in memory."""
    name = name or infra.provider
    ssh = SSHAuth(key_path=infra.ssh_key_path, known_hosts=infra.ssh_known_hosts,
                  key_text=infra.ssh_private_key.get_secret_value() if infra.ssh_private_key else None,
                  key_source=(f"the SSH private key of the Prefect block {infra.ssh_private_key_block} "
                              "(JEX_INFRA__SSH_PRIVATE_KEY_BLOCK)" if infra.ssh_private_key_block
                              else "JEX_INFRA__SSH_PRIVATE_KEY"),
                  accept_new_host_keys=infra.accept_new_host_keys)
    if name == "local":
        return LocalProvider(Path(infra.state_dir) / "machines")
    if name == "ssh":
        return SSHProvider(infra.remote_root, hosts or infra.hosts, port=infra.ssh_port, user=infra.ssh_user,
                           **ssh.model_dump())
    if name == "ec2":
        from jex.infra.aws import aws_client

        client = aws_client("ec2", region=infra.ec2_region, endpoint_url=infra.ec2_endpoint_url, infra=infra)
        return EC2Provider(client, instance_type=infra.ec2_instance_type, image_id=infra.ec2_image_id,
                           image_name=infra.ec2_image_name, image_owner=infra.ec2_image_owner,
                           key_name=infra.ec2_key_name, user=infra.ssh_user, ssh=ssh)
    if name == "command":
        templates = CommandTemplates(infra.command_create, infra.command_describe, infra.command_list,
                                     infra.command_delete)
        if not all((templates.create, templates.describe, templates.list_machines, templates.delete)):
            raise InputError("the command provider needs JEX_INFRA__COMMAND_CREATE, _DESCRIBE, _LIST and _DELETE")

        def shell_for(m: Machine) -> Shell:
            if m.host in ("", "localhost"):
                return LocalShell()
            return ssh.shell(m.host, m.port or 22, m.user or infra.ssh_user, host_key=m.host_key)

        return CommandProvider(templates, shell_for=shell_for, keeps_disk=infra.command_keeps_disk)
    from jex.settings import PROVIDER_NAMES

    raise InputError(f"unknown provider {name!r}; providers that rent machines: "
                     f"{', '.join(p for p in PROVIDER_NAMES if p != 'inprocess')}", field="provider")


def keeps_disk(name: str, infra: InfraSettings) -> bool:
    """Whether a machine of provider `name`, as the settings configure it, keeps its disk after it powers
    off (`Provider.keeps_disk`); `inprocess` rents no machine, so nothing can be lost."""
    if name == "command":
        return infra.command_keeps_disk
    cls: dict[str, type[Provider]] = {"local": LocalProvider, "ssh": SSHProvider, "ec2": EC2Provider}
    return cls[name].keeps_disk if name in cls else True


def check_results_survive(provider: str, *, keeps_disk: bool, bucket: str | None, watchdog: bool) -> None:
    """Refuse, in one line, a campaign whose machines would power themselves off (their watchdog, at a
    lease expiry) with results only on a disk the provider does not keep: it needs a bucket to upload to
    first. Called before any machine is created (`jex run`'s pre-flight, `GpuFleet`)."""
    if keeps_disk or bucket or not watchdog:
        return
    keep = " (or JEX_INFRA__COMMAND_KEEPS_DISK=true if your cloud keeps a stopped VM's disk)" \
        if provider == "command" else ""
    raise InputError(f"--provider {provider}: its machines lose their disk when they power off, as a machine whose "
                     f"orchestrator disappears does, and no bucket is set for its results: set JEX_STORE__S3_BUCKET"
                     f"{keep}")


def policy_from_settings(infra: InfraSettings, **overrides: Any) -> Policy:
    """The machine policy of the settings: every Policy field that is a setting (`POLICY_SETTINGS`), by its
    name, and the hard time to live of `ttl_hours`; `overrides` last."""
    return Policy(**{**{name: getattr(infra, name) for name in POLICY_SETTINGS},
                     "ttl_s": infra.ttl_hours * 3600 if infra.ttl_hours else None, **overrides})


def _jobs_on(session: MachineSession) -> list[JobRecord]:
    started = session.started
    wd = shlex.quote(started.machine.workdir)
    out = started.shell.run(f'for f in {wd}/jobs/*/job.json; do [ -f "$f" ] && tr -d "\\n" < "$f" && echo; done; true'
                            ).stdout
    return [JobRecord.model_validate_json(line) for line in out.splitlines() if line.strip()]


LOST_AFTER_S = 900.0
"""A machine younger than this is never called lost: a cloud's listing can lag its creation."""


def _collect_jobs(session: MachineSession, jobs: list[ReconciledJob]) -> None:
    """Supervise every job the machine holds to its end and collect it (no job is launched again);
    each is added to `jobs` as it ends (so an error later keeps the ones before it)."""
    for rec in _jobs_on(session):
        session.python, session.code_dir = rec.python, rec.code
        job = RemoteJob.from_record(rec)
        try:
            outcome = session.run(job, relaunch=False)
        except JobFailed as e:
            outcome = e.outcome
        jobs.append(ReconciledJob(job=job.name, status=outcome.status, artifacts=len(outcome.artifacts),
                                  lost=outcome.lost))


def _reconcile_machine(provider: Provider, ledger: CostLedger, machine: Machine, errors: list[str], *,
                       policy: Policy | None, s3: S3Store | None, echo: Echo) -> ReconciledMachine:
    """Collect a campaign's machine (or call it an orphan), then delete it; errors are added to `errors`."""
    session = MachineSession(provider, campaign=machine.campaign or "orphans", ledger=ledger, policy=policy,
                             s3=s3, echo=echo, machine=machine)
    ledger.open(machine.id, machine.campaign, provider.name, session.price_per_hour, machine.created_at)
    action: Literal["collected", "orphan"] = "collected" if machine.campaign else "orphan"
    jobs: list[ReconciledJob] = []
    try:
        if machine.campaign:
            _collect_jobs(session, jobs)
    except (ShellError, OSError, ValueError) as e:
        errors.append(f"{machine.id}: {e}")
    finally:
        teardown = session.teardown(f"reconcile: {action}")
    echo(f"reconcile: {machine.id} ({machine.campaign or 'no campaign'}): {action}, deleted")
    return ReconciledMachine(machine=machine.id, campaign=machine.campaign, action=action, jobs=jobs,
                             teardown=teardown)


def sweep(provider: Provider, ledger: CostLedger, *, policy: Policy | None = None, s3: S3Store | None = None,
          campaign: str | None = None, echo: Echo | None = None, lost_after_s: float = LOST_AFTER_S
          ) -> ReconcileReport:
    """Supervise, collect and delete every jex machine the provider lists (of one campaign, or all);
    adopt what machines that stopped themselves left in S3, and delete those still listed powered off
    (`_delete_powered_off`); name the machines that are gone (`report_lost`)."""
    say: Echo = echo or (lambda s: log.info("%s", s))
    machines: list[ReconciledMachine] = []
    errors: list[str] = []
    powered_off = []
    for machine in provider.list_machines(campaign):
        if machine.powered_off:  # nothing runs on it to collect: what it handed over is in S3, if anywhere
            powered_off.append(machine)
            continue
        machines.append(_reconcile_machine(provider, ledger, machine, errors, policy=policy, s3=s3, echo=say))
    if s3 is not None:
        try:
            machines += adopt_self_terminated(s3, ledger, campaign=campaign, skip={m.machine for m in machines},
                                              provider=provider.name, policy=policy or Policy(), echo=say)
        except Exception as e:  # noqa: BLE001 - S3 down: report it; the next reconcile adopts them
            errors.append(f"adopting self-terminated machines from S3: {type(e).__name__}: {e}")
            # S3 could not be read: what looks lost may be there (a powered-off machine's results too);
            # decide at the next reconcile
            return ReconcileReport(machines=machines, errors=errors)
    machines = _delete_powered_off(provider, ledger, powered_off, machines, errors, policy=policy, echo=say)
    machines += report_lost(ledger, provider, campaign=campaign, seen={m.machine for m in machines}, echo=say,
                            after_s=lost_after_s)
    return ReconcileReport(machines=machines, errors=errors)


def _delete_powered_off(provider: Provider, ledger: CostLedger, powered_off: list[Machine],
                        machines: list[ReconciledMachine], errors: list[str], *, policy: Policy | None,
                        echo: Echo) -> list[ReconciledMachine]:
    """Delete the machines listed powered off (a stopped VM still holds quota): `machines` with each one's
    teardown added to its adoption from S3, or a `stopped` entry naming the jobs whose results went with
    its disk. A machine S3 does not account for, on a provider that keeps disks, is kept (its results may
    be on its disk) and named in `errors`."""
    adopted = {m.machine: m for m in machines if m.action == "adopted"}
    out = [m for m in machines if m.machine not in {p.id for p in powered_off}]
    for machine in powered_off:
        entry = ledger.get(machine.id)
        accounted = machine.id in adopted or (entry is not None and (entry.end_reason or "").startswith(
            "self-terminated"))
        if not accounted and provider.keeps_disk and machine.campaign:
            errors.append(f"{machine.id} ({machine.campaign}) is powered off ({machine.state}) and its results are "
                          f"not in S3 but may be on its disk, which provider {provider.name} keeps: start it and "
                          "reconcile again to collect them, or delete it")
            continue
        session = MachineSession(provider, campaign=machine.campaign or "orphans", ledger=ledger, policy=policy,
                                 echo=echo, machine=machine)
        ledger.open(machine.id, machine.campaign, provider.name, session.price_per_hour, machine.created_at)
        teardown = session.teardown(f"reconcile: powered off ({machine.state})")
        if accounted:
            found = adopted.get(machine.id) or ReconciledMachine(machine=machine.id, campaign=machine.campaign,
                                                                 action="adopted")
            out.append(found.model_copy(update={"teardown": teardown}))
            echo(f"reconcile: {machine.id} ({machine.campaign}) was powered off ({machine.state}): deleted")
            continue
        jobs = _recorded_jobs(ledger, machine.id) if machine.campaign else []
        out.append(ReconciledMachine(machine=machine.id, campaign=machine.campaign, action="stopped", jobs=jobs,
                                     teardown=teardown))
        echo(f"reconcile: {machine.id} ({machine.campaign or 'no campaign'}) was powered off ({machine.state}) with "
             f"nothing of it in S3: deleted; whatever job(s) {', '.join(j.job for j in jobs) or 'none recorded'} "
             "had not handed over went with its disk")
    return out


def reconcile(provider: Provider, ledger: CostLedger, *, policy: Policy | None = None, s3: S3Store | None = None,
              campaign: str | None = None, echo: Echo | None = None, lost_after_s: float = LOST_AFTER_S
              ) -> dict[str, Any]:
    """`sweep`, its report as JSON (for the reconcile flow and the CLI, which read it by key)."""
    return sweep(provider, ledger, policy=policy, s3=s3, campaign=campaign, echo=echo,
                 lost_after_s=lost_after_s).model_dump()


def _recorded_jobs(ledger: CostLedger, machine_id: str) -> list[LostJob]:
    """The jobs the orchestrator launched on a machine (its records in the state folder), with the
    artifact patterns whatever it had not handed over would have matched."""
    records = sorted((Path(ledger.path).parent / "jobs").glob(f"{machine_id}-*.json"))
    return [LostJob(job=rec.name, lost=rec.artifacts, collect_to=rec.collect_to)
            for rec in (JobRecord.model_validate_json(p.read_text()) for p in records)]


def report_lost(ledger: CostLedger, provider: Provider, *, campaign: str | None, seen: set[str], echo: Echo,
                after_s: float = LOST_AFTER_S) -> list[ReconciledMachine]:
    """Machines the ledger holds open that this provider leased (same provider, and for host providers
    one of its hosts), that it no longer knows (`describe` is None), that S3 did not account for, and
    that are older than `after_s`: gone with whatever they had not handed over. Each is reported with
    the jobs it ran and closed in the ledger as lost (so it is named once, and its cost stops)."""
    hosts = set(getattr(provider, "hosts", []) or [])
    entries = []
    for e in ledger.entries(campaign):
        if e.deleted_at is not None or e.provider != provider.name or e.machine_id in seen:
            continue
        if hosts and e.host not in hosts:
            continue  # leased on a host this provider was not told about (`--host`): not ours to judge
        if time.time() - e.created_at < after_s or provider.describe(e.machine_id) is not None:
            continue
        jobs = _recorded_jobs(ledger, e.machine_id)
        ledger.close(e.machine_id, "lost: gone without its results reaching the orchestrator or S3")
        entries.append(ReconciledMachine(machine=e.machine_id, campaign=e.campaign, action="lost", jobs=jobs))
        echo(f"reconcile: {e.machine_id} ({e.campaign or 'no campaign'}) is gone and nothing of it reached S3: "
             f"whatever job(s) {', '.join(j.job for j in jobs) or 'none recorded'} had not handed over is lost")
    return entries


def _self_terminated_in_s3(s3: S3Store, campaign: str | None, skip: set[str]) -> list[tuple[str, str]]:
    """(campaign, machine) of every SELF_TERMINATED.json under the campaigns' prefix, less `skip`."""
    root = s3.key("campaigns") + "/"
    found = []
    for obj in s3.list_objects(root + (f"{campaign}/" if campaign else "")):
        parts = obj.key[len(root):].split("/")  # <campaign>/machines/<machine>/SELF_TERMINATED.json
        if len(parts) == 4 and parts[1] == "machines" and parts[3] == MARKER and parts[2] not in skip:
            found.append((parts[0], parts[2]))
    return found


def _adopt_jobs(s3: S3Store, machine_id: str, doc: SelfTerminated) -> list[ReconciledJob]:
    """Fetch a self-terminated machine's artifacts where their jobs said they belong (sha256-verified)."""
    jobs = []
    for name, job in doc.jobs.items():
        transfer = adopt_artifacts(s3, job, RemoteJob.from_record(job.record).local_path)
        status = "adopted" if job.status == "success" and not transfer.lost else "self_terminated"
        jobs.append(ReconciledJob(job=name, status=status, artifacts=len(transfer.artifacts), lost=transfer.lost))
    return jobs


def adopt_self_terminated(s3: S3Store, ledger: CostLedger, *, campaign: str | None, skip: set[str], provider: str,
                          policy: Policy, echo: Echo) -> list[ReconciledMachine]:
    """Machines that stopped themselves (their SELF_TERMINATED.json in S3): fetch their artifacts where
    their jobs said they belong (sha256-verified) and record them in the ledger as self-terminated."""
    entries = []
    for camp, machine_id in _self_terminated_in_s3(s3, campaign, skip):
        known = ledger.get(machine_id)
        if known is not None and (known.end_reason or "").startswith("self-terminated"):
            continue  # adopted before
        state = Path(ledger.path).parent / "self-terminated" / f"{machine_id}.json"
        doc = self_terminated_marker(s3, camp, machine_id, state)
        if doc is None:
            continue
        jobs = _adopt_jobs(s3, machine_id, doc)
        ledger.open(machine_id, camp, provider, policy.price_per_hour or 0.0, doc.created_at or doc.time)
        ledger.close(machine_id, f"self-terminated: {doc.reason}", doc.time)
        entries.append(ReconciledMachine(machine=machine_id, campaign=camp, action="adopted", jobs=jobs))
        echo(f"reconcile: {machine_id} ({camp}) stopped itself ({doc.reason}); adopted "
             f"{sum(j.artifacts for j in jobs)} artifact(s) from S3")
    return entries
