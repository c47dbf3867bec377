"""Prefect's local (ephemeral) API, made dependable on a fresh machine.

Without PREFECT_API_URL a flow starts a temporary API server. On a fresh PREFECT_HOME that server
must first create its SQLite database, which on a slow 2-core machine outlasts its start-up timeout
(seen here: the flow fails with 'Timed out while attempting to connect to ephemeral Prefect API
server'). Migrating the database once, before the first flow, avoids it.

Migrating takes ~13 s on 2 cores, the same work for every new PREFECT_HOME of one Prefect version, so
it is done once per machine and Prefect version into a template (`<cache>/prefect-db/<version>/`), and
each new database is a copy of it.

The temporary server is a child process that outlives an orchestrator killed with SIGKILL (a uvicorn
process with parent 1, holding its port). Each one this process starts is recorded in the state folder
(`jex.infra.processes`) and forgotten when Prefect stops it; whatever a killed orchestrator left running is
stopped here, before the next flow, and by `jex infra reconcile`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from jex.infra.processes import forget_process, orphans_line, record_process, stop_orphans

log = logging.getLogger(__name__)
TEMPLATE_DIR = Path.home() / ".cache" / "jex" / "prefect-db"
SERVER_MODULE = "prefect.server.api.server"
"""Where Prefect's temporary server (`SubprocessASGIServer`) lives."""
SERVER_KIND = "prefect-server"


def ensure_local_api(state_dir: Path | None = None, *, ahead: bool = False) -> bool:
    """Stop the processes a killed jex left running (one line on stderr when there were any), then prepare
    the ephemeral API's database if no API URL is configured and none exists yet, and have its server
    recorded in `state_dir` (default: the settings') when it starts; returns whether flows will use the
    ephemeral API (no URL configured, in the environment or Prefect's profile). `ahead`: the caller starts
    the server itself next (`start_temporary_api`), which records it."""
    if state_dir is None:
        from jex.settings import load_settings

        state_dir = Path(load_settings().infra.state_dir)
    if stopped := stop_orphans(state_dir):
        print(orphans_line(stopped), file=sys.stderr)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if os.environ.get("PREFECT_API_URL"):
        return False
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return False
    RECORD_IN[:] = [Path(state_dir)]
    if not ahead:
        record_temporary_servers(state_dir)
    url = settings.server.database.connection_url
    url_text = url.get_secret_value() if url is not None else ""
    if url_text and not url_text.startswith("sqlite"):
        return True
    db = Path(url_text.split("///", 1)[1]) if "///" in url_text else Path(settings.home) / "prefect.db"
    if db.exists():
        return True
    db.parent.mkdir(parents=True, exist_ok=True)
    partial = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    shutil.copyfile(migrated_template(), partial)
    os.replace(partial, db)
    return True


def start_temporary_api() -> TemporaryAPI:
    """Start Prefect's temporary API server now, before this process imports Prefect's server module and its
    flows, instead of at the first flow's first API call: the server's process comes up while this one imports
    (on a GPU host the server's start took 4.7 s after 3.7 s of those). Prefect's client finds it as its own
    temporary server (the `SubprocessASGIServer` it would have started, as Prefect's test harness registers
    one). Call after `ensure_local_api(ahead=True)` said flows use the temporary API; `TemporaryAPI.ready()`
    before any flow runs."""
    import atexit
    import importlib.util
    import socket

    from prefect.settings import get_current_settings

    with socket.socket() as probe:  # a free port, as the server binds it in a moment
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.origin is not None
    command = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent), "--factory",
               "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
               "error", "--lifespan", "on"]  # Prefect's own temporary server's command and environment
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    process = subprocess.Popen(command, env=env)
    state_dir = RECORD_IN[-1]
    try:
        record_process(state_dir, kind=SERVER_KIND, pid=process.pid, port=port, command=command)
    except OSError as e:
        log.warning("could not record the temporary Prefect server (pid %s) in %s: %s", process.pid, state_dir, e)
    api = TemporaryAPI(process, port, state_dir)
    atexit.register(api.stop)
    return api


class TemporaryAPI:
    """Prefect's temporary server as `start_temporary_api` started it: handed to Prefect's client by `ready()`."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, state_dir: Path):
        self.process, self.port, self.state_dir = process, port, state_dir
        self.server: Any = None
        self.address = f"http://127.0.0.1:{port}"

    def ready(self, timeout_s: float | None = None) -> None:
        """Register the server as the temporary one Prefect's client asks for (as Prefect's test harness does;
        importing Prefect's server module for it while the server starts) and wait until it answers; raise
        RuntimeError naming its end when it exits first or does not answer."""
        import httpx

        record_temporary_servers(self.state_dir)  # any server Prefect itself would start is recorded too
        import prefect.server.api.server as module

        self.server = module.SubprocessASGIServer(self.port)
        self.server.server_process, self.server.running, self.server.jex_state_dir = \
            self.process, True, self.state_dir
        module.SubprocessASGIServer._instances[None] = self.server
        timeout_s = timeout_s or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the temporary Prefect server on {self.address} exited "
                                       f"({self.process.returncode}) before it answered")
                try:
                    if client.get(f"{self.address}/api/health", timeout=5).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"the temporary Prefect server on {self.address} did not answer in {timeout_s:.0f} s")

    def stop(self) -> None:
        """Stop it (also when no flow needed it, before it answered) and forget its record."""
        if self.server is not None:  # Prefect's own stop, as for the server it would have started
            if self.server.server_process is not None:
                self.server.stop()
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        forget_process(self.state_dir, self.process.pid)


def migrated_template() -> Path:
    """An empty Prefect database migrated to this Prefect version's schema, made on first use."""
    from prefect import __version__

    template = TEMPLATE_DIR / __version__ / "prefect.db"
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
        made = Path(tmp) / "prefect.db"
        env = {**os.environ, "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{made}"}
        subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], check=True,
                       stdout=subprocess.DEVNULL, env=env)
        if any(made.with_name(made.name + suffix).exists() for suffix in ("-wal", "-journal")):
            raise RuntimeError(f"the migrated Prefect database {made} was left with an open journal")
        os.replace(made, template)  # another process may have made it meanwhile: the same bytes
    return template


def record_temporary_servers(state_dir: Path) -> None:
    """Have every temporary server Prefect starts in this process recorded in `state_dir` (the last one
    named) as it is spawned (an owner killed during the server's start-up leaves it running too) and
    forgotten when Prefect stops it: its server class replaced by a recording one. Called only where flows
    will use the ephemeral API, which imports Prefect's server module (~2 s) anyway."""
    import importlib

    RECORD_IN[:] = [Path(state_dir)]
    _record_servers_of(importlib.import_module(SERVER_MODULE))


RECORD_IN: list[Path] = []
"""The state folder this process records its temporary servers in (set by `record_temporary_servers`)."""


def _record_servers_of(module: ModuleType) -> None:
    base = module.SubprocessASGIServer
    if getattr(base, "jex_records", False):
        return

    class RecordedServer(base):  # type: ignore[misc, valid-type]
        """Prefect's temporary server, each process it spawns recorded (`jex.infra.processes`)."""

        jex_records = True

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:  # Prefect's one place that spawns it
            process = super()._run_uvicorn_command()
            args = process.args
            command = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
            self.jex_state_dir = RECORD_IN[-1]
            try:
                record_process(self.jex_state_dir, kind=SERVER_KIND, pid=process.pid, port=self.port,
                               command=command)
            except OSError as e:  # an unwritable state folder must not stop the flow; only the record is lost
                log.warning("could not record Prefect's temporary server (pid %s) in %s: %s", process.pid,
                            self.jex_state_dir, e)
            return process

        def stop(self) -> None:
            process = self.server_process
            super().stop()
            if process is not None and hasattr(self, "jex_state_dir"):
                forget_process(self.jex_state_dir, process.pid)

    setattr(module, "SubprocessASGIServer", RecordedServer)  # noqa: B010 - a module attribute mypy does not know
