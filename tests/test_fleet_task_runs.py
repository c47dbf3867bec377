"""The fleet in the Prefect UI: each machine's life is a task run `machine-LABEL`, its steps (bootstrap,
golden replay, each engine job with its collection, teardown) child task runs `LABEL-STEP`.

A fleet runs inside a small flow on the test's Prefect API, with the `local` provider; the task runs
are read back from that API.
"""

from __future__ import annotations

import sys
from uuid import UUID

import pytest
from prefect.client.schemas.objects import TaskRun

from tests.conftest import row, write_suite


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The session's Prefect test API."""


def _task_runs(flow_run_id: UUID) -> dict[str, TaskRun]:
    """The flow run's task runs by name (each name once)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    by_name = {r.name: r for r in runs}
    assert len(by_name) == len(runs), sorted(r.name for r in runs)
    return by_name


def _children(runs: dict[str, TaskRun], parent: TaskRun) -> dict[str, str]:
    """Names and final state types of the task runs whose parent is `parent`."""
    return {name: r.state_type.value for name, r in runs.items()
            if any(getattr(p, "id", None) == parent.id for p in r.task_inputs.get("__parents__", []))}


def _fleet_flow(tmp_path, monkeypatch, rows: int):
    """A flow that runs the fast pass of a `rows`-row suite on one `local` machine; returns it and the
    fleet it used (filled in when it runs)."""
    from prefect import flow
    from prefect.runtime import flow_run

    from jex.engine_spec import EngineSpec
    from jex.flows.machines.fleet import GpuFleet
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(tmp_path / "infra"))
    monkeypatch.setenv("JEX_INFRA__POLL_S", "0.3")
    monkeypatch.setenv("JEX_INFRA__WORKER_PYTHON", sys.executable)
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=write_suite(tmp_path / "s", {"a": [row(f"a{i}", "a") for i in range(rows)]}))
    job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(), shard_rows=rows), store=str(store.root))
    fleet = GpuFleet(MachinesSpec(provider="local", golden_rows=2), campaign="ui", store=str(store.root),
                     settings=load_settings(), echo=print)

    @flow(name="fleet-in-the-ui")
    def one_stage() -> str:
        with fleet:
            fleet.run_stage(job)
        return str(flow_run.id)

    return one_stage, fleet


@pytest.mark.slow
def test_a_machine_is_a_task_run_with_its_steps_as_child_task_runs(harness, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    one_stage, fleet = _fleet_flow(tmp_path, monkeypatch, rows=3)
    flow_run_id = UUID(one_stage())
    runs = _task_runs(flow_run_id)
    machine = runs["machine-w0"]
    assert machine.state_type.value == "COMPLETED"
    assert _children(runs, machine) == {"w0-bootstrap": "COMPLETED", "w0-golden": "COMPLETED",
                                        "w0-fast_pass": "COMPLETED", "w0-teardown": "COMPLETED"}
    assert fleet.provider.list_machines() == []
    with get_client(sync_client=True) as client:  # the machine's collected shards move the progress artifact
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))
    assert [(a.key, a.data) for a in arts] == [("fast-pass-progress", 100.0)]


def test_a_machine_that_fails_fails_its_task_run_and_is_still_torn_down(harness, tmp_path, monkeypatch):
    from prefect.runtime import flow_run

    from jex.errors import InfraError
    from jex.infra.machine import MachineSession

    one_stage, fleet = _fleet_flow(tmp_path, monkeypatch, rows=1)
    seen: dict[str, str] = {}

    def lose_the_connection(session):  # the machine exists, then its bootstrap fails
        seen["flow_run"] = str(flow_run.id)
        raise InfraError(f"bootstrap of {session.machine.id} lost its connection")

    monkeypatch.setattr(MachineSession, "bootstrap", lose_the_connection)
    with pytest.raises(InfraError, match="machine w0 of provider 'local' did not start: bootstrap of"):
        one_stage()
    runs = _task_runs(UUID(seen["flow_run"]))
    machine = runs["machine-w0"]
    assert machine.state_type.value == "FAILED"
    assert _children(runs, machine) == {"w0-bootstrap": "FAILED", "w0-teardown": "COMPLETED"}
    assert fleet.provider.list_machines() == [] and fleet.sessions[0].teardown_record is not None
