"""`jex config show`: the effective settings, the ones every command, flow and form reads."""

from __future__ import annotations

import json

import typer

from jex.settings import load_settings

config_app = typer.Typer(no_args_is_help=True, help="Settings (JEX_* variables and .env).")


@config_app.command("show")
def config_show() -> None:
    """Print the effective settings; secrets are masked."""
    settings = load_settings()
    typer.echo(json.dumps(json.loads(settings.model_dump_json()), indent=2))


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
