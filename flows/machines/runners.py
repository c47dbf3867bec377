"""Where a campaign's engine stages compute their shards: one interface, four places, one factory.

- `InProcessRunner`: the stage task computes in the flow's own process (nothing to do beforehand);
- `WorkerProcessesRunner`: fresh local processes, one engine each (`tasks/execution/workers.py`): data
  parallelism on one host, or a twin audit's "same stage, another process";
- `FleetRunner`: rented machines (`flows/machines/fleet.py`): golden replay, detached shard jobs, collection.
- `ServedRunner`: a served model's stages, in this process (the server computes): its golden check, its usage.

In every case the stage task then runs in the flow's process and finds the shards in the store: it
merges them (or finds the stage complete) without loading an engine. `make_runner` is the only place
that decides which runner a campaign gets (`MachinesSpec.provider`, `workers`, `fresh_processes`).

Lab jobs (the early-exit probe, parity, the bake-off: `jex.lab.jobs`) go the same way
(`run_lab`): in this process, or as a job on the fleet's first machine, its outputs collected back.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from jex.fileio import sha256_json
from jex.flows.machines.fleet import GpuFleet
from jex.flows.machines.machines_doc import MachinesDoc, report_section
from jex.infra.cost_ledger import CostLedger, ServedLedgerEntry
from jex.lab.jobs import LabJob, LabSummary, lab_summary, run_lab_job
from jex.record import write_record
from jex.run_records import ENGINE_STAGES
from jex.tasks.campaign_spec import MachinesSpec
from jex.tasks.capture.served import (
    SERVED_FILE,
    ServedCheck,
    ServedDoc,
    answer_journals,
    served_check,
    served_doc,
    served_section,
    served_usage,
    stored_check,
    usage_cost,
)
from jex.tasks.capture.stages import stage_plan
from jex.tasks.execution import WorkerReport, run_workers
from jex.tasks.inputs import EngineJob
from jex.tasks.outputs.report import MachinesSection


class StageRunner(ABC):
    """Computes an engine stage's missing shards before its task runs; a context manager (machines
    are released on exit, also on failure)."""

    def __enter__(self) -> StageRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @abstractmethod
    def compute(self, job: EngineJob) -> EngineJob:
        """Compute the shards the job's stage still needs. Returns the job as its stage task must see
        it: with the engine fingerprint measured where the shards were computed (machines), or as it
        was (this process's own engine)."""

    def engine_calls(self) -> dict[str, int] | None:
        """Shards computed outside this process, by stage (None: count this process's engine calls)."""
        return None

    def report(self) -> MachinesDoc | None:
        """The machines report (`machines.json`), for runners that rent machines."""
        return None

    def section(self) -> MachinesSection | None:
        """What the run's report shows of where its engine stages ran (None: in this process)."""
        return report_section(self.report())

    def run_lab(self, job: LabJob) -> None:
        """Run a lab job (probe, parity, bake-off); its outputs land in `job.out`. Here: in this process."""
        run_lab_job(job)


class InProcessRunner(StageRunner):
    def compute(self, job: EngineJob) -> EngineJob:
        return job


class ServedRunner(InProcessRunner):
    """A served model's engine stages (`engine.kind = "openai"`): in this process, each request to its server
    (the server computes: no machine is rented, whatever the provider). Before the first stage that sends rows,
    the golden check (`tasks/capture/served.py`: rows sent twice, at concurrency 1 and at the engine's); at the
    end `served.json` and the report's section (identity, check, usage, cost), and on exit (also on failure: its
    answers were paid for) the usage in the cost ledger (`served_entries`). No settings audit: a served model's
    batch invariance cannot be proven."""

    def __init__(self, spec: MachinesSpec, run_dir: Path, *, campaign: str | None = None,
                 ledger: CostLedger | None = None):
        from jex.settings import load_settings

        self.spec, self.run_dir = spec, run_dir
        self.campaign = campaign or run_dir.name
        self.ledger = ledger or CostLedger(Path(load_settings().infra.state_dir) / "ledger.json")
        self.jobs: list[EngineJob] = []
        self.check: ServedCheck | None = None
        self.doc: ServedDoc | None = None
        """The usage and cost at the end of the engine stages (`__exit__`)."""

    def __enter__(self) -> ServedRunner:
        if self.spec.provider not in ("inprocess", "local"):
            print(f"a served model needs no machine: its engine stages run in this process (provider "
                  f"{self.spec.provider} unused)")
        return self

    def __exit__(self, *exc: object) -> None:
        """Record the engine stages' usage in the cost ledger; after a failure a ledger that cannot be written is
        a warning (the failure is what the campaign reports)."""
        if not self.jobs:
            return
        try:
            self.doc = served_doc(self.jobs[0].inputs.engine, self.check, served_usage(self.jobs))
            for entry in served_entries(self.campaign, self.jobs, self.doc):
                self.ledger.record_served(entry)
        except Exception as e:
            if exc[0] is None:
                raise
            print(f"WARNING: the served model's usage is not in the cost ledger ({type(e).__name__}: {e})")

    def compute(self, job: EngineJob) -> EngineJob:
        self.jobs.append(job)
        rows, tokens = self.spec.golden_generation_rows, self.spec.golden_generation_tokens
        if self.check is None and rows and (job.inputs.bundle.rows or job.inputs.bundle.generate_rows):
            stored = stage_plan(job.inputs, job.store).complete  # nothing to send: only a stored check is read
            self.check = stored_check(job, rows, tokens) if stored else served_check(job, rows=rows, tokens=tokens)
            if self.check is not None and not stored:
                print(f"served golden check: {self.check.line()}")
        return job

    def section(self) -> MachinesSection | None:
        if not self.jobs:
            return None
        engine = self.jobs[0].inputs.engine
        doc = self.doc or served_doc(engine, self.check, served_usage(self.jobs))
        write_record(self.run_dir / SERVED_FILE, doc)
        return MachinesSection(markdown=served_section(doc, engine), shards={}, audit=None)


def served_entries(campaign: str, jobs: list[EngineJob], doc: ServedDoc) -> list[ServedLedgerEntry]:
    """The cost ledger's entries of a served model's answers: one per answer journal (an engine stage's folder in
    the store, keyed by its path), charged to the campaign that first records it. A resumed campaign's journal
    grows its entry; another campaign reading the same stored stage adds nothing (it sent nothing)."""
    engine = jobs[0].inputs.engine
    return [ServedLedgerEntry(
        served_id=f"journal-{sha256_json(str(folder.resolve()))[:16]}", campaign=campaign, journal=str(folder),
        endpoint=doc.endpoint, model=doc.model, requests=usage.requests, prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens, price_input_per_mtok=engine.price_input_per_mtok,
        price_output_per_mtok=engine.price_output_per_mtok, cost_usd=usage_cost(engine, usage),
        recorded_at=time.time()) for folder, usage in answer_journals(jobs).items() if usage.requests]


class WorkerProcessesRunner(StageRunner):
    """`workers` fresh processes on this host share each engine stage (worker w takes shards w, w+N, ...)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.reports: dict[str, list[WorkerReport]] = {}

    def compute(self, job: EngineJob) -> EngineJob:
        _, reports = run_workers(job, workers=self.workers)
        self.reports.setdefault(job.inputs.stage, []).extend(reports)
        return job

    def engine_calls(self) -> dict[str, int]:
        return {stage: sum(len(r.computed_shards) for r in self.reports.get(stage, []))
                for stage in ENGINE_STAGES}


class FleetRunner(StageRunner):
    def __init__(self, fleet: GpuFleet):
        self.fleet = fleet

    def __enter__(self) -> FleetRunner:
        self.fleet.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fleet.__exit__(*exc)

    def compute(self, job: EngineJob) -> EngineJob:
        return self.fleet.run_stage(job)

    def engine_calls(self) -> dict[str, int]:
        shards = self.fleet.report().shards()
        return {k: shards.get(k, 0) for k in ENGINE_STAGES}

    def report(self) -> MachinesDoc:
        return self.fleet.report()

    def run_lab(self, job: LabJob) -> None:
        self.fleet.run_lab(job)


def make_runner(spec: MachinesSpec, *, campaign: str, store: str, served_run: Path | None = None) -> StageRunner:
    """The runner a campaign's machines section asks for; a served model's (`served_run`: its run folder) runs
    its engine stages here, whatever the provider."""
    if served_run is not None:
        return ServedRunner(spec, served_run, campaign=campaign)
    if spec.provider != "inprocess":
        return FleetRunner(GpuFleet(spec, campaign=campaign, store=store))
    if spec.workers > 1 or spec.fresh_processes:
        return WorkerProcessesRunner(spec.workers)
    return InProcessRunner()


def run_lab(job: LabJob, machines: MachinesSpec | None = None) -> LabSummary:
    """Run a lab job where `machines` says (None: the settings' provider, `JEX_INFRA__PROVIDER`) through
    `make_runner`: in this process, or on a machine released at the end, also on failure. Returns its
    summary (`lab_summary`); a machine run also leaves `machines.json` in `job.out`."""
    from jex.fileio import write_json
    from jex.settings import load_settings

    machines = machines or MachinesSpec(provider=load_settings().infra.provider)
    runner = make_runner(machines, campaign=f"lab-{job.kind}-{Path(job.out).resolve().name}", store=job.out)
    try:
        with runner:
            runner.run_lab(job)
    finally:
        if (doc := runner.report()) is not None:
            write_json(Path(job.out) / "machines.json", doc.model_dump(mode="json"))
    return lab_summary(job)
