"""`jex probe early-exit`: could rationales be cut short? (lab/early_exit.py). Its flags are the fields of
the probe's job (`ProbeJob`): their help and defaults come from the record."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.cli.common import field_default, field_option, print_path, record_from_flags
from jex.cli.run import Provider
from jex.errors import JexError
from jex.lab.early_exit import DEFAULT_KS, DEFAULT_TAUS
from jex.lab.jobs import ProbeJob


def _grid(values: tuple[float, ...]) -> str:
    return " ".join(f"{v:g}" for v in values)


probe_app = typer.Typer(no_args_is_help=True, help="Probes: measurements that decide whether a lever is worth it.")


@probe_app.command("early-exit")
def early_exit(suite: Annotated[Path, field_option(ProbeJob, "suite")],
               out: Annotated[Path, typer.Option("-o", "--out", help="Folder for probe.json, probe.md, probe.png")],
               rows: Annotated[int, field_option(ProbeJob, "rows")] = field_default(ProbeJob, "rows"),
               every: Annotated[int, field_option(ProbeJob, "every")] = field_default(ProbeJob, "every"),
               max_tokens: Annotated[int, field_option(ProbeJob, "max_tokens")] = field_default(ProbeJob, "max_tokens"),
               engine: Annotated[str, typer.Option(help="hf | hf-batched | vllm")] = "hf",
               model: Annotated[str | None, typer.Option(help="Model folder, GGUF or Hub id")] = None,
               device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
               batch_size: Annotated[int, typer.Option(help="Requests per engine call")] = 8,
               tau: Annotated[list[float] | None, field_option(
                   ProbeJob, "taus", more=f"; repeat for a grid [default: {_grid(DEFAULT_TAUS)}]")] = None,
               k: Annotated[list[int] | None, field_option(
                   ProbeJob, "ks", more=f"; repeat for a grid [default: {_grid(DEFAULT_KS)}]")] = None,
               end_of_thought: Annotated[str | None, field_option(ProbeJob, "end_of_thought")] = None,
               seed: Annotated[int, field_option(ProbeJob, "seed")] = field_default(ProbeJob, "seed"),
               provider: Provider = None) -> None:
    """For N gated rows: the free gate's fire rate and, per checkpoint, accuracy, flips and tokens saved."""
    from jex.cli import preflight
    from jex.cli.common import connect_prefect, fail
    from jex.engine_spec import EngineSpec
    from jex.settings import load_settings

    try:  # pre-flight
        preflight.suite(suite)
        preflight.model(model)
        preflight.at_least(batch_size, "--batch-size", 1)
        preflight.writable_dir(out, "--out")
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
        spec = EngineSpec(kind=engine, model=model, device=device, batch_size=batch_size)
        job = record_from_flags(ProbeJob, {"taus": "--tau", "ks": "--k"}, suite=str(suite), rows=rows, every=every,
                                max_tokens=max_tokens, engine=spec, taus=tau, ks=k, end_of_thought=end_of_thought,
                                seed=seed)
        settings = load_settings()
    except JexError as e:
        fail(e)
    connect_prefect(settings)
    from jex.flows.lab import early_exit_probe
    from jex.tasks.campaign_spec import MachinesSpec

    try:
        res = early_exit_probe(job, out=str(out), machines=MachinesSpec(provider=provider) if provider else None)
    except (JexError, ValueError) as e:  # the engine's errors are JexErrors
        fail(e)
    typer.echo(f"full accuracy {res.full_accuracy:.3f}, free gate fired at {100 * res.gate_fire_rate:.2f} % of "
               "checkpoints")
    print_path(out)


def register(app: typer.Typer) -> None:
    app.add_typer(probe_app, name="probe")
