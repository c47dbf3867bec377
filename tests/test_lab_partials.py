"""Issue 29 item 7: stratified parity samples and the reason-parity mismatch record, on small data made here."""

from __future__ import annotations

import math

import polars as pl

from jex.engine.types import FinishReason, Generation, Readout, ReadoutMode
from jex.lab.parity import compare_reasoned, stratified_rows, write_mismatches
from jex.tasks.capture.engine_calls import CaptureRow


def _rows(sizes: dict[str, int]) -> list[CaptureRow]:
    return [CaptureRow(f"{c}-{i}", "p", ("A", "B"), ("x", "y"), gold=0, catalog=c)
            for c, n in sizes.items() for i in range(n)]


def test_a_stratified_parity_sample_takes_every_catalog_in_proportion_not_the_first_rows():
    rows = _rows({"a": 12, "b": 6, "c": 6})
    picked = stratified_rows(rows, 8, seed=1)
    by_catalog = {c: sum(r.catalog == c for r in picked) for c in "abc"}
    assert by_catalog == {"a": 4, "b": 2, "c": 2}
    assert [r.run_id for r in picked] != [r.run_id for r in rows[:8]]
    assert picked == sorted(picked, key=rows.index)  # suite order kept


def test_a_stratified_parity_sample_is_fixed_by_its_seed():
    rows = _rows({"a": 30, "b": 30})
    assert stratified_rows(rows, 10, seed=5) == stratified_rows(rows, 10, seed=5)
    assert stratified_rows(rows, 10, seed=5) != stratified_rows(rows, 10, seed=6)
    assert stratified_rows(rows, 0) == rows and stratified_rows(rows, 99) == rows


def test_a_stratified_sample_gives_the_remainder_to_the_largest_fractions():
    picked = stratified_rows(_rows({"a": 5, "b": 3, "c": 2}), 3, seed=0)  # exact 1.5 / 0.9 / 0.6
    assert sorted(r.catalog for r in picked) == ["a", "b", "c"]


def _readout(rid: str, p0: float) -> Readout:
    return Readout(rid, (math.log(p0), math.log(1 - p0)), None, 1.0, ReadoutMode.LABEL_SLOT)


def test_the_reason_parity_mismatch_record_has_one_row_per_mismatch(tmp_path):
    rows = _rows({"a": 1, "b": 2})
    gen = [Generation(r.run_id, "t", (1, 2), FinishReason.STOP) for r in rows]
    pre = [_readout(r.run_id, 0.6) for r in rows]
    post_a = [_readout(r.run_id, 0.9) for r in rows]
    post_b = [_readout(rows[0].run_id, 0.9), _readout(rows[1].run_id, 0.2), _readout(rows[2].run_id, 0.95)]
    reasoned = compare_reasoned(rows, gen, gen, post_a, post_b, pre, {r.run_id: 0 for r in rows})
    path = write_mismatches({"readout": {"common": 0, "refused": 0}, "timings": {}, "accuracy_a": None,
                             "accuracy_b": None, "reasoned": reasoned}, tmp_path)
    assert path == tmp_path / "parity-mismatches.parquet"
    record = pl.read_parquet(path)
    assert record.height == 1
    row = record.row(0, named=True)
    assert (row["run_id"], row["catalog"], row["choice_a"], row["choice_b"], row["gold"]) == ("b-0", "b", 0, 1, 0)
    assert math.isclose(row["pre_margin"], math.log(0.6 / 0.4) - math.log(0.4 / 0.6))
    assert row["post_margin_a"] > 0 and row["post_margin_b"] > 0


def test_no_mismatch_record_without_choice_parity(tmp_path):
    assert write_mismatches({"readout": {"common": 0, "refused": 0}, "timings": {}, "accuracy_a": None,
                             "accuracy_b": None}, tmp_path) is None
    assert not (tmp_path / "parity-mismatches.parquet").exists()


def test_an_experiment_shares_one_machine_budget_across_its_sub_runs(tmp_path):
    import pytest

    from jex.errors import FlowError
    from jex.flows.lab import ExperimentBudget
    from jex.infra.cost_ledger import CostLedger
    from jex.tasks.campaign_spec import CampaignSpec

    ledger = CostLedger(tmp_path / "ledger.json")
    budget = ExperimentBudget(25.0, ledger)
    spec = CampaignSpec()
    assert budget.spec_for(spec, "base").machines.budget_usd == 25.0
    ledger.open("m1", "base-0123456789", "local", 3600.0, created_at=100.0)  # $1 a second
    ledger.close("m1", "done", at=110.0)
    budget.charge(tmp_path / "runs" / "base-0123456789")
    assert budget.spec_for(spec, "arm1").machines.budget_usd == pytest.approx(15.0)  # what the base left
    ledger.open("m2", "arm1-0123456789", "local", 3600.0, created_at=100.0)
    ledger.close("m2", "done", at=120.0)
    budget.charge(tmp_path / "runs" / "arm1-0123456789")
    with pytest.raises(FlowError, match=r"experiment budget spent: \$30.0000 of \$25.0000 before sub-run arm2"):
        budget.spec_for(spec, "arm2")


def test_the_report_area_table_splits_the_full_index_by_the_manifests_area(sample_suite):
    import random

    from jex.tasks.bundle.suite_table import load_suite_table
    from jex.tasks.outputs.report import _score_section
    from jex.tasks.scoring.index import catalog_shares
    from jex.tasks.scoring.score import area_table, score_with_ci

    table = load_suite_table(sample_suite)
    rng = random.Random(4)
    preds = pl.DataFrame([{"run_id": rid, "choice": gold if rng.random() < 0.6 else (gold + 1) % k}
                          for rid, gold, k in table.rows.select("run_id", "gold", "n_options").iter_rows()],
                         schema={"run_id": pl.String, "choice": pl.Int32})
    doc = score_with_ci(table.rows, preds, table.spec, draws=20, seed=1)
    assert math.isclose(sum(catalog_shares(table.spec).values()), 1.0)
    lines = area_table(doc, table.spec)
    rows = {cells[1].strip(): cells for cells in (line.split("|") for line in lines[3:])}
    assert set(rows) == {"math", "knowledge", "logic", "language"}
    assert rows["math"][2].strip() == "4"  # arith, sorted_max, units, compare
    assert math.isclose(sum(float(c[6]) for c in rows.values()), doc.full, abs_tol=0.03)  # points add up to full
    assert "| area |" in "\n".join(_score_section(doc, table.spec))


def test_no_area_table_when_every_catalog_is_general(sample_suite):
    from dataclasses import replace

    from jex.tasks.bundle.suite_table import load_suite_table
    from jex.tasks.scoring.score import area_table, score_with_ci

    table = load_suite_table(sample_suite)
    general = replace(table.spec, catalogs=tuple(replace(c, area="general") for c in table.spec.catalogs))
    preds = table.rows.select("run_id", choice=pl.col("gold").cast(pl.Int32))
    assert area_table(score_with_ci(table.rows, preds, general, draws=10, seed=1), general) == []


def test_required_tools_follow_the_engine_kind():
    from jex.infra.machine import required_tools

    assert required_tools("vllm") == required_tools("vllm-control") == ("ninja", "cc|gcc|clang")
    assert required_tools("hf") == ()


def test_the_machine_preflight_names_a_tool_missing_from_path(tmp_path):
    """The bootstrap on a real (local) machine: a missing tool fails it with one line naming the tool, and the
    machine is torn down; 'a|b' is satisfied by any one of them."""
    import sys

    import pytest

    from jex.infra.cost_ledger import CostLedger
    from jex.infra.machine import MachineSession, Policy
    from jex.infra.providers import LocalProvider
    from jex.infra.shell import ShellError

    provider = LocalProvider(tmp_path / "machines")

    def session(tools: tuple[str, ...]) -> MachineSession:
        return MachineSession(provider, campaign="c1", ledger=CostLedger(tmp_path / "state" / "ledger.json"),
                              policy=Policy(backoff_s=0.1, watchdog=False), python=sys.executable,
                              state_dir=tmp_path / "state", tools=tools)

    with pytest.raises(ShellError) as err:
        session(("sh", "jex-no-such-tool|jex-nor-this-one")).start()
    line = str(err.value).splitlines()[-1]
    assert "machine pre-flight: jex-no-such-tool or jex-nor-this-one not found on PATH" in line
    assert provider.list_machines("c1") == []
    ok = session(("jex-no-such-tool|sh",))
    with ok:
        ok.start()
