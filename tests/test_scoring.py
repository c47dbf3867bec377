"""Scoring definitions on small hand-computed cases, and the two-scorer agreement."""

from __future__ import annotations

import json

import polars as pl
import pytest

from jex.errors import InputError
from jex.tasks.bundle.suite_table import load_predictions, load_suite_table
from jex.tasks.scoring.score import ScorerDisagreement, score_files, score_twice
from tests.conftest import row, write_suite


def preds(path, mapping):
    with open(path, "w") as f:
        for rid, choice in mapping.items():
            f.write(json.dumps({"run_id": rid, "choice": choice}) + "\n")
    return path


@pytest.fixture
def two_legs(tmp_path):
    # leg P: catalog a (4 options, weight 1), catalog b (2 options, weight 3); leg Q: catalog c (chance 0.1)
    rows = {
        "a": [row("a1", "a", gold=0), row("a2", "a", gold=1), row("a3", "a", gold=2), row("a4", "a", gold=3)],
        "b": [row("b1", "b", k=2, gold=0), row("b2", "b", k=2, gold=1)],
        "c": [row("c1", "c", gold=0), row("c2", "c", gold=0), row("cx", "c", gold=0)],
    }
    return write_suite(tmp_path / "s", rows, legs={"P": 0.25, "Q": 0.75}, catalogs=[
        {"id": "a", "leg": "P", "weight": 1.0}, {"id": "b", "leg": "P", "weight": 3.0},
        {"id": "c", "leg": "Q", "chance": 0.1, "exclusions": ["cx"]}])


def test_hand_computed_case(two_legs, tmp_path):
    p = preds(tmp_path / "p.jsonl", {"a1": 0, "a2": 1, "a3": 0, "b1": 0, "b2": 0, "c1": 0, "c2": None, "cx": 1})
    doc = score_files(two_legs, p, tmp_path / "out", draws=50).model_dump()
    a, b, c = (doc["catalogs"][k] for k in "abc")
    # a: 2 of 4 right, a4 has no prediction (unsupported); chance 1/4
    assert (a["n"], a["correct"], a["unsupported"], a["acc"], a["chance"]) == (4, 2, 1, 0.5, 0.25)
    assert a["skill"] == (0.5 - 0.25) / 0.75
    # b: 1 of 2, chance 1/2 -> skill 0
    assert (b["acc"], b["chance"], b["skill"]) == (0.5, 0.5, 0.0)
    # c: cx excluded; c1 right, c2 null -> unsupported; manifest chance 0.1
    assert (c["n"], c["correct"], c["unsupported"], c["chance"]) == (2, 1, 1, 0.1)
    assert c["skill"] == (0.5 - 0.1) / 0.9
    p_index = 100 * (1 * a["skill"] + 3 * b["skill"]) / 4
    q_index = 100 * c["skill"]
    assert doc["legs"]["P"]["index"] == pytest.approx(p_index, abs=1e-12)
    assert doc["legs"]["P"]["raw"] == pytest.approx(100 * (0.5 + 3 * 0.5) / 4, abs=1e-12)
    assert doc["full"] == pytest.approx((0.25 * p_index + 0.75 * q_index) / 1.0, abs=1e-12)
    assert set(doc) >= {"full", "legs", "catalogs", "ci", "provenance"}
    assert all(len(v["ci"]) == 2 for v in doc["catalogs"].values())


def test_json_keeps_full_float_precision(two_legs, tmp_path):
    p = preds(tmp_path / "p.jsonl", {"a1": 0, "b1": 0, "c1": 0})
    doc = score_files(two_legs, p, tmp_path / "out", draws=10).model_dump()
    on_disk = json.loads((tmp_path / "out" / "score.json").read_text())
    assert on_disk["full"] == doc["full"] and on_disk["catalogs"]["a"]["skill"] == (0.25 - 0.25) / 0.75
    assert "Full index" in (tmp_path / "out" / "score.md").read_text()


def test_no_predictions_at_all_scores_every_row_unsupported(two_legs, tmp_path):
    doc = score_files(two_legs, preds(tmp_path / "p.jsonl", {}), tmp_path / "out", draws=10)
    assert doc.catalogs["a"].unsupported == 4 and doc.catalogs["a"].skill == -1 / 3


def test_scorers_agree_bit_for_bit_on_sample_suite(sample_suite, tmp_path):
    table = load_suite_table(sample_suite)
    choices = [(i * 7919) % n for i, n in enumerate(table.rows["n_options"].to_list())]
    p = pl.DataFrame({"run_id": table.rows["run_id"], "choice": choices}, schema={"run_id": pl.String,
                                                                                  "choice": pl.Int32})
    score_twice(table.rows, p, table.spec)  # raises on any difference


def test_disagreement_is_detected(two_legs, monkeypatch):
    table = load_suite_table(two_legs)
    p = pl.DataFrame({"run_id": ["a1"], "choice": [0]}, schema={"run_id": pl.String, "choice": pl.Int32})
    import jex.tasks.scoring.score as score_mod

    real = score_mod.plain_score

    def off_by_one_ulp(*a, **kw):
        out = real(*a, **kw)
        out["catalogs"]["a"]["acc"] = out["catalogs"]["a"]["acc"] + 1e-16
        return out

    monkeypatch.setattr(score_mod, "plain_score", off_by_one_ulp)
    with pytest.raises(ScorerDisagreement, match="/catalogs/a/acc"):
        score_twice(table.rows, p, table.spec)


def test_scoring_a_bundle_equals_scoring_the_folder(sample_suite, tmp_path):
    from jex.tasks.bundle.bundle_file import build_bundle

    build_bundle(sample_suite, tmp_path / "b.tar.gz")
    table = load_suite_table(sample_suite)
    p = preds(tmp_path / "p.jsonl", {rid: 0 for rid in table.rows["run_id"].to_list()[::3]})
    a = score_files(sample_suite, p, tmp_path / "o1", draws=20)
    b = score_files(tmp_path / "b.tar.gz", p, tmp_path / "o2", draws=20)
    assert a.full == b.full and a.ci == b.ci


@pytest.mark.parametrize("record, field, words", [
    ({"run_id": "a1", "choice": 4}, "choice", "out of range for 4 options"),
    ({"run_id": "zz", "choice": 0}, "run_id", "not in the suite"),
    ({"run_id": "a1", "choice": "B"}, "choice", "option index or null"),
    ({"run_id": "a1"}, "choice", "missing choice"),
    ({"choice": 1}, "run_id", "missing run_id"),
])
def test_prediction_errors_name_file_row_and_field(two_legs, tmp_path, record, field, words):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"run_id": "b1", "choice": 0}) + "\n" + json.dumps(record) + "\n")
    table = load_suite_table(two_legs)
    with pytest.raises(InputError) as e:
        load_predictions(path, table.rows)
    assert (e.value.row, e.value.field) == (2, field) and words in str(e.value)


def test_duplicate_prediction_is_refused(two_legs, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"run_id": "a1", "choice": 0}\n{"run_id": "a1", "choice": 1}\n')
    with pytest.raises(InputError, match="duplicate prediction"):
        load_predictions(path, load_suite_table(two_legs).rows)
