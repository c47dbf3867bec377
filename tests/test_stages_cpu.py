"""The coverage gate, fold and calibration (temperature scaling) on small hand-made frames; the budget
projection's arithmetic."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from jex.tasks.probabilities.calibrate import calibrate, fit_temperature
from jex.tasks.probabilities.coverage_gate import coverage_gate, margins
from jex.tasks.probabilities.fold import fold_logprobs, fold_predictions


def lp(*probs):
    return [math.log(p) for p in probs]


def panel(rows):
    return pl.DataFrame({"run_id": [r[0] for r in rows], "catalog": [r[1] for r in rows],
                         "logprobs": [r[2] for r in rows]},
                        schema={"run_id": pl.String, "catalog": pl.String, "logprobs": pl.List(pl.Float64)})


def test_margin_is_top1_minus_top2_log_odds():
    m = margins(pl.Series([lp(0.7, 0.2, 0.1), None]))
    assert m[0] == pytest.approx(math.log(0.7 / 0.3) - math.log(0.2 / 0.8))
    assert m[1] is None


def test_gate_takes_the_least_sure_fraction_ties_by_run_id():
    p = panel([("r4", "a", lp(0.5, 0.5)), ("r1", "a", lp(0.9, 0.1)), ("r3", "a", lp(0.5, 0.5)),
               ("r2", "b", lp(0.6, 0.4)), ("r5", "b", None)])
    gated = coverage_gate(p, coverage=0.6)  # round(0.6 * 5) = 3
    assert gated["run_id"].to_list() == ["r3", "r4", "r2"]


def test_gate_per_catalog_cap():
    p = panel([(f"a{i}", "a", lp(0.5 + i / 100, 0.5 - i / 100)) for i in range(4)]
              + [(f"b{i}", "b", lp(0.9, 0.1)) for i in range(4)])
    gated = coverage_gate(p, coverage=0.5, per_catalog_cap=0.5)  # 4 rows, at most 2 from a
    assert gated["run_id"].to_list() == ["a0", "a1", "b0", "b1"]


def test_gate_rejects_bad_coverage():
    with pytest.raises(ValueError, match="coverage"):
        coverage_gate(panel([("r", "a", lp(0.5, 0.5))]), coverage=1.5)


def test_fold_rules():
    fast, post = lp(0.8, 0.2), lp(0.2, 0.8)
    assert fold_logprobs(fast, post, rule="replace", weight=0.3) == post
    mixed = fold_logprobs(fast, post, rule="mix", weight=0.5)
    assert [math.exp(x) for x in mixed] == pytest.approx([0.5, 0.5])
    w = 0.75
    want = np.array([0.8 ** 0.25 * 0.2 ** 0.75, 0.2 ** 0.25 * 0.8 ** 0.75])
    assert [math.exp(x) for x in fold_logprobs(fast, post, rule="mix", weight=w)] == pytest.approx(want / want.sum())


def test_fold_keeps_ungated_and_missing_rows():
    p = panel([("r1", "a", lp(0.6, 0.4)), ("r2", "a", lp(0.55, 0.45)), ("r3", "a", lp(0.9, 0.1))])
    gated = pl.DataFrame({"run_id": ["r1", "r2"]})
    reasoned = pl.DataFrame({"run_id": ["r1", "r2"], "post_logprobs": [lp(0.1, 0.9), None]},
                            schema={"run_id": pl.String, "post_logprobs": pl.List(pl.Float64)})
    out = fold_predictions(p, reasoned, gated, rule="replace")
    assert out["choice"].to_list() == [1, 0, 0]
    assert out["folded"].to_list() == [True, False, False] and out["gated"].to_list() == [True, True, False]


def test_fold_refuses_reasoned_rows_that_were_not_gated():
    p = panel([("r1", "a", lp(0.6, 0.4))])
    reasoned = pl.DataFrame({"run_id": ["zz"], "post_logprobs": [lp(0.1, 0.9)]})
    with pytest.raises(ValueError, match="not gated panel rows"):
        fold_predictions(p, reasoned, pl.DataFrame({"run_id": ["r1"]}))


def test_temperature_fit_recovers_a_known_temperature():
    rng = np.random.default_rng(0)
    true_logits = rng.normal(0, 2, size=(4000, 4))
    gold = np.array([rng.choice(4, p=np.exp(x) / np.exp(x).sum()) for x in true_logits])
    overconfident = true_logits * 3.0  # a model 3x too sure of itself
    lp_ = overconfident - np.log(np.exp(overconfident).sum(1, keepdims=True))
    assert fit_temperature(lp_, gold) == pytest.approx(3.0, rel=0.1)


def test_calibration_is_out_of_fold_and_never_changes_a_choice():
    rng = np.random.default_rng(1)
    n = 300
    raw = rng.normal(0, 3, size=(n, 3))
    lps = [list(x - np.log(np.exp(x).sum())) for x in raw]
    frame = pl.DataFrame({"run_id": [str(i) for i in range(n)], "question_id": [f"q{i // 2}" for i in range(n)],
                          "gold": rng.integers(0, 3, n), "folded_logprobs": lps})
    out, report = calibrate(frame, folds=4)
    assert report.argmax_changed == 0 and len(report.folds) == 4
    assert [int(np.argmax(x)) for x in out["calibrated_logprobs"].to_list()] == [int(np.argmax(x)) for x in lps]
    assert report.nll_after < report.nll_before  # random labels: flattening helps


def test_a_tie_made_by_rounding_is_counted_not_taken_for_a_changed_choice():
    from jex.tasks.probabilities.calibrate import choice_reversals

    below = -1.6
    above = float(np.nextafter(below, 0))  # one ulp higher: option 1 is chosen
    assert choice_reversals([[below, above]], [[-0.69, -0.69]]) == (0, 1)
    assert choice_reversals([[below, above]], [[-0.6, -0.7]]) == (1, 0)
    assert choice_reversals([[-0.5, -0.5]], [[-0.69, -0.69]]) == (0, 0)  # tied before: no new tie


def test_projection_picks_the_largest_coverage_within_both_budgets():
    from jex.flows.budget import project

    # 100,000 rows: fast pass 0.3 s/row = 8.33 h; reason 3 s/row
    got = project(rows=100_000, fast_s_per_row=0.3, reason_s_per_row=3.0, coverages=[0.05, 0.15, 0.30], price=2.0,
                  gpus=1, budget_hours=30, budget_usd=1000)
    hours = [t.hours for t in got.table]
    assert hours == pytest.approx([(30_000 + c * 300_000) / 3600 for c in (0.05, 0.15, 0.30)])
    assert [t.fits for t in got.table] == [True, True, False] and got.recommended_coverage == 0.15
    assert got.table[0].usd == pytest.approx(hours[0] * 2.0)
    two = project(rows=100_000, fast_s_per_row=0.3, reason_s_per_row=3.0, coverages=[0.30], price=2.0, gpus=2,
                  budget_hours=30, budget_usd=1000)
    assert two.recommended_coverage == 0.30  # data parallel halves the wall time, not the cost
