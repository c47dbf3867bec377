"""The one base of every typed record that crosses a boundary (stage inputs and summaries, documents,
job messages, the worker protocol's files): frozen, refusing unknown fields."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


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
