"""The orchestrator's Prefect server: deployments, UI-triggered runs, schedules, automation, retry-stage, history.

A real `jex server start` on 127.0.0.1 (server, process worker, deployments) per module, stopped by
`jex server stop`; a real browser (Debian's Chromium driven by playwright) for the UI test; a
PostgreSQL database on 127.0.0.1:5432 for the second backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from jex.deployments.server import _alive
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
DOCS_IMG = ROOT / "docs" / "img"
"""Where the browser test's screenshots go: docs/img only with `make screenshots` (JEX_DOCS_SCREENSHOTS=1),
else a temporary folder, so running the tests leaves the work tree as it was."""
NOTIFY_BLOCK = "custom-webhook/jex-alerts"


def _jex(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "jex", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


PREFECT_PACE = {"PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}
"""Prefect's own settings, for the server and worker `jex server start` starts: its worker asks for runs to start
every second (Prefect's default: 10 s) and its scheduler creates scheduled runs every 5 s (default 60 s); the
same services doing the same work, less time waiting for their next turn."""


def _start(tmp: Path, defaults: dict, extra_env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "JEX_INFRA__STATE_DIR": str(tmp / "infra"),
           "JEX_PREFECT__PORT": str(free_port()), "JEX_INFRA__POLL_S": "0.5", "JEX_INFRA__HEARTBEAT_S": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING", **PREFECT_PACE, **(extra_env or {})}
    env.pop("PREFECT_API_URL", None)
    (tmp / "defaults.json").write_text(json.dumps(defaults))
    _jex(["server", "start", "--defaults", str(tmp / "defaults.json")], env)
    state = json.loads((tmp / "infra" / "server.json").read_text())
    return {"env": {**env, "PREFECT_API_URL": state["api_url"]}, "state": state, "tmp": tmp}


def _stop(server: dict) -> None:
    out = _jex(["server", "stop"], server["env"])
    assert "stopped" in out.stdout
    assert not any(_alive(pid) for pid in server["state"]["pids"]), "jex server stop left a process running"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from jex.sample_suite import write_sample_suite

    tmp = tmp_path_factory.mktemp("server")
    suite = write_sample_suite(tmp / "suite", rows=36, seed=5)
    defaults = {"name": "ui", "suite": str(suite), "reason_max_tokens": 6, "bootstrap_draws": 100,
                "fast_shard_rows": 9, "store": str(tmp / "store"), "out": str(tmp / "runs"),
                "machines": {"provider": "local", "golden_rows": 8}}
    srv = _start(tmp, defaults, {"JEX_PREFECT__NOTIFY_BLOCK": NOTIFY_BLOCK})
    srv["defaults"] = defaults
    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = srv["state"]["api_url"]
    try:
        yield srv
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old
        _stop(srv)


def _run(name: str, parameters: dict, timeout: float = 900):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: os.environ["PREFECT_API_URL"]}):
        return run_deployment(name, parameters=parameters, timeout=timeout, poll_interval=1)  # its state: each second


@contextlib.contextmanager
def _client():
    """A client of the server under test. Settings are read once when prefect is imported (maybe by an
    earlier test module), so the API URL is set through a settings context, not the environment."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: os.environ["PREFECT_API_URL"]}), get_client(sync_client=True) as c:
        yield c


def test_campaign_deployment_runs_from_the_api_and_publishes_its_report(server):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    spec = {**server["defaults"], "name": "api"}
    run = _run("campaign/campaign", {"spec": spec})
    assert run.state_name == "Completed", run.state.message
    with _client() as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    report = next(a for a in arts if a.key == "campaign-report")
    assert "Campaign report: api" in report.data and "## Machines" in report.data
    assert "](data:image/png;base64," in report.data and "](skill.png)" not in report.data
    with _client() as c:  # the machine and its steps are task runs of the campaign's flow run
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        states = {t.name: t.state_name for t in c.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))}
    assert {k: v for k, v in states.items() if k.startswith(("machine-", "w0-"))} == {
        "machine-w0": "Completed", "w0-bootstrap": "Completed", "w0-golden": "Completed",
        "w0-fast_pass": "Completed", "w0-reason": "Completed", "w0-teardown": "Completed"}
    run_dir = next((server["tmp"] / "runs").glob("api-*"))
    assert json.loads((run_dir / "machines.json").read_text())["machines"][0]["teardown"]["reason"] == \
        "campaign stages done"
    out = _jex(["runs", "--json"], server["env"])
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    mine = next(r for r in rows if r["id"] == str(run.id))
    assert mine["state"] == "Completed" and mine["index"] is not None
    assert mine["cost_usd"] == 0, "a local machine costs nothing unless a price is set"
    stages = json.loads((run_dir / "stages.json").read_text())
    engine = json.loads((run_dir / "provenance.json").read_text())["engine"]
    assert (mine["model"], mine["bundle"], mine["weights_sha256"]) == \
        ("embedded", stages["bundle"]["key"], engine["weights_sha256"])
    by_weights = _jex(["runs", "--json", "--model", engine["weights_sha256"][:10]], server["env"])
    assert str(run.id) in by_weights.stdout
    assert str(run.id) not in _jex(["runs", "--json", "--model", "another/model"], server["env"]).stdout


def test_experiment_deployment_runs_from_the_api_and_publishes_its_report(server):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    out = server["tmp"] / "experiment"
    arms = '[gate]\ndraws = 100\npermutations = 100\n\n[[arms]]\nname = "fw"\nfold_weight = 1.0\n'
    run = _run("experiment/experiment", {"spec": {"campaign": {**server["defaults"], "name": "base"},
                                                  "arms_toml": arms, "out": str(out)}})
    assert run.state_name == "Completed", run.state.message
    with _client() as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    report = next(a for a in arts if a.key == "experiment-report")
    doc = json.loads((out / "experiment.json").read_text())
    assert doc["gate"]["settings_sha256"] in report.data and "| fw | arm |" in report.data
    assert "](data:image/png;base64," in report.data and "](forest.png)" not in report.data
    assert doc["arms"]["fw"]["engine_calls"] == {"fast_pass": 0, "reason": 0}  # a fold arm reuses the capture


def test_a_browser_starts_a_campaign_from_the_run_form(server, tmp_path):
    if not shutil.which("chromium"):
        pytest.skip("Debian's chromium is not installed (`.ci/services.sh` installs it as root)")
    from playwright.sync_api import sync_playwright

    ui = server["state"]["ui_url"]
    shots = DOCS_IMG if os.environ.get("JEX_DOCS_SCREENSHOTS") == "1" else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{ui}/deployments", wait_until="networkidle")
        page.get_by_text("retry-stage").first.wait_for()
        page.screenshot(path=str(shots / "ui-deployments.png"))
        page.locator('a[href^="/deployments/deployment/"]', has_text="campaign").first.click()
        run = page.get_by_role("button", name="Run", exact=True)
        run.wait_for(timeout=30_000)
        run.click()
        page.get_by_role("button", name="Custom run").click()
        page.wait_for_url("**/run?**")
        page.get_by_text("Campaign name (prefix of the run folder)").wait_for()
        boxes = page.locator("textarea")
        name = next(boxes.nth(i) for i in range(boxes.count()) if boxes.nth(i).input_value() == "ui")
        name.fill("browser")  # the form is pre-filled with the deployment's defaults
        shared = server["defaults"]["store"]
        stores = [boxes.nth(i) for i in range(boxes.count()) if boxes.nth(i).input_value() == shared]
        stores[0].fill(str(tmp_path / "store"))  # its own store: its stages run on a machine, none come from a cache
        page.screenshot(path=str(shots / "ui-run-form.png"))
        run_id = _submit(page, "browser")  # the run the form created, with the name typed into it
        # Off the UI while the campaign runs: a live run page re-renders as it polls, and on 2 cores the
        # browser's software compositing took more CPU than the campaign it watched (76 s in one CI run)
        page.goto("about:blank")
        deadline = time.time() + 900
        while time.time() < deadline:
            with _client() as c:
                state = c.read_flow_run(run_id).state_name
            if state in ("Completed", "Failed", "Crashed"):
                break
            time.sleep(1)
        assert state == "Completed"
        page.goto(f"{ui}/runs/flow-run/{run_id}", wait_until="networkidle")
        page.get_by_text("Completed", exact=True).first.wait_for(timeout=30_000)  # and the UI shows it
        page.screenshot(path=str(shots / "ui-run-completed.png"))
        page.locator("li.p-tab#task-runs").click()  # each machine's life and its steps are task runs
        page.get_by_placeholder("Search by run name").fill("w0")
        page.get_by_role("link", name=re.compile(r"^report-")).wait_for(state="detached", timeout=30_000)
        for step in ("machine-w0", "w0-bootstrap", "w0-golden", "w0-fast_pass", "w0-teardown"):
            page.get_by_text(step, exact=False).first.wait_for(timeout=30_000)
        page.screenshot(path=str(shots / "ui-run-machines.png"))
        page.goto(f"{ui}/artifacts/artifact/{_report_artifact(run_id)}", wait_until="networkidle")
        plots = page.locator("img[src^='data:image/png;base64,']")  # the report's plots travel inside it
        plots.first.wait_for(timeout=30_000)
        assert plots.count() == 2 and plots.first.evaluate("img => img.naturalWidth") > 100  # drawn, not broken
        plots.first.scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "ui-report-artifact.png"))
        browser.close()
    assert next((server["tmp"] / "runs").glob("browser-*/report.md")).exists()


def _report_artifact(flow_run_id: str) -> str:
    """The id of the campaign report artifact of the flow run."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with _client() as c:
        found = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["campaign-report"]),
                                                                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert found, "the campaign run published no report artifact"
    return str(found[0].id)


def _submit(page: Any, name: str, tries: int = 3, wait_s: float = 60) -> str:
    """Submit the run form and return the id of the campaign run named `name` it created: the UI's toast said
    it was scheduled, or the server holds the run. A submit whose create request never went out or failed
    (a busy server's error toast) is clicked again, as a user would; one still under way is waited for, so a
    slow server never gets two runs. After `tries`, fail with the API calls that failed and the page's text."""
    creates: list[str | None] = []  # each create_flow_run POST: None while under way, then its status
    failed: list[str] = []

    def creates_run(request: Any) -> bool:
        return request.method == "POST" and "create_flow_run" in request.url

    def on_request(request: Any) -> None:
        if creates_run(request):
            creates.append(None)

    def on_response(response: Any) -> None:
        if response.status >= 400:
            failed.append(f"{response.status} {response.request.method} {response.url}")
        if creates_run(response.request) and creates:
            creates[-1] = str(response.status)

    def on_request_failed(request: Any) -> None:
        failed.append(f"{request.failure} {request.method} {request.url}")
        if creates_run(request) and creates:
            creates[-1] = "failed"

    page.on("request", on_request)
    page.on("response", on_response)
    page.on("requestfailed", on_request_failed)
    for _ in range(tries):
        before = len(creates)
        page.get_by_role("button", name="Submit").click()
        deadline = time.time() + wait_s
        while time.time() < deadline or (len(creates) > before and creates[-1] is None
                                         and time.time() < deadline + 4 * wait_s):
            if page.get_by_text("scheduled to start", exact=False).count():
                return _wait_for_run_named(name)
            with contextlib.suppress(AssertionError):
                return _wait_for_run_named(name, timeout=2)
        if len(creates) > before and (creates[-1] or "").startswith("2"):
            return _wait_for_run_named(name)  # created: the server lists it soon
    said = page.inner_text("body")[-2000:]
    raise AssertionError(f"the form created no run named {name!r} in {tries} submits; create requests: {creates}; "
                         f"failed API calls: {failed}; the page reads:\n{said}")


def _wait_for_run_named(name: str, timeout: float = 120) -> str:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    deadline = time.time() + timeout
    while time.time() < deadline:
        with _client() as c:
            runs = c.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["campaign"])))
        named = [r for r in runs if (r.parameters.get("spec") or {}).get("name") == name]
        assert len(named) <= 1, f"{len(named)} campaign runs are named {name!r}"
        if named:
            return str(named[0].id)
        time.sleep(1)
    raise AssertionError(f"no campaign run named {name!r} was created")


def test_the_budget_projection_schedule_creates_runs(server):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    deadline, runs = time.time() + 60, []
    while time.time() < deadline and not runs:
        with _client() as c:
            runs = c.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["budget"])))
        time.sleep(1)
    assert runs and all(r.state_name == "Scheduled" for r in runs)
    assert {r.expected_start_time.astimezone().hour for r in runs} == {3} or \
        {r.expected_start_time.hour for r in runs} == {3}


def test_registering_deletes_the_deployment_of_the_renamed_calibration_flow(server):
    """The budget projection was the `calibration` flow and deployment: a server registered before the
    rename loses that deployment (and its nightly schedule of a module that is gone) on registering."""
    from prefect.exceptions import ObjectNotFound

    from jex.deployments.register import retire_deployments

    with _client() as c:
        c.create_deployment(flow_id=c.create_flow_from_name("calibration"), name="calibration")
        assert retire_deployments() == ["calibration/calibration"]  # inside the client's settings context
        with pytest.raises(ObjectNotFound):
            c.read_deployment_by_name("calibration/calibration")
        assert retire_deployments() == []


def test_a_failed_campaign_triggers_reconcile_through_the_automation(server):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.test_notifications import Hook

    hook = Hook()  # the team's webhook, configured as a Prefect notification block
    with temporary_settings({PREFECT_API_URL: os.environ["PREFECT_API_URL"]}):
        CustomWebhookNotificationBlock(name="jex", url=hook.url, allow_private_urls=True,
                                       json_data={"subject": "{{subject}}", "text": "{{body}}"}
                                       ).save(NOTIFY_BLOCK.split("/")[1], overwrite=True)
    failed = _run("campaign/campaign", {"spec": {**server["defaults"], "name": "bad", "suite": "/nonexistent"}})
    assert failed.state_name == "Failed"
    deadline, triggered = time.time() + 180, None
    while time.time() < deadline:
        with _client() as c:
            runs = c.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["reconcile"])))
        triggered = next((r for r in runs if r.parameters.get("flow_run_id") == str(failed.id)), None)
        if triggered is not None and triggered.state_name == "Completed":
            break
        time.sleep(1)
    assert triggered is not None, "the automation did not run reconcile"
    assert triggered.state_name == "Completed"
    hook.close()
    (note,) = hook.received  # the failure was announced: campaign, stage, run folder
    assert note["subject"] == "jex: campaign bad failed at stage bundle"
    assert "run folder: none yet (file /nonexistent/suite.toml: no suite manifest here" in note["text"]


def test_retry_stage_reruns_only_the_named_stage_and_after(server):
    spec = {**server["defaults"], "name": "retry", "machines": {"provider": "inprocess"}}
    first = _run("campaign/campaign", {"spec": spec})  # the shared store: its capture may come from the cache
    assert first.state_name == "Completed", first.state.message
    run_dir = next((server["tmp"] / "runs").glob("retry-*"))

    fold = _run("retry-stage/retry-stage", {"run_dir": str(run_dir), "stage": "fold"})
    assert fold.state_name == "Completed", fold.state.message
    calls = json.loads((run_dir / "engine_calls.json").read_text())
    assert calls["redo"] == ["fold", "calibrate", "overlay", "score"]
    assert calls["calls"] == {"fast_pass": 0, "reason": 0} and len(calls["retired"]) == 4

    predictions = (run_dir / "predictions.parquet").read_bytes()
    reason = _run("retry-stage/retry-stage", {"run_dir": str(run_dir), "stage": "reason"})
    assert reason.state_name == "Completed", reason.state.message
    calls = json.loads((run_dir / "engine_calls.json").read_text())  # no failed row: only the stages after it
    assert calls["redo"][0] == "reason" and len(calls["retired"]) == 4
    assert calls["calls"] == {"fast_pass": 0, "reason": 0}
    assert (run_dir / "predictions.parquet").read_bytes() == predictions


def test_the_server_runs_on_postgresql(tmp_path):
    import asyncio

    import asyncpg

    db = f"jex_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(host="127.0.0.1", port=5432, user="postgres", database="test")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        asyncio.run(admin(f"CREATE DATABASE {db}"))
    except (OSError, asyncpg.PostgresError) as e:
        pytest.skip(f"no PostgreSQL on 127.0.0.1:5432 ({e})")
    srv = _start(tmp_path, {"name": "pg"}, {
        "JEX_PREFECT__DATABASE_URL": f"postgresql+asyncpg://postgres@127.0.0.1:5432/{db}"})
    try:
        assert srv["state"]["database"] == "postgresql"
        os.environ["PREFECT_API_URL"] = srv["state"]["api_url"]
        run = _run("reconcile/reconcile", {"provider": "local"}, timeout=300)
        assert run.state_name == "Completed", run.state.message
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        _stop(srv)
        asyncio.run(admin(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
