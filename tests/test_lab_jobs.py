"""Lab jobs through the providers (issue 29 item 5): the early-exit probe, parity, the bake-off and the
budget projection (`jex calibrate`) run on a machine of the `local` provider, their outputs come back
from its job folder, and on the deterministic CPU engine they equal the in-process run on the same rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jex.sample_suite import write_sample_suite

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lab_suite(tmp_path_factory) -> Path:
    return write_sample_suite(tmp_path_factory.mktemp("lab") / "suite", rows=18, seed=7)


@pytest.fixture()
def local_machines(tmp_path, monkeypatch):
    """The `local` provider's machines, polled often, running this interpreter."""
    for k, v in {"JEX_INFRA__STATE_DIR": str(tmp_path / "infra"), "JEX_INFRA__POLL_S": "0.3",
                 "JEX_INFRA__WORKER_PYTHON": sys.executable, "JEX_INFRA__PROVIDER": "local"}.items():
        monkeypatch.setenv(k, v)


def _ran_on_a_machine(out: Path, job: str) -> None:
    """`out` holds the machines report of one local machine that ran `job`, and the job's folder."""
    machines = json.loads((out / "machines.json").read_text())
    assert machines["provider"] == "local" and len(machines["machines"]) == 1
    machine = machines["machines"][0]
    assert [o["job"] for o in machine["jobs"]] == [job] and machine["jobs"][0]["status"] == "success"
    assert (out / ".machines" / machine["machine"]["id"] / job / "args.json").exists()


def _cli(*argv: str) -> None:
    from typer.testing import CliRunner

    from jex.cli import app

    result = CliRunner().invoke(app, list(argv))
    assert result.exit_code == 0, result.output


def test_probe_runs_on_a_local_machine_and_equals_in_process(lab_suite, tmp_path, prefect_harness, local_machines):
    runs = {}
    for provider in ("local", "inprocess"):
        out = tmp_path / provider
        _cli("probe", "early-exit", "--suite", str(lab_suite), "--rows", "2", "--every", "4", "--max-tokens", "8",
             "--provider", provider, "-o", str(out))
        runs[provider] = json.loads((out / "probe.json").read_text())
        assert (out / "probe.png").stat().st_size > 1000
    _ran_on_a_machine(tmp_path / "local", "lab-probe")
    assert not (tmp_path / "inprocess" / "machines.json").exists()
    assert runs["local"] == runs["inprocess"]


def test_parity_runs_on_a_local_machine_and_equals_in_process(lab_suite, tmp_path, prefect_harness, local_machines):
    runs = {}
    for provider in ("local", "inprocess"):
        out = tmp_path / provider
        _cli("parity", "--suite", str(lab_suite), "--rows", "3", "--engine-a", "hf", "--engine-b", "hf-batched",
             "--provider", provider, "-o", str(out))
        runs[provider] = json.loads((out / "parity.json").read_text())
    _ran_on_a_machine(tmp_path / "local", "lab-parity")
    assert runs["local"]["readout"] == runs["inprocess"]["readout"] and runs["local"]["readout"]["common"] == 3
    assert (runs["local"]["accuracy_a"], runs["local"]["accuracy_b"]) == (runs["inprocess"]["accuracy_a"],
                                                                          runs["inprocess"]["accuracy_b"])


def test_bakeoff_runs_on_a_local_machine_and_equals_in_process(tmp_path, prefect_harness, local_machines):
    from jex.flows.experiments import bakeoff
    from jex.flows.fleet import MachinesSpec

    ids = {}
    for provider in ("local", "inprocess"):
        out = tmp_path / provider
        res = bakeoff(arms=["hf-bi"], prompts=2, tokens=4, ladder=[1, 2], repeats=1, out=str(out),
                      machines=MachinesSpec(provider=provider))
        assert res["errors"] == {}
        arm = json.loads((out / "arm-hf-bi.json").read_text())
        ids[provider] = {b: r["token_ids"] for b, r in arm["rungs"].items()}
    _ran_on_a_machine(tmp_path / "local", "lab-bakeoff")
    assert ids["local"] == ids["inprocess"] and set(ids["local"]) == {"1", "2"}


def test_calibrate_measures_its_sample_on_a_local_machine(lab_suite, tmp_path, prefect_harness, local_machines):
    measured = {}
    for provider in ("local", "inprocess"):
        out = tmp_path / provider
        _cli("calibrate", "--suite", str(lab_suite), "--coverage", "0.25", "--sample-every", "3", "--provider",
             provider, "--out", str(out))
        budget = next(out.glob("*-budget"))
        measured[provider] = json.loads((budget / "budget.json").read_text())["measured"]
    budget = next((tmp_path / "local").glob("*-budget"))
    machines = json.loads((budget / "machines.json").read_text())
    assert machines["provider"] == "local"
    assert [o["job"] for o in machines["machines"][0]["jobs"]] == ["golden", "fast_pass", "reason"]
    same = ("sample_rows", "gated", "fix_rate", "fixed", "flipped")
    assert {k: measured["local"][k] for k in same} == {k: measured["inprocess"][k] for k in same}
    assert measured["local"]["fast_s_per_row"] > 0 and measured["local"]["reason_s_per_row"] > 0
