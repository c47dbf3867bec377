"""The deployments users run from the Prefect UI, on the orchestrator's process work pool.

    campaign     the whole campaign; its parameters are typed pydantic models, so the UI shows a form
    budget       the budget projection (`jex calibrate`): time and cost per coverage, on the cron from settings
    bakeoff      the batch-invariance bake-off
    parity       engine parity on a suite
    reconcile    no machine outlives its campaign: on a schedule, and on every failed/crashed campaign
    retry-stage  continue a campaign from a named stage, reusing the cached capture
    experiment   arms against the base, judged by a pre-registered test; the decision ledger
    models       one campaign per model on one suite, then their comparison with paired intervals

Each deployment points at this checkout (`flow.from_source(ROOT, entrypoint)`), so the process worker
runs the code the server was started from. `register` writes into the Prefect API of the current Prefect
settings (`connected_to`): jex's own server (`jex server start`) or a team's (`jex deploy`). It is
idempotent: it first compares what the server holds with what is wanted (`plan`), then creates or
updates only what differs, and deletes the deployments of flows since renamed (`RETIRED_DEPLOYMENTS`).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from jex.engine_spec import EMBEDDED_MODEL
from jex.errors import InputError, ServerError
from jex.settings import JexSettings

if TYPE_CHECKING:
    from prefect.automations import Automation

    from jex.flows.campaign import CampaignSpec

ROOT = Path(__file__).resolve().parent.parent
POOL = "jex-orchestrator"
FAILURE_AUTOMATION = "jex: reconcile after a failed campaign"
RETIRED_DEPLOYMENTS = ("calibration/calibration",)
"""`flow/deployment` names no longer registered: the budget projection was the `calibration` flow and
deployment. Registering deletes them, so no old schedule runs an entrypoint that is gone."""
T = TypeVar("T")


def _ran(result: T | Coroutine[Any, Any, T]) -> T:
    """The result of one of Prefect's sync-or-async methods (typed as returning either), which run
    synchronously outside an event loop, as registering always is."""
    if isinstance(result, Coroutine):
        result.close()
        raise ServerError("registering the deployments needs a synchronous caller (it ran inside an event loop)")
    return result


def deployment_specs(settings: JexSettings, campaign_defaults: Mapping[str, Any] | None = None
                     ) -> list[dict[str, Any]]:
    """Name, entrypoint, default parameters and schedule of every deployment.

    The campaign form's defaults take the one path `jex run` takes: settings, then `campaign_defaults`
    (`jex server start --defaults FILE`), through `campaign_spec`."""
    from jex.flows.budget import BudgetSpec
    from jex.flows.campaign import campaign_spec

    spec = campaign_spec(settings, campaign_defaults or {})
    return [
        {"name": "campaign", "entrypoint": "flows/campaign.py:campaign",
         "parameters": {"spec": spec.model_dump(mode="json")},
         "description": "Run a benchmark campaign: bundle, fast pass, gate, reason, fold, calibrate, overlays, score"},
        {"name": "budget", "entrypoint": "flows/budget.py:budget_projection",
         "parameters": {"spec": BudgetSpec(campaign=spec).model_dump(mode="json")},
         "cron": settings.prefect.budget_cron,
         "description": "Measure reasoning cost and fix rate on a sample; project time and cost per coverage"},
        {"name": "bakeoff", "entrypoint": "flows/lab.py:bakeoff",
         "description": "Batch-invariance bake-off of engine arms"},
        {"name": "parity", "entrypoint": "flows/lab.py:parity",
         "description": "Engine parity (argmax agreement, max |dp|) on a suite"},
        {"name": "reconcile", "entrypoint": "flows/reconcile.py:reconcile_flow",
         "interval": settings.prefect.reconcile_every_s, "job_variables": _notify_env(settings),
         "description": "Supervise, collect and delete every jex machine; orphans are torn down"},
        {"name": "retry-stage", "entrypoint": "flows/retry_stage.py:retry_stage",
         "description": "Continue a campaign (its run folder) from a named stage; the capture upstream is reused"},
        {"name": "models", "entrypoint": "flows/lab.py:models_comparison",
         "parameters": {"spec": spec.model_dump(mode="json"), "models": [EMBEDDED_MODEL]},
         "description": "One campaign per model on one suite, then their comparison: every model's score and "
                        "every pair's paired interval (compare.md)"},
        {"name": "experiment", "entrypoint": "flows/lab.py:experiment",
         "parameters": {"spec": _experiment_defaults(spec)},
         "description": "Arms against the base: placebos, twin audit, sweeps, pre-registered test, decision ledger"},
    ]


def _experiment_defaults(spec: CampaignSpec) -> dict[str, Any]:
    from jex.flows.lab import ExperimentSpec

    return ExperimentSpec(campaign=spec, out=str(Path(spec.out) / "experiment")).model_dump(mode="json")


def _notify_env(settings: JexSettings) -> dict[str, Any] | None:
    """The notification hook: the reconcile deployment's runs (which the failure automation starts) get
    the notification block to tell the team through, whichever worker runs them."""
    block = settings.prefect.notify_block
    return {"env": {"JEX_PREFECT__NOTIFY_BLOCK": block}} if block else None


Action = Literal["create", "update", "delete", "unchanged", "missing"]


@dataclass(frozen=True)
class Change:
    """One object of the registration and what registering does to it. `missing`: the notification
    block the settings name is not on the server (registering cannot create it; the team does)."""

    kind: Literal["work pool", "deployment", "automation", "notification block"]
    name: str
    action: Action
    differs: tuple[str, ...] = ()
    """The fields an `update` changes."""


@dataclass(frozen=True)
class Registration:
    """What registering found and did; `ids`: deployment name (and "automation") -> id on the server
    (only those that exist: a dry run leaves out what it would create)."""

    changes: tuple[Change, ...]
    ids: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(c.action in ("create", "update", "delete") for c in self.changes)


@contextlib.contextmanager
def connected_to(api_url: str, *, auth_string: str | None = None, api_key: str | None = None) -> Iterator[None]:
    """Prefect's client settings for the API at `api_url`, with its basic auth (`auth_string`,
    'user:password') or Prefect Cloud's `api_key`. Prefect reads its environment once, so a context."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string,
                             PREFECT_API_KEY: api_key}):
        yield


def register(settings: JexSettings, campaign_defaults: Mapping[str, Any] | None = None, *,
             dry_run: bool = False) -> Registration:
    """Make the server hold the work pool (process), every deployment (parameters, schedules, notification
    hook) and the failure automation as `settings` want them, changing only what differs; `dry_run`:
    only say what that would change."""
    from prefect import flow as prefect_flow

    check_budget_cron(settings.prefect.budget_cron)
    changes = [_pool_change(), *_retired_changes()]
    if not dry_run:
        _apply(changes)
    ids: dict[str, str] = {}
    for d in deployment_specs(settings, campaign_defaults):
        source = _ran(prefect_flow.from_source(source=str(ROOT), entrypoint=d["entrypoint"]))
        kw = {k: d[k] for k in ("parameters", "cron", "interval", "description", "job_variables")
              if d.get(k) is not None}
        change, held_id = _deployment_change(f"{source.name}/{d['name']}", d)
        changes.append(change)
        if change.action != "unchanged" and not dry_run:
            with contextlib.redirect_stdout(io.StringIO()):  # deploy() prints a table per deployment
                held_id = str(source.deploy(name=d["name"], work_pool_name=POOL, build=False, push=False,
                                            print_next_steps=False, ignore_warnings=True, **kw))
        if held_id:
            ids[d["name"]] = held_id
    automation, automation_id = _automation_change(ids.get("reconcile"))
    changes.append(automation)
    if automation.action != "unchanged" and not dry_run:
        automation_id = ensure_failure_automation(ids["reconcile"])
    if automation_id:
        ids["automation"] = automation_id
    if settings.prefect.notify_block:
        changes.append(_block_change(settings.prefect.notify_block))
    return Registration(changes=tuple(changes), ids=ids)


def check_budget_cron(cron: str) -> None:
    """A cron expression Prefect accepts, or one line naming the setting (before anything is registered)."""
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except ValueError:
        raise InputError(f"not a cron expression: {cron!r} (e.g. '0 3 * * *')",
                         field="JEX_PREFECT__BUDGET_CRON / --budget-cron") from None


def _apply(changes: list[Change]) -> None:
    """Create the pool and delete the retired deployments, as `changes` say (before any deployment)."""
    if any(c.kind == "work pool" and c.action == "create" for c in changes):
        ensure_pool()
    if any(c.kind == "deployment" and c.action == "delete" for c in changes):
        retire_deployments()


def _found(read: Callable[[Any], Any]) -> Any:
    """`read(client)` against the server, or None where the object is not there (ObjectNotFound)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return read(client)
        except ObjectNotFound:
            return None


def _deployment(name: str) -> Any:
    """The deployment 'flow/deployment' on the server, or None."""
    return _found(lambda c: c.read_deployment_by_name(name))


def _pool_change() -> Change:
    return Change("work pool", POOL, "unchanged" if _found(lambda c: c.read_work_pool(POOL)) else "create")


def _retired_changes() -> list[Change]:
    return [Change("deployment", name, "delete") for name in RETIRED_DEPLOYMENTS
            if _deployment(name) is not None]


def _deployment_change(full_name: str, wanted: Mapping[str, Any]) -> tuple[Change, str | None]:
    """How the deployment `full_name` ('flow/deployment') on the server differs from `wanted` (one of
    `deployment_specs`), and its id if it exists."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            old = client.read_deployment_by_name(full_name)
        except ObjectNotFound:
            return Change("deployment", full_name, "create"), None
    held = {"entrypoint": old.entrypoint, "description": old.description, "parameters": old.parameters,
            "work_pool": old.work_pool_name, "job_variables": old.job_variables or {},
            "source": old.pull_steps, "schedules": sorted(_schedule_text(s.schedule) for s in old.schedules)}
    want = {"entrypoint": wanted["entrypoint"], "description": wanted.get("description"),
            "parameters": wanted.get("parameters") or {}, "work_pool": POOL,
            "job_variables": wanted.get("job_variables") or {},
            "source": [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}],
            "schedules": sorted(t for t in (_cron_text(wanted.get("cron")), _interval_text(wanted.get("interval")))
                                if t)}
    differs = tuple(k for k in want if want[k] != held[k])
    return Change("deployment", full_name, "update" if differs else "unchanged", differs), str(old.id)


def _cron_text(cron: str | None) -> str | None:
    return f"cron {cron}" if cron else None


def _interval_text(seconds: float | None) -> str | None:
    return f"every {float(seconds)} s" if seconds else None


def _schedule_text(schedule: Any) -> str:
    """A schedule as `_cron_text` / `_interval_text` write it (its anchor date aside)."""
    if getattr(schedule, "cron", None):
        return f"cron {schedule.cron}"
    interval = getattr(schedule, "interval", None)
    if interval is not None:
        return f"every {float(interval.total_seconds())} s"
    return repr(schedule)


def _automation_change(reconcile_deployment_id: str | None) -> tuple[Change, str | None]:
    """The failure automation on the server against `failure_automation(reconcile_deployment_id)` (the
    trigger, the action and the deployment it runs), and its id if there is exactly one."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.read_automations_by_name(name=FAILURE_AUTOMATION)
    if not found:
        return Change("automation", FAILURE_AUTOMATION, "create"), None
    if len(found) > 1:
        return Change("automation", FAILURE_AUTOMATION, "update", ("count",)), None
    old = found[0]
    if reconcile_deployment_id is None:  # a dry run before the reconcile deployment exists
        return Change("automation", FAILURE_AUTOMATION, "update", ("actions",)), str(old.id)
    want = failure_automation(reconcile_deployment_id)
    differs = tuple(name for name in ("description", "enabled", "trigger", "actions")
                    if _comparable(getattr(want, name)) != _comparable(getattr(old, name)))
    return Change("automation", FAILURE_AUTOMATION, "update" if differs else "unchanged", differs), str(old.id)


def _comparable(value: Any) -> Any:
    """`value` as JSON with ids left out (the server gives every trigger one) and lists of names
    sorted (a set, such as a trigger's `expect`, has no order)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        items = [_comparable(v) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    return value


def _block_change(block: str) -> Change:
    """Whether the notification block 'type-slug/name' the settings name is on the server."""
    block_type, _, name = block.partition("/")
    found = _found(lambda c: c.read_block_document_by_name(name=name, block_type_slug=block_type))
    return Change("notification block", block, "unchanged" if found else "missing")


def retire_deployments() -> list[str]:
    """Delete the `RETIRED_DEPLOYMENTS` this server still has; returns those deleted."""
    from prefect.client.orchestration import get_client

    retired = []
    for name in RETIRED_DEPLOYMENTS:
        old = _deployment(name)
        if old is not None:
            with get_client(sync_client=True) as client:
                client.delete_deployment(old.id)
            retired.append(name)
    return retired


def ensure_pool() -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=POOL, type="process",
                                                   description="The orchestrator: runs jex flows as processes"))
        except ObjectAlreadyExists:
            pass


def ensure_failure_automation(reconcile_deployment_id: str) -> str:
    """When a campaign run goes Failed or Crashed, run the reconcile deployment (machines never outlive runs):
    the automation replaced by `failure_automation`; returns its id."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name=FAILURE_AUTOMATION):
            client.delete_automation(old.id)
    automation = _ran(failure_automation(reconcile_deployment_id).create())
    return str(automation.id)


def failure_automation(reconcile_deployment_id: str) -> Automation:
    """The failure automation as it is wanted (not yet on any server)."""
    from prefect.automations import Automation
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    return Automation(
        name=FAILURE_AUTOMATION,
        description="A failed or crashed campaign triggers reconcile, which collects and deletes its machines",
        trigger=EventTrigger(expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                             match_related={"prefect.resource.role": "flow", "prefect.resource.name": "campaign"},
                             posture=Posture.Reactive, threshold=1),
        # 3.9: a bare flow_run.id is a UUID the template engine cannot serialise; `| string` can
        actions=[RunDeployment(source="selected", deployment_id=reconcile_deployment_id,
                               parameters={"flow_run_id": "{{ flow_run.id | string }}"})],
    )

