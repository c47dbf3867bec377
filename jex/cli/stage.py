"""`jex stage run|golden`: one engine stage, or the golden replay, without Prefect: what a machine runs.

Imported on every machine: nothing here may import `jex.flows` or prefect (the commands import lazily)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

stage_app = typer.Typer(no_args_is_help=True, help="Run one engine stage without Prefect (what a GPU worker runs).")


EngineHostOption = Annotated[Path | None, typer.Option(
    "--engine-host", help="Serve the engine work from this machine's long-lived engine hosts (one per slot) "
                          "instead of loading an engine in this process")]
HostRequestsOption = Annotated[int, typer.Option(
    "--host-requests", help="With --engine-host: requests a host it starts serves before it exits (0 = any; "
                            "1 = each job loads its own engine)")]


@stage_app.command("golden")
def stage_golden(args_file: Annotated[Path, typer.Option("--args", help="JSON: bundle, engine, store")],
                 rows: Annotated[int, typer.Option(help="Rows from the head of the bundle")] = 64,
                 out: Annotated[Path, typer.Option(help="Readout Parquet")] = Path("golden.parquet"),
                 fingerprint_out: Annotated[Path, typer.Option("--fingerprint")] = Path("fingerprint.json"),
                 engine_host: EngineHostOption = None, host_requests: HostRequestsOption = 0,
                 compile_cache_in: Annotated[Path | None, typer.Option(
                     help="With --engine-host: an earlier machine's compile cache, unpacked before the first "
                          "engine start")] = None,
                 compile_cache_out: Annotated[Path | None, typer.Option(
                     help="With --engine-host: write this machine's packed compile cache here")] = None,
                 devices: Annotated[str | None, typer.Option(help="With --engine-host: CUDA_VISIBLE_DEVICES of "
                                                                 "the engine host")] = None) -> None:
    """Pre-flight golden replay on a machine: read out the bundle's first rows; record the engine fingerprint."""
    from jex.tasks.capture.engine_host import (
        HostRequest,
        absolute_args,
        bring_compile_cache,
        run_request,
        take_compile_cache,
    )

    request = HostRequest(job="golden", args=absolute_args(json.loads(args_file.read_text()), Path.cwd()),
                          golden_rows=rows, golden_out=str(out.resolve()),
                          fingerprint_out=str(fingerprint_out.resolve()))
    if engine_host and compile_cache_in:
        bring_compile_cache(engine_host.resolve(), compile_cache_in)
    run_request(request, engine_host, max_requests=host_requests, devices=devices.split(",") if devices else None)
    if engine_host and compile_cache_out and take_compile_cache(engine_host.resolve(), compile_cache_out):
        typer.echo(f"compile cache -> {compile_cache_out}")
    typer.echo(f"golden replay: {rows} rows -> {out}")


@stage_app.command("run")
def stage_run(stage: Annotated[str, typer.Argument(help="fast_pass | reason")],
              args_file: Annotated[Path, typer.Option("--args", help="JSON: bundle, engine, store, shard_rows[, gate, "
                                                                      "max_tokens]")],
              worker: Annotated[int, typer.Option(help="This worker's index")] = 0,
              workers: Annotated[int, typer.Option(help="Number of workers sharing the stage")] = 1,
              engine_host: EngineHostOption = None, host_requests: HostRequestsOption = 0,
              slots: Annotated[int, typer.Option(help="With --engine-host: engine hosts sharing this worker's "
                                                      "shards, each claiming the next free one")] = 1,
              devices: Annotated[str | None, typer.Option(help="With --engine-host: CUDA_VISIBLE_DEVICES of each "
                                                              "slot, comma-separated")] = None) -> None:
    """Compute this worker's shards of an engine stage into the store (shards w, w+N, ...)."""
    from jex.tasks.capture.engine_host import HostRequest, absolute_args, run_request

    if stage not in ("fast_pass", "reason"):
        raise typer.BadParameter(f"unknown engine stage {stage!r}; expected fast_pass or reason")
    request = HostRequest(job=stage, args=absolute_args(json.loads(args_file.read_text()), Path.cwd()),
                          worker=worker, workers=workers)
    for summary in run_request(request, engine_host, slots=slots, devices=devices.split(",") if devices else None,
                               max_requests=host_requests):
        fields = summary.model_dump()
        typer.echo(json.dumps({k: fields.get(k) for k in ("stage", "key", "rows", "computed_shards", "partial",
                                                           "compute_seconds", "computed_rows")}))


def register(app: typer.Typer) -> None:
    app.add_typer(stage_app, name="stage")
