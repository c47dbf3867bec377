"""`jex experiment run|ledger`: arms against the base, and the decision ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.errors import JexError

experiment_app = typer.Typer(no_args_is_help=True, help="Experiments: arms against the base, placebos, twin "
                                                        "audits, sweeps, the decision ledger.")


def _fail(err: Exception) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(2)


@experiment_app.command("run")
def run(arms: Annotated[Path, typer.Option(help="Arms file (TOML): [base], [gate], [[arms]]")],
        out: Annotated[Path, typer.Option("-o", "--out", help="Experiment folder")],
        suite: Annotated[Path | None, typer.Option(help="Suite folder or bundle (default: the embedded sample)")]
        = None,
        sample_rows: Annotated[int, typer.Option(help="Rows of the embedded sample suite")] = 360,
        panel_catalogs: Annotated[str | None, typer.Option(help="ID,ID,...: run on these catalogs only and "
                                                                "project onto the full index")] = None,
        panel_share: Annotated[float | None, typer.Option(help="Declared panel share of the full weight "
                                                               "(asserted)")] = None,
        engine: Annotated[str, typer.Option(help="hf | hf-batched | vllm | vllm-control")] = "hf",
        model: Annotated[str | None, typer.Option(help="Model folder or GGUF (default: embedded SmolLM2)")] = None,
        device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
        coverage: Annotated[float, typer.Option(help="Base coverage (an arm may change it)")] = 0.10,
        reason_max_tokens: Annotated[int, typer.Option(help="Rationale length limit")] = 48,
        store: Annotated[Path | None, typer.Option(help="Artifact store (default: OUT/store)")] = None,
        provider: Annotated[str | None, typer.Option(help="Where engine stages run: inprocess | local | ssh | ec2 | "
                                                          "command (default: settings)")] = None) -> None:
    """Run the base and every arm (cached sub-runs), judge them by the pre-registered gate.

    The last line printed is the experiment folder (experiment.json, report.md, forest.png, ledger.toml).
    """
    from jex.flows.campaign import CampaignSpec
    from jex.flows.experiment import ExperimentSpec, plan_experiment, run_experiment
    from jex.flows.fleet import GoldenMismatch, JobFailed, MachinesSpec
    from jex.settings import load_settings
    from jex.tasks.capture.engine_pool import EngineSpec

    if not arms.is_file():
        _fail(JexError(f"file {arms}: arms file not found"))
    try:
        base = CampaignSpec(name="base", suite=str(suite) if suite else None, sample_rows=sample_rows,
                            engine=EngineSpec(kind=engine, model=model, device=device), coverage=coverage,
                            reason_max_tokens=reason_max_tokens, store=str(store or out / "store"), out=str(out),
                            machines=MachinesSpec(provider=provider or load_settings().infra.provider))
        spec = ExperimentSpec(campaign=base, arms_toml=arms.read_text(), arms_path=str(arms), out=str(out),
                              panel_catalogs=[c.strip() for c in panel_catalogs.split(",") if c.strip()]
                              if panel_catalogs else None, panel_share=panel_share)
        plan_experiment(spec)  # a bad arms file fails here: before Prefect, before any engine
        from jex.flows.local_api import ensure_local_api

        ensure_local_api()
        folder = run_experiment(spec)
    except (JexError, GoldenMismatch, JobFailed) as e:
        _fail(e)
    typer.echo(folder)


@experiment_app.command("ledger")
def ledger(out: Annotated[Path, typer.Argument(help="Experiment folder (holds ledger.toml)")]) -> None:
    """Print the decision ledger: arm, verdict, effect and CI, placebo effect, gate hash, date, reopen-when."""
    from jex.tasks.lab.experiment_report import format_ledger, read_ledger

    try:
        typer.echo(format_ledger(read_ledger(out / "ledger.toml")))
    except JexError as e:
        _fail(e)
