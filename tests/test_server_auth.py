"""Nobody in who does not belong: the server's basic authentication.

Bound to anything but loopback, `jex server start` refuses to start without an auth string; with
one, an unauthenticated request is refused (401), the CLI, the worker and the flows it runs send it,
and the secret is in no state file, log or `jex config show`. A real `jex server start` on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
SECRET = "jex-admin:Sup3r-s3cret-pa55"


def _jex(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jex", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "JEX_INFRA__STATE_DIR": str(tmp / "infra"),
           "JEX_PREFECT__PORT": str(free_port()), "PREFECT_LOGGING_LEVEL": "INFO", **extra}
    for k in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "JEX_PREFECT__AUTH_STRING"):
        if k not in extra:
            env.pop(k, None)
    return env


def test_a_server_reachable_from_other_machines_does_not_start_without_authentication(tmp_path):
    p = _jex(["server", "start", "--host", "0.0.0.0", "--no-worker"], _env(tmp_path))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "refusing to serve on 0.0.0.0" in p.stderr and "JEX_PREFECT__AUTH_STRING" in p.stderr
    assert not (tmp_path / "infra" / "server.json").exists()  # nothing was started


def _post(url: str, auth: str | None) -> int:
    import base64

    req = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_unauthenticated_requests_are_refused_and_authenticated_runs_complete(tmp_path):
    env = _env(tmp_path, JEX_PREFECT__AUTH_STRING=SECRET)
    started = _jex(["server", "start"], env)
    assert started.returncode == 0, started.stderr[-3000:]
    state = json.loads((tmp_path / "infra" / "server.json").read_text())
    api = state["api_url"]
    try:
        assert _post(f"{api}/deployments/filter", None) == 401
        assert _post(f"{api}/deployments/filter", "jex-admin:wrong") == 401
        assert _post(f"{api}/deployments/filter", SECRET) == 200
        # a flow run through the worker: the worker and the flow talk to the API with the secret
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: SECRET}):
            run = run_deployment("reconcile/reconcile", parameters={"provider": "local"}, timeout=600)
        assert run.state_name == "Completed", run.state.message
        runs = _jex(["runs", "--json"], {**env, "PREFECT_API_URL": api})  # the CLI sends it from settings
        assert runs.returncode == 0, runs.stderr[-2000:]
        shown = _jex(["config", "show"], env)
        assert shown.returncode == 0 and SECRET not in shown.stdout and "Sup3r" not in shown.stdout
    finally:
        stopped = _jex(["server", "stop"], env)
        assert stopped.returncode == 0, stopped.stderr
    leaked = [str(f) for f in tmp_path.rglob("*") if f.is_file() and "Sup3r-s3cret" in f.read_text(errors="ignore")]
    assert leaked == [], f"the auth secret was written to {leaked}"
