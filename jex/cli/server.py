"""`jex server start|stop` and `jex runs`: the orchestrator's Prefect server, and the campaigns it knows."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from jex.cli.common import fail
from jex.settings import JexSettings, load_settings

server_app = typer.Typer(no_args_is_help=True, help="The orchestrator's Prefect server, worker and deployments.")


def use_running_server(settings: JexSettings) -> None:
    """Talk to PREFECT_API_URL, else `JEX_PREFECT__API_URL`, else the server `jex server start` recorded."""
    from jex.deployments.server import client_env, healthy, state_file

    for k, v in client_env(settings).items():  # basic auth of the server, when it has one
        os.environ.setdefault(k, v)
    if settings.prefect.api_url:
        os.environ.setdefault("PREFECT_API_URL", settings.prefect.api_url)
    sf = state_file(settings)
    if not os.environ.get("PREFECT_API_URL") and sf.exists():
        url = json.loads(sf.read_text())["api_url"]
        if healthy(url):
            os.environ["PREFECT_API_URL"] = url


@server_app.command("start")
def server_start(port: Annotated[int | None, typer.Option(help="default: settings (4200)")] = None,
                 host: Annotated[str | None, typer.Option(help="Bind address (default: settings, 127.0.0.1); not "
                                                               "loopback needs JEX_PREFECT__AUTH_STRING")] = None,
                 database_url: Annotated[str | None, typer.Option(help="PostgreSQL URL, e.g. postgresql+asyncpg://"
                                                                       "postgres@127.0.0.1:5432/test (default: "
                                                                       "SQLite)")] = None,
                 defaults: Annotated[Path | None, typer.Option(help="JSON: default campaign form values")] = None,
                 worker: Annotated[bool, typer.Option(help="Start the process worker too")] = True) -> None:
    """Start the Prefect server on 127.0.0.1, register the deployments and automation, start the worker."""
    from jex.deployments.server import ServerError, start

    settings = load_settings()
    flags = {"port": port, "host": host, "database_url": database_url}
    prefect = settings.prefect.model_validate({**settings.prefect.model_dump(),
                                               **{k: v for k, v in flags.items() if v}})
    settings = settings.model_copy(update={"prefect": prefect})
    try:
        state = start(settings, campaign_defaults=json.loads(defaults.read_text()) if defaults else None,
                      worker=worker)
    except ServerError as e:
        fail(e)
    typer.echo(f"Prefect UI: {state['ui_url']}  (API {state['api_url']}, {state['database']})")
    typer.echo(f"deployments: {', '.join(k for k in state['deployments'] if k != 'automation')}; "
               f"work pool {state['pool']}; PIDs {state['pids']}")
    typer.echo(f"export PREFECT_API_URL={state['api_url']}")


@server_app.command("stop")
def server_stop() -> None:
    """Stop exactly the processes `jex server start` started (by their process groups)."""
    from jex.deployments.server import stop

    pids = stop(load_settings())
    typer.echo(f"stopped {pids}" if pids else "no jex server recorded")


def runs_cmd(limit: Annotated[int, typer.Option(help="Newest N campaign runs")] = 20,
             as_json: Annotated[bool, typer.Option("--json", help="JSON lines")] = False) -> None:
    """Campaign runs known to the Prefect API: state, index, coverage, machine cost."""
    from jex.flows.history import campaign_runs, format_runs

    use_running_server(load_settings())
    rows = campaign_runs(limit)
    typer.echo("\n".join(json.dumps(r.to_json()) for r in rows) if as_json else format_runs(rows))


def register(app: typer.Typer) -> None:
    app.add_typer(server_app, name="server")
    app.command("runs")(runs_cmd)
