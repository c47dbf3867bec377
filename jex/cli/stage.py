"""`jex stage run|golden`: one engine stage, or the golden replay, without Prefect: what a machine runs.

Imported on every machine: nothing here may import `jex.flows` or prefect (the commands import lazily)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from pydantic import BaseModel

from jex.settings import GOLDEN_ROWS

if TYPE_CHECKING:
    from jex.engine_spec import EngineSpec
    from jex.tasks.execution.engine_host import HostOptions
    from jex.tasks.inputs import EngineJob

R = TypeVar("R", bound=BaseModel)

stage_app = typer.Typer(no_args_is_help=True, help="Run one engine stage without Prefect (what a GPU worker runs).")


JobOption = Annotated[Path, typer.Option("--args", help="JSON: an EngineJob (the stage's inputs record: bundle, "
                                                       "engine, shard_rows[, gate, max_tokens]; and the store)")]
HostOptionsOption = Annotated[Path | None, typer.Option(
    "--host-options", help="JSON (a HostOptions record: engine folder, slots, devices, max requests, stall_s, "
                           "...): serve the engine work from this machine's long-lived engine hosts (one per "
                           "slot) instead of loading an engine in this process")]


@stage_app.command("golden")
def stage_golden(args_file: JobOption,
                 rows: Annotated[int, typer.Option(help="Rows from the head of the bundle")] = GOLDEN_ROWS,
                 out: Annotated[Path, typer.Option(help="Readout Parquet")] = Path("golden.parquet"),
                 fingerprint_out: Annotated[Path, typer.Option("--fingerprint")] = Path("fingerprint.json"),
                 generation_rows: Annotated[int, typer.Option(
                     help="Rows whose rationale prompts are decoded greedily (0: none)")] = 0,
                 generation_tokens: Annotated[int, typer.Option(help="New tokens per generated row")] = 32,
                 generation_out: Annotated[Path, typer.Option(help="Generation Parquet")] = Path("generation.parquet"),
                 host_options: HostOptionsOption = None,
                 compile_cache_in: Annotated[Path | None, typer.Option(
                     help="With --host-options: an earlier machine's compile cache, unpacked before the first "
                          "engine start")] = None,
                 compile_cache_out: Annotated[Path | None, typer.Option(
                     help="With --host-options: write this machine's packed compile cache here")] = None,
                 probe: Annotated[Path | None, typer.Option(
                     help="The settings audit's probe (JSON), run first on the same engine")] = None,
                 probe_out: Annotated[Path, typer.Option(help="Where the probe's arms and outcome go")] = Path("audit")
                 ) -> None:
    """Pre-flight golden replay on a machine: read out the bundle's first `rows` rows (0: none), decode the
    first `generation_rows` greedily and record the engine fingerprint; with --host-options on slot 0's
    engine host. With hosts kept up for
    every job (`max_requests` 0), every other slot's engine is started too: beside the replay's when
    engines start together, else right after it."""
    from jex.engine.compile_cache import bring_compile_cache, take_compile_cache
    from jex.tasks.capture.invariance import InvarianceProbe
    from jex.tasks.execution.engine_host import HostRequest, run_request

    options = _host_options(host_options)
    audit = _record(InvarianceProbe, probe, "--probe").model_copy(
        update={"engine_home": options.home if options else None}) if probe else None
    request = HostRequest(job="golden", engine_job=_job(args_file), golden_rows=rows, golden_out=str(out.resolve()),
                          fingerprint_out=str(fingerprint_out.resolve()), generation_rows=generation_rows,
                          generation_tokens=generation_tokens, generation_out=str(generation_out.resolve()),
                          probe=audit, probe_out=str(probe_out.resolve()))
    home = Path(options.home) if options else None
    serving = options if options and options.max_requests == 0 else None  # hosts kept up for every job
    together = not request.engine_job.inputs.engine.starts_alone()
    if home and compile_cache_in:
        bring_compile_cache(home, compile_cache_in)
    if serving and together:
        _prestart(serving, request.engine_job.inputs.engine)
    run_request(request, options.first_slots(1) if options else None)  # the replay: slot 0
    if serving and not together:
        _prestart(serving, request.engine_job.inputs.engine)
    if home and compile_cache_out and take_compile_cache(home, compile_cache_out):
        typer.echo(f"compile cache -> {compile_cache_out}")
    typer.echo(f"golden replay: {rows} rows -> {out}")


@stage_app.command("run")
def stage_run(args_file: JobOption,
              worker: Annotated[int, typer.Option(help="This worker's index")] = 0,
              workers: Annotated[int, typer.Option(help="Number of workers sharing the stage")] = 1,
              host_options: HostOptionsOption = None) -> None:
    """Compute this worker's shards of the job's engine stage into the store (shards w, w+N, ...); with
    several slots, their engine hosts share them, each claiming the next free one."""
    from jex.tasks.execution.engine_host import HostRequest, run_request

    job = _job(args_file)
    request = HostRequest(job=job.inputs.stage, engine_job=job, worker=worker, workers=workers)
    for summary in run_request(request, _host_options(host_options)):
        fields = summary.model_dump()
        typer.echo(json.dumps({k: fields.get(k) for k in ("stage", "key", "rows", "computed_shards", "partial",
                                                           "compute_seconds", "computed_rows")}))


def _job(path: Path) -> EngineJob:
    """The job file (`EngineJob` JSON: the stage's inputs record and the store), paths made absolute."""
    from jex.tasks.inputs import EngineJob

    return _record(EngineJob, path, "--args").resolved(Path.cwd())


def _host_options(path: Path | None) -> HostOptions | None:
    """The job's `--host-options` file, validated, its engine folder made absolute."""
    from jex.tasks.execution.engine_host import HostOptions

    if path is None:
        return None
    options = _record(HostOptions, path, "--host-options")
    return options.model_copy(update={"home": str(Path(options.home).resolve())})


def _record(model: type[R], path: Path, flag: str) -> R:
    """The JSON record of a file given by `flag`: one line naming the file and the first bad field."""
    from pydantic import ValidationError

    from jex.cli import preflight
    from jex.cli.common import input_error

    try:
        return model.model_validate(preflight.json_file(path, flag))
    except ValidationError as e:
        raise input_error(e, file=path, model=model) from None


def _prestart(options: HostOptions, engine: EngineSpec) -> None:
    """Start the engines of slots 1.. (slot 0 runs the golden replay). Only a head start: a host that
    fails to start here is started again by the first job that needs it, which then reports why."""
    from jex.tasks.execution.engine_host import EngineHostDied, HostPolicy, prestart

    try:
        prestart(Path(options.home), engine, range(1, options.slots), options.devices, HostPolicy.of(options))
    except EngineHostDied as e:
        typer.echo(f"{e}; its first job starts it again")


def register(app: typer.Typer) -> None:
    app.add_typer(stage_app, name="stage")
