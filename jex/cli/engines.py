"""`jex bakeoff` and `jex parity`: engines measured against each other. Each command's flags are the
fields of its lab job (`BakeoffJob`, `ParityJob`): their help and defaults come from the record."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from jex.cli import preflight
from jex.cli.common import (
    connect_prefect,
    fail,
    field_default,
    field_flags,
    field_option,
    print_path,
    record_from_flags,
)
from jex.cli.run import Provider
from jex.errors import InputError, JexError
from jex.lab.bakeoff import ARMS
from jex.lab.jobs import BakeoffJob, ParityJob
from jex.settings import load_settings

BAKEOFF_FLAGS = ("model", "prompts", "tokens", "repeats", "reference_prompts", "max_num_seqs", "device")
"""The flags of `jex bakeoff` generated from `BakeoffJob`'s fields (the lists, `--arms` and `--ladder`, are
written comma-separated)."""


@field_flags({flag: (BakeoffJob.model_fields[flag], BakeoffJob.model_fields[flag].description or "")
              for flag in BAKEOFF_FLAGS}, defaults=True, before="ladder")
def bakeoff(out: Annotated[Path, typer.Option("-o", "--out", help="Folder for bakeoff.json/.md/.png")],
            arms: Annotated[str, field_option(BakeoffJob, "arms", more=f"; comma-separated: {', '.join(ARMS)}")]
            = ",".join(field_default(BakeoffJob, "arms")),
            ladder: Annotated[str, field_option(BakeoffJob, "ladder", more="; comma-separated")]
            = ",".join(map(str, field_default(BakeoffJob, "ladder"))),
            provider: Provider = None, **flags: Any) -> None:
    """Batch-invariance bake-off: the ladder for an invariant arm and a control arm, each in its own process."""
    chosen = [a.strip() for a in arms.split(",") if a.strip()]
    try:
        unknown = [a for a in chosen if a not in ARMS]
        if unknown or not chosen:
            raise InputError(f"--arms: unknown arm {unknown[0] if unknown else arms!r}; expected some of "
                             f"{', '.join(ARMS)}")
        job = record_from_flags(BakeoffJob, arms=chosen, ladder=preflight.int_list(ladder, "--ladder"), **flags)
        preflight.model(job.model)
        preflight.writable_dir(out, "--out")
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
    except JexError as e:
        fail(e)
    connect_prefect(load_settings())
    from jex.flows.lab import bakeoff as bakeoff_flow
    from jex.tasks.campaign_spec import MachinesSpec

    try:
        res = bakeoff_flow(job, out=str(out), machines=MachinesSpec(provider=provider) if provider else None)
    except JexError as e:
        fail(e)
    typer.echo(res.verdict)
    print_path(out)
    if res.errors:
        fail(JexError(f"arms failed: {res.errors}"))


def parity(suite: Annotated[Path, field_option(ParityJob, "suite")],
           out: Annotated[Path, typer.Option("-o", "--out", help="Folder for parity.json and parity.md")],
           engine_a: Annotated[str, field_option(ParityJob, "engine_a")] = field_default(ParityJob, "engine_a"),
           engine_b: Annotated[str, field_option(ParityJob, "engine_b")] = field_default(ParityJob, "engine_b"),
           model: Annotated[str | None, field_option(ParityJob, "model")] = field_default(ParityJob, "model"),
           rows: Annotated[int, field_option(ParityJob, "rows")] = field_default(ParityJob, "rows"),
           reason_rows: Annotated[int, field_option(ParityJob, "reason_rows")]
           = field_default(ParityJob, "reason_rows"),
           max_tokens: Annotated[int, field_option(ParityJob, "max_tokens")] = field_default(ParityJob, "max_tokens"),
           device: Annotated[str, field_option(ParityJob, "device")] = field_default(ParityJob, "device"),
           batch_size: Annotated[int, field_option(ParityJob, "batch_size")] = field_default(ParityJob, "batch_size"),
           reference: Annotated[Path | None, typer.Option(help="A finished run folder (its readouts and, with "
                                                          "--reason-rows, its post-rationale answers) or a stored "
                                                          "capture (capture.parquet or reference rows): engine A "
                                                          "against it, no engine B, in this process")] = None,
           provider: Provider = None) -> None:
    """Parity of two engines on the same rows: readout agreement, |dp|, flips; choices after a rationale."""
    try:
        preflight.suite(suite)
        preflight.model(model)
        preflight.choice(engine_a, "--engine-a", preflight.ENGINE_KINDS)
        preflight.choice(engine_b, "--engine-b", preflight.ENGINE_KINDS)
        job = record_from_flags(ParityJob, suite=str(suite), engine_a=engine_a, engine_b=engine_b, model=model,
                                rows=rows, reason_rows=reason_rows, max_tokens=max_tokens, device=device,
                                batch_size=batch_size)
        if reference is not None and not reference.is_dir():
            preflight.existing_file(reference, "--reference")
        preflight.writable_dir(out, "--out")
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
    except JexError as e:
        fail(e)
    if reference is not None:
        from jex.lab.parity import capture_parity_files, run_parity_files

        try:
            res = run_parity_files(suite, reference, out, kind=engine_a, model=model, device=device,
                                   batch_size=batch_size, rows=rows, reason_rows=reason_rows) if reference.is_dir() \
                else capture_parity_files(suite, reference, out, kind=engine_a, model=model, device=device,
                                          batch_size=batch_size, rows=rows)
        except (JexError, ValueError) as e:  # the engine's errors are JexErrors
            fail(e)
        readout = res["readout"]
        after = res.get("reasoned")
        typer.echo(f"argmax agreement {readout['agree']}/{readout['common']}, max |dp| {readout['max_abs_dp']:.3g}"
                   + (f"; after the rationale {len(after['mismatches'])} of {after['rows']} choices differ, "
                      f"{after['identical_rationales']} rationales identical" if after else ""))
        print_path(out)
        return
    connect_prefect(load_settings())
    from jex.flows.lab import parity as parity_flow
    from jex.tasks.campaign_spec import MachinesSpec

    try:
        r = parity_flow(job, out=str(out), machines=MachinesSpec(provider=provider) if provider else None)
    except (JexError, ValueError) as e:  # the engine's errors are JexErrors
        fail(e)
    typer.echo(f"argmax agreement {r.agree}/{r.common}, max |dp| {r.max_abs_dp or 0:.3g}")
    print_path(out)


def register(app: typer.Typer) -> None:
    app.command("bakeoff")(bakeoff)
    app.command("parity")(parity)
