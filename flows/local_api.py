"""Prefect's local (ephemeral) API, made dependable on a fresh machine.

Without PREFECT_API_URL a flow starts a temporary API server. On a fresh PREFECT_HOME that server
must first create its SQLite database, which on a slow 2-core machine outlasts its start-up timeout
(seen here: the flow fails with 'Timed out while attempting to connect to ephemeral Prefect API
server'). Migrating the database once, before the first flow, avoids it.

Migrating takes ~13 s on 2 cores, the same work for every new PREFECT_HOME of one Prefect version, so
it is done once per machine and Prefect version into a template (`<cache>/prefect-db/<version>/`), and
each new database is a copy of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE_DIR = Path.home() / ".cache" / "jex" / "prefect-db"


def ensure_local_api() -> bool:
    """Prepare the ephemeral API's database if no API URL is configured and none exists yet; returns
    whether flows will use the ephemeral API (no URL configured, in the environment or Prefect's profile)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if os.environ.get("PREFECT_API_URL"):
        return False
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return False
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
