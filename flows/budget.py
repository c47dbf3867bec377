"""The budget projection (`jex calibrate`): measure the reason stage on a stratified sample, and project a
campaign's time and cost. (Not the campaign's `calibrate` stage, which is temperature scaling.)

The fast pass runs on the whole suite (cached, shared with the campaign); the coverage gate picks `coverage`
of a stratified sample (whole questions, ~1/`sample_every` of every catalog); the reason stage runs
on those rows. From the measured seconds per fast-pass row and per reasoned row, and the fix rate
at that coverage, it projects wall time and cost for each coverage of a target suite size under a
price per GPU-hour, and recommends the largest coverage that fits the budget of hours and money.

The per-row budget table turns the same measure around: the deadline (the budget of hours, or of money
at the price, whichever binds) minus the fast pass over the suite leaves GPU-seconds for reasoned
rows; divided by each coverage's reasoned rows that is the allowed seconds per row, set against the
measured seconds per reasoned row, with the cut needed (1 - allowed / measured). The coverage cliff
is the highest coverage whose heavy path (reason seconds per row) still fits that deadline;
coverages above it are infeasible at the measured latency.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from prefect import flow
from pydantic import Field

from jex.fileio import write_json, write_text
from jex.flows.campaign import publish_machines
from jex.flows.machines.runners import StageRunner, make_runner
from jex.infra.cost_ledger import CostLedger, ProjectedSpend
from jex.infra.instance_catalogue import gpus_of, machine_price
from jex.record import Record
from jex.tasks.campaign_spec import BudgetSpec, sample_suite_dir
from jex.tasks.decision_stages import gate_stage
from jex.tasks.documents import FoldDoc, read_doc
from jex.tasks.inputs import BundleInputs, EngineJob, FastPassInputs, FoldInputs, ReasonInputs
from jex.tasks.prefect_tasks import bundle_task, fast_pass_task, fold_task, reason_task
from jex.tasks.store import LocalStore

if TYPE_CHECKING:
    from jex.settings import InfraSettings

EngineInputsT = TypeVar("EngineInputsT", FastPassInputs, ReasonInputs)


class ProjectedCoverage(Record):
    coverage: float
    reasoned_rows: int
    hours: float = Field(description="Projected wall hours")
    usd: float = Field(description="Projected machine cost")
    fits: bool = Field(description="Within both budgets (hours and money)")


class Projection(Record):
    table: list[ProjectedCoverage]
    recommended_coverage: float | None = Field(description="The largest coverage that fits; None: none fits")


class RowBudget(Record):
    """One coverage of the per-row budget table."""

    coverage: float
    reasoned_rows: int
    allowed_s_per_row: float = Field(description="Deadline GPU-seconds left after the fast pass, per reasoned row "
                                                 "(<= 0: the fast pass alone overruns the deadline)")
    cut_needed: float = Field(description="Share of the measured reason seconds per row to cut (0: none)")
    feasible: bool = Field(description="At or below the coverage cliff: the measured heavy path fits")


class RowBudgetTable(Record):
    """The per-row budget table and the coverage cliff for one deadline."""

    deadline_hours: float = Field(description="Wall hours: the budget of hours or of money, whichever binds")
    fast_pass_hours: float = Field(description="Wall hours of the fast pass over the projected rows")
    reason_s_per_row: float = Field(description="Measured seconds per reasoned row (the heavy path)")
    table: list[RowBudget]
    cliff_coverage: float = Field(description="Highest coverage (0..1) whose heavy path fits the deadline")
    feasible_coverage: float | None = Field(description="Highest listed coverage at or below the cliff; None: none")


class Measured(Record):
    """What the budget projection measured on its sample."""

    sample_rows: int | None = Field(description="Panel rows of the stratified sample")
    gated: int
    fast_s_per_row: float = Field(description="0.0 when the capture was reused (no timing)")
    reason_s_per_row: float
    fix_rate: float | None
    fixed: int
    flipped: int


class BudgetRun(Record):
    """`OUT/<run>-budget/budget.json`: the measure and the projection."""

    spec: BudgetSpec
    measured: Measured
    projection_rows: int = Field(description="Rows of the suite projected for")
    projection: Projection
    row_budget: RowBudgetTable | None = Field(None, description="The per-row budget table and the coverage cliff")


def deadline_hours(*, price: float, gpus: int, budget_hours: float, budget_usd: float) -> float:
    """Wall hours the budgets allow: the budget of hours, or of money at `price` x `gpus`, whichever binds."""
    return min(budget_hours, budget_usd / (price * gpus)) if price > 0 else budget_hours


def row_budget(*, rows: int, fast_s_per_row: float, reason_s_per_row: float, coverages: list[float], price: float,
               gpus: int, budget_hours: float, budget_usd: float) -> RowBudgetTable:
    """The per-row budget table and the coverage cliff (see the module docstring)."""
    hours = deadline_hours(price=price, gpus=gpus, budget_hours=budget_hours, budget_usd=budget_usd)
    left = hours * 3600 * gpus - rows * fast_s_per_row  # GPU-seconds for reasoned rows
    cliff = 1.0 if reason_s_per_row <= 0 else max(0.0, min(1.0, left / (rows * reason_s_per_row)))
    table = []
    for c in sorted(coverages):
        reasoned = max(1, round(c * rows))
        allowed = left / reasoned
        cut = 0.0 if reason_s_per_row <= allowed or reason_s_per_row <= 0 else 1 - max(allowed, 0.0) / reason_s_per_row
        table.append(RowBudget(coverage=c, reasoned_rows=reasoned, allowed_s_per_row=allowed, cut_needed=cut,
                               feasible=cut == 0.0 and left > 0))
    feasible = [t.coverage for t in table if t.feasible]
    return RowBudgetTable(deadline_hours=hours, fast_pass_hours=rows * fast_s_per_row / 3600 / gpus,
                          reason_s_per_row=reason_s_per_row, table=table, cliff_coverage=cliff,
                          feasible_coverage=max(feasible) if feasible else None)


def render_row_budget(budget: RowBudgetTable) -> list[str]:
    """The per-row budget table and the coverage cliff as Markdown lines."""
    lines = ["## Per-row budget", "", f"Deadline {budget.deadline_hours:.1f} h; the fast pass takes "
             f"{budget.fast_pass_hours:.1f} h; the heavy path measures {budget.reason_s_per_row:.2f} s per reasoned "
             "row.", "", "| coverage | reasoned rows | budget per row | cut needed vs "
             f"{budget.reason_s_per_row:.2f} s | feasible |", "|---:|---:|---:|---:|---|"]
    for t in budget.table:
        cut = "none" if t.cut_needed == 0 else f"-{100 * t.cut_needed:.0f}%"
        lines.append(f"| {100 * t.coverage:g}% | {t.reasoned_rows:,} | {t.allowed_s_per_row:.2f} s | {cut} | "
                     f"{'yes' if t.feasible else 'no (above the cliff)'} |")
    feasible = "none, every one is above the cliff" if budget.feasible_coverage is None else budget.feasible_coverage
    lines += ["", f"**Coverage cliff: {100 * budget.cliff_coverage:.1f}%** (the highest coverage whose heavy path "
              f"fits the deadline; highest listed feasible: {feasible})."]
    return lines


def project(*, rows: int, fast_s_per_row: float, reason_s_per_row: float, coverages: list[float], price: float,
            gpus: int, budget_hours: float, budget_usd: float) -> Projection:
    """Wall hours and cost per coverage, and the largest coverage within both budgets."""
    table = []
    for c in sorted(coverages):
        hours = (rows * fast_s_per_row + c * rows * reason_s_per_row) / 3600 / gpus
        cost = hours * gpus * price
        table.append(ProjectedCoverage(coverage=c, reasoned_rows=round(c * rows), hours=hours, usd=cost,
                                       fits=hours <= budget_hours and cost <= budget_usd))
    fitting = [t.coverage for t in table if t.fits]
    return Projection(table=table, recommended_coverage=max(fitting) if fitting else None)


def recommendation(doc: BudgetRun) -> str:
    """The recommended coverage in one line; when none fits, what is missing: the smallest projected
    coverage's hours and cost against the budget each exceeds, and the flag that moves it."""
    spec, table = doc.spec, doc.projection.table
    if doc.projection.recommended_coverage is not None:
        return f"Recommended coverage: {doc.projection.recommended_coverage:g}"
    if not table:
        return "No coverage to recommend: no coverages were projected"
    low = table[0]
    over = ([f"~{low.hours:.1f} h, over --budget-hours {spec.budget_hours:g}"] * (low.hours > spec.budget_hours)
            + [f"~${low.usd:.2f}, over --budget-usd {spec.budget_usd:g}"] * (low.usd > spec.budget_usd))
    return (f"No coverage fits the budget: the smallest projected, {low.coverage:g} of {doc.projection_rows} rows, "
            f"needs {' and '.join(over)}; raise the budget or lower --target-rows")


def budget_dir(spec: BudgetSpec) -> Path:
    """`OUT/<run>-budget`: the folder of `budget.json` and `budget.md` (and `machines.json` on machines)."""
    run = spec.campaign.run_dir()
    return run.with_name(run.name + "-budget")


def render(doc: BudgetRun) -> str:
    m, spec = doc.measured, doc.spec
    lines = ["# Budget projection", "", f"Sample: {m.sample_rows} panel rows, {m.gated} gated at coverage "
             f"{spec.coverage}; fast pass {m.fast_s_per_row:.4f} s/row, reason "
             f"{m.reason_s_per_row:.3f} s/reasoned row, fix rate {m.fix_rate}.", "",
             f"Projection for {doc.projection_rows} rows on {spec.gpus} GPU(s) at "
             f"${spec.price_per_gpu_hour}/GPU-hour (budget {spec.budget_hours} h, "
             f"${spec.budget_usd}):", "", "| coverage | reasoned rows | wall | cost | fits |",
             "|---:|---:|---:|---:|---|"]
    for t in doc.projection.table:
        lines.append(f"| {t.coverage:.2f} | {t.reasoned_rows} | ~{t.hours:.1f} h | ~${t.usd:.0f} | "
                     f"{'yes' if t.fits else 'no'} |")
    lines += ["", f"**{recommendation(doc)}**"]
    if doc.row_budget is not None:
        lines += ["", *render_row_budget(doc.row_budget)]
    return "\n".join(lines) + "\n"


def gpu_hour_price(spec: BudgetSpec, infra: InfraSettings) -> float:
    """$ per GPU-hour of the projection: the spec's, else one of the campaign's machines' price (its
    `machines.price_per_hour`, the settings', or its provider's: the instance catalogue's for EC2, 0 for
    hosts) over that machine's GPUs."""
    if spec.price_per_gpu_hour is not None:  # None while neither the spec nor JEX_INFRA__PRICE_PER_HOUR sets it
        return spec.price_per_gpu_hour
    machines = spec.campaign.machines
    return (machine_price(infra, machines.provider, machines.price_per_hour)
            / gpus_of(infra, machines.provider))


def projected_spend(doc: BudgetRun, *, source: Path) -> ProjectedSpend:
    """The campaign's machine-hours at its own coverage, from the seconds per row measured on the sample: every
    row's fast pass and its share of reasoned rows, on machines that each carry `gpus_per_machine` engines'
    GPUs (a machine is paid whole, whichever of its GPUs the campaign uses)."""
    c, m, rows = doc.spec.campaign, doc.measured, doc.projection_rows
    gpu_hours = rows * (m.fast_s_per_row + c.coverage * m.reason_s_per_row) / 3600
    return ProjectedSpend(campaign=c.run_dir().name, coverage=c.coverage,
                          machine_hours=gpu_hours / c.machines.gpus_per_machine, measured_at=time.time(),
                          source=str(source.absolute()))


def computed(runner: StageRunner, inputs: EngineInputsT, store: str) -> EngineInputsT:
    """The engine stage's inputs once `runner` computed its shards, as its stage task must see them."""
    return cast(EngineInputsT, runner.compute(EngineJob(inputs=inputs, store=store)).inputs)


@flow(name="budget-projection", log_prints=True)
def budget_projection(spec: BudgetSpec = BudgetSpec()) -> BudgetRun:  # noqa: B008
    """Measure the sample, its engine stages where the campaign's `machines` say (`make_runner`, as the
    campaign: on machines they leave `machines.json` beside `budget.json`), and project. The campaign's
    projected machine-hours are kept beside the cost ledger (`ProjectedSpend`): its machines are refused
    before any starts if they cost more than its budget at their price."""
    from jex.settings import load_settings

    infra = load_settings().infra
    price = gpu_hour_price(spec, infra)
    spec = spec.model_copy(update={"price_per_gpu_hour": price})
    c = spec.campaign
    store = LocalStore(c.store)
    out = budget_dir(spec)
    runner = make_runner(c.machines, campaign=out.name, store=c.store)
    try:
        with runner:
            bundle = bundle_task(BundleInputs(suite=c.suite or sample_suite_dir(c)), c.store)
            fast = fast_pass_task(computed(runner, c.fast_pass_inputs(bundle), c.store), c.store)
            gate = gate_stage(store, bundle=bundle, fast=fast, coverage=spec.coverage, sample_every=spec.sample_every)
            t0 = time.perf_counter()
            reason = reason_task(computed(runner, c.reason_inputs(bundle, gate), c.store), c.store)
            wall = time.perf_counter() - t0
    finally:
        if (machines := runner.report()) is not None:
            publish_machines(out, machines)
    fold = fold_task(FoldInputs(bundle=bundle, fast=fast, gate=gate, reason=reason, rule=c.fold_rule,
                                weight=c.fold_weight, draws=c.bootstrap_draws, seed=c.bootstrap_seed), c.store)
    counters = read_doc(FoldDoc, fold.fold_json).overall
    fast_rate = fast.compute_seconds / fast.computed_rows if fast.computed_rows else None
    reason_rate = reason.compute_seconds / reason.computed_rows if reason.computed_rows else wall / max(reason.rows, 1)
    if fast_rate is None:  # a fully reused capture carries no timing: use the reason stage's measure only
        fast_rate = 0.0
    measured = Measured(sample_rows=gate.panel_rows, gated=gate.rows, fast_s_per_row=fast_rate,
                        reason_s_per_row=reason_rate, fix_rate=counters.fix_rate, fixed=counters.fixed,
                        flipped=counters.flipped)
    rows = spec.target_rows or fast.rows
    terms = {"price": price, "budget_hours": spec.budget_hours, "budget_usd": spec.budget_usd}
    doc = BudgetRun(spec=spec, measured=measured, projection_rows=rows,
                    projection=project(rows=rows, fast_s_per_row=fast_rate, reason_s_per_row=reason_rate,
                                       coverages=spec.coverages, gpus=spec.gpus, **terms),
                    row_budget=row_budget(rows=rows, fast_s_per_row=fast_rate, reason_s_per_row=reason_rate,
                                          coverages=spec.coverages, gpus=spec.gpus, **terms))
    write_json(out / "budget.json", doc.model_dump(mode="json"))
    CostLedger(Path(infra.state_dir) / "ledger.json").record_projection(projected_spend(doc,
                                                                                   source=out / "budget.json"))
    write_text(out / "budget.md", render(doc))
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(markdown=render(doc), key="budget-projection")
    except Exception:  # noqa: BLE001 - the artifact is a copy of what is on disk
        pass
    print(render(doc))
    return doc
