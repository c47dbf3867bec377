"""The deployments users run from the Prefect UI, on the orchestrator's process work pool.

    campaign     the whole campaign; its parameters are typed pydantic models, so the UI shows a form
    budget       the budget projection (`jex calibrate`): time and cost per coverage, on the cron from settings
    bakeoff      the batch-invariance bake-off
    parity       engine parity on a suite
    reconcile    no machine outlives its campaign: on a schedule, and on every failed/crashed campaign
    retry-stage  continue a campaign from a named stage, reusing the cached capture
    experiment   arms against the base, judged by a pre-registered test; the decision ledger

Each deployment points at this checkout (`flow.from_source(ROOT, entrypoint)`), so the process worker
runs the code the server was started from. `register` is idempotent: running it again updates them,
and deletes the deployments of flows since renamed (`RETIRED_DEPLOYMENTS`).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from jex.errors import ServerError
from jex.settings import JexSettings

if TYPE_CHECKING:
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
        {"name": "bakeoff", "entrypoint": "flows/experiments.py:bakeoff",
         "description": "Batch-invariance bake-off of engine arms"},
        {"name": "parity", "entrypoint": "flows/experiments.py:parity",
         "description": "Engine parity (argmax agreement, max |dp|) on a suite"},
        {"name": "reconcile", "entrypoint": "flows/reconcile.py:reconcile_flow",
         "interval": settings.prefect.reconcile_every_s,
         "description": "Supervise, collect and delete every jex machine; orphans are torn down"},
        {"name": "retry-stage", "entrypoint": "flows/retry.py:retry_stage",
         "description": "Continue a campaign (its run folder) from a named stage; the capture upstream is reused"},
        {"name": "experiment", "entrypoint": "flows/experiment.py:experiment",
         "parameters": {"spec": _experiment_defaults(spec)},
         "description": "Arms against the base: placebos, twin audit, sweeps, pre-registered test, decision ledger"},
    ]


def _experiment_defaults(spec: CampaignSpec) -> dict[str, Any]:
    from jex.flows.experiment import ExperimentSpec

    return ExperimentSpec(campaign=spec, out=str(Path(spec.out) / "experiment")).model_dump(mode="json")


def register(settings: JexSettings, campaign_defaults: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Create the work pool (process) if missing, (re)register every deployment; returns name -> id."""
    from prefect import flow as prefect_flow

    ensure_pool()
    retire_deployments()
    ids = {}
    for d in deployment_specs(settings, campaign_defaults):
        source = _ran(prefect_flow.from_source(source=str(ROOT), entrypoint=d["entrypoint"]))
        kw = {k: d[k] for k in ("parameters", "cron", "interval", "description") if d.get(k) is not None}
        with contextlib.redirect_stdout(io.StringIO()):  # deploy() prints a table per deployment
            ids[d["name"]] = str(source.deploy(name=d["name"], work_pool_name=POOL, build=False, push=False,
                                               print_next_steps=False, ignore_warnings=True, **kw))
    ids["automation"] = str(ensure_failure_automation(ids["reconcile"]))
    return ids


def retire_deployments() -> list[str]:
    """Delete the `RETIRED_DEPLOYMENTS` this server still has; returns those deleted."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    retired = []
    with get_client(sync_client=True) as client:
        for name in RETIRED_DEPLOYMENTS:
            try:
                old = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
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
    """When a campaign run goes Failed or Crashed, run the reconcile deployment (machines never outlive runs)."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name=FAILURE_AUTOMATION):
            client.delete_automation(old.id)
    automation = _ran(Automation(
        name=FAILURE_AUTOMATION,
        description="A failed or crashed campaign triggers reconcile, which collects and deletes its machines",
        trigger=EventTrigger(expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                             match_related={"prefect.resource.role": "flow", "prefect.resource.name": "campaign"},
                             posture=Posture.Reactive, threshold=1),
        # 3.9: a bare flow_run.id is a UUID the template engine cannot serialise; `| string` can
        actions=[RunDeployment(source="selected", deployment_id=reconcile_deployment_id,
                               parameters={"flow_run_id": "{{ flow_run.id | string }}"})],
    ).create())
    return str(automation.id)

