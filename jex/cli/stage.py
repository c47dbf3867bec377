"""`jex stage run|golden`: one engine stage, or the golden replay, without Prefect: what a machine runs.

Imported on every machine: nothing here may import `jex.flows` or prefect (the commands import lazily)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from jex.tasks.capture.engine_host import HostPolicy
    from jex.tasks.capture.engine_pool import EngineSpec

stage_app = typer.Typer(no_args_is_help=True, help="Run one engine stage without Prefect (what a GPU worker runs).")


EngineHostOption = Annotated[Path | None, typer.Option(
    "--engine-host", help="Serve the engine work from this machine's long-lived engine hosts (one per slot) "
                          "instead of loading an engine in this process")]
HostRequestsOption = Annotated[int, typer.Option(
    "--host-requests", help="With --engine-host: requests a host it starts serves before it exits (0 = any; "
                            "1 = each job loads its own engine)")]
StallOption = Annotated[float | None, typer.Option(
    "--stall-s", help="With --engine-host: seconds a host may go without finishing a shard before this job "
                      "stops it and starts a new one (default: 600)")]
SlotsOption = Annotated[int, typer.Option(help="With --engine-host: the machine's engine slots")]
DevicesOption = Annotated[str | None, typer.Option(help="With --engine-host: CUDA_VISIBLE_DEVICES of each slot, "
                                                        "comma-separated")]


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
                 slots: SlotsOption = 1, devices: DevicesOption = None,
                 stall_s: StallOption = None) -> None:
    """Pre-flight golden replay on a machine: read out the bundle's first rows; record the engine
    fingerprint. With engine hosts, every slot's engine is started too: beside the replay's when
    engines start together, else right after it."""
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
    slot_devices = devices.split(",") if devices else None
    home = engine_host.resolve() if engine_host and host_requests == 0 else None
    together = not request.args.engine.starts_alone()
    if engine_host and compile_cache_in:
        bring_compile_cache(engine_host.resolve(), compile_cache_in)
    if home and together:
        _prestart(home, request.args.engine, slots, slot_devices)
    run_request(request, engine_host, devices=slot_devices[:1] if slot_devices else None,
                policy=_policy(host_requests, stall_s))
    if home and not together:
        _prestart(home, request.args.engine, slots, slot_devices)
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
              slots: SlotsOption = 1, devices: DevicesOption = None, stall_s: StallOption = None) -> None:
    """Compute this worker's shards of an engine stage into the store (shards w, w+N, ...); with
    several slots, their engine hosts share them, each claiming the next free one."""
    from jex.tasks.capture.engine_host import HostRequest, absolute_args, run_request

    if stage not in ("fast_pass", "reason"):
        raise typer.BadParameter(f"unknown engine stage {stage!r}; expected fast_pass or reason")
    request = HostRequest(job=stage, args=absolute_args(json.loads(args_file.read_text()), Path.cwd()),
                          worker=worker, workers=workers)
    for summary in run_request(request, engine_host, slots=slots, devices=devices.split(",") if devices else None,
                               policy=_policy(host_requests, stall_s)):
        fields = summary.model_dump()
        typer.echo(json.dumps({k: fields.get(k) for k in ("stage", "key", "rows", "computed_shards", "partial",
                                                           "compute_seconds", "computed_rows")}))


def _prestart(home: Path, engine: EngineSpec, slots: int, devices: list[str] | None) -> None:
    """Start the engines of slots 1.. (slot 0 runs the golden replay). Only a head start: a host that
    fails to start here is started again by the first job that needs it, which then reports why."""
    from jex.tasks.capture.engine_host import EngineHostDied, prestart

    try:
        prestart(home, engine, range(1, slots), devices)
    except EngineHostDied as e:
        typer.echo(f"{e}; its first job starts it again")


def _policy(host_requests: int, stall_s: float | None) -> HostPolicy:
    from jex.tasks.capture.engine_host import HostPolicy

    return HostPolicy(max_requests=host_requests, **({"stall_s": stall_s} if stall_s is not None else {}))


def register(app: typer.Typer) -> None:
    app.add_typer(stage_app, name="stage")
