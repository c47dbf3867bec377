"""The audit through a whole campaign (slow): a planted failing batch is retried, split, its failing row
retried by the row policy, counted and named while the campaign finishes; the reference audit reaches
score.json, report.md and an artifact; the audit settings fail a run that does not meet them."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from jex.engine.types import EngineError
from jex.errors import FlowError
from jex.sample_suite import write_sample_suite
from jex.suite import iter_rows
from jex.tasks.probabilities.fold import ErrorCountersNotZero

pytestmark = pytest.mark.slow


class PoisonedEngine:
    """The real engine, except that a readout batch holding `poisoned` fails (a recoverable error)."""

    def __init__(self, real, poisoned: str):
        self.real, self.poisoned, self.failed_batches = real, poisoned, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def readout(self, requests, *args, **kwargs):
        ids = [r.run_id for r in requests]
        if self.poisoned in ids:
            self.failed_batches.append(len(ids))
            raise EngineError("planted: device lost this batch")
        return self.real.readout(requests, *args, **kwargs)


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The session's Prefect test API."""


def test_campaign_counts_a_failing_batch_audits_the_reference_and_enforces_both(harness, tmp_path, monkeypatch):
    import jex.tasks.capture.stages as stages
    from jex.flows.campaign import campaign
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec
    from jex.tasks.execution.engine_pool import get_engine

    suite = write_sample_suite(tmp_path / "suite", rows=27, seed=5)
    run_ids = [r.run_id for r in iter_rows(suite)]  # suite order: shards of 9 are rows 0-8, 9-17, 18-26
    poisoned = run_ids[3]
    reference = tmp_path / "reference.jsonl"
    reference.write_text("".join(json.dumps({"run_id": r, "choice": 0, "probs": None}) + "\n" for r in run_ids))
    engines: dict[str, PoisonedEngine] = {}

    def poisoned_engine(spec):
        return engines.setdefault("e", PoisonedEngine(get_engine(spec), poisoned))

    monkeypatch.setattr(stages, "get_engine", poisoned_engine)
    spec = CampaignSpec(name="audit", suite=str(suite), coverage=0.2, reason_max_tokens=8, bootstrap_draws=50,
                        fast_shard_rows=9, reason_shard_rows=3, store=str(tmp_path / "store"), out=str(tmp_path),
                        machines=MachinesSpec(provider="inprocess"), reference=str(reference))
    run_dir = Path(campaign(spec))

    assert engines["e"].failed_batches == [9, 9, 4, 4, 2, 2, 1, 1, 1]  # retried, split down to the row, its 3 tries
    fold = json.loads((run_dir / "fold.json").read_text())
    assert fold["errors"]["batch_errors"] == 1 and fold["error_rows"]["batch_errors"][0]["run_id"] == poisoned
    assert fold["failed_rows"] == {"fast_pass": [{"run_id": poisoned, "attempts": 3, "error_type": "EngineError",
                                                  "error": "planted: device lost this batch"}]}
    named = f"fast pass: 1 row failed after 3 attempts: ids {poisoned}"
    from jex.cli.results import run_results

    assert run_results(run_dir).failed_rows == [named]
    assert {k: v for k, v in fold["errors"].items() if k != "batch_errors"} == dict.fromkeys(
        ("context_refusals", "readout_errors", "unmatched_rows", "key_fallbacks", "mechanism_failures"), 0)
    report = (run_dir / "report.md").read_text()
    assert "| error: batch_errors | 1 |" in report and f"| batch_errors | {poisoned} |" in report
    assert f"- {named}" in report

    preds = pl.read_parquet(run_dir / "predictions.parquet")
    audit = json.loads((run_dir / "score.json").read_text())["reference_audit"]["final"]
    assert audit["run_missing"] == 1  # the poisoned row has no answer: counted, not compared
    expected = preds.filter(pl.col("choice").is_not_null() & (pl.col("choice") != 0))["run_id"].to_list()
    assert [f["run_id"] for f in audit["flip_rows"]] == expected
    assert audit["argmax_agreement"] == (26 - len(expected)) / 26
    assert "## Reference audit" in report and "| scoring |" in report

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=["campaign-reference-audit"])))
    assert found

    with pytest.raises(ErrorCountersNotZero, match="batch_errors"):  # cached: fails after the report
        campaign(spec.model_copy(update={"require_zero_errors": True}))
    with pytest.raises(FlowError, match="below reference_min_agreement"):
        campaign(spec.model_copy(update={"reference_min_agreement": 0.99}))
