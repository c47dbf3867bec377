"""What every command group shares: one-line user errors, flags as the fields of a record (a CampaignSpec,
a lab job), and the Prefect API a flow reports to."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, NoReturn, TypeVar, Union, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from jex.engine_spec import closest_name
from jex.errors import InputError, JexError, ServerError, user_error
from jex.settings import JexSettings

R = TypeVar("R", bound=BaseModel)


def fail(err: Exception) -> NoReturn:
    """Print a user error as one line on stderr and exit 1 (no traceback; typer's usage errors exit 2)."""
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(1)


def print_path(path: Path | str) -> None:
    """The last line of a command that wrote a report, file or folder: its absolute path, as `jex run` ends
    with its run folder (so `$(jex ... | tail -1)` is the output wherever the command ran)."""
    typer.echo(os.path.abspath(path))


def boundary_error(exc: BaseException) -> JexError | None:
    """The CLI's one error boundary: `exc` as a one-line JexError, or None when it is a bug. Beyond
    `jex.errors.user_error`: invalid parameters (pydantic)."""
    if isinstance(exc, ValidationError):
        return input_error(exc)
    return user_error(exc)


class _UserErrorOnConsole(logging.Filter):
    """On the console only: a flow or task run's record of a user's error (its traceback) is dropped;
    the run's own log (Prefect's API handler) keeps it, and jex prints the error as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or boundary_error(exc) is None


def quiet_user_errors_in_flows() -> None:
    """Install `_UserErrorOnConsole` on Prefect's console handlers (after its logging is set up)."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _UserErrorOnConsole) for f in handler.filters):
            handler.addFilter(_UserErrorOnConsole())
            # the handler keeps the stderr of the moment logging was set up; a command run in-process (a
            # test's CliRunner) swaps stderr and closes it after, so write to whatever stderr is now
            handler.console.file = _CurrentStderr()  # type: ignore[assignment]


class _CurrentStderr:
    """`sys.stderr` as it is at each write (not as it was when Prefect's console handler was made)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stderr, name)


TEMPORARY_API_NOTICE = ("no Prefect server configured: using a temporary one (this run will not appear in a "
                        "UI); `jex server start` or set PREFECT_API_URL")
"""What a command that runs a flow says first, on stderr, when its runs go to Prefect's temporary API."""


def connect_prefect(settings: JexSettings, *, notice: bool = True, ahead: bool = False) -> bool:
    """Before a flow runs in this process: PREFECT_API_URL if set, else `JEX_PREFECT__API_URL`, else the
    running `jex server` (its state file, if it answers), else Prefect's temporary local API (its database
    made ready; `TEMPORARY_API_NOTICE` on stderr unless not `notice`). The server's basic-auth secret, if
    any, goes along. Returns whether flows will use the temporary API (`ahead`: the caller starts it next,
    `jex.flows.local_api.start_temporary_api`)."""
    from jex.deployments.server import client_env, running_api_url
    from jex.flows.local_api import ensure_local_api

    url = settings.prefect.api_url
    if not url and not os.environ.get("PREFECT_API_URL"):
        url = running_api_url(settings)  # a running `jex server`: no temporary server to start
    if url:
        os.environ.setdefault("PREFECT_API_URL", url)
        for name, value in client_env(settings).items():
            os.environ.setdefault(name, value)
    if os.environ.get("PREFECT_API_URL"):
        check_api_answers(os.environ["PREFECT_API_URL"])
    temporary = ensure_local_api(ahead=ahead)
    if temporary and notice:
        typer.echo(TEMPORARY_API_NOTICE, err=True)
    quiet_user_errors_in_flows()
    return temporary


def check_api_answers(url: str, timeout_s: float = 10.0) -> None:
    """A configured Prefect API answers (any HTTP reply will do); else one ServerError line naming it."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.TransportError as e:
        raise ServerError(f"the Prefect API at {url} does not answer ({type(e).__name__}): start it (`jex server "
                          f"start`) or point PREFECT_API_URL / JEX_PREFECT__API_URL at one that runs") from None


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


def field_option(record: type[BaseModel], name: str, *decls: str, more: str = "") -> Any:
    """The typer option of the flag that sets `record`'s field `name`: its help is the field's description
    (what the Prefect form shows), then `more`, what only the flag needs (how to write a list)."""
    return typer.Option(*decls, help=f"{record.model_fields[name].description}{more}")


BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
"""A pydantic field's range constraints, as a flag's check says them."""
F = TypeVar("F", bound=Callable[..., Any])


def field_flag_type(field: FieldInfo) -> tuple[type, tuple[str, ...]]:
    """The type of the flag that sets `field` (its annotation less None; a Literal is a str) and its choices."""
    arms: list[Any] = [a for a in get_args(field.annotation) if a is not type(None)] \
        if get_origin(field.annotation) in (Union, UnionType) else [field.annotation]
    if len(arms) == 1 and get_origin(arms[0]) is Literal:
        return str, tuple(get_args(arms[0]))
    flag_types: list[type] = [int, float, str, bool]
    flag_type = next((t for t in flag_types if len(arms) == 1 and arms[0] is t), None)
    if flag_type is None:
        raise TypeError(f"no flag type for a field of type {field.annotation}")
    return flag_type, ()


def field_flags(fields: Mapping[str, tuple[FieldInfo, str]], *, defaults: bool = False,
                before: str | None = None) -> Callable[[F], F]:
    """A command with one more option per field, generated from the field (as vLLM builds its command line
    from its config classes): `fields` maps the flag's name (`max_num_seqs` -> `--max-num-seqs`) to the
    field and the flag's help. Each option's type is the field's (`field_flag_type`); its default None (a
    flag left out changes nothing), or with `defaults` the field's. They come before the command's own
    option `before` (else last); the command receives them as keywords (`**flags`) and checks them against
    the field's constraints (`check_field_flags`)."""
    def wrap(command: F) -> F:
        sig = inspect.signature(command, eval_str=True)  # its own options as typer reads them
        own = [p.replace(kind=p.KEYWORD_ONLY) for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        made = []
        for flag, (field, text) in fields.items():
            kind = field_flag_type(field)[0]
            default = field.get_default(call_default_factory=True) if defaults else None
            made.append(inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[
                kind if default is not None else kind | None, typer.Option(help=text)]))
        at = [p.name for p in own].index(before) if before else len(own)
        params = [*own[:at], *made, *own[at:]]

        @functools.wraps(command)
        def generated(*args: Any, **kwargs: Any) -> Any:
            return command(*args, **kwargs)

        generated.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        generated.__annotations__ = {**{p.name: p.annotation for p in params}, "return": sig.return_annotation}
        return generated  # type: ignore[return-value]
    return wrap


def check_field_flags(given: Mapping[str, Any], fields: Mapping[str, FieldInfo]) -> None:
    """Pre-flight of the generated flags given: each within its field's range (ge, gt, le, lt) and choices."""
    for flag, field in fields.items():
        value, name = given.get(flag), "--" + flag.replace("_", "-")
        if value is None:
            continue
        choices = field_flag_type(field)[1]
        if choices and value not in choices:
            raise InputError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
        for bound in field.metadata:
            for key, says in BOUNDS.items():
                limit = getattr(bound, key, None)
                if limit is not None and not {"ge": value >= limit, "gt": value > limit, "le": value <= limit,
                                              "lt": value < limit}[key]:
                    raise InputError(f"{name}: expected a number {says} {limit:g}, got {value:g}")


def field_default(record: type[BaseModel], name: str) -> Any:
    """The default of `record`'s field `name`: the default of the flag that sets it, declared once."""
    return record.model_fields[name].get_default(call_default_factory=True)


def record_from_flags(record: type[R], renamed: Mapping[str, str] | None = None, **fields: Any) -> R:
    """`record(**fields)`, built from a command's flags; a value it refuses is an InputError naming the flag
    that set it (`--` and the field's name, dashed, unless `renamed` maps the field to its flag)."""
    try:
        return record(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        name = str(first["loc"][0])
        flag = (renamed or {}).get(name, "--" + name.replace("_", "-"))
        raise InputError(f"{flag}: {first['msg'].removeprefix('Value error, ')}, got {first['input']!r}") from None
