"""`jex bakeoff` and `jex parity`: engines measured against each other."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.cli import preflight
from jex.cli.common import connect_prefect, fail
from jex.cli.run import Provider
from jex.engine.types import EngineDeadError, EngineError
from jex.errors import InputError, JexError
from jex.settings import load_settings


def bakeoff(out: Annotated[Path, typer.Option("-o", "--out", help="Folder for bakeoff.json/.md/.png")],
            arms: Annotated[str, typer.Option(help="Comma-separated arms (hf-bi, hf-bi-ngram, hf-control, vllm-bi, "
                                                   "vllm-bi-ngram, "
                                                   "vllm-bi-fdo, vllm-control)")] = "hf-control,hf-bi",
            model: Annotated[str | None, typer.Option(help="Model folder (default: embedded)")] = None,
            prompts: int = 32, tokens: int = 256, ladder: str = "1,8,16,32", repeats: int = 2,
            max_num_seqs: int = 32, device: str = "cpu", provider: Provider = None) -> None:
    """Batch-invariance bake-off: the ladder for an invariant arm and a control arm, each in its own process."""
    from jex.tasks.lab.bakeoff import ARMS

    chosen = [a.strip() for a in arms.split(",") if a.strip()]
    try:
        unknown = [a for a in chosen if a not in ARMS]
        if unknown or not chosen:
            raise InputError(f"--arms: unknown arm {unknown[0] if unknown else arms!r}; expected some of "
                             f"{', '.join(ARMS)}")
        rungs = preflight.int_list(ladder, "--ladder")
        for flag, value in (("--prompts", prompts), ("--tokens", tokens), ("--repeats", repeats),
                            ("--max-num-seqs", max_num_seqs)):
            preflight.at_least(value, flag, 1)
        preflight.model(model)
        preflight.writable_dir(out, "--out")
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
    except JexError as e:
        fail(e)
    connect_prefect(load_settings())
    from jex.flows.experiments import bakeoff as bakeoff_flow
    from jex.flows.fleet import MachinesSpec

    try:
        res = bakeoff_flow(arms=chosen, model=model, prompts=prompts, tokens=tokens, ladder=rungs, repeats=repeats,
                           max_num_seqs=max_num_seqs, device=device, out=str(out),
                           machines=MachinesSpec(provider=provider) if provider else None)
    except JexError as e:
        fail(e)
    typer.echo(res["verdict"])
    if res["errors"]:
        fail(JexError(f"arms failed: {res['errors']}"))


def parity(suite: Annotated[Path, typer.Option(help="Suite folder")],
           out: Annotated[Path, typer.Option("-o", "--out", help="Folder for parity.json and parity.md")],
           engine_a: Annotated[str, typer.Option(help="hf | hf-batched | vllm | vllm-control")] = "hf",
           engine_b: Annotated[str, typer.Option(help="hf | hf-batched | vllm | vllm-control")] = "hf-batched",
           model: Annotated[str | None, typer.Option(help="Model folder (default: embedded)")] = None,
           rows: Annotated[int, typer.Option(help="Rows to read (0 = all)")] = 0,
           reason_rows: Annotated[int, typer.Option(help="Rows for generation parity")] = 0,
           max_tokens: int = 96, device: str = "cpu", batch_size: int = 8,
           reference: Annotated[Path | None, typer.Option(help="Stored capture (capture.parquet or reference "
                                                          "rows): engine A against it, no engine B, in this "
                                                          "process")] = None,
           provider: Provider = None) -> None:
    """Parity of two engines on the same rows: readout agreement, |dp|, flips; choices after a rationale."""
    try:
        preflight.suite(suite)
        preflight.model(model)
        preflight.choice(engine_a, "--engine-a", preflight.ENGINE_KINDS)
        preflight.choice(engine_b, "--engine-b", preflight.ENGINE_KINDS)
        for flag, value in (("--rows", rows), ("--reason-rows", reason_rows)):
            preflight.at_least(value, flag, 0)
        for flag, value in (("--max-tokens", max_tokens), ("--batch-size", batch_size)):
            preflight.at_least(value, flag, 1)
        if reference is not None:
            preflight.existing_file(reference, "--reference")
        preflight.writable_dir(out, "--out")
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
    except JexError as e:
        fail(e)
    if reference is not None:
        from jex.tasks.lab.parity import capture_parity_files

        try:
            readout = capture_parity_files(suite, reference, out, kind=engine_a, model=model, device=device,
                                           batch_size=batch_size, rows=rows)["readout"]
        except (JexError, ValueError, EngineError, EngineDeadError) as e:
            fail(e)
        typer.echo(f"argmax agreement {readout['agree']}/{readout['common']}, max |dp| {readout['max_abs_dp']:.3g} "
                   f"-> {out}")
        return
    connect_prefect(load_settings())
    from jex.flows.experiments import parity as parity_flow
    from jex.flows.fleet import MachinesSpec

    try:
        r = parity_flow(suite=str(suite), engine_a=engine_a, engine_b=engine_b, model=model, rows=rows,
                        reason_rows=reason_rows, max_tokens=max_tokens, device=device, batch_size=batch_size,
                        out=str(out), machines=MachinesSpec(provider=provider) if provider else None)
    except (JexError, ValueError, EngineError, EngineDeadError) as e:
        fail(e)
    typer.echo(f"argmax agreement {r['agree']}/{r['common']}, max |dp| {r['max_abs_dp']:.3g} -> {out}")


def register(app: typer.Typer) -> None:
    app.command("bakeoff")(bakeoff)
    app.command("parity")(parity)
