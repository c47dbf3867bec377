"""Lab jobs through the providers (issue 29 item 5): the early-exit probe, parity, the bake-off and the
budget projection (`jex calibrate`) run on a machine of the `local` provider, their outputs come back
from its job folder, and on the deterministic CPU engine they equal the same computation in the test's
process on the same rows: the job the machine was handed (its `args.json`, or the spec in
`budget.json`), run here by the pure lab function (the flows' in-process provider is proven by
test_speculative.py and test_campaign_flow.py)."""

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


def _ran_on_a_machine(out: Path, job: str) -> Path:
    """`out` holds the machines report of one local machine that ran `job`, and the job's folder;
    returns the job's `args.json` there (the job as the machine was handed it)."""
    machines = json.loads((out / "machines.json").read_text())
    assert machines["provider"] == "local" and len(machines["machines"]) == 1
    machine = machines["machines"][0]
    assert [o["job"] for o in machine["jobs"]] == [job] and machine["jobs"][0]["status"] == "success"
    args = out / ".machines" / machine["machine"]["id"] / job / "args.json"
    assert args.exists()
    return args


def _here(args: Path, out: Path, suite: Path | None = None):
    """The machine's lab job (`args`) as this process runs it: on `suite` (the rows the machine was
    sent), its outputs in `out`."""
    from jex.lab.jobs import LabJob

    job = LabJob.model_validate_json(args.read_text())
    spec = job.spec.model_copy(update={"suite": str(suite)}) if suite is not None else job.spec
    return LabJob(spec=spec, out=str(out))


def _cli(*argv: str) -> Path:
    """`jex ARGV` in this process; the folder it printed last (where its output went, absolute)."""
    from typer.testing import CliRunner

    from jex.cli import app

    result = CliRunner().invoke(app, list(argv))
    assert result.exit_code == 0, result.output
    last = Path(result.stdout.strip().splitlines()[-1])
    assert last.is_absolute() and last.is_dir(), result.stdout
    return last


def test_probe_runs_on_a_local_machine_and_equals_in_process(lab_suite, tmp_path, prefect_harness, local_machines):
    from jex.lab.jobs import run_lab_job

    out = tmp_path / "local"
    _cli("probe", "early-exit", "--suite", str(lab_suite), "--rows", "2", "--every", "4", "--max-tokens", "8",
         "--provider", "local", "-o", str(out))
    assert (out / "probe.png").stat().st_size > 1000
    run_lab_job(_here(_ran_on_a_machine(out, "lab-probe"), tmp_path / "here", lab_suite))
    assert json.loads((out / "probe.json").read_text()) == json.loads((tmp_path / "here" / "probe.json").read_text())


def test_parity_runs_on_a_local_machine_and_equals_in_process(lab_suite, tmp_path, prefect_harness, local_machines):
    from jex.lab.jobs import run_lab_job

    out = tmp_path / "local"
    _cli("parity", "--suite", str(lab_suite), "--rows", "3", "--engine-a", "hf", "--engine-b", "hf-batched",
         "--provider", "local", "-o", str(out))
    run_lab_job(_here(_ran_on_a_machine(out, "lab-parity"), tmp_path / "here", lab_suite))
    there, here = (json.loads((d / "parity.json").read_text()) for d in (out, tmp_path / "here"))
    assert there["readout"] == here["readout"] and there["readout"]["common"] == 3
    assert (there["accuracy_a"], there["accuracy_b"]) == (here["accuracy_a"], here["accuracy_b"])


def test_bakeoff_runs_on_a_local_machine_and_equals_in_process(tmp_path, prefect_harness, local_machines):
    """The arm's ladder computed here as its arm process computes it (`_arm_main`), without the process."""
    from jex.flows.lab import bakeoff
    from jex.lab.bakeoff import arm_engine
    from jex.lab.jobs import BakeoffJob
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.invariance import compare, divergence_prompts, run_ladder

    out = tmp_path / "local"
    res = bakeoff(BakeoffJob(arms=["hf-bi"], prompts=2, tokens=4, ladder=[1, 2], repeats=1), out=str(out),
                  machines=MachinesSpec(provider="local"))
    assert res.errors == {}
    spec = _here(_ran_on_a_machine(out, "lab-bakeoff"), tmp_path / "here").spec
    assert isinstance(spec, BakeoffJob) and spec.arms == ["hf-bi"]
    arm = json.loads((out / "arm-hf-bi.json").read_text())
    there = {b: r["token_ids"] for b, r in arm["rungs"].items()}
    engine = arm_engine("hf-bi", spec)
    rungs = compare(run_ladder(engine, divergence_prompts(spec.prompts), ladder=spec.ladder, repeats=spec.repeats,
                               tokens=spec.tokens))
    assert there == {b: r.token_ids for b, r in rungs.items()} and set(there) == {"1", "2"}


def test_calibrate_measures_its_sample_on_a_local_machine(lab_suite, tmp_path, prefect_harness, local_machines):
    from jex.flows.budget import BudgetSpec, budget_projection
    from jex.tasks.campaign_spec import MachinesSpec

    budget = _cli("calibrate", "--suite", str(lab_suite), "--coverage", "0.25", "--sample-every", "3", "--provider",
                  "local", "--out", str(tmp_path / "local"))
    assert [budget] == list((tmp_path / "local").glob("*-budget"))
    machines = json.loads((budget / "machines.json").read_text())
    assert machines["provider"] == "local"
    assert [o["job"] for o in machines["machines"][0]["jobs"]] == ["golden", "fast_pass", "reason"]
    there = json.loads((budget / "budget.json").read_text())
    spec = BudgetSpec.model_validate(there["spec"])  # the machine's measure, repeated here in a store of its own
    here_dir = tmp_path / "here"
    spec.campaign = spec.campaign.model_copy(update={"out": str(here_dir), "store": str(here_dir / "store"),
                                                     "machines": MachinesSpec(provider="inprocess")})
    here = budget_projection(spec).measured.model_dump(mode="json")
    same = ("sample_rows", "gated", "fix_rate", "fixed", "flipped")
    assert {k: there["measured"][k] for k in same} == {k: here[k] for k in same}
    assert there["measured"]["fast_s_per_row"] > 0 and there["measured"]["reason_s_per_row"] > 0
