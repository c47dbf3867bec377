"""Stage cache keys: what a stage's output depends on, hashed.

key = sha256(stage name, stage version, the stage's typed inputs) where an input artifact enters by
its content hash and an engine by its fingerprint (`jex.engine.fingerprint`). Never the request
alone, and never jex's commit or a library's version (those are provenance, kept beside the
artifacts): changing the model, the tokenizer, the render, an engine setting that changes numbers,
a parameter or the stage version changes exactly the keys downstream of the change.

The inputs are one frozen record per stage (`tasks/inputs.py`); `StageInputs.key()` hashes every
field, so an input cannot be added to a stage without reaching its key. A field that must not
change the key says so with `Unkeyed(why)`; a field that enters the key in another form than its
value (a path by its file's content, an engine spec by its fingerprint) says how with `KeyedBy`, and
one that enters through another field's entry says which with `KeyedThrough`, and an optional one that
enters only when set (the keys of campaigns without it unchanged) with `KeyedWhenSet`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, JsonValue

from jex.fileio import sha256_json

STAGE_VERSIONS = {"bundle": 2, "fast_pass": 3, "gate": 2, "reason": 3, "generate": 1, "fold": 3, "calibrate": 2,
                  "overlay": 2, "score": 3, "report": 1, "spec_proof_sample": 2, "golden": 1, "compile_cache": 3}
"""Bump a stage's version by hand when its code changes what it writes (tests/test_keys_pinned.py)."""


@dataclass(frozen=True)
class Unkeyed:
    """Marks an input field that does not change the stage's output (`why` says why not)."""

    why: str


@dataclass(frozen=True)
class KeyedThrough:
    """Marks an input field that changes the key through another field's entry (`through`)."""

    through: str
    why: str


@dataclass(frozen=True)
class KeyedWhenSet:
    """Marks an optional input field that enters the key as its value only when it is set: the keys of
    the stages that never set it stay what they were before it existed (`why` says what it is)."""

    why: str


@dataclass(frozen=True)
class KeyedBy:
    """Marks an input field that enters the key as `by(inputs)` instead of its value."""

    by: Callable[[Any], Any]
    why: str


def keyed_value(value: Any) -> Any:
    """A value as it enters a key: a stage summary by the sha256 of its main artifact, a record by its
    fields (recursively), anything else as it is."""
    from jex.tasks.records import StageSummary

    if isinstance(value, StageSummary):
        return value.sha256
    if isinstance(value, BaseModel):
        return {k: keyed_value(getattr(value, k)) for k in type(value).model_fields}
    if isinstance(value, list | tuple):
        return [keyed_value(v) for v in value]
    if isinstance(value, dict):
        return {k: keyed_value(v) for k, v in value.items()}
    return value


KeyDoc = dict[str, JsonValue]
"""A stage's inputs as they enter its key (JSON)."""


def stage_key(stage: str, inputs: KeyDoc) -> str:
    """The key of `stage` on the keyed form of its inputs (`StageInputs.key_doc`)."""
    return sha256_json({"stage": stage, "version": STAGE_VERSIONS[stage], "inputs": inputs})[:32]
