"""What every command group shares: one-line user errors, flags as CampaignSpec fields, and the Prefect
API a flow reports to."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import typer
from pydantic import ValidationError

from jex.errors import InputError
from jex.settings import JexSettings


def fail(err: Exception) -> NoReturn:
    """Print a user error as one line on stderr and exit 2 (no traceback)."""
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(2)


def connect_prefect(settings: JexSettings) -> None:
    """Before a flow runs in this process: PREFECT_API_URL if set, else `JEX_PREFECT__API_URL`, else
    Prefect's local API (its database made ready). The server's basic-auth secret, if any, goes along."""
    from jex.deployments.server import client_env
    from jex.flows.local_api import ensure_local_api

    if settings.prefect.api_url:
        os.environ.setdefault("PREFECT_API_URL", settings.prefect.api_url)
        for name, value in client_env(settings).items():
            os.environ.setdefault(name, value)
    ensure_local_api()


def input_error(err: ValidationError, *, file: Path | str | None = None) -> InputError:
    """The first problem of a pydantic validation as an InputError naming the file and the field."""
    first = err.errors()[0]
    return InputError(first["msg"].removeprefix("Value error, "), file=str(file) if file else None,
                      field=".".join(str(p) for p in first["loc"]) or None)


def spec_fields(flags: Mapping[str, Any], field_of_flag: Mapping[str, str]) -> dict[str, Any]:
    """The CampaignSpec fields the given flags set, as nested tables (`engine.kind` -> {"engine": {"kind"}});
    a flag not given (None, or an empty repeatable option) sets nothing."""
    fields: dict[str, Any] = {}
    for flag, path in field_of_flag.items():
        value = flags.get(flag)
        if value is None or value == []:
            continue
        *tables, leaf = path.split(".")
        node = fields
        for table in tables:
            node = node.setdefault(table, {})
        node[leaf] = str(value) if isinstance(value, Path) else value
    return fields
