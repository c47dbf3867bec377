"""Provenance blocks: what produced an artifact, recorded so a re-run is a reproduction.

A block holds the jex version and git commit, Python and package versions, the sha256 of every
input and the settings used. It never holds secrets (callers pass `JexSettings.public_dict()`),
timestamps or host names, so that the same inputs on the same stack give the same bytes.
"""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TypedDict

from pydantic import BaseModel, ConfigDict, Field, JsonValue

import jex

ProvenanceBlock = dict[str, JsonValue]
"""What produced an artifact (JSON): never inside what a cache key hashes."""


class GitState(TypedDict):
    commit: str
    dirty: bool | None

PACKAGES = ("polars", "pyarrow", "numpy", "torch", "transformers", "prefect", "pydantic",
            "vllm", "triton", "gguf", "accelerate")
REPO_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def git_commit() -> GitState:
    """The commit of the jex checkout, and whether tracked files differ from it."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip() != ""
        return {"commit": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


@functools.cache
def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(*, inputs: dict[str, str] | None = None, settings: Mapping[str, JsonValue] | None = None,
               **extra: JsonValue) -> ProvenanceBlock:
    """A provenance block. `inputs` maps an input's name to its sha256; `extra` adds sections."""
    block: ProvenanceBlock = {
        "jex": {"version": jex.__version__, "commit": git_commit()["commit"], "dirty": git_commit()["dirty"]},
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "packages": dict(package_versions()),
        "inputs": dict(sorted((inputs or {}).items())),
        "settings": dict(settings or {}),
    }
    block.update(extra)
    return block


class _Section(BaseModel):
    """A part of a provenance block read back: its other keys kept as they are (sections vary by writer)."""

    model_config = ConfigDict(frozen=True, extra="allow")


class HubRevision(_Section):
    commit: str | None = None


class EngineProvenance(_Section):
    """The engine section a run folder's `provenance.json` holds (the fast pass's engine fingerprint)."""

    weights_sha256: str | None = None
    hub: HubRevision | None = None


class JexProvenance(_Section):
    """The jex that wrote the block: its version and commit, and whether tracked files differed from it."""

    version: str
    commit: str
    dirty: bool | None = None


class AuditProvenance(_Section):
    """The settings audit that covered a run's engine (`MachinesSection.audit`): its status, proven, unproven or
    failed (batch invariance shown, not shown for want of power, or broken)."""

    status: str


class ProvenanceDoc(_Section):
    """A provenance block read back from its file (`provenance.json` of a run folder): the fixed sections
    typed, the `extra` ones a writer added kept as they are."""

    jex: JexProvenance
    python: str
    implementation: str
    packages: dict[str, str | None]
    inputs: dict[str, str]
    settings: dict[str, JsonValue]
    engine: EngineProvenance | None = None
    settings_audit: AuditProvenance | None = Field(None, description="None: no audit covered the run (in-process "
                                                                     "engine stages, or audits off)")


def read_provenance(path: str | Path) -> ProvenanceDoc:
    return ProvenanceDoc.model_validate_json(Path(path).read_bytes())
