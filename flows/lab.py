"""The lab's flows: the experiment, and the lab jobs (the batch-invariance bake-off, engine parity, the
early-exit probe). Each takes one record, which is also its form in the Prefect UI: `ExperimentSpec`, and
the jobs' `BakeoffJob`, `ParityJob`, `ProbeJob` (`jex.lab.jobs`, which the CLI's flags and a machine read too).

The experiment: the base and each arm as a cached campaign sub-run, judged by a pre-registered test.

1. The arms file is parsed and every arm's campaign is derived and validated: a bad file fails here,
   before any engine starts (an `InputError` naming the arm and the field).
2. The test's settings (the arms file's `[gate]`) and every arm as declared are written and hashed
   before any arm result exists.
3. The base, then each arm (a sweep: each grid point) runs as a `campaign` sub-flow on the same store:
   an arm recomputes exactly the stages whose keys it changes (a fold arm: no engine call at all).
   A twin re-runs the base's engine stages in a fresh process on its own store, so nothing is reused.
   The experiment has one machine budget (the base's `machines.budget_usd`, else the settings'), shared
   by its sub-runs: each may spend only what the ones before it left (`ExperimentBudget`), so N arms
   cannot spend N budgets. An experiment whose budget is spent stops before its next sub-run.
4. Paired statistics, verdicts, sweeps, the panel projection and the twin audit go to `OUT/`
   (`experiment.json`, `report.md`, `forest.png`, `sweep-*.png`), the ledger is appended, and the report
   becomes a Prefect artifact. A twin that is not byte-identical fails the run (after the report).

A lab job runs where its `machines` say (None: the settings' provider): in this process or on a machine
(`jex.flows.machines.runners.run_lab`); its Markdown report becomes a Prefect artifact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jex.errors import FlowError, InputError
from jex.flows.campaign import campaign
from jex.flows.machines.runners import run_lab
from jex.infra.cost_ledger import CostLedger
from jex.lab.arms import ArmDecl, ArmsFile, parse_arms
from jex.lab.experiment_report import (
    ArmRun,
    TwinAudit,
    analyse,
    experiment_decisions,
    register_experiment_test,
    register_with_base,
    twin_audit,
    write_experiment,
)
from jex.lab.jobs import (
    BakeoffJob,
    BakeoffSummary,
    LabJob,
    LabSummary,
    ParityJob,
    ParitySummary,
    ProbeJob,
    ProbeSummary,
)
from jex.run_records import EngineCalls
from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec, sample_suite_dir
from jex.tasks.decisions import append_decisions, ledger_path, model_facts
from jex.tasks.outputs.inline_images import inline_images

EXAMPLE_ARMS = '''name = "sample"

[gate]
metric = "full"
placebo = "reworded"

[[arms]]
name = "system"
hypothesis = "a system prompt helps the small model"
reopen_when = "a model of 1B parameters or more"
[arms.render]
system_prompt = "You are a careful expert. Answer with the letter of the correct option."

[[arms]]
name = "reworded"
kind = "placebo"
[arms.render]
question_template = "{prompt}\\n\\n{options}\\n\\nReply with the letter of the right option."

[[arms]]
name = "twin"
kind = "twin"

[[arms]]
name = "fold-weight"
kind = "sweep"
parameter = "fold_weight"
grid = [0.25, 0.5, 0.75, 1.0]
reopen_when = "coverage above 0.3"
'''


class ExperimentSpec(BaseModel):
    """An experiment: the base campaign, the arms file's text and where the results go (the UI form)."""

    model_config = ConfigDict(extra="forbid")
    campaign: CampaignSpec = Field(CampaignSpec(), description="The base campaign (suite, engine, store, ...)")
    arms_toml: str = Field(EXAMPLE_ARMS, description="The arms file (TOML text): [base], [gate], [[arms]]")
    arms_path: str = Field("arms.toml", description="Where the arms file came from (named in errors)")
    out: str = Field("runs/experiment", description="Experiment folder: experiment.json, report.md (decisions "
                                                        "go to the store's ledger.toml)")
    panel_catalogs: list[str] | None = Field(None, description="Run on these catalogs of the suite; project onto "
                                                               "the full index")
    panel_share: float | None = Field(None, gt=0, le=1, description="Declared share of the full weight of the "
                                                                     "panel, asserted (+-0.0005) before any arm runs")


class Point(BaseModel):
    """One sub-run to make: an arm, or a sweep's grid point."""

    model_config = ConfigDict(frozen=True)
    name: str
    kind: str
    spec: CampaignSpec
    sweep: str | None = None
    value: Any = None


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)
    arms: ArmsFile
    base: CampaignSpec
    points: tuple[Point, ...]
    shares: dict[str, float] | None = None


def derive(base: CampaignSpec, decl: ArmDecl, *, name: str, path: str) -> CampaignSpec:
    """The campaign of one arm: the base with the arm's differences (validated as a whole)."""
    doc = base.model_dump(mode="json")
    doc.update(decl.campaign)
    engine = {**doc["engine"], **decl.engine}
    if decl.model is not None:
        engine["model"] = decl.model
    engine["render"] = {**engine["render"], **decl.render}
    doc["engine"], doc["name"] = engine, name
    try:
        return CampaignSpec.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InputError(f"arm '{decl.name}': {first['msg']}", file=path, field=loc.removeprefix("engine.")) from None


def plan_experiment(spec: ExperimentSpec) -> Plan:
    """Parse the arms and derive every sub-run's campaign; all errors come before any engine starts."""
    arms = parse_arms(spec.arms_toml, path=spec.arms_path)
    out = Path(spec.out)
    base = spec.campaign.model_copy(update={"out": str(out / "runs")})
    suite = base.suite or sample_suite_dir(base)
    if Path(suite).is_file():  # a bundle: the campaign reads a suite folder, so write one from it
        from jex.lab.panel import panel_suite
        from jex.tasks.bundle.suite_table import load_suite_table

        ids = [c.id for c in load_suite_table(suite).spec.catalogs]
        suite = str(panel_suite(suite, out / "suite-of-bundle", ids))
    shares = None
    if spec.panel_catalogs:
        from jex.lab.panel import prepare_panel

        panel = prepare_panel(suite, out / "panel-suite", spec.panel_catalogs, declared_share=spec.panel_share)
        shares = panel.shares
        print(f"panel {spec.panel_catalogs}: share of the full weight {panel.share:.5f}")
        suite = str(panel.suite)
    base = derive(base.model_copy(update={"suite": suite}), arms.base, name="base", path=spec.arms_path)
    try:
        from jex.lab.experiment_stats import metric_weights
        from jex.tasks.bundle.suite_table import load_suite_table

        table = load_suite_table(suite)
        metric_weights(table.spec, dict.fromkeys((c.id for c in table.spec.catalogs), 0.0), arms.test.metric)
    except ValueError as e:
        raise InputError(str(e), file=spec.arms_path, field="gate.metric") from None
    points = []
    for decl in arms.arms:
        for name, point in decl.points():
            s = derive(base, point, name=name, path=spec.arms_path)
            points.append(Point(name=name, kind=decl.kind, spec=s, sweep=decl.name if decl.kind == "sweep" else None,
                                value=_value(point, decl.parameter) if decl.kind == "sweep" else None))
    return Plan(arms=arms, base=base, points=tuple(points), shares=shares)


def _value(decl: ArmDecl, parameter: str | None) -> Any:
    group, _, key = (parameter or "").partition(".")
    if group in ("render", "engine"):
        return getattr(decl, group)[key]
    return decl.model if parameter == "model" else decl.campaign[parameter or ""]


class ExperimentBudget:
    """One machine budget for every sub-run of an experiment: the ledger's cost of the sub-runs so far
    (each a ledger campaign, its run folder's name) is taken off before the next one starts."""

    def __init__(self, total_usd: float, ledger: CostLedger, *, of: str = "experiment", parts: str = "arms"):
        self.total_usd, self.ledger = total_usd, ledger
        self.of, self.parts = of, parts
        self.spent_usd = 0.0

    def spec_for(self, spec: CampaignSpec, name: str) -> CampaignSpec:
        """`spec` with what is left of the budget as its machines' budget; FlowError when none is left."""
        left = self.total_usd - self.spent_usd
        if left <= 0:
            raise FlowError(f"{self.of} budget spent: ${self.spent_usd:.4f} of ${self.total_usd:.4f} before "
                            f"sub-run {name}; raise machines.budget_usd or drop {self.parts}")
        return spec.model_copy(update={"machines": spec.machines.model_copy(update={"budget_usd": left})})

    def charge(self, run_dir: Path) -> None:
        """Add a finished sub-run's machine cost (from the ledger)."""
        self.spent_usd += self.ledger.total(run_dir.name)


def experiment_budget(base: CampaignSpec, *, of: str = "experiment", parts: str = "arms") -> ExperimentBudget:
    """The experiment's (or a comparison's) budget: the base's `machines.budget_usd`, else the settings', on
    the settings' ledger."""
    from jex.settings import load_settings

    infra = load_settings().infra
    total = base.machines.budget_usd if base.machines.budget_usd is not None else infra.budget_usd
    return ExperimentBudget(total, CostLedger(Path(infra.state_dir) / "ledger.json"), of=of, parts=parts)


def _sub_run(spec: CampaignSpec, *, recompute: bool = False) -> tuple[Path, dict[str, int], float]:
    t0 = time.perf_counter()
    run_dir = Path(campaign(spec, recompute=recompute))
    calls = {str(stage): n for stage, n in EngineCalls.read(run_dir).calls.items()}
    return run_dir, calls, time.perf_counter() - t0


@flow(name="models", log_prints=True)
def models_comparison(spec: CampaignSpec = CampaignSpec(),  # noqa: B008 - UI form default
                      models: list[str] | None = None, recompute: bool = False) -> str:
    """One campaign per model on the campaign's suite, one after another (each cached as its own campaign,
    so a model added later is the only one computed; one machine budget for them all, as an experiment's),
    then their comparison: `compare.md` with its plot and `compare.json` in the comparison folder, and the
    Markdown as an artifact. Returns that folder. `recompute`: as the campaign flow's, for every model."""
    from jex.lab.model_comparison import compare_runs, comparison_folder, render_comparison, write_comparison

    names = list(dict.fromkeys(models or []))
    if len(names) < 2:
        raise InputError(f"models: a comparison needs two or more different models, got {names}", field="models")
    budget = experiment_budget(spec, of="comparison", parts="models")
    run_dirs = []
    for model in names:
        run_dir, calls, wall = _sub_run(budget.spec_for(spec.with_model(model), model), recompute=recompute)
        budget.charge(run_dir)
        print(f"model {model}: {run_dir} engine calls {calls} ({wall:.1f} s)")
        run_dirs.append(run_dir)
    doc = compare_runs(run_dirs)
    out = write_comparison(doc, comparison_folder(spec.located().out, spec.name, run_dirs))
    try:
        create_markdown_artifact(markdown=inline_images(render_comparison(doc), out), key="models-comparison",
                                 description=f"{len(names)} models of campaign {spec.name}")
    except Exception as e:  # noqa: BLE001 - the files are written; a display failure must not hide the result
        print(f"could not publish the comparison artifact: {e}")
    print(f"comparison folder: {out.resolve()}")
    return str(out)


def run_models(spec: CampaignSpec, models: list[str], *, recompute: bool = False) -> Path:
    """Run the models flow in this process (Prefect's local API unless PREFECT_API_URL is set)."""
    return Path(models_comparison(spec, models, recompute=recompute))


def run_twin(base: CampaignSpec, name: str, out: Path) -> tuple[Path, dict[str, int], float, str]:
    """The base again on a store of its own, its engine stages computed by fresh processes, then the
    campaign flow over that store. In-process campaigns: one worker process per stage
    (`MachinesSpec.fresh_processes`); with machines (local, ssh, ec2, command): the campaign's own
    fleet, whose machines are fresh processes."""
    store = out / f"twin-{name}" / "store"
    machines = base.machines
    if machines.provider == "inprocess":
        machines = machines.model_copy(update={"fresh_processes": True})
    spec = base.model_copy(update={"store": str(store), "name": name, "machines": machines})
    run_dir, calls, wall = _sub_run(spec)
    in_process = EngineCalls.read(run_dir).in_process
    if any(in_process.values()):
        raise FlowError(f"twin {name}: the flow recomputed engine stages in-process ({in_process})")
    return run_dir, calls, wall, str(store)


@flow(name="experiment", log_prints=True)
def experiment(spec: ExperimentSpec = ExperimentSpec()) -> str:  # noqa: B008 - UI form default
    """Run an experiment (see the module docstring); returns the experiment folder."""
    plan = plan_experiment(spec)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    test_sha = register_experiment_test(plan.arms, out)
    print(f"pre-registered test ([gate]) written: sha256 {test_sha}")
    budget = experiment_budget(plan.base)
    base_dir, base_calls, base_wall = _sub_run(budget.spec_for(plan.base, "base"))
    budget.charge(base_dir)
    name, params = model_facts(plan.base.engine)
    registered = register_with_base(test_sha, base_dir, model_name=name, model_params=params)
    print(f"registered on the base's suite and model (before any arm): sha256 {registered.sha256}")
    base = ArmRun("base", "base", base_dir, base_calls, base_wall)
    runs: list[ArmRun] = []
    twins: dict[str, TwinAudit] = {}
    for p in plan.points:
        if p.kind == "twin":
            run_dir, calls, wall, store = run_twin(budget.spec_for(plan.base, p.name), p.name, out)
            twins[p.name] = {**twin_audit(base_dir, run_dir), "store": store}
        else:
            run_dir, calls, wall = _sub_run(budget.spec_for(p.spec, p.name))
        budget.charge(run_dir)
        runs.append(ArmRun(p.name, p.kind, run_dir, calls, wall, p.sweep, p.value))
        print(f"arm {p.name}: {run_dir} engine calls {calls} ({wall:.1f} s)")
    doc = analyse(plan.arms, base=base, runs=runs, test_sha256=test_sha, out=out, twins=twins,
                  panel={"shares": plan.shares, "asserted_share": spec.panel_share} if plan.shares else None,
                  settings=spec.model_dump(mode="json"), registered=registered)
    ledger = ledger_path(plan.base.store)
    added = len(append_decisions(ledger, experiment_decisions(doc, plan.arms, registered, source=out)))
    write_experiment(out, doc, ledger=ledger.resolve())
    report = inline_images((out / "report.md").read_text(), out)
    try:
        create_markdown_artifact(markdown=report, key="experiment-report", description=f"experiment {doc['name']}")
        create_table_artifact(table=[{"arm": n, "kind": a["kind"], "delta": round(a["delta"], 4),
                                      "ci_low": round(a["ci"][0], 4), "ci_high": round(a["ci"][1], 4),
                                      "p": round(a["p"], 4), "verdict": a["verdict"]} for n, a in doc["arms"].items()],
                              key="experiment-arms", description=f"arms of {doc['name']}")
    except Exception as e:  # noqa: BLE001 - the files are written; a display failure must not hide the result
        print(f"could not publish the experiment artifacts: {e}")
    print(f"ledger: {added} decision(s) appended to {ledger}")
    different = [n for n, t in twins.items() if not t["identical"]]
    if different:
        first = twins[different[0]]["first_difference"]
        assert first is not None  # not identical: twin_audit recorded the first difference
        raise FlowError(f"twin audit: {different[0]} is not byte-identical to the base: first difference in "
                        f"{first['artifact']} at row {first['row']} (run_id {first['run_id']}, column "
                        f"{first['column']}); see {out / 'report.md'}")
    print(f"experiment folder: {out.resolve()}")
    return str(out)


def run_experiment(spec: ExperimentSpec) -> Path:
    """Run the flow in this process (Prefect's local API unless PREFECT_API_URL is set)."""
    return Path(experiment(spec))


def _lab_job(spec: BakeoffJob | ParityJob | ProbeJob, out: str, machines: MachinesSpec | None, *,
             report: str, key: str) -> tuple[LabSummary, str]:
    """Run a lab job where `machines` say; its Markdown `report` (a file in `out`) becomes the artifact `key`.
    Returns the job's summary and the report."""
    summary = run_lab(LabJob(spec=spec, out=out), machines)
    text = (Path(out) / report).read_text()
    create_markdown_artifact(markdown=text, key=key)
    return summary, text


@flow(name="bakeoff", log_prints=True)
def bakeoff(job: BakeoffJob = BakeoffJob(), out: str = "runs/bakeoff",  # noqa: B008 - UI form default
            machines: MachinesSpec | None = None) -> BakeoffSummary:
    """Each arm in its own process; the verdict and the table become a Prefect artifact."""
    summary, _ = _lab_job(job, out, machines, report="bakeoff.md", key="bakeoff-report")
    assert isinstance(summary, BakeoffSummary)  # a bake-off job's summary
    print(summary.verdict)
    return summary


@flow(name="parity", log_prints=True)
def parity(job: ParityJob, out: str = "runs/parity", machines: MachinesSpec | None = None) -> ParitySummary:
    """Readout parity (and choice parity after a rationale) of two engines on the same rows: a stratified
    sample of `job.rows` (0: all); the mismatches after a rationale also go to parity-mismatches.parquet."""
    summary, _ = _lab_job(job, out, machines, report="parity.md", key="parity-report")
    assert isinstance(summary, ParitySummary)  # a parity job's summary
    return summary


@flow(name="early-exit-probe", log_prints=True)
def early_exit_probe(job: ProbeJob, out: str = "runs/probe",
                     machines: MachinesSpec | None = None) -> ProbeSummary:
    """Probe `job.rows` gated rows of a suite folder or bundle; writes probe.json, probe.md, probe.png."""
    summary, text = _lab_job(job, out, machines, report="probe.md", key="early-exit-probe")
    print(text.splitlines()[4] if len(text.splitlines()) > 4 else text)
    assert isinstance(summary, ProbeSummary)  # a probe job's summary
    return summary
