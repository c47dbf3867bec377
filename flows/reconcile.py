"""The reconcile flow: no machine outlives its campaign (run after a restart, on a schedule, on failure).

Run by the failure automation (with the failed run's `flow_run_id`), it also tells the team: when
`JEX_PREFECT__NOTIFY_BLOCK` names a Prefect notification block (Slack, e-mail, a webhook ...), it
sends the campaign, the stage that failed and the run folder through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from jex.errors import JexError
from jex.infra.cost_ledger import CostLedger
from jex.infra.reaper import make_provider, policy_from_settings, sweep
from jex.infra.records import ReconcileReport
from jex.run_records import RunStages


@flow(name="reconcile", log_prints=True)
def reconcile_flow(provider: str | None = None, campaign: str | None = None,
                   flow_run_id: str | None = None) -> ReconcileReport:
    """Supervise, collect and delete every jex machine of `provider` (all campaigns unless one is named).

    `flow_run_id` is the failed campaign run that triggered it through the automation (for the log).
    """
    from jex.flows.credentials import with_block_credentials
    from jex.flows.machines.fleet import s3_store
    from jex.settings import load_settings

    settings = with_block_credentials(load_settings())
    log = get_run_logger()
    if flow_run_id:
        log.info("triggered by the failure of flow run %s", flow_run_id)
    ledger = CostLedger(Path(settings.infra.state_dir) / "ledger.json")
    report = sweep(make_provider(settings.infra, name=provider), ledger, policy=policy_from_settings(settings.infra),
                   s3=s3_store(settings), campaign=campaign, echo=log.info)
    log.info("reconciled %d machine(s); errors: %s", len(report.machines), report.errors or "none")
    if flow_run_id and settings.prefect.notify_block:
        try:
            notify_failure(settings.prefect.notify_block, flow_run_id, report)
        except Exception as e:  # noqa: BLE001 - a notification failure must not hide the reconcile
            log.warning("could not send the failure notification through %s: %s: %s",
                        settings.prefect.notify_block, type(e).__name__, e)
    return report


def failure_notice(parameters: dict[str, Any], state: str, message: str, run_name: str,
                   report: ReconcileReport) -> tuple[str, str]:
    """(subject, body) naming the campaign, the stage that failed (the first one its run folder does
    not record as done) and the run folder."""
    from jex.flows.campaign import STAGES
    from jex.tasks.campaign_spec import CampaignSpec

    spec = CampaignSpec.model_validate(parameters.get("spec") or {})
    try:
        run_dir: Path | str = spec.located().run_dir()
        done = RunStages.read(run_dir).root
    except (JexError, OSError) as e:  # its identity needs the suite and model: it failed before it had a folder
        run_dir, done = f"none yet ({e})", {}
    stage = next((s for s in STAGES if s not in done), "report")
    machines = len(report.machines)
    subject = f"jex: campaign {spec.name} {state.lower()} at stage {stage}"
    body = (f"campaign {spec.name} {state.lower()} at stage {stage}\n"
            f"run folder: {run_dir}\n"
            f"flow run: {run_name}: {message[:500]}\n"
            f"machines reconciled: {machines}; errors: {report.errors or 'none'}")
    return subject, body


def notify_failure(block: str, flow_run_id: str, report: ReconcileReport) -> None:
    """Send `failure_notice` of the failed run through the notification block named `block`."""
    from uuid import UUID

    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(flow_run_id))
    subject, body = failure_notice(run.parameters, run.state_name or "failed",
                                   (run.state.message if run.state else "") or "", run.name, report)
    # prefect types load() as "value or coroutine" (sync_compatible); called from sync code, it is the block
    Block.load(block).notify(body=body, subject=subject)  # type: ignore[union-attr]
    get_run_logger().info("failure notification sent through %s", block)
