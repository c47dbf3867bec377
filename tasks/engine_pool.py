"""Engines for the stages: one per spec per process, loaded only when a stage really runs.

A stage's cache key needs the engine's fingerprint, which is computed from the spec and the model
files without loading the model, so a fully cached campaign never loads one.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.base import package_version
from engine.render import renderer_fingerprint
from engine.vllm_engine import VLLM_PIN  # noqa: F401 - the worker stack pins it

CALLS: Counter[str] = Counter()
"""Engine calls per stage in this process (tests use it to prove what a retry recomputed)."""
_ENGINES: dict[str, Any] = {}


class EngineSpec(BaseModel):
    """Which engine a stage uses. This is what the campaign form shows under 'engine'."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["hf", "hf-batched", "vllm", "vllm-control"] = Field("hf", description="Engine and profile")
    model: str | None = Field(None, description="Model folder or GGUF; empty = the embedded SmolLM2")
    device: str = "cpu"
    batch_size: int = Field(8, ge=1)
    max_num_seqs: int = Field(32, ge=1)
    cache_dir: str = Field(str(Path.home() / ".cache" / "jex"), description="Converted-model cache")



def fingerprint(spec: EngineSpec) -> dict[str, Any]:
    """The cache-key part of an engine's provenance, without loading the model."""
    from engine.models import resolve_model, weights_sha256

    path = resolve_model(spec.model, Path(spec.cache_dir)) if spec.kind.startswith("hf") else Path(spec.model or "")
    fp: dict[str, Any] = {"kind": spec.kind, "weights_sha256": weights_sha256(path),
                          "device_type": spec.device.split(":")[0], "renderer": renderer_fingerprint(),
                          "torch": package_version("torch")}
    if spec.kind.startswith("hf"):
        fp["transformers"] = package_version("transformers")
        if spec.kind == "hf-batched":  # batched numerics depend on the batch shape
            fp["batch_size"] = spec.batch_size
    else:
        fp["vllm"] = package_version("vllm")
        fp["max_num_seqs"] = spec.max_num_seqs
    return fp


def get_engine(spec: EngineSpec) -> Any:
    from engine.factory import make_engine

    key = spec.model_dump_json()
    if key not in _ENGINES:
        _ENGINES[key] = make_engine(spec.kind, model=spec.model, device=spec.device, batch_size=spec.batch_size,
                                    cache_dir=Path(spec.cache_dir), max_num_seqs=spec.max_num_seqs)
    return _ENGINES[key]
