"""Errors a user can act on: each names where the problem is and what to do.

One root, `JexError`, for every error jex raises on purpose: bad input, machines/SSH/S3 (infra),
a campaign that cannot go on (flow) and the orchestrator server. The console entry point prints a
`JexError` as one line, never a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class JexError(Exception):
    """Base class for errors shown to the user without a traceback."""


class InputError(JexError):
    """Bad input, located by file, row (1-based line for JSONL, row index for Parquet, or a tool's
    sample id) and field."""

    def __init__(self, message: str, *, file: str | None = None, row: int | str | None = None,
                 field: str | None = None):
        self.file, self.row, self.field = file, row, field
        where = ", ".join(p for p in (
            f"file {file}" if file else "",
            f"row {row}" if row is not None else "",
            f"field '{field}'" if field else "") if p)
        super().__init__(f"{where}: {message}" if where else message)


class InfraError(JexError):
    """A machine, provider, SSH connection or bucket refused or failed (infra/)."""


class FlowError(JexError):
    """A campaign or another flow cannot go on (flows/)."""


class ServerError(JexError):
    """The orchestrator's Prefect server could not be started, reached or configured (deployments/)."""


class SettingsError(InputError):
    """A `JEX_*` variable or the `.env` file cannot be read as settings (names the variable)."""


_SERVICE_MODULES = {"httpx": ServerError, "httpcore": ServerError, "botocore": InfraError, "boto3": InfraError,
                    "paramiko": InfraError, "s3transfer": InfraError}
"""A library whose exceptions mean a service or machine refused or is down (checked by the class's module)."""
_DATA_MODULES = ("polars", "pyarrow")
"""A library whose exceptions, raised while reading a user's file, mean the file is corrupt."""


def user_error(exc: BaseException) -> JexError | None:
    """`exc` as the JexError a user can act on, or None when it is a bug.

    The last line of defence of the console entry (`jex.cli`): an error of a user's input or
    environment that a room did not turn into a JexError where it was raised (an OSError naming its
    path, undecodable text, a service down, a corrupt Parquet file) still prints as one line.
    """
    import json
    import tomllib

    if isinstance(exc, JexError):
        return exc
    if isinstance(exc, OSError):
        return os_error(exc)
    if isinstance(exc, UnicodeDecodeError):
        return InputError(f"not UTF-8 text (byte {exc.start}: {exc.reason}); expected a text file")
    if isinstance(exc, json.JSONDecodeError):
        return InputError(f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})")
    if isinstance(exc, tomllib.TOMLDecodeError):
        return InputError(f"not valid TOML: {exc}")
    root = type(exc).__module__.split(".")[0]
    if root in _SERVICE_MODULES:
        return _SERVICE_MODULES[root](f"{type(exc).__name__}: {exc}".splitlines()[0])
    if root in _DATA_MODULES:
        return InputError(f"corrupt or unreadable data file ({type(exc).__name__}: {str(exc).splitlines()[0]})"
                          if str(exc) else f"corrupt or unreadable data file ({type(exc).__name__})")
    return None


def os_error(exc: OSError, *, what: str = "") -> JexError:
    """An OSError as one line: the path, what was expected there and the system's reason."""
    path = exc.filename
    expected = {IsADirectoryError: "a file, found a folder", NotADirectoryError: "a folder, found a file",
                FileNotFoundError: "an existing path", PermissionError: "a path jex may read and write",
                FileExistsError: "a path not yet taken"}.get(type(exc))
    reason = exc.strerror or str(exc) or type(exc).__name__
    message = f"{what + ': ' if what else ''}{reason}" + (f"; expected {expected}" if expected else "")
    if path is None:
        return (InfraError if isinstance(exc, ConnectionError | TimeoutError) else InputError)(message)
    return InputError(message, file=str(path))
