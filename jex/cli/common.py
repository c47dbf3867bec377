"""What every command group shares: one-line user errors, flags as CampaignSpec fields, and the Prefect
API a flow reports to."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import typer
from pydantic import BaseModel, ValidationError

from jex.engine_spec import closest_name
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


def input_error(err: ValidationError, *, file: Path | str | None = None,
                model: type[BaseModel] | None = None) -> InputError:
    """The first problem of a pydantic validation as an InputError naming the file and the field; an
    unknown field of `model` (or of a record inside it) is told the closest valid name."""
    first = err.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden" and model is not None:
        valid = _valid_names(model, [str(p) for p in first["loc"][:-1]])
        closest = closest_name(str(first["loc"][-1]), valid)
        message = f"unknown field; {'did you mean ' + repr(closest) + '? ' if closest else ''}valid: {', '.join(valid)}"
    return InputError(message, file=str(file) if file else None,
                      field=".".join(str(p) for p in first["loc"]) or None)


def _valid_names(model: type[BaseModel], path: list[str]) -> list[str]:
    """The field names of the record at `path` inside `model` (following nested records)."""
    for name in path:
        field = model.model_fields.get(name)
        inner = field.annotation if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        model = inner
    return sorted(model.model_fields)


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
