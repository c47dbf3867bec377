"""`jex server start|stop`: the orchestrator's Prefect server, its process worker, and the deployments.

start: `prefect server start` on 127.0.0.1 (SQLite under PREFECT_HOME by default; PostgreSQL when
JEX_PREFECT__DATABASE_URL is set), waits for /api/health, registers the work pool, deployments and
the failure automation, then starts a process worker on the pool. The PIDs (each process leads its
own process group) go to `<state>/server.json`; `stop` signals exactly those groups, TERM then KILL.

Nobody in who does not belong: bound to anything but loopback, the server refuses to start without
basic authentication (`JEX_PREFECT__AUTH_STRING` = 'user:password', Prefect's `server.api.auth_string`).
The server, its worker and the flows it runs get the secret through their environment only; it is
in no command line, no state file, no log line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jex.deployments.register import POOL, ROOT, connected_to, register
from jex.errors import ServerError
from jex.fileio import write_json
from jex.settings import JexSettings


def state_file(settings: JexSettings) -> Path:
    return Path(settings.infra.state_dir).resolve() / "server.json"


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(settings: JexSettings) -> None:
    """Refuse a server reachable from other machines without authentication."""
    host = settings.prefect.host
    if not is_loopback(host) and not settings.prefect.auth_string:
        raise ServerError(f"refusing to serve on {host}: other machines could start campaigns with the team's "
                          "cloud credentials. Set JEX_PREFECT__AUTH_STRING='user:password' (basic authentication) "
                          "or bind 127.0.0.1")
    if settings.prefect.auth_string:
        check_auth_string(settings.prefect.auth_string.get_secret_value(), loopback=is_loopback(host))


MIN_PASSWORD = 16
"""The shortest password of a server reachable from other machines."""


def check_auth_string(auth: str, *, loopback: bool) -> None:
    """'user:password', both non-empty; off loopback the password has at least MIN_PASSWORD characters."""
    user, sep, password = auth.partition(":")
    if not sep or not user.strip() or not password:
        raise ServerError("JEX_PREFECT__AUTH_STRING must have the form 'user:password', both non-empty")
    if not loopback and len(password) < MIN_PASSWORD:
        raise ServerError(f"JEX_PREFECT__AUTH_STRING: a server reachable from other machines needs a password of "
                          f"at least {MIN_PASSWORD} characters (got {len(password)})")


def client_env(settings: JexSettings) -> dict[str, str]:
    """What a Prefect client of this server needs besides the URL: the basic-auth secret, if any."""
    auth = settings.prefect.auth_string
    return {"PREFECT_API_AUTH_STRING": auth.get_secret_value()} if auth else {}


def _env(settings: JexSettings, api_url: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": api_url,
           "PREFECT_UI_API_URL": api_url, "PREFECT_LOGGING_LEVEL": "INFO"}  # flow-run logs reach the UI
    if settings.prefect.database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = settings.prefect.database_url.get_secret_value()
    if settings.prefect.auth_string:  # the server checks it; its worker and their flows send it
        env["PREFECT_SERVER_API_AUTH_STRING"] = settings.prefect.auth_string.get_secret_value()
        env.update(client_env(settings))
    return env


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def start(settings: JexSettings, *, campaign_defaults: Mapping[str, Any] | None = None, worker: bool = True,
          timeout: float = 180.0) -> dict[str, Any]:
    """Start server (+ worker), register everything; returns the state written to server.json."""
    check_bind(settings)
    sf = state_file(settings)
    if sf.exists():
        old = read_state(sf)
        if healthy(old["api_url"]):
            raise ServerError(f"a jex server is already running at {old['api_url']} (state {sf}); "
                              "`jex server stop` first")
        stop(settings)
    host, port = settings.prefect.host, settings.prefect.port
    api_url = f"http://{host}:{port}/api"
    env = _env(settings, api_url)
    logs = sf.parent / "server-logs"
    logs.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port),
                               "--analytics-off"], env=env, cwd=ROOT, start_new_session=True,
                              stdout=open(logs / "server.log", "ab"), stderr=subprocess.STDOUT)
    state: dict[str, Any] = {"api_url": api_url, "ui_url": f"http://{host}:{port}", "pids": [server.pid],
                             "database": "postgresql" if settings.prefect.database_url else "sqlite",
                             "pool": POOL, "started_at": time.time(), "auth": bool(settings.prefect.auth_string)}
    write_json(sf, state)
    deadline = time.time() + timeout
    while not healthy(api_url):
        if server.poll() is not None or time.time() > deadline:
            stop(settings)
            raise ServerError(f"the Prefect server did not come up at {api_url}; see {logs / 'server.log'}")
        time.sleep(0.5)
    auth = settings.prefect.auth_string.get_secret_value() if settings.prefect.auth_string else None
    with connected_to(api_url, auth_string=auth):
        state["deployments"] = register(settings, campaign_defaults).ids
    if worker:
        w = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process",
                              "--name", "jex-orchestrator-worker"], env=env, cwd=ROOT, start_new_session=True,
                             stdout=open(logs / "worker.log", "ab"), stderr=subprocess.STDOUT)
        state["pids"].append(w.pid)
    write_json(sf, state)
    return state


def read_state(sf: Path) -> dict[str, Any]:
    """The state file `start` wrote (`api_url`, `pids`, ...); a damaged one is one ServerError naming it."""
    try:
        state = json.loads(sf.read_bytes().decode("utf-8"))
        if isinstance(state, dict) and isinstance(state.get("api_url"), str) and isinstance(state.get("pids"), list) \
                and all(isinstance(p, int) for p in state["pids"]):
            return state
        problem = "expected api_url and pids"
    except (OSError, ValueError) as e:
        problem = str(e).splitlines()[0]
    raise ServerError(f"file {sf}: the server's state file is unreadable ({problem}); check no jex server runs, "
                      "then delete it")


def stop(settings: JexSettings, grace: float = 15.0) -> list[int]:
    """Stop the process groups recorded by `start` (and nothing else); returns the PIDs signalled."""
    sf = state_file(settings)
    if not sf.exists():
        return []
    pids = read_state(sf)["pids"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if _alive(p)]
        for p in alive:
            try:
                os.killpg(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while any(_alive(p) for p in alive) and time.time() < deadline:
            time.sleep(0.2)
    sf.unlink(missing_ok=True)
    return pids


def _alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in the process group `pgid`."""
    try:  # reap the leader if it is our own child, so it does not linger as a zombie
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def running_api_url(settings: JexSettings, timeout: float = 0.5) -> str | None:
    """The API of the jex server `start` recorded, if it answers now (else None: the caller starts Prefect's
    temporary one). A flow of `jex run` then reports there: no temporary server to start (~2 s saved)."""
    sf = state_file(settings)
    try:
        url = json.loads(sf.read_text()).get("api_url") if sf.exists() else None
    except (OSError, ValueError, AttributeError):
        return None
    return url if isinstance(url, str) and healthy(url, timeout) else None
