"""Where a campaign's engine stages compute their shards: one interface, three places, one factory.

- `InProcessRunner`: the stage task computes in the flow's own process (nothing to do beforehand);
- `WorkerProcessesRunner`: fresh local processes, one engine each (`tasks/capture/workers.py`): data
  parallelism on one host, or a twin audit's "same stage, another process";
- `FleetRunner`: rented machines (`flows/fleet.py`): golden replay, detached shard jobs, collection.

In every case the stage task then runs in the flow's process and finds the shards in the store: it
merges them (or finds the stage complete) without loading an engine. `make_runner` is the only place
that decides which runner a campaign gets (`MachinesSpec.provider`, `workers`, `fresh_processes`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from jex.flows.fleet import GpuFleet, MachinesSpec
from jex.flows.machines_doc import MachinesDoc
from jex.tasks.capture.workers import WorkerReport, run_workers
from jex.tasks.inputs import EngineJob


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


class InProcessRunner(StageRunner):
    def compute(self, job: EngineJob) -> EngineJob:
        return job


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
                for stage in ("fast_pass", "reason")}


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
        return {k: shards.get(k, 0) for k in ("fast_pass", "reason")}

    def report(self) -> MachinesDoc:
        return self.fleet.report()


def make_runner(spec: MachinesSpec, *, campaign: str, store: str) -> StageRunner:
    """The runner a campaign's machines section asks for."""
    if spec.provider != "inprocess":
        return FleetRunner(GpuFleet(spec, campaign=campaign, store=store))
    if spec.workers > 1 or spec.fresh_processes:
        return WorkerProcessesRunner(spec.workers)
    return InProcessRunner()
