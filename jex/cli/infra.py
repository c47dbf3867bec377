"""`jex infra reconcile|ledger`: every jex machine collected and deleted; what machines cost."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.cli.common import connect_prefect
from jex.settings import load_settings

infra_app = typer.Typer(no_args_is_help=True, help="Machines: reconcile, ledger, providers.")


@infra_app.command("reconcile")
def infra_reconcile(provider: Annotated[str | None, typer.Option(help="default: settings")] = None,
                    campaign: Annotated[str | None, typer.Option(help="Only this campaign's machines")] = None) -> None:
    """Supervise, collect and delete every machine the provider tags as jex's (after a restart, or scheduled)."""
    from jex.cli import preflight

    preflight.choice(provider, "--provider", preflight.PROVIDERS)
    connect_prefect(load_settings())
    from jex.flows.reconcile import reconcile_flow

    report = reconcile_flow(provider=provider, campaign=campaign)
    for m in report.machines:
        typer.echo(f"{m.machine} ({m.campaign or 'no campaign'}): {m.action}, jobs "
                   f"{[(j.job, j.status) for j in m.jobs]}, deleted after "
                   f"{m.teardown.attempts if m.teardown else None} attempt(s)")
    typer.echo(f"{len(report.machines)} machine(s) reconciled, {len(report.errors)} error(s)")
    if report.errors:
        raise typer.Exit(1)


@infra_app.command("ledger")
def infra_ledger(campaign: Annotated[str | None, typer.Option(help="Only this campaign")] = None) -> None:
    """Every machine's life in seconds, its price and cost, and the running total."""
    from jex.infra.cost_ledger import CostLedger

    report = CostLedger(Path(load_settings().infra.state_dir) / "ledger.json").usage(campaign)
    for m in report.machines:
        typer.echo(f"{m.machine_id:<28} {m.campaign or '-':<28} {m.seconds:>9.1f} s "
                   f"${m.cost_usd:>9.4f}  {m.end_reason or 'running'}")
    typer.echo(f"total ${report.total_usd:.4f} over {report.machine_seconds:.0f} machine-seconds")


def register(app: typer.Typer) -> None:
    app.add_typer(infra_app, name="infra")
