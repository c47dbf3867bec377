"""The one base of every typed record that crosses a boundary (stage inputs and summaries, documents,
job messages, the worker protocol's files): frozen, refusing unknown fields."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, ValidationError, model_serializer

from jex.errors import InputError
from jex.fileio import write_json


class Record(BaseModel):
    """A frozen record that refuses unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    omit_if_none: ClassVar[frozenset[str]] = frozenset()
    """Fields left out of the dump while None (their key was absent from the JSON before)."""

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        doc: dict[str, object] = handler(self)
        for name in self.omit_if_none:
            if doc.get(name, False) is None:
                del doc[name]
        return doc


R = TypeVar("R", bound=BaseModel)


def read_record(kind: type[R], path: str | Path) -> R:
    """A JSON file the project wrote, read back through its record (`model_validate_json`): a missing,
    renamed or unknown key is an `InputError` naming the file and the record, never a wrong reading."""
    try:
        return kind.model_validate_json(Path(path).read_bytes())
    except ValidationError as e:
        raise InputError(f"not a valid {kind.__name__} ({e.error_count()} error(s)):\n{e}", file=str(path)) from None


def write_record(path: str | Path, record: BaseModel) -> str:
    """Write a record atomically as canonical JSON (`write_json`: sorted keys); returns the sha256 of the bytes."""
    return write_json(path, record.model_dump(mode="json", fallback=str))
