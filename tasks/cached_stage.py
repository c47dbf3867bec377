"""One shape for every stage: a key from the stage's inputs record, a folder in the store for that key,
the stored summary when the folder is complete, else the stage's body run in the folder and its
summary recorded last, with the provenance of what computed it beside it.

    gate_stage = CachedStage(GateInputs, GateSummary, body=_gate)
    gated = gate_stage(store, GateInputs(bundle=b, fast=f, coverage=0.1))   # -> GateSummary
    gated = gate_stage(store, bundle=b, fast=f, coverage=0.1)               # the same, fields as keywords

The inputs record (`tasks/inputs.py`) is the one declaration of what the stage takes: its key, the
body's arguments, the Prefect task's parameter (`tasks/prefect_tasks.py`) and a machine's job
(`EngineJob`). The keywords of `run` beyond the record (an engine stage's `share`: which shards this
process computes, and its progress callback) say how to compute, never what: they cannot change the
output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from jex.provenance import provenance
from jex.tasks.inputs import StageInputs
from jex.tasks.records import PartialSummary, StageSummary
from jex.tasks.store import LocalStore, StageDir

S = TypeVar("S", bound=StageSummary)
I = TypeVar("I", bound=StageInputs)  # noqa: E741 - the inputs type, as S is the summary's


@dataclass(frozen=True)
class CachedStage(Generic[I, S]):
    """`inputs.key()` names the stage folder; `body(folder, store, inputs, **how)` writes the stage's
    files into `folder.path` and returns its summary (key `folder.key`), or a `PartialSummary` when
    other processes finish the stage."""

    inputs: type[I]
    summary: type[S]
    body: Callable[..., S | PartialSummary]

    @property
    def name(self) -> str:
        return str(self.inputs.model_fields["stage"].default)

    def __call__(self, store: LocalStore, inputs: I | None = None, /, **fields: Any) -> S:
        out = self.run(store, inputs if inputs is not None else self.inputs(**fields))
        if isinstance(out, PartialSummary):
            raise TypeError(f"stage {self.name} returned a partial summary; call run() for sharded stages")
        return out

    def folder(self, store: LocalStore, inputs: I) -> StageDir:
        return store.stage(self.name, inputs.key())

    def run(self, store: LocalStore, inputs: I, **how: Any) -> S | PartialSummary:
        """The stored summary, or the body's: a `PartialSummary` when this process computed only some
        of a shared stage's shards (another process merges them)."""
        folder = self.folder(store, inputs)
        if folder.complete:
            return folder.read(self.summary)
        out = self.body(folder, store, inputs, **how)
        if isinstance(out, PartialSummary):
            return out
        return folder.finish(out, provenance(stage=self.name, key=folder.key, inputs_keyed=inputs.key_doc()))
