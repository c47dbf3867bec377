"""The reconcile flow: no machine outlives its campaign (run after a restart, on a schedule, on failure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from infra.ledger import Ledger
from infra.reconcile import make_provider, policy_from_settings, reconcile


@flow(name="reconcile", log_prints=True)
def reconcile_flow(provider: str | None = None, campaign: str | None = None,
                   flow_run_id: str | None = None) -> dict[str, Any]:
    """Supervise, collect and delete every jex machine of `provider` (all campaigns unless one is named).

    `flow_run_id` is the failed campaign run that triggered it through the automation (for the log).
    """
    from flows.remote import _s3
    from jex.settings import load_settings

    settings = load_settings()
    log = get_run_logger()
    if flow_run_id:
        log.info("triggered by the failure of flow run %s", flow_run_id)
    report = reconcile(make_provider(settings.infra, name=provider),
                       Ledger(Path(settings.infra.state_dir) / "ledger.json"),
                       policy=policy_from_settings(settings.infra), s3=_s3(settings), campaign=campaign,
                       echo=log.info)
    log.info("reconciled %d machine(s); errors: %s", len(report["machines"]), report["errors"] or "none")
    return report
