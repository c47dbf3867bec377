"""Execution: where an engine job is computed, and its one face for the orchestrator.

An engine stage's job (`EngineJob`: its inputs record and the store) is computed in this process
(`run_engine_job`), by an engine host that serves a machine's jobs (`engine_host`: `HostOptions`,
`HostRequest`, `run_request`), or by data-parallel worker processes (`run_workers`); each process keeps
one engine per spec (`engine_pool`). The machine-side chain, one record at each joint (the comments at
`engine_job.run_engine_job` and `docs/architecture.md`, "The machine-side call chain"):

0. the orchestrator writes `args.json` (`EngineJob`) and `host-options.json` (`HostOptions`);
1. `jex stage run` reads them and calls `run_request(HostRequest)`;
2. the client hands the request to a slot's engine host, starting one where none listens;
3. the host warms the request's engine once (`EngineStart` in `starts.jsonl`) and executes it;
4. `run_engine_job(EngineJob, ShardShare)` computes the shards through the capture's stages;
5. the reply (`HostReply`) carries the stage's summary back to the job, which writes its marker.

`jex.flows` imports this package only, never its modules.
"""

from jex.tasks.execution.engine_host import (
    COMPILE_CACHE,
    STARTS,
    EngineHostDied,
    HostOptions,
    HostPolicy,
    HostRequest,
    parse_starts,
    prestart,
    run_request,
)
from jex.tasks.execution.engine_host.protocol import EngineStart
from jex.tasks.execution.engine_job import run_engine_job
from jex.tasks.execution.engine_pool import CALLS, compile_cache_key, get_engine, kernel_settings, model_shape
from jex.tasks.execution.workers import WorkerReport, run_workers

__all__ = ["CALLS", "COMPILE_CACHE", "STARTS", "EngineHostDied", "EngineStart", "HostOptions", "HostPolicy",
           "HostRequest", "WorkerReport", "compile_cache_key", "get_engine", "kernel_settings", "model_shape",
           "parse_starts", "prestart", "run_engine_job", "run_request", "run_workers"]
