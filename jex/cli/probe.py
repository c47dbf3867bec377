"""`jex probe early-exit`: could rationales be cut short? (tasks/lab/early_exit.py)"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.cli.run import Provider
from jex.errors import JexError

probe_app = typer.Typer(no_args_is_help=True, help="Probes: measurements that decide whether a lever is worth it.")


@probe_app.command("early-exit")
def early_exit(suite: Annotated[Path, typer.Option(help="Suite folder or bundle file")],
               out: Annotated[Path, typer.Option("-o", "--out", help="Folder for probe.json, probe.md, probe.png")],
               rows: Annotated[int, typer.Option(help="Gated rows to probe")] = 200,
               every: Annotated[int, typer.Option(help="A checkpoint every M generated tokens")] = 8,
               max_tokens: Annotated[int, typer.Option(help="Rationale length limit")] = 128,
               engine: Annotated[str, typer.Option(help="hf | hf-batched | vllm")] = "hf",
               model: Annotated[str | None, typer.Option(help="Model folder, GGUF or Hub id")] = None,
               device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
               batch_size: Annotated[int, typer.Option(help="Requests per engine call")] = 8,
               tau: Annotated[list[float] | None, typer.Option(
                   help="Stable-margin exit: margin threshold (log-odds); repeat for a grid [default: 1 2 3]")] = None,
               k: Annotated[list[int] | None, typer.Option(
                   help="Stable-margin exit: consecutive checkpoints above tau; repeat for a grid "
                        "[default: 2 3]")] = None,
               provider: Provider = None) -> None:
    """For N gated rows: the free gate's fire rate and, per checkpoint, accuracy, flips and tokens saved."""
    from jex.cli import preflight
    from jex.cli.common import connect_prefect, fail
    from jex.engine.types import EngineDeadError, EngineError
    from jex.engine_spec import EngineSpec
    from jex.settings import load_settings

    try:  # pre-flight
        preflight.suite(suite)
        preflight.model(model)
        for flag, value in (("--rows", rows), ("--every", every), ("--max-tokens", max_tokens),
                            ("--batch-size", batch_size)):
            preflight.at_least(value, flag, 1)
        for value in k or []:
            preflight.at_least(value, "--k", 1)
        preflight.writable_dir(out, "--out")
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
        spec = EngineSpec(kind=engine, model=model, device=device, batch_size=batch_size)
        settings = load_settings()
    except JexError as e:
        fail(e)
    connect_prefect(settings)
    from jex.flows.fleet import MachinesSpec
    from jex.flows.probe import early_exit_probe

    try:
        res = early_exit_probe(suite=str(suite), rows=rows, every=every, max_tokens=max_tokens, out=str(out),
                               engine=spec, taus=tau, ks=k,
                               machines=MachinesSpec(provider=provider) if provider else None)
    except (JexError, ValueError, EngineError, EngineDeadError) as e:
        fail(e)
    typer.echo(f"full accuracy {res['full_accuracy']:.3f}, free gate fired at {100 * res['gate_fire_rate']:.2f} % of "
               f"checkpoints -> {out}")


def register(app: typer.Typer) -> None:
    app.add_typer(probe_app, name="probe")
