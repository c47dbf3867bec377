"""The engine job's entry: one `EngineJob` (an engine stage's inputs record and the store) computed in
this process, whoever called: `jex stage run` on a machine (through its engine hosts, or alone), an
engine host serving a machine's jobs (`engine_host/server.py: execute`), a data-parallel worker process
(`workers.py`). The stages it runs are `stages.py`'s; the whole machine-side path, with the record at each
joint, is written down in docs/architecture.md ("The machine-side call chain") and, step by step, below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jex.tasks.inputs import EngineJob, FastPassInputs, GenerateInputs
from jex.tasks.records import FastPassSummary, GenerateSummary, PartialSummary, ReasonSummary
from jex.tasks.store import LocalStore

if TYPE_CHECKING:  # the capture's stages import this package's engine pool: imported when a job runs
    from jex.tasks.capture.stages import ShardShare

EngineStageSummaries = FastPassSummary | ReasonSummary | GenerateSummary


def run_engine_job(job: EngineJob, share: ShardShare | None = None) -> EngineStageSummaries | PartialSummary:
    """Compute (this process's `share` of) the job's engine stage into the job's store (`share` None: all of
    it, alone); a `PartialSummary` when other processes of the share still compute some of its shards."""
    from jex.tasks.capture.stages import ALONE, fast_pass_stage, generate_stage, reason_stage

    share = share or ALONE
    # The machine-side call chain, the record at each joint named (docs/architecture.md):
    # 1. `jex stage run --args JOB.json --worker W --workers N [--host-options H.json]` (jex/cli/stage.py,
    #    under `jex.infra.worker_protocol`): reads the `EngineJob` (its paths made absolute) and the
    #    `HostOptions`, and asks `run_request` for a `HostRequest(job=stage, engine_job, worker, workers)`.
    # 2. `run_request` (engine_host/client.py): without `HostOptions`, `execute` in that process; else one
    #    `HostRequest` per slot (`claim` with several) over the slot's socket, a host started with a
    #    `HostLaunch` when none listens, the `HostReply` awaited while `HostProgress` shows it alive.
    # 3. The host (engine_host/server.py: `EngineHost.handle`) starts the engine once (`warm`:
    #    `engine_pool.get_engine` -> engine/factory.py `make_engine(EngineSpec) -> TokenizedEngine`,
    #    an `EngineStart` appended), then `execute` calls here with a `ShardShare` (worker, workers,
    #    claim, progress callback, engine start seconds).
    # 4. Here: the inputs record picks the stage (`FastPassInputs`, `ReasonInputs` or `GenerateInputs`).
    store, inputs = LocalStore(job.store), job.inputs
    # 5. `CachedStage.run` (tasks/cached_stage.py): `inputs.key()` names `<store>/<stage>/<key>/` (a
    #    `StageDir`); a complete folder returns its summary and no engine is touched; else the body.
    # 6. The body (stages.py `_fast_pass` / `_reason`): the bundle's rows as `CaptureRow`s, then
    #    `_sharded` -> `run_sharded` (tasks/store.py): this share's shards (w, w+N, ..., or claimed
    #    first come first served), shards already written reused.
    # 7. Each shard: rendered and tokenised with the engine's `ChatTokenizer` (`ReadoutRequest`s;
    #    reason: `ReasonCall`s holding `GenerateRequest`s), then read in one engine call through
    #    `compute_resilient` (a failing batch split and retried): `TokenizedEngine.readout -> Readout`
    #    (engine/base.py; reason: `generate -> Generation`, then the re-read); the frame and its failed
    #    rows (`ShardRows`) become `shard-NNNNN.parquet` (+ `.failed.json`), the host's progress updated.
    # 8. After its shards the call records its work (`ShardWork`, `.work-*.json`) and returns a
    #    `PartialSummary` while other processes still compute, else merges the shards (`capture.parquet`
    #    / `reasoned.parquet`) into a `FastPassSummary` / `ReasonSummary`, which `CachedStage.run`
    #    records (`StageDir.finish`: provenance, every file's sha256, `_SUCCESS.json` last).
    # 9. Back up the chain: a `HostReply(summary=JobSummary)` per slot; one JSON line per summary from
    #    `jex stage run`; `SUCCESS.json` from the worker protocol, listing the shards. The orchestrator
    #    collects them verified (flows/machines/fleet.py) and the stage's task merges them in the flow's process.
    if isinstance(inputs, FastPassInputs):
        return fast_pass_stage.run(store, inputs, share=share)
    if isinstance(inputs, GenerateInputs):
        return generate_stage.run(store, inputs, share=share)
    return reason_stage.run(store, inputs, share=share)


__all__ = ["run_engine_job"]
