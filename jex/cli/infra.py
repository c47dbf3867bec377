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
    """Stop the servers and workers a killed jex left running on this host, then supervise, collect and delete
    every machine the provider tags as jex's (after a restart, or scheduled)."""
    from jex.cli import preflight
    from jex.infra.processes import orphans_line, stop_orphans

    preflight.choice(provider, "--provider", preflight.PROVIDERS)
    settings = load_settings()
    typer.echo(orphans_line(stop_orphans(Path(settings.infra.state_dir))))
    connect_prefect(settings)
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
    """Every machine's life in seconds, the price it was billed at and its cost; every served model's requests,
    tokens and their cost; and the running total."""
    from jex.infra.cost_ledger import CostLedger

    report = CostLedger(Path(load_settings().infra.state_dir) / "ledger.json").usage(campaign)
    for m in report.machines:
        typer.echo(f"{m.machine_id:<28} {m.campaign or '-':<28} {m.provider:<8} {m.seconds:>9.1f} s "
                   f"at ${m.price_per_hour:g}/h ${m.cost_usd:>9.4f}  {m.end_reason or 'running'}")
    for s in report.served:
        price = (f"at ${s.price_input_per_mtok or 0:g}/${s.price_output_per_mtok or 0:g} per Mtok "
                 f"${s.cost_usd:>9.4f}" if s.cost_usd is not None else "no price set")
        typer.echo(f"{s.served_id:<28} {s.campaign or '-':<28} {'served':<8} {s.requests} requests, "
                   f"{s.prompt_tokens} prompt + {s.completion_tokens} completion tokens {price}  {s.model or '-'}")
    served = (f" and {sum(s.prompt_tokens + s.completion_tokens for s in report.served)} served tokens"
              if report.served else "")
    typer.echo(f"total ${report.total_usd:.4f} over {report.machine_seconds:.0f} machine-seconds{served}")


def register(app: typer.Typer) -> None:
    app.add_typer(infra_app, name="infra")
