"""Budget tools (issue 29 item 6): the per-row budget table, the coverage cliff, the retention gate and the
tau/k early-exit rule, each on small data made here."""

from __future__ import annotations

import pytest

SEED_ROWS = 240_440  # the seeds' suite: 5% coverage = 12,022 reasoned rows
SEED_FAST_S = 33_840 / SEED_ROWS  # the fast pass over the suite: ~9.4 h


def _seed_budget(coverages: list[float], reason_s: float = 9.16):
    from jex.flows.budget import row_budget

    return row_budget(rows=SEED_ROWS, fast_s_per_row=SEED_FAST_S, reason_s_per_row=reason_s, coverages=coverages,
                      price=0.0, gpus=1, budget_hours=72.0, budget_usd=1e9)


def test_per_row_budget_reproduces_the_seeds_table():
    """72 h card, 9.4 h fast pass, 9.16 s per reasoned row: 18.7 s / 6.25 s / 3.75 s; cuts none / -32% / -59%."""
    budget = _seed_budget([0.05, 0.15, 0.25])
    allowed = [round(t.allowed_s_per_row, 2) for t in budget.table]
    assert [t.reasoned_rows for t in budget.table] == [12_022, 36_066, 60_110]
    assert allowed == [18.75, 6.25, 3.75]
    assert [round(100 * t.cut_needed) for t in budget.table] == [0, 32, 59]


def test_coverage_cliff_marks_coverages_above_it_infeasible():
    budget = _seed_budget([0.05, 0.10, 0.15, 0.25])
    assert budget.cliff_coverage == pytest.approx(225_360 / (SEED_ROWS * 9.16))  # ~10.2 %
    assert [t.feasible for t in budget.table] == [True, True, False, False]
    assert budget.feasible_coverage == 0.10


def test_money_can_be_the_binding_deadline():
    from jex.flows.budget import deadline_hours

    assert deadline_hours(price=2.0, gpus=2, budget_hours=72.0, budget_usd=40.0) == 10.0
    assert deadline_hours(price=0.0, gpus=2, budget_hours=72.0, budget_usd=40.0) == 72.0


def test_a_fast_pass_over_the_deadline_leaves_no_coverage():
    from jex.flows.budget import row_budget

    budget = row_budget(rows=1000, fast_s_per_row=10.0, reason_s_per_row=1.0, coverages=[0.05], price=0.0, gpus=1,
                        budget_hours=1.0, budget_usd=1.0)
    assert budget.cliff_coverage == 0.0 and budget.feasible_coverage is None
    assert budget.table[0].cut_needed == 1.0


def test_the_budget_markdown_lists_the_cut_and_the_cliff():
    from jex.flows.budget import render_row_budget

    text = "\n".join(render_row_budget(_seed_budget([0.05, 0.15])))
    assert "| 5% | 12,022 | 18.75 s | none | yes |" in text and "-32%" in text and "Coverage cliff: 10.2%" in text


def test_stable_exit_waits_for_k_consecutive_margins_above_tau():
    from jex.lab.early_exit import stable_exit

    margins = [3.0, 0.5, 3.0, None, 3.0, 3.0, 3.0]
    assert stable_exit(margins, tau=2.0, k=1) == 0
    assert stable_exit(margins, tau=2.0, k=2) == 5  # the dip at 1 and the unread margin at 3 break the run
    assert stable_exit(margins, tau=2.0, k=4) is None
    assert stable_exit(margins, tau=3.0, k=1) is None  # strictly above tau


def test_stable_margin_stats_count_exits_savings_and_lost_answers():
    from jex.lab.early_exit import stable_margin_stats
    from jex.tasks.capture.engine_calls import CaptureRow

    rows = [CaptureRow(f"r{g}", "p", ("A", "B"), ("x", "y"), gold=g) for g in (0, 1)]
    lengths = [12, 10]
    marks = [4, 8, 12]
    # r0: confident from 4 tokens on, right; r1: confidently wrong at 4 and 8, right after its whole rationale
    answer = {(0, 4): 0, (0, 8): 0, (0, 12): 0, (1, 4): 0, (1, 8): 0, (1, 10): 1}
    margins = {(0, 4): 5.0, (0, 8): 5.0, (0, 12): 5.0, (1, 4): 4.0, (1, 8): 4.0, (1, 10): 1.0}
    stats = stable_margin_stats(rows, lengths, answer, margins, marks, tau=3.0, k=2)
    assert (stats.exited, stats.tokens_saved, stats.mean_tokens_spent) == (2, (12 - 8) + (10 - 8), 8.0)
    assert (stats.accuracy, stats.flips, stats.correct_lost) == (0.5, 1, 1)
    strict = stable_margin_stats(rows, lengths, answer, margins, marks, tau=4.5, k=2)
    assert (strict.exited, strict.accuracy, strict.correct_lost) == (1, 1.0, 0)
