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
