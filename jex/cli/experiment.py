"""`jex experiment run|ledger`: arms against the base, and the decision ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.cli import preflight
from jex.cli.common import connect_prefect, fail, print_path, spec_fields
from jex.cli.run import (
    CAMPAIGN_FIELD_OF_FLAG,
    Device,
    EngineKind,
    OneModel,
    PanelCatalogs,
    Provider,
    ReasonMaxTokens,
    Store,
    catalog_list,
)
from jex.errors import InputError, JexError
from jex.settings import load_settings

experiment_app = typer.Typer(no_args_is_help=True, help="Experiments: arms against the base, placebos, twin "
                                                        "audits, sweeps, the decision ledger.")


@experiment_app.command("run")
def run(arms: Annotated[Path, typer.Option(help="Arms file (TOML): [base], [gate], [[arms]]")],
        out: Annotated[Path, typer.Option("-o", "--out", help="Experiment folder")],
        suite: Annotated[Path | None, typer.Option(help="Suite folder or bundle (default: the embedded sample)")]
        = None,
        sample_rows: Annotated[int | None, typer.Option(help="Rows of the embedded sample suite (default: 360)")]
        = None,
        panel_catalogs: PanelCatalogs = None,
        panel_share: Annotated[float | None, typer.Option(help="Declared panel share of the full weight "
                                                               "(asserted)")] = None,
        engine: EngineKind = None, model: OneModel = None, device: Device = None,
        coverage: Annotated[float | None, typer.Option(help="Base coverage (an arm may change it) (default: "
                                                            "0.10)")] = None,
        reason_max_tokens: ReasonMaxTokens = None, store: Store = None, provider: Provider = None) -> None:
    """Run the base and every arm (cached sub-runs), judge them by the pre-registered test ([gate]).

    The last line printed is the experiment folder (experiment.json, report.md, forest.png, ledger.toml).
    """
    flags = {**locals(), "name": "base"}  # every option by name; one not given is None
    try:  # pre-flight: before Prefect starts or anything is written
        arms_toml = preflight.text_file(arms, "--arms")
        if not preflight.toml_file(arms, "--arms").get("arms"):
            raise InputError("--arms: the arms file holds no [[arms]] table", file=str(arms))
        from jex.lab.arms import parse_arms

        parse_arms(arms_toml, path=str(arms))  # every arm and field, before Prefect starts
        preflight.writable_dir(out, "--out")
        if suite is not None:
            preflight.suite(suite)
        preflight.model(model)
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
        preflight.choice(engine, "--engine", preflight.ENGINE_KINDS)
        preflight.share(coverage, "--coverage")
        preflight.share(panel_share, "--panel-share")
        preflight.at_least(sample_rows, "--sample-rows", 18)
        if store is not None:
            preflight.writable_dir(store, "--store")
    except JexError as e:
        fail(e)
    settings = load_settings()
    connect_prefect(settings)
    from jex.flows.lab import ExperimentSpec, plan_experiment, run_experiment
    from jex.tasks.campaign_spec import campaign_spec

    try:
        base = campaign_spec(settings, spec_fields(flags, {**CAMPAIGN_FIELD_OF_FLAG, "sample_rows": "sample_rows"}))
        spec = ExperimentSpec(campaign=base, arms_toml=arms_toml, arms_path=str(arms), out=str(out),
                              panel_catalogs=catalog_list(panel_catalogs) if panel_catalogs else None,
                              panel_share=panel_share)
        plan_experiment(spec)  # a bad arms file fails here: before any engine
        folder = run_experiment(spec)
    except JexError as e:
        fail(e)
    print_path(folder)


@experiment_app.command("ledger")
def ledger(out: Annotated[Path, typer.Argument(help="Experiment folder (its experiment.json names the store's "
                                                    "ledger.toml)")]) -> None:
    """Print this experiment's decisions from its store's ledger: arm, verdict, effect and CI, test hash, model,
    reopen-when (`jex ledger` lists every decision of a store)."""
    from jex.lab.experiment_report import experiment_ledger
    from jex.tasks.decisions import format_decisions

    try:
        path, decisions = experiment_ledger(out)
    except JexError as e:
        fail(e)
    typer.echo(f"{path}: {len(decisions)} decision(s) of {out}")
    typer.echo(format_decisions(decisions))


def register(app: typer.Typer) -> None:
    app.add_typer(experiment_app, name="experiment")
