"""`jex deploy`: jex's deployments, work pool, schedules and failure automation registered into a team's
Prefect server, not jex's own.

A plain `prefect server start` (none of jex's server code) with basic authentication, on a free
127.0.0.1 port with its own PREFECT_HOME (SQLite); `jex deploy` registers into it, a second
`jex deploy` changes nothing, and the campaign deployment, triggered through the API, is run to
completion by a worker started separately (`prefect worker start --run-once`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
AUTH = "team:0nly-the-team-gets-in"


def _deploy(*args: str, url: str) -> str:
    """`jex deploy ARGS` in this process (the flows it loads stay imported: seconds, not tens), as a
    client of the team's server sees it: the URL and the secret in the environment; its stdout."""
    from typer.testing import CliRunner

    from jex.cli import app

    out = CliRunner().invoke(app, ["deploy", *args], env={"PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": AUTH})
    assert out.exit_code == 0, out.output[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def team_server(tmp_path_factory):
    """A plain Prefect server with basic auth; yields (API URL, the environment of its clients)."""
    tmp = tmp_path_factory.mktemp("team")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFECT_API_", "JEX_PREFECT__")) and k != "PREFECT_HOME"}
    server_env = {**base, "PREFECT_HOME": str(tmp / "server-home"), "PREFECT_SERVER_API_AUTH_STRING": AUTH,
                  "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = open(tmp / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port), "--analytics-off"], env=server_env, cwd=tmp,
                              start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.time() < deadline, (tmp / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        client_env = {**base, "PREFECT_HOME": str(tmp / "client-home"), "PREFECT_API_URL": url,
                      "PREFECT_API_AUTH_STRING": AUTH, "JEX_INFRA__STATE_DIR": str(tmp / "infra"),
                      "PREFECT_LOGGING_LEVEL": "WARNING"}
        yield url, client_env, tmp
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.slow
def test_deploy_registers_into_a_team_server_once_and_its_campaign_runs_on_a_separate_worker(team_server):
    from jex.sample_suite import write_sample_suite

    url, env, tmp = team_server
    suite = write_sample_suite(tmp / "suite", rows=18, seed=5)
    defaults = {"name": "team", "suite": str(suite), "reason_max_tokens": 4, "bootstrap_draws": 50,
                "coverage": 0.0, "store": str(tmp / "store"), "out": str(tmp / "runs"),
                "machines": {"provider": "inprocess"}}
    (tmp / "defaults.json").write_text(json.dumps(defaults))

    dry = _deploy("--dry-run", "--defaults", str(tmp / "defaults.json"), url=url)
    assert "would create  deployment campaign/campaign" in dry and "nothing was written" in dry
    first = _deploy("--defaults", str(tmp / "defaults.json"), url=url)
    assert "created       deployment campaign/campaign" in first and "created       automation" in first
    again = _deploy("--defaults", str(tmp / "defaults.json"), url=url)
    assert again.splitlines()[-1].startswith("nothing changed"), again
    assert "created" not in again and "updated" not in again

    from prefect.deployments import run_deployment

    from jex.deployments.register import POOL, connected_to

    with connected_to(url, auth_string=AUTH):
        run = run_deployment("campaign/campaign", parameters={"spec": {**defaults, "name": "team-run"}}, timeout=0)
    worker = subprocess.run([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type",
                             "process", "--run-once"], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert worker.returncode == 0, worker.stderr[-3000:]
    from prefect.client.orchestration import get_client

    with connected_to(url, auth_string=AUTH), get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    assert state is not None and state.is_completed(), (state, worker.stdout[-2000:], worker.stderr[-3000:])
    assert list((tmp / "runs").glob("team-run-*/score.json"))


def test_deploy_without_a_server_named_is_one_line_saying_how_to_name_one(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from jex.cli import app

    monkeypatch.chdir(tmp_path)  # no .env
    for name in [n for n in os.environ if n.startswith(("JEX_PREFECT__", "PREFECT_API_"))]:
        monkeypatch.delenv(name)
    out = CliRunner().invoke(app, ["deploy", "--dry-run"])
    assert out.exit_code == 1 and out.stderr.splitlines() == [
        "error: no Prefect server to register into: set PREFECT_API_URL or pass --api-url "
        "(`jex server start` registers into jex's own server)"]


def test_a_budget_cron_prefect_would_refuse_is_one_line_naming_the_setting_before_anything_is_registered():
    from jex.deployments.register import check_budget_cron
    from jex.errors import InputError

    check_budget_cron("15 4 * * *")
    with pytest.raises(InputError, match="JEX_PREFECT__BUDGET_CRON / --budget-cron': not a cron expression"):
        check_budget_cron("every night")
