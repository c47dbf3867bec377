"""`jex server start|stop` and `jex runs`: the orchestrator's Prefect server, and the campaigns it knows."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from jex.cli import preflight
from jex.cli.common import fail
from jex.errors import JexError, ServerError
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
        url = preflight.json_file(sf, "the server's state file").get("api_url")
        if not isinstance(url, str):
            raise ServerError(f"file {sf}: no 'api_url' in the server's state file; `jex server stop` forgets it")
        if healthy(url):
            os.environ["PREFECT_API_URL"] = url


def check_api(url: str, timeout: float = 5.0) -> None:
    """The Prefect API at `url` answers and accepts this client's credentials (one line if not)."""
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{url.rstrip('/')}/admin/version")
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ServerError(f"the Prefect API at {url} refused this client ({e.code}): set JEX_PREFECT__AUTH_STRING "
                              "to the server's 'user:password'") from None
        raise ServerError(f"the Prefect API at {url} answered {e.code} {e.reason}") from None
    except (OSError, ValueError) as e:
        raise ServerError(f"no Prefect API answers at {url} ({getattr(e, 'reason', e)}): start one with "
                          "`jex server start`, or set PREFECT_API_URL / JEX_PREFECT__API_URL") from None


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
        form = preflight.json_file(defaults, "--defaults") if defaults else None
        state = start(settings, campaign_defaults=form, worker=worker)
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

    try:  # pre-flight: the API answers and takes our credentials, before Prefect's client retries for seconds
        preflight.at_least(limit, "--limit", 1)
        use_running_server(load_settings())
        if os.environ.get("PREFECT_API_URL"):
            check_api(os.environ["PREFECT_API_URL"])
    except JexError as e:
        fail(e)
    rows = campaign_runs(limit)
    typer.echo("\n".join(json.dumps(r.to_json()) for r in rows) if as_json else format_runs(rows))


def register(app: typer.Typer) -> None:
    app.add_typer(server_app, name="server")
    app.command("runs")(runs_cmd)
