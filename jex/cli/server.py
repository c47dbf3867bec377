"""`jex server start|stop`, `jex deploy` and `jex runs`: the orchestrator's Prefect server, registering into a
team's server, and the campaigns a server knows."""

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


def check_api(url: str, timeout: float = 5.0, *, auth: str | None = None) -> None:
    """The Prefect API at `url` answers and accepts this client's credentials (`auth`, else
    PREFECT_API_AUTH_STRING: basic auth 'user:password'); one line if not."""
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{url.rstrip('/')}/admin/version")
    auth = auth or os.environ.get("PREFECT_API_AUTH_STRING")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ServerError(f"the Prefect API at {url} refused this client ({e.code}): set JEX_PREFECT__AUTH_STRING "
                              "(or PREFECT_API_AUTH_STRING) to the server's 'user:password'") from None
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


def deploy_cmd(api_url: Annotated[str | None, typer.Option(help="The Prefect API to register into (default: "
                                                                 "PREFECT_API_URL, then JEX_PREFECT__API_URL)")] = None,
               dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be created, updated or "
                                                                        "deleted; change nothing")] = False,
               defaults: Annotated[Path | None, typer.Option(help="JSON: default campaign form values")] = None,
               budget_cron: Annotated[str | None, typer.Option(help="Cron of the budget projection (default: "
                                                                    "settings, 0 3 * * *)")] = None,
               reconcile_every: Annotated[float | None, typer.Option(help="Seconds between scheduled reconciles "
                                                                          "(default: settings, 900)")] = None) -> None:
    """Register the work pool, deployments, schedules, failure automation and notification hook into a
    team's Prefect server (or Prefect Cloud). Idempotent: only what differs is changed.

    Auth: PREFECT_API_AUTH_STRING (or JEX_PREFECT__AUTH_STRING), 'user:password' basic auth of a
    self-hosted server; PREFECT_API_KEY for Prefect Cloud. A worker on a machine with this checkout runs
    the flows: `prefect worker start --pool jex-orchestrator`."""
    from jex.deployments.register import POOL, connected_to, register

    settings = load_settings()
    flags = {"budget_cron": budget_cron, "reconcile_every_s": reconcile_every}
    try:
        prefect = settings.prefect.model_validate({**settings.prefect.model_dump(),
                                                   **{k: v for k, v in flags.items() if v is not None}})
        settings = settings.model_copy(update={"prefect": prefect})
        url = api_url or os.environ.get("PREFECT_API_URL") or settings.prefect.api_url
        if not url:
            raise ServerError("no Prefect server to register into: set PREFECT_API_URL or pass --api-url "
                              "(`jex server start` registers into jex's own server)")
        auth = os.environ.get("PREFECT_API_AUTH_STRING") or (
            settings.prefect.auth_string.get_secret_value() if settings.prefect.auth_string else None)
        api_key = os.environ.get("PREFECT_API_KEY")
        if not api_key:  # Prefect Cloud has no /admin/version; its client says what is wrong
            check_api(url, auth=auth)
        form = preflight.json_file(defaults, "--defaults") if defaults else None
        with connected_to(url, auth_string=auth, api_key=api_key):
            done = register(settings, form, dry_run=dry_run)
    except JexError as e:
        fail(e)
    verb = {"create": "would create" if dry_run else "created", "update": "would update" if dry_run else "updated",
            "delete": "would delete" if dry_run else "deleted", "unchanged": "unchanged", "missing": "missing"}
    for c in done.changes:
        why = f" ({', '.join(c.differs)})" if c.differs else ""
        typer.echo(f"{verb[c.action]:<13} {c.kind} {c.name}{why}")
    for c in done.changes:
        if c.action == "missing":
            typer.echo(f"warning: the notification block {c.name} is not on the server: failed campaigns will "
                       "reach nobody until it is created (Prefect UI: Blocks)", err=True)
    counts = {a: sum(c.action == a for c in done.changes) for a in ("create", "update", "delete")}
    summary = ", ".join(f"{n} {verb[a]}" for a, n in counts.items() if n)
    if not done.changed:
        typer.echo(f"nothing changed: {url} already holds all {len(done.changes)} as wanted")
    elif dry_run:
        typer.echo(f"dry run: {summary} at {url}; nothing was written")
    else:
        typer.echo(f"registered into {url}: {summary}; start a worker on this checkout: "
                   f"prefect worker start --pool {POOL}")


def runs_cmd(limit: Annotated[int, typer.Option(help="Newest N campaign runs")] = 20,
             model: Annotated[str | None, typer.Option(help="Only this model's runs: its name as the campaign "
                                                            "gave it ('embedded' for the default), or a prefix "
                                                            "of its weights' sha256")] = None,
             as_json: Annotated[bool, typer.Option("--json", help="JSON lines")] = False) -> None:
    """Campaign runs known to the Prefect API: state, index, coverage, machine cost, the model (name,
    revision, weights) and the bundle each read."""
    from jex.flows.history import campaign_runs, format_runs

    try:  # pre-flight: the API answers and takes our credentials, before Prefect's client retries for seconds
        preflight.at_least(limit, "--limit", 1)
        use_running_server(load_settings())
        if os.environ.get("PREFECT_API_URL"):
            check_api(os.environ["PREFECT_API_URL"])
    except JexError as e:
        fail(e)
    rows = campaign_runs(limit, model=model)
    typer.echo("\n".join(json.dumps(r.to_json()) for r in rows) if as_json else format_runs(rows))


def register(app: typer.Typer) -> None:
    app.add_typer(server_app, name="server")
    app.command("deploy")(deploy_cmd)
    app.command("runs")(runs_cmd)
