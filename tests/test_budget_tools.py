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
    same = [0] * len(margins)
    assert stable_exit(margins, same, tau=2.0, k=1) == 0
    assert stable_exit(margins, same, tau=2.0, k=2) == 5  # the dip at 1 and the unread margin at 3 break the run
    assert stable_exit(margins, same, tau=2.0, k=4) is None
    assert stable_exit(margins, same, tau=3.0, k=1) is None  # strictly above tau


def test_stable_exit_needs_the_answer_to_stay_the_same():
    from jex.lab.early_exit import stable_exit

    margins = [5.0, 5.0, 5.0, 5.0]
    assert stable_exit(margins, [0, 1, 0, 0], tau=2.0, k=2) == 3  # confident flips restart the run
    assert stable_exit(margins, [0, 1, 2, 3], tau=2.0, k=2) is None
    assert stable_exit(margins, [0, 1, 2, 3], tau=2.0, k=1) == 0


def test_the_probe_pool_is_a_seeded_draw_from_each_catalog_in_turn():
    from jex.lab.early_exit import stratified_pool
    from jex.tasks.capture.engine_calls import CaptureRow

    rows = [CaptureRow(f"{c}{i}", "p", ("A", "B"), ("x", "y"), gold=0, catalog=c) for c in "ab" for i in range(20)]
    pool = stratified_pool(rows, 10, seed=7)
    assert [r.catalog for r in pool] == list("ababababab")
    assert [r.run_id for r in pool] != ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]  # not the head
    assert pool == stratified_pool(rows, 10, seed=7) != stratified_pool(rows, 10, seed=8)
    alone = stratified_pool([r for r in rows if r.catalog == "a"], 5, seed=7)
    assert [r.run_id for r in alone] == [r.run_id for r in pool if r.catalog == "a"]  # whatever catalog b holds


def test_the_free_gate_watches_a_named_end_of_thought_token_of_one_token(embedded_model_dir):
    import pytest
    from transformers import AutoTokenizer

    from jex.lab.early_exit import end_of_thought_id

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    assert end_of_thought_id(tokenizer, None) == tokenizer.eos_token_id
    (im_end,) = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert end_of_thought_id(tokenizer, "<|im_end|>") == im_end
    with pytest.raises(ValueError, match="'</think>' is [2-9] tokens"):  # not a token of SmolLM2's vocabulary
        end_of_thought_id(tokenizer, "</think>")
