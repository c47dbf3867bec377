"""Build providers from settings, and reconcile: no machine outlives the orchestrator that started it.

After a restart (the laptop-sleep case) `reconcile` lists every machine the provider tags as jex's:
those still running are supervised to the end, those that finished while nobody watched are
collected, orphans without a campaign are torn down. Every machine it touches ends deleted.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

from infra.ledger import Ledger
from infra.providers import CommandProvider, CommandTemplates, EC2Provider, LocalProvider, Provider, SSHProvider
from infra.remote import JobFailed, MachineSession, Policy, RemoteJob
from infra.shell import ShellError

log = logging.getLogger("jex.infra.reconcile")


def make_provider(infra: Any, *, name: str | None = None, hosts: list[str] | None = None) -> Provider:
    """The provider named in settings (or `name`), configured from `JEX_INFRA__*`; secrets stay in memory."""
    name = name or infra.provider
    ssh = {"key_path": infra.ssh_key_path, "known_hosts": infra.ssh_known_hosts,
           "key_text": infra.ssh_private_key.get_secret_value() if infra.ssh_private_key else None,
           "accept_new_host_keys": infra.accept_new_host_keys}
    if name == "local":
        return LocalProvider(Path(infra.state_dir) / "machines")
    if name == "ssh":
        return SSHProvider(infra.remote_root, hosts or infra.hosts, port=infra.ssh_port, user=infra.ssh_user, **ssh)
    if name == "ec2":
        from infra.aws import aws_client

        client = aws_client("ec2", region=infra.ec2_region, endpoint_url=infra.ec2_endpoint_url, infra=infra)
        return EC2Provider(client, image_id=infra.ec2_image_id, instance_type=infra.ec2_instance_type,
                           key_name=infra.ec2_key_name, user=infra.ssh_user, ssh=ssh)
    if name == "command":
        templates = CommandTemplates(infra.command_create, infra.command_describe, infra.command_list,
                                     infra.command_delete)
        if not all((templates.create, templates.describe, templates.list, templates.delete)):
            raise ValueError("the command provider needs JEX_INFRA__COMMAND_CREATE, _DESCRIBE, _LIST and _DELETE")
        from infra.shell import LocalShell, SSHShell

        def shell_for(m: Any) -> Any:
            if m.host in ("", "localhost"):
                return LocalShell()
            return SSHShell(m.host, m.port or 22, m.user or infra.ssh_user, host_key=m.host_key, **ssh)

        return CommandProvider(templates, shell_for=shell_for)
    raise ValueError(f"unknown provider {name!r}")


def policy_from_settings(infra: Any, **overrides: Any) -> Policy:
    return Policy(**{"poll_s": infra.poll_s, "heartbeat_s": infra.heartbeat_s,
                     "heartbeat_timeout_s": infra.heartbeat_timeout_s, "budget_usd": infra.budget_usd,
                     "price_per_hour": infra.price_per_hour, "wall_budget_s": infra.budget_hours * 3600, **overrides})


def _jobs_on(session: MachineSession) -> list[dict[str, Any]]:
    wd = shlex.quote(session.machine.workdir)
    out = session.shell.run(f'for f in {wd}/jobs/*/job.json; do [ -f "$f" ] && tr -d "\\n" < "$f" && echo; done; true'
                           ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def reconcile(provider: Provider, ledger: Ledger, *, policy: Policy | None = None, s3: Any = None,
              campaign: str | None = None, echo: Any = None) -> dict[str, Any]:
    """Supervise, collect and delete every jex machine the provider lists (of one campaign, or all)."""
    echo = echo or (lambda s: log.info("%s", s))
    report: dict[str, Any] = {"machines": [], "errors": []}
    for machine in provider.list(campaign):
        entry: dict[str, Any] = {"machine": machine.id, "campaign": machine.campaign, "jobs": []}
        session = MachineSession(provider, campaign=machine.campaign or "orphans", ledger=ledger, policy=policy,
                                 s3=s3, echo=echo, machine=machine)
        ledger.open(machine.id, machine.campaign, provider.name, session.policy.price_per_hour, machine.created_at)
        try:
            if not machine.campaign:
                entry["action"] = "orphan"
            else:
                entry["action"] = "collected"
                for rec in _jobs_on(session):
                    session.python, session.code_dir = rec["python"], rec["code"]
                    job = RemoteJob(rec["name"], [], rec["artifacts"], Path(rec["collect_to"]),
                                    strip_prefix=rec.get("strip_prefix", ""))
                    try:
                        outcome = session.run(job, relaunch=False)
                    except JobFailed as e:
                        outcome = e.outcome
                    entry["jobs"].append({"job": job.name, "status": outcome.status,
                                          "artifacts": len(outcome.artifacts), "lost": outcome.lost})
        except (ShellError, OSError, ValueError) as e:
            report["errors"].append(f"{machine.id}: {e}")
        finally:
            entry["teardown"] = session.teardown(f"reconcile: {entry.get('action', 'error')}")
        report["machines"].append(entry)
        echo(f"reconcile: {machine.id} ({machine.campaign or 'no campaign'}): {entry.get('action')}, deleted")
    return report

