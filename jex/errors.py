"""Errors a user can act on: each names where the problem is and what to do."""

from __future__ import annotations


class JexError(Exception):
    """Base class for errors shown to the user without a traceback."""


class InputError(JexError):
    """Bad input, located by file, row (1-based line for JSONL, row index for Parquet) and field."""

    def __init__(self, message: str, *, file: str | None = None, row: int | None = None,
                 field: str | None = None):
        self.file, self.row, self.field = file, row, field
        where = ", ".join(p for p in (
            f"file {file}" if file else "",
            f"row {row}" if row is not None else "",
            f"field '{field}'" if field else "") if p)
        super().__init__(f"{where}: {message}" if where else message)
