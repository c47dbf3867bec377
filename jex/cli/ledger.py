"""`jex ledger`: the store's decision ledger (experiments, overlay gates, campaigns), filtered, with the
reopen conditions that have come true."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.cli.common import fail
from jex.errors import InputError, JexError
from jex.settings import load_settings

KINDS = ("experiment-arm", "overlay-rule", "campaign")


def ledger(store: Annotated[Path | None, typer.Option(help="Artifact store whose ledger.toml to read (default: "
                                                           "JEX_STORE__ROOT/store, as `jex run`)")] = None,
           kind: Annotated[str | None, typer.Option(help="Only this kind: experiment-arm | overlay-rule | "
                                                         "campaign")] = None,
           status: Annotated[str | None, typer.Option(help="Only this status: GO, NO-GO, PASS, FAIL, DONE, "
                                                           "UNVERIFIED")] = None,
           reopened: Annotated[bool, typer.Option("--reopened", help="Only the decisions whose typed reopen "
                                                                    "conditions have come true")] = False) -> None:
    """List the decisions of a store's ledger, then every decision whose reopen condition (`reopen_if`:
    model_params_at_least, coverage_above, other_suite) holds against what the ledger knows."""
    from jex.tasks.decisions import format_decisions, ledger_path, read_decisions
    from jex.tasks.decisions import reopened as reopened_decisions

    path = ledger_path(store if store is not None else Path(load_settings().store.root) / "store")
    try:
        if kind is not None and kind not in KINDS:
            raise InputError(f"--kind: expected one of {list(KINDS)}, got {kind!r}", field="--kind")
        if not path.exists():
            raise InputError("no decision ledger here yet: experiments, overlay gates and campaigns on this store "
                             "write it", file=str(path))
        decisions = read_decisions(path)
    except JexError as e:
        fail(e)
    came_true = reopened_decisions(decisions)
    shown = [d for d in decisions if (kind is None or d.kind == kind)
             and (status is None or d.status.upper() == status.upper())]
    if reopened:
        keep = {id(d) for d, _ in came_true}
        shown = [d for d in shown if id(d) in keep]
    typer.echo(f"{path}: {len(shown)} of {len(decisions)} decision(s)")
    typer.echo(format_decisions(shown))
    shown_ids = {id(d) for d in shown}
    for d, why in came_true:
        if id(d) in shown_ids:
            typer.echo(f"REOPEN {d.kind} {d.subject} ({d.status}, {d.date}): " + "; ".join(why))


def register(app: typer.Typer) -> None:
    app.command("ledger")(ledger)
