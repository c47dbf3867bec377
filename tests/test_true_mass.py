"""Multi-gold catalogs (`scoring = "true_mass"`): the probability mass of a row's true options, as
lm-eval's TruthfulQA mc2 computes it, scored by both scorers and resampled by the clustered bootstrap."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest

from jex.errors import InputError
from jex.numerics import true_mass
from jex.suite import iter_rows, load_manifest
from jex.tasks.bundle.bundle_file import build_bundle
from jex.tasks.bundle.suite_table import load_suite_table
from jex.tasks.scoring.score import score_files
from tests.conftest import row, write_suite


def test_true_mass_is_lm_evals_mc2_to_the_bit():
    from lm_eval.tasks.truthfulqa.utils import process_results_mc2

    rnd = random.Random(3)
    for _ in range(200):
        k = rnd.randint(2, 9)
        lls = [rnd.uniform(-80.0, -0.1) for _ in range(k)]
        labels = [1] * rnd.randint(1, k - 1) + [0] * k
        labels = labels[:k]
        rnd.shuffle(labels)
        if not any(labels):
            labels[0] = 1
        doc = {"mc2_targets": {"labels": labels}}
        expected = process_results_mc2(doc, [(ll, False) for ll in lls])["acc"]
        assert true_mass(lls, [i for i, v in enumerate(labels) if v == 1]).hex() == float(expected).hex()


def test_true_mass_survives_log_likelihoods_too_small_to_exponentiate():
    assert true_mass([-900.0, -901.0, -950.0], [0]) == pytest.approx(1 / (1 + math.exp(-1.0)), rel=1e-12)


def multi_gold_suite(root, rows_per_catalog=12, seed=1):
    """A true_mass catalog (loglikelihood readout) beside a plain accuracy one."""
    rnd = random.Random(seed)
    tqa = []
    for i in range(rows_per_catalog):
        k = rnd.choice([3, 4, 5])
        true = sorted(rnd.sample(range(k), rnd.randint(1, k - 1)))
        tqa.append(row(f"tqa{i}", "tqa", q=f"tq{i // 2}", k=k, gold=true[0], true_options=true))
    acc = [row(f"acc{i}", "acc", k=4, gold=i % 4) for i in range(rows_per_catalog)]
    suite = write_suite(root, {"tqa": tqa, "acc": acc})
    text = (suite / "suite.toml").read_text().replace('id = "tqa"\n', 'id = "tqa"\nscoring = "true_mass"\n'
                                                                      'readout = "loglikelihood"\n')
    (suite / "suite.toml").write_text(text)
    return suite, tqa, acc


def test_a_true_mass_catalog_scores_the_mean_mass_with_the_uniform_forecast_for_a_missing_row(tmp_path):
    suite, tqa, acc = multi_gold_suite(tmp_path / "s")
    rnd = random.Random(5)
    masses = {r["run_id"]: rnd.random() for r in tqa}
    with open(tmp_path / "p.jsonl", "w") as f:
        for r in tqa[1:]:  # tqa0 has no prediction: the uniform forecast's mass t/k
            f.write(json.dumps({"run_id": r["run_id"], "choice": r["gold"], "true_mass": masses[r["run_id"]]}) + "\n")
        for r in acc:
            f.write(json.dumps({"run_id": r["run_id"], "choice": 0}) + "\n")
    doc = score_files(suite, tmp_path / "p.jsonl", tmp_path / "out", draws=50)  # raises unless both scorers agree
    t = doc.catalogs["tqa"]
    first = tqa[0]
    terms = [len(first["true_options"]) / len(first["options"])] + [masses[r["run_id"]] for r in tqa[1:]]
    assert (t.kind, t.unsupported, t.n) == ("true_mass", 1, len(tqa))
    assert t.value == math.fsum(terms) / len(tqa)
    assert t.chance == float(sum(Fraction(len(r["true_options"]), len(r["options"])) for r in tqa) / len(tqa))
    assert t.skill == (t.value - t.chance) / (1.0 - t.chance)
    assert t.ci[0] <= t.skill <= t.ci[1] and t.ci[0] < t.ci[1]  # the bootstrap resampled the masses


def test_the_bundle_carries_the_true_options_to_scoring(tmp_path):
    suite, tqa, _ = multi_gold_suite(tmp_path / "s")
    bundle = build_bundle(suite, tmp_path / "b.tar.gz").path
    table = load_suite_table(bundle)
    true = dict(zip(table.rows["run_id"].to_list(), table.rows["true_options"].to_list(), strict=True))
    assert [true[r["run_id"]] for r in tqa] == [r["true_options"] for r in tqa]
    assert true["acc0"] is None
    assert [r.true_options for r in iter_rows(suite)][:len(tqa)] == [r["true_options"] for r in tqa]


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"true_options": None}, "true_options", "is scored by true_mass: every row lists its true options"),
    ({"true_options": [1, 2]}, "true_options", "the gold index 0 is not among the true options"),
    ({"true_options": [0, 7]}, "true_options", "distinct option indices"),
])
def test_bad_true_options_name_file_row_and_field(tmp_path, change, field, words):
    suite, tqa, _ = multi_gold_suite(tmp_path / "s")
    lines = (suite / "rows" / "tqa.jsonl").read_text().splitlines()
    first = {**json.loads(lines[0]), "gold": 0, **change}
    (suite / "rows" / "tqa.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(InputError) as e:
        list(iter_rows(suite))
    assert f"rows/tqa.jsonl, row 1, field '{field}'" in str(e.value) and words in str(e.value)


def test_true_mass_needs_the_loglikelihood_readout(tmp_path):
    suite, _, _ = multi_gold_suite(tmp_path / "s")
    toml = suite / "suite.toml"
    toml.write_text(toml.read_text().replace('readout = "loglikelihood"\n', ""))
    with pytest.raises(InputError, match="scored by true_mass, which reads each option's log-likelihood"):
        load_manifest(suite)


def test_mass_out_of_range_in_a_predictions_file_names_the_field(tmp_path):
    suite, tqa, _ = multi_gold_suite(tmp_path / "s")
    (tmp_path / "p.jsonl").write_text(json.dumps({"run_id": "tqa0", "choice": 0, "true_mass": 1.5}) + "\n")
    with pytest.raises(InputError, match=r"p.jsonl, row 1, field 'true_mass': true_mass must be a probability"):
        score_files(suite, tmp_path / "p.jsonl", tmp_path / "out", draws=10)
