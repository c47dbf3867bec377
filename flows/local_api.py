"""Prefect's local (ephemeral) API, made dependable on a fresh machine.

Without PREFECT_API_URL a flow starts a temporary API server. On a fresh PREFECT_HOME that server
must first create its SQLite database, which on a slow 2-core machine outlasts its start-up timeout
(seen here: the flow fails with 'Timed out while attempting to connect to ephemeral Prefect API
server'). Migrating the database once, before the first flow, avoids it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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
    subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], check=True,
                   stdout=subprocess.DEVNULL)
    return True
