"""Machine providers behind one interface: create, describe, list by campaign tag, delete.

Every call is idempotent and logged (never with secrets). A machine is tagged with its campaign;
`list_machines()` is what reconciliation walks after an orchestrator restart.

    local    the "machine" is a work folder plus detached processes on this host (embedded default)
    ssh      a lease on an existing host reached with paramiko: a work folder plus its processes
    ec2      boto3: run, tag, describe, terminate instances
    command  any cloud CLI through create/describe/list/delete command templates printing JSON

Each provider declares whether a machine's disk outlives the machine powering itself off
(`Provider.keeps_disk`): a host lease's folder does; an EC2 instance (terminated on shutdown) and, unless
configured otherwise, a command cloud's VM do not.

`python -m jex.infra.providers --state DIR create|describe|list|delete|poweroff ...` drives the local
provider from a shell; the command provider's tests point their templates at it (`poweroff`: what a
cloud that does not keep disks does to a VM that powers off).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jex.errors import InfraError, InputError
from jex.fileio import atomic_open
from jex.infra.shell import LocalShell, Shell, ShellError, SSHShell
from jex.infra.worker_protocol import DETACHED_PGIDS, PGID, POWEROFF_PID
from jex.record import Record

log = logging.getLogger(__name__)
TAG_CAMPAIGN, TAG_MACHINE, TAG_MANAGED = "jex:campaign", "jex:machine", "jex:managed"
POWERED_OFF = frozenset({"stopping", "stopped", "shutoff", "poweroff", "powered-off", "powered_off", "off",
                         "halted", "deallocating", "deallocated", "terminated", "exited"})
"""Machine states (lower-cased) of a VM that powered off but still exists, holding quota: EC2 `stopped`,
OpenStack `SHUTOFF`, GCP `TERMINATED`, Azure `deallocated`, DigitalOcean `off`. A command provider's
`describe`/`list` print the cloud's state in the `state` field."""


class Machine(BaseModel):
    """A machine as its provider describes it (`machine.json` of a host lease, a command's JSON line).
    Fields a provider's command prints beyond these are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    id: str
    provider: str
    campaign: str | None
    host: str = "127.0.0.1"
    port: int = 22
    user: str = "root"
    workdir: str = ""
    created_at: float = Field(default_factory=time.time)
    state: str = "running"
    host_key: str | None = None
    """'TYPE BASE64' returned by the provider (e.g. from the cloud's console output)."""
    meta: dict[str, Any] = Field(default_factory=dict)
    """Provider-specific facts (e.g. the EC2 instance type)."""

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True)

    @property
    def powered_off(self) -> bool:
        """Stopped but not deleted (`POWERED_OFF`): nothing runs on it; reconcile deletes it."""
        return self.state.lower() in POWERED_OFF


class SSHAuth(Record):
    """How SSH shells authenticate and pin host keys (the `SSHShell` keywords of the same names)."""

    key_path: Path | None = None
    key_text: str | None = Field(default=None, repr=False)
    """A private key's text (a secret: never logged, never written)."""
    key_source: str = "the SSH private key"
    """Where `key_text` came from, named when it cannot be loaded (e.g. JEX_INFRA__SSH_PRIVATE_KEY)."""
    known_hosts: Path | None = None
    accept_new_host_keys: bool = False

    def shell(self, host: str, port: int, user: str, *, host_key: str | None = None) -> SSHShell:
        return SSHShell(host, port, user, host_key=host_key, **self.model_dump())


class ProviderError(InfraError):
    """The provider refused or failed a call."""


class Provider(ABC):
    """Create, describe, list and delete machines; all idempotent. `describe` returns None once gone."""

    name: str
    self_shutdown: str = "poweroff"
    """How the machine's watchdog stops it: poweroff (a cloud machine) | host (a lease on a host)."""
    keeps_disk: bool = False
    """Whether a machine's disk, and the results on it, outlive the machine powering itself off. Where it
    does not, a campaign needs a bucket (`jex.infra.reaper.check_results_survive`) and the watchdog never
    powers off with results only on the disk before its hard time to live."""

    def hourly_price(self) -> float:
        """USD/hour of one machine when nobody set a price (`Policy.price_per_hour`): 0 here (a host you have,
        a `command` VM whose price jex cannot know); EC2's from the instance catalogue."""
        return 0.0

    def create(self, campaign: str | None, label: str = "gpu") -> Machine:
        log.info("provider %s: create campaign=%s label=%s", self.name, campaign, label)
        machine = self._create(campaign, label)
        log.info("provider %s: created %s at %s", self.name, machine.id, machine.host)
        return machine

    def describe(self, machine_id: str) -> Machine | None:
        log.debug("provider %s: describe %s", self.name, machine_id)
        return self._describe(machine_id)

    def list_machines(self, campaign: str | None = None) -> list[Machine]:
        """Every machine this provider tags as jex's, or those of `campaign`."""
        machines = self._list()
        log.info("provider %s: list campaign=%s -> %d machine(s)", self.name, campaign, len(machines))
        return [m for m in machines if campaign is None or m.campaign == campaign]

    def delete(self, machine_id: str) -> None:
        log.info("provider %s: delete %s", self.name, machine_id)
        self._delete(machine_id)

    @abstractmethod
    def _create(self, campaign: str | None, label: str) -> Machine: ...

    @abstractmethod
    def _describe(self, machine_id: str) -> Machine | None: ...

    @abstractmethod
    def _list(self) -> list[Machine]: ...

    @abstractmethod
    def _delete(self, machine_id: str) -> None: ...

    @abstractmethod
    def shell(self, machine: Machine) -> Shell: ...


def new_machine_id(label: str) -> str:
    return f"jex-{label}-{uuid.uuid4().hex[:10]}"


# A host lease: `ROOT/<id>/machine.json` marks the machine; its jobs live under `ROOT/<id>/work`.
# Deleting it kills the process group of every job (`worker.pgid`) and of every process that
# outlives jobs (`DETACHED_PGIDS`: the engine hosts), then removes the folder.
_LIST = 'for f in {root}/*/machine.json; do [ -f "$f" ] && cat "$f" && echo; done; true'
_DELETE = ('d={root}/{id}; [ -d "$d" ] || exit 0; '
           f'for p in "$d"/work/watchdog.pid "$d"/work/{POWEROFF_PID} "$d"/work/jobs/*/{PGID} '
           f'"$d"/work/{DETACHED_PGIDS}; do '
           '[ -f "$p" ] && kill -KILL -- -"$(cat "$p")" 2>/dev/null; done; '
           'rm -rf "$d"')


class HostProvider(Provider):
    """Machines as leases on hosts reachable through a shell (this host, or SSH hosts)."""

    def __init__(self, root: str | Path, hosts: list[str] | None = None):
        self.root = str(root)
        self.hosts = hosts or ["127.0.0.1"]
        self._next = 0

    self_shutdown = "host"
    keeps_disk = True  # the watchdog ends a lease by killing its processes; the folder stays unless uploaded

    def _shell_for(self, host: str) -> Shell:
        raise NotImplementedError

    def _create(self, campaign: str | None, label: str) -> Machine:
        host = self.hosts[self._next % len(self.hosts)]
        self._next += 1
        machine = self._machine(new_machine_id(label), campaign, host)
        sh = self._shell_for(host)
        sh.run(f"mkdir -p {shlex.quote(machine.workdir)}/jobs && "
               f"printf '%s' {shlex.quote(machine.to_json())} > {self.root}/{machine.id}/machine.json")
        return machine

    def _machine(self, machine_id: str, campaign: str | None, host: str) -> Machine:
        raise NotImplementedError

    def _describe(self, machine_id: str) -> Machine | None:
        for m in self._list():
            if m.id == machine_id:
                return m
        return None

    def _list(self) -> list[Machine]:
        found = []
        for host in self.hosts:
            out = self._shell_for(host).run(_LIST.format(root=shlex.quote(self.root))).stdout
            found += [Machine.model_validate_json(line) for line in out.splitlines() if line.strip()]
        return found

    def _delete(self, machine_id: str) -> None:
        for host in self.hosts:
            self._shell_for(host).run(_DELETE.format(root=shlex.quote(self.root), id=shlex.quote(machine_id)))


class LocalProvider(HostProvider):
    name = "local"

    def __init__(self, root: str | Path):
        super().__init__(Path(root).resolve(), ["localhost"])

    def _shell_for(self, host: str) -> Shell:
        return LocalShell()

    def _machine(self, machine_id: str, campaign: str | None, host: str) -> Machine:
        return Machine(id=machine_id, provider=self.name, campaign=campaign, host="localhost", port=0, user="",
                       workdir=f"{self.root}/{machine_id}/work")

    def shell(self, machine: Machine) -> Shell:
        return LocalShell()

    def power_off(self, machine_id: str) -> None:
        """What a cloud that does not keep disks does to a VM that powers off: its processes end, its
        disk (the work folder) is wiped, and it stays listed, `stopped`, until deleted. The command
        provider's tests emulate such a cloud with it (`python -m jex.infra.providers ... poweroff ID`,
        the watchdog's `poweroff_command`); a process of the machine that runs it is killed last."""
        home = Path(self.root) / machine_id
        if not (home / "machine.json").is_file():
            return
        work = home / "work"
        groups = []
        for pid_file in [work / "watchdog.pid", work / POWEROFF_PID, *work.glob(f"jobs/*/{PGID}"),
                         *work.glob(DETACHED_PGIDS)]:
            try:
                groups.append(int(pid_file.read_text().strip()))
            except (OSError, ValueError):
                continue
        own = os.getpgrp()
        for pgid in (g for g in groups if g != own):
            _kill_group(pgid)
        machine = Machine.model_validate_json((home / "machine.json").read_text())
        with atomic_open(home / "machine.json", "w") as f:
            f.write(machine.model_copy(update={"state": "stopped"}).to_json())
        shutil.rmtree(work, ignore_errors=True)
        if own in groups:
            _kill_group(own)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


class SSHProvider(HostProvider):
    name = "ssh"

    def __init__(self, root: str, hosts: list[str], *, port: int = 22, user: str = "root",
                 key_path: Path | None = None, key_text: str | None = None, known_hosts: Path | None = None,
                 accept_new_host_keys: bool = False, key_source: str = "the SSH private key"):
        super().__init__(root, hosts)
        self.port, self.user = port, user
        self._ssh = SSHAuth(key_path=key_path, key_text=key_text, known_hosts=known_hosts,
                            accept_new_host_keys=accept_new_host_keys, key_source=key_source)
        self._ssh.shell("", port, user).private_key()  # checked before the first connection
        self._shells: dict[str, SSHShell] = {}

    def _shell_for(self, host: str) -> Shell:
        if host not in self._shells:
            self._shells[host] = self._ssh.shell(host, self.port, self.user)
        return self._shells[host]

    def _machine(self, machine_id: str, campaign: str | None, host: str) -> Machine:
        return Machine(id=machine_id, provider=self.name, campaign=campaign, host=host, port=self.port,
                       user=self.user, workdir=f"{self.root}/{machine_id}/work")

    def shell(self, machine: Machine) -> Shell:
        return self._ssh.shell(machine.host, self.port, self.user)


class EC2Provider(Provider):
    """EC2 instances tagged `jex:managed`, `jex:campaign`, `jex:machine`; reached over SSH. The instance type's
    price comes from the instance catalogue (`jex.infra.instance_catalogue`); the image, unless given, is the
    newest one named like `image_name` owned by `image_owner` (`find_image`, looked up at the first create)."""

    name = "ec2"
    GONE = ("shutting-down", "terminated")
    keeps_disk = False  # created with InstanceInitiatedShutdownBehavior=terminate: a poweroff ends it, disk and all

    def __init__(self, client: Any, *, instance_type: str, image_id: str | None = None, image_name: str = "",
                 image_owner: str = "amazon", key_name: str | None = None, workdir: str = "/opt/jex/work",
                 user: str = "ubuntu", ssh: SSHAuth | None = None):
        self.client, self.image_id, self.instance_type, self.key_name = client, image_id, instance_type, key_name
        self.image_name, self.image_owner = image_name, image_owner
        self.workdir, self.user, self._ssh = workdir, user, ssh or SSHAuth()

    def hourly_price(self) -> float:
        """The instance catalogue's on-demand price of the instance type in the client's region (an InputError
        naming what to set when it has none)."""
        from jex.infra.instance_catalogue import ec2_price

        return ec2_price(self.instance_type, self.client.meta.region_name)

    def find_image(self) -> str:
        """The id of the newest available image named like `image_name` (EC2's `*`/`?` pattern) that
        `image_owner` owns; an InputError naming the settings when there is none."""
        images = self.client.describe_images(
            Owners=[self.image_owner], Filters=[{"Name": "name", "Values": [self.image_name]},
                                                {"Name": "state", "Values": ["available"]}])["Images"]
        if not images:
            raise InputError(f"no EC2 image named like {self.image_name!r} owned by {self.image_owner} in "
                             f"{self.client.meta.region_name}: set JEX_INFRA__EC2_IMAGE_ID, or "
                             "JEX_INFRA__EC2_IMAGE_NAME and JEX_INFRA__EC2_IMAGE_OWNER")
        newest = max(images, key=lambda i: (i.get("CreationDate", ""), i.get("Name", "")))
        log.info("provider ec2: image %s (%s) for %r", newest["ImageId"], newest.get("Name"), self.image_name)
        return str(newest["ImageId"])

    def _as_machine(self, inst: dict[str, Any]) -> Machine:
        """A machine from one instance of boto3's `describe_instances` / `run_instances` response."""
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        launched = inst.get("LaunchTime")  # a datetime from boto3
        return Machine(id=inst["InstanceId"], provider=self.name, campaign=tags.get(TAG_CAMPAIGN) or None,
                       host=inst.get("PublicIpAddress") or inst.get("PrivateIpAddress") or "", port=22,
                       user=self.user, workdir=self.workdir, state=inst["State"]["Name"],
                       created_at=launched.timestamp() if isinstance(launched, datetime) else time.time(),
                       meta={"instance_type": inst.get("InstanceType")})

    def _create(self, campaign: str | None, label: str) -> Machine:
        tags = [{"Key": TAG_MANAGED, "Value": "1"}, {"Key": TAG_MACHINE, "Value": new_machine_id(label)}]
        if campaign:
            tags.append({"Key": TAG_CAMPAIGN, "Value": campaign})
        if self.image_id is None:
            self.image_id = self.find_image()
        kw: dict[str, Any] = {"ImageId": self.image_id, "InstanceType": self.instance_type, "MinCount": 1,
                              "MaxCount": 1, "TagSpecifications": [{"ResourceType": "instance", "Tags": tags}],
                              "InstanceInitiatedShutdownBehavior": "terminate"}  # the watchdog's poweroff ends it
        if self.key_name:
            kw["KeyName"] = self.key_name
        inst = self.client.run_instances(**kw)["Instances"][0]
        return self._as_machine(inst)

    def _describe(self, machine_id: str) -> Machine | None:
        from botocore.exceptions import ClientError

        try:
            res = self.client.describe_instances(InstanceIds=[machine_id])["Reservations"]
        except ClientError as e:
            if "NotFound" in e.response.get("Error", {}).get("Code", ""):
                return None
            raise
        insts = [i for r in res for i in r["Instances"]]
        if not insts or insts[0]["State"]["Name"] in self.GONE:
            return None
        return self._as_machine(insts[0])

    def _list(self) -> list[Machine]:
        pages = self.client.get_paginator("describe_instances").paginate(
            Filters=[{"Name": f"tag:{TAG_MANAGED}", "Values": ["1"]},
                     {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}])
        return [self._as_machine(i) for page in pages for r in page["Reservations"] for i in r["Instances"]]

    def _delete(self, machine_id: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.terminate_instances(InstanceIds=[machine_id])
        except ClientError as e:
            if "NotFound" not in e.response.get("Error", {}).get("Code", ""):
                raise

    def shell(self, machine: Machine) -> Shell:
        return self._ssh.shell(machine.host, 22, self.user, host_key=machine.host_key)


@dataclass
class CommandTemplates:
    """Shell command templates; placeholders {campaign} {label} {id}. Output: one JSON machine per line."""

    create: str
    describe: str
    list_machines: str
    delete: str


class CommandProvider(Provider):
    """Any cloud CLI: `create` prints the machine as JSON, `describe` prints it (with its `state`, also
    when it is powered off) or nothing once gone; `list` prints powered-off machines too, which
    reconcile deletes; `delete` deletes (a stopped VM still holds quota)."""

    name = "command"

    def __init__(self, templates: CommandTemplates, *, shell_for: Callable[[Machine], Shell] | None = None,
                 timeout: float = 300, keeps_disk: bool = False):
        self.t, self.timeout = templates, timeout
        self._shell_for = shell_for or (lambda m: LocalShell())
        self.keeps_disk = keeps_disk
        """Most clouds drop an ephemeral disk with the VM: False unless `JEX_INFRA__COMMAND_KEEPS_DISK`."""

    def _run(self, template: str, **kw: str) -> tuple[str, str]:
        """Run a template with its placeholders quoted; (the command, what it printed)."""
        cmd = template.format(**{k: shlex.quote(v) for k, v in kw.items()})
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=self.timeout)
        if p.returncode != 0:
            raise ProviderError(f"command provider: `{cmd[:160]}` exited {p.returncode}: {p.stderr.strip()[-400:]}")
        return cmd, p.stdout

    def _call(self, template: str, **kw: str) -> list[Machine]:
        """Run a template; every line it prints is a machine (this provider's, whatever it says)."""
        cmd, out = self._run(template, **kw)
        try:
            return [Machine.model_validate({**json.loads(line), "provider": self.name})
                    for line in out.splitlines() if line.strip()]
        except ValueError as e:  # pydantic's ValidationError is a ValueError too
            raise ProviderError(f"command provider: `{cmd[:160]}` printed something that is not JSON lines "
                                f"of machines: {e}") from e

    def _create(self, campaign: str | None, label: str) -> Machine:
        machines = self._call(self.t.create, campaign=campaign or "", label=label)
        if len(machines) != 1:
            raise ProviderError(f"command provider: create printed {len(machines)} machines, expected 1")
        return machines[0]

    def _describe(self, machine_id: str) -> Machine | None:
        machines = self._call(self.t.describe, id=machine_id)
        return machines[0] if machines else None

    def _list(self) -> list[Machine]:
        return self._call(self.t.list_machines)

    def _delete(self, machine_id: str) -> None:
        self._run(self.t.delete, id=machine_id)

    def shell(self, machine: Machine) -> Shell:
        return self._shell_for(machine)


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m jex.infra.providers", description="Drive the local provider")
    p.add_argument("--state", required=True, type=Path)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create")
    c.add_argument("--campaign", default="")
    c.add_argument("--label", default="gpu")
    sub.add_parser("list")
    for name in ("describe", "delete", "poweroff"):
        sub.add_parser(name).add_argument("id")
    args = p.parse_args(argv)
    provider = LocalProvider(args.state)
    if args.cmd == "create":
        print(provider.create(args.campaign or None, args.label).to_json())
    elif args.cmd == "list":
        for listed in provider.list_machines():
            print(listed.to_json())
    elif args.cmd == "describe":
        if (found := provider.describe(args.id)) is not None:
            print(found.to_json())
    elif args.cmd == "poweroff":
        provider.power_off(args.id)
    else:
        provider.delete(args.id)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_main(sys.argv[1:]))
    except ShellError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
