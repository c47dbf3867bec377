"""`jex config show`: the effective settings, the ones every command, flow and form reads."""

from __future__ import annotations

import json

import typer

from jex.settings import settings_and_problems

config_app = typer.Typer(no_args_is_help=True, help="Settings (JEX_* variables and .env).")


@config_app.command("show")
def config_show() -> None:
    """Print the effective settings; secrets are masked. A malformed variable or `.env` is named (and left
    out of what is shown), and the command exits 1."""
    settings, problems = settings_and_problems()
    typer.echo(json.dumps(settings.model_dump(mode="json"), indent=2))
    for problem in problems:
        typer.echo(f"error: {problem} (left out above)", err=True)
    if problems:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
