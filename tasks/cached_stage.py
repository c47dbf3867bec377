"""One shape for every stage: a key from the stage's inputs, a folder in the store for that key, the
stored summary when the folder is complete, else the stage's body run in the folder and its summary
recorded last.

    GATE = CachedStage("gate", GateSummary, key=gate_key, body=gate_body)
    gated = GATE(store, fast=fast, coverage=0.1)        # -> GateSummary; the body runs at most once

The key function and the body take the same keyword inputs (a key function ignores the ones that do
not change the output, such as progress callbacks). The Prefect wrappers cache on the same key
(`tasks/prefect_tasks.py`, `StoreKey`), so a stage has one key, computed in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from jex.tasks.records import PartialSummary, StageSummary
from jex.tasks.store import LocalStore

S = TypeVar("S", bound=StageSummary)


@dataclass(frozen=True)
class CachedStage(Generic[S]):
    """`key(**inputs)` names the stage folder; `body(folder: StageDir, store, **inputs)` writes the
    stage's files into `folder.path` and returns its summary (key `folder.key`), or a
    `PartialSummary` when other processes finish the stage."""

    name: str
    summary: type[S]
    key: Callable[..., str]
    body: Callable[..., S | PartialSummary]

    def __call__(self, store: LocalStore, **inputs: Any) -> S:
        out = self.run(store, **inputs)
        if isinstance(out, PartialSummary):
            raise TypeError(f"stage {self.name} returned a partial summary; call run() for sharded stages")
        return out

    def run(self, store: LocalStore, **inputs: Any) -> S | PartialSummary:
        """The stored summary, or the body's: a `PartialSummary` when this process computed only some
        of a shared stage's shards (another process merges them)."""
        folder = store.stage(self.name, self.key(**inputs))
        if folder.complete:
            return self.summary.model_validate(folder.summary())
        out = self.body(folder, store, **inputs)
        return out if isinstance(out, PartialSummary) else folder.finish(out)
