"""Reference audit: a run against the banked rows its bundle carries; parity against a stored capture."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest

from jex.errors import InputError
from jex.lab.parity import capture_readouts
from jex.tasks.capture.stages import bundle_stage
from jex.tasks.decision_stages import score_stage
from jex.tasks.documents import ScoreDoc, read_doc
from jex.tasks.records import FoldSummary, OverlaySummary
from jex.tasks.scoring.reference_audit import audit_markdown
from jex.tasks.store import LocalStore, write_parquet
from tests.conftest import row, write_suite

N = 12


@pytest.fixture
def suite(tmp_path):
    rows = {c: [row(f"{c}{i}", c, q=f"{c}q{i // 2}", k=3, gold=i % 3) for i in range(N)] for c in ("a", "b")}
    return write_suite(tmp_path / "suite", rows)


def run_outputs(tmp_path, run_ids):
    """A run's fold and overlay outputs as the score stage reads them: fast pass = final here."""
    logprobs = [[math.log(p) for p in ((0.6, 0.3, 0.1), (0.2, 0.7, 0.1), (0.25, 0.25, 0.5))[i % 3]]
                for i in range(len(run_ids))]
    choice = [max(range(3), key=lambda j, lp=lp: lp[j]) for lp in logprobs]
    folded = pl.DataFrame({"run_id": run_ids, "logprobs": logprobs, "fast_choice": choice},
                          schema={"run_id": pl.String, "logprobs": pl.List(pl.Float64), "fast_choice": pl.Int32})
    preds = folded.select("run_id", choice="fast_choice", probs=pl.col("logprobs").list.eval(pl.element().exp()))
    write_parquet(folded, tmp_path / "folded.parquet")
    write_parquet(preds, tmp_path / "predictions.parquet")
    return (FoldSummary(key="f", sha256="f", folded=str(tmp_path / "folded.parquet"), fold_json="", errors={}),
            OverlaySummary(key="p", sha256="p", predictions=str(tmp_path / "predictions.parquet"), applied=[]), preds)


def write_reference(path, preds, flip=()):
    with open(path, "w") as f:
        for r in preds.iter_rows(named=True):
            choice = (r["choice"] + 1) % 3 if r["run_id"] in flip else r["choice"]
            f.write(json.dumps({"run_id": r["run_id"], "choice": choice, "probs": r["probs"]}) + "\n")
    return path


def audit(tmp_path, suite, flip=()):
    run_ids = [f"{c}{i}" for c in ("a", "b") for i in range(N)]
    fold, overlay, preds = run_outputs(tmp_path, run_ids)
    store = LocalStore(tmp_path / f"store-{len(flip)}")
    bundle = bundle_stage(store, suite=suite, reference=str(write_reference(tmp_path / "ref.jsonl", preds, flip)))
    summary = score_stage(store, bundle=bundle, overlay=overlay, fold=fold, draws=20, seed=1)
    doc = read_doc(ScoreDoc, summary.score_json).reference_audit
    assert doc is not None
    return summary, doc


def test_a_reference_equal_to_the_runs_own_capture_agrees_fully(tmp_path, suite):
    summary, doc = audit(tmp_path, suite)
    assert summary.reference_agreement == 1.0
    for name in ("fast_pass", "final"):
        a = doc.model_dump()[name]
        assert (a["compared"], a["flips"], a["argmax_agreement"], a["max_abs_dp"]) == (2 * N, 0, 1.0, 0.0)
        assert a["catalogs"] == {c: {"compared": N, "agree": N, "argmax_agreement": 1.0} for c in ("a", "b")}


def test_planted_flips_are_reported_exactly_with_their_pre_margins(tmp_path, suite):
    planted = ["a1", "a4", "b7"]
    summary, doc = audit(tmp_path, suite, flip=planted)
    final = doc.model_dump()["final"]
    assert [r["run_id"] for r in final["flip_rows"]] == planted and final["flips"] == 3
    assert summary.reference_agreement == (2 * N - 3) / (2 * N)
    assert final["catalogs"]["a"]["agree"] == N - 2 and final["catalogs"]["b"]["agree"] == N - 1
    a1 = final["flip_rows"][0]
    assert (a1["run_choice"], a1["reference_choice"]) == (1, 2)
    assert a1["pre_margin"] == pytest.approx(math.log(0.7 / 0.3) - math.log(0.2 / 0.8))
    assert final["max_abs_dp"] == 0.0  # probabilities banked as they are: only the choices were planted
    md = "\n".join(audit_markdown(doc))
    assert "## Reference audit" in md and "| a4 | a | 2 | 1 | 1 |" in md  # reference, run, gold


def test_capture_readouts_accept_reference_rows_and_name_missing_rows(tmp_path):
    path = tmp_path / "ref.jsonl"
    path.write_text(json.dumps({"run_id": "x", "choice": 1, "probs": [0.25, 0.75]}) + "\n")
    (got,) = capture_readouts(path, ["x"])
    assert got.choice == 1 and got.probs == pytest.approx((0.25, 0.75))
    with pytest.raises(InputError, match=r"ref.jsonl, field 'run_id': the capture lacks 1 .*'y'"):
        capture_readouts(path, ["x", "y"])



@pytest.mark.slow
def test_parity_against_a_stored_capture_needs_no_second_engine(tmp_path):
    """`jex parity --reference CAPTURE`: the live engine agrees with its own capture; a planted
    swap in the capture is the one flip."""
    from typer.testing import CliRunner

    from jex.cli import app
    from jex.engine_spec import EngineSpec
    from jex.lab.parity import parity_with_capture
    from jex.sample_suite import write_sample_suite
    from jex.tasks.bundle.reading import bundle_rows
    from jex.tasks.capture.engine_calls import as_rows
    from jex.tasks.capture.stages import fast_pass_stage
    from jex.tasks.execution.engine_pool import get_engine

    suite = write_sample_suite(tmp_path / "suite", rows=18, seed=3)
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=suite)
    capture = fast_pass_stage(store, bundle=bundle, engine=EngineSpec(), shard_rows=9).capture
    result = CliRunner().invoke(app, ["parity", "--suite", str(suite), "--reference", capture, "-o",
                                      str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    same = json.loads((tmp_path / "out" / "parity.json").read_text())["readout"]
    assert (same["common"], same["flips"], same["argmax_agreement"], same["max_abs_dp"]) == (18, 0, 1.0, 0.0)
    frame = pl.read_parquet(capture)
    lp = frame["logprobs"].to_list()
    victim = frame["run_id"][4]
    lp[4] = sorted(lp[4])  # the most likely option becomes the least: a flip on this row only
    write_parquet(frame.with_columns(pl.Series("logprobs", lp)), tmp_path / "planted.parquet")
    res = parity_with_capture(get_engine(EngineSpec()), tmp_path / "planted.parquet",
                              as_rows(bundle_rows(bundle, store)))["readout"]
    assert res["flips"] == 1 and [f["run_id"] for f in res["flip_rows"]] == [victim]
