"""The campaign flow end to end on a tiny suite with the embedded model (slow).

Retrying never re-runs the capture: engine call counters prove it. A killed run resumes at the
first missing shard. Merged captures are byte-identical whatever the shard size or worker split.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from jex.engine_spec import EngineSpec
from jex.sample_suite import write_sample_suite
from jex.tasks.capture.stages import ShardShare, bundle_stage, fast_pass_stage
from jex.tasks.execution.engine_pool import CALLS
from jex.tasks.inputs import FastPassInputs
from jex.tasks.store import LocalStore

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    return write_sample_suite(tmp_path_factory.mktemp("tiny") / "suite", rows=27, seed=5)


def test_capture_bytes_do_not_depend_on_shard_size_or_workers(tiny_suite, tmp_path):
    engine = EngineSpec()
    captures = []
    for name, shard_rows, workers in (("a", 5, 1), ("b", 16, 1), ("c", 4, 2)):
        store = LocalStore(tmp_path / name)
        bundle = bundle_stage(store, suite=tiny_suite)
        for w in range(workers):  # several workers, each taking every n-th shard, then the merge
            summary = fast_pass_stage.run(store, FastPassInputs(bundle=bundle, engine=engine, shard_rows=shard_rows),
                                          share=ShardShare(worker=w, workers=workers))
        assert summary.rows == 27
        captures.append(Path(summary.capture).read_bytes())
    assert captures[0] == captures[1] == captures[2]


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The session's Prefect test API."""


def _spec(suite, tmp_path):
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    return CampaignSpec(name="t", suite=str(suite), coverage=0.2, reason_max_tokens=8, bootstrap_draws=50,
                        fast_shard_rows=9, reason_shard_rows=3, store=str(tmp_path / "store"), out=str(tmp_path),
                        machines=MachinesSpec(provider="inprocess"))


def test_fold_failure_retry_makes_no_engine_calls_upstream(harness, tiny_suite, tmp_path, monkeypatch, s3_server):
    import jex.tasks.decision_stages as cpu
    from jex.flows.campaign import campaign, stored_run
    from jex.settings import load_settings

    real = cpu.fold_predictions
    failures = {"left": 1}

    def flaky(*args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected fold failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "fold_predictions", flaky)
    spec = _spec(tiny_suite, tmp_path)
    CALLS.clear()
    with pytest.raises(RuntimeError, match="injected fold failure"):
        campaign(spec)
    assert CALLS["fast_pass"] == 3 and CALLS["reason"] >= 1  # the capture ran once
    assert stored_run(spec, load_settings()) is None  # fold is not stored: `jex run` must run the flow
    CALLS.clear()
    run_dir = Path(campaign(spec))
    assert CALLS["fast_pass"] == 0 and CALLS["reason"] == 0  # the retry re-ran nothing upstream of fold
    for name in ("predictions.parquet", "score.json", "fold.json", "report.md", "skill.png", "reliability.png",
                 "provenance.json"):
        assert (run_dir / name).exists(), name
    first = (run_dir / "score.json").read_bytes(), (run_dir / "predictions.parquet").read_bytes()
    assert stored_run(spec, load_settings()) == run_dir  # every stage stored: `jex run` starts no Prefect API
    campaign(spec)
    assert ((run_dir / "score.json").read_bytes(), (run_dir / "predictions.parquet").read_bytes()) == first
    import json

    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket="campaigns")
    monkeypatch.setenv("JEX_STORE__S3_BUCKET", "campaigns")
    monkeypatch.setenv("JEX_STORE__S3_ENDPOINT_URL", s3_server)
    assert stored_run(spec, load_settings()) is None  # S3 configured: the flow uploads
    campaign(spec)  # S3 configured: stage folders and the run folder go up, verified
    uploaded = {o["key"] for o in json.loads((run_dir / "s3.json").read_text())["objects"]}
    assert f"jex/runs/{run_dir.name}/score.json" in uploaded
    assert any(k.startswith("jex/store/fast_pass/") and k.endswith("capture.parquet") for k in uploaded)
    fold = json.loads((run_dir / "fold.json").read_text())
    assert fold["overall"]["panel_rows"] == 27 and fold["overall"]["gated"] == 5
    assert fold["errors"] == {"context_refusals": 0, "readout_errors": 0, "unmatched_rows": 0, "key_fallbacks": 0,
                              "batch_errors": 0, "mechanism_failures": 0}
    assert "Fold (dry-run counters)" in (run_dir / "report.md").read_text()
    assert "| area | catalogs |" in (run_dir / "report.md").read_text()  # the manifest's `area`, one row each
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    wanted = ["campaign-report", "campaign-catalogs", "fast-pass-progress", "reason-progress"]
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=wanted)))
    assert {a.key for a in found} == set(wanted)  # the UI shows the report, the table and the progress
    latest = {a.key: a.data for a in sorted(found, key=lambda a: a.created)}
    report = latest["campaign-report"]
    assert report.count("](data:image/png;base64,") == 2  # the skill and reliability plots travel inline
    assert "](skill.png)" not in report and "](reliability.png)" not in report
    table = json.loads(latest["campaign-catalogs"]) if isinstance(latest["campaign-catalogs"], str) \
        else latest["campaign-catalogs"]
    assert sorted(r["catalog"] for r in table) == sorted(fold["catalogs"])  # one row per catalog


def test_budget_projection_flow_measures_and_projects(harness, tiny_suite, tmp_path):
    from jex.flows.budget import BudgetSpec, budget_projection

    spec = BudgetSpec(campaign=_spec(tiny_suite, tmp_path), coverage=0.5, sample_every=2, target_rows=150_000,
                      coverages=[0.05, 0.5], price_per_gpu_hour=2.0, budget_hours=1e6, budget_usd=1e9)
    doc = budget_projection(spec)
    m = doc.measured
    assert m.sample_rows is not None and 0 < m.sample_rows < 27 and m.gated == round(0.5 * m.sample_rows + 1e-9)
    assert m.fast_s_per_row > 0 and m.reason_s_per_row > 0
    table = doc.projection.table
    assert table[1].hours > table[0].hours and doc.projection.recommended_coverage == 0.5
    assert "Recommended coverage" in next(tmp_path.glob("*-budget/budget.md")).read_text()
    assert doc.row_budget is not None and doc.row_budget.feasible_coverage == 0.5
    assert "Coverage cliff" in next(tmp_path.glob("*-budget/budget.md")).read_text()


def test_killed_run_resumes_at_the_first_missing_shard(tiny_suite, tmp_path, prefect_api_url):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": prefect_api_url,
           "PYTHONUNBUFFERED": "1"}
    jex = [sys.executable, "-m", "jex"]
    cmd = jex + ["run", "--suite", str(tiny_suite), "--out", str(tmp_path), "--shard-rows", "3",
                 "--reason-max-tokens", "4", "--name", "crash", "--provider", "inprocess"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    shards: list[Path] = []
    while time.time() < deadline and proc.poll() is None:
        shards = list((tmp_path / "store" / "fast_pass").glob("*/shards-3/shard-*.parquet"))
        if len(shards) >= 2:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 2 <= len(shards) < 9, "the run should be killed in the middle of the fast pass"
    done_before = sorted(int(p.stem.split("-")[1]) for p in
                         (tmp_path / "store" / "fast_pass").glob("*/shards-3/shard-*.parquet"))
    run_dir = next(tmp_path.glob("crash-*"))
    out = subprocess.run(jex + ["run", "--resume", str(run_dir)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(run_dir)
    import json

    summary = json.loads(next((tmp_path / "store" / "fast_pass").glob("*/_SUCCESS.json")).read_text())
    assert summary["reused_shards"] == done_before
    assert summary["computed_shards"] == [i for i in range(9) if i not in done_before]


def test_bakeoff_and_parity_flows_publish_their_reports(harness, tiny_suite, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from jex.flows.lab import bakeoff, parity
    from jex.lab.jobs import BakeoffJob, ParityJob
    from jex.tasks.campaign_spec import MachinesSpec

    here = MachinesSpec(provider="inprocess")  # on a machine: test_lab_jobs.py
    b = bakeoff(BakeoffJob(arms=["hf-control", "hf-bi"], prompts=2, tokens=4, ladder=[1, 2], repeats=1),
                out=str(tmp_path / "bk"), machines=here)
    assert b.errors == {} and b.verdict.split(":")[0] in ("UNDERPOWERED", "INVARIANT")
    p = parity(ParityJob(suite=str(tiny_suite), engine_a="hf", engine_b="hf-batched", rows=9, reason_rows=2,
                         max_tokens=4), out=str(tmp_path / "par"), machines=here)
    assert p.common == 9 and (p.max_abs_dp or 0) < 1e-3  # batched padding moves probabilities by ~1e-6
    assert (tmp_path / "par" / "parity.md").exists() and not (tmp_path / "par" / "machines.json").exists()
    record = pl.read_parquet(tmp_path / "par" / "parity-mismatches.parquet")  # written even when empty
    assert {"run_id", "catalog", "pre_margin", "post_margin_a", "post_margin_b", "choice_a", "choice_b"} \
        <= set(record.columns)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["bakeoff-report", "parity-report"])))
    assert {a.key for a in found} == {"bakeoff-report", "parity-report"}
