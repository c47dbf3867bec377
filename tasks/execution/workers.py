"""Data parallelism over engine stages: N worker processes, one engine each, then one merge.

Worker w of N computes shards w, w+N, ... of a stage (`engine_job.run_engine_job` with its
`ShardShare`, then `run_sharded`); each process sees one GPU through CUDA_VISIBLE_DEVICES (tensor
parallel 1: batch invariance survives data parallelism, not tensor parallelism). The merge is the
stage called once more with workers=1: every shard exists, so nothing is recomputed, and the merged
capture is the same bytes as a one-worker run.

    python -m jex.tasks.execution.workers JOB.json WORKER WORKERS    (one worker; used by `run_workers`)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from jex.tasks.inputs import EngineJob
from jex.tasks.records import FastPassSummary, GenerateSummary, PartialSummary, ReasonSummary, Record


class WorkerReport(Record):
    """What one data-parallel worker process printed: its engine start, compute time and shards."""

    worker: int
    engine_start_s: float
    compute_s: float
    computed_shards: list[int]
    device: str | None


def run_workers(job: EngineJob, *, workers: int, devices: list[str] | None = None,
                timeout: float | None = None
                ) -> tuple[FastPassSummary | ReasonSummary | GenerateSummary, list[WorkerReport]]:
    """Run the job's engine stage on `workers` processes, then merge; returns the stage summary and
    each worker's report.

    `devices[i]` becomes worker i's CUDA_VISIBLE_DEVICES (None: inherit). Raises if any worker fails.
    """
    from jex.tasks.execution.engine_job import run_engine_job

    stage = job.inputs.stage
    spec_file = Path(job.store) / f".workers-{stage}-{os.getpid()}.json"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(job.model_dump_json())
    procs = []
    for w in range(workers):
        env = dict(os.environ)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[w]
        procs.append(subprocess.Popen([sys.executable, "-m", "jex.tasks.execution.workers", str(spec_file), str(w),
                                       str(workers)], env=env, stdout=subprocess.PIPE, text=True))
    reports = []
    for w, p in enumerate(procs):
        out, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{stage} worker {w} exited {p.returncode}")
        reports.append(WorkerReport.model_validate_json(out.strip().splitlines()[-1]))
    summary = run_engine_job(job)  # the merge: every shard exists, so nothing is recomputed
    spec_file.unlink(missing_ok=True)
    if isinstance(summary, PartialSummary):
        raise RuntimeError(f"{stage}: shards missing after every worker finished")
    return summary, reports


def _main(spec_file: str, worker: int, workers: int) -> None:
    from jex.tasks.capture.stages import ShardShare
    from jex.tasks.execution.engine_job import run_engine_job
    from jex.tasks.execution.engine_pool import get_engine

    job = EngineJob.model_validate_json(Path(spec_file).read_text())
    t0 = time.perf_counter()
    get_engine(job.inputs.engine)
    started = time.perf_counter()
    summary = run_engine_job(job, ShardShare(worker=worker, workers=workers))
    done = time.perf_counter()
    print(WorkerReport(worker=worker, engine_start_s=started - t0, compute_s=done - started,
                       computed_shards=summary.computed_shards,
                       device=os.environ.get("CUDA_VISIBLE_DEVICES")).model_dump_json())


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
