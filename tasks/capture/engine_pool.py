"""Engines for the stages: one per spec per process, loaded only when a stage really runs.

A stage's cache key needs the engine's fingerprint, which is computed from the spec and the model
files without loading the model, so a fully cached campaign never loads one.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jex.engine.base import package_version
from jex.engine.render import RenderSpec
from jex.engine.vllm_engine import VLLM_PIN  # noqa: F401 - the worker stack pins it

CALLS: Counter[str] = Counter()
"""Engine calls per stage in this process (tests use it to prove what a retry recomputed)."""
_ENGINES: dict[str, Any] = {}


class EngineSpec(BaseModel):
    """Which engine a stage uses. This is what the campaign form shows under 'engine'."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["hf", "hf-batched", "vllm", "vllm-control"] = Field("hf", description="Engine and profile")
    profile: Literal["audit", "audit-ngram"] = Field("audit", description="audit-ngram: n-gram speculative decoding, "
                                                                          "kept only if proven exact on this run")
    model: str | None = Field(None, description="Model folder or GGUF; empty = the embedded SmolLM2")
    device: str = "cpu"
    batch_size: int = Field(8, ge=0, description="Requests per engine call; 0 (vLLM only): all the stage hands "
                                                 "over (a shard) in one call, scheduled by vLLM")
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16, description="vLLM: tokens per scheduler step; "
                                                                        "empty = vLLM's default")
    dtype: str | None = Field(None, description="Weights dtype; empty = the engine's (hf float32, vllm bfloat16 "
                                                "under the audit profile)")
    gpu_memory_utilization: float = Field(0.30, gt=0, le=0.95, description="vLLM: share of GPU memory")
    kv_cache_memory_gib: float | None = Field(None, gt=0, description="vLLM: KV cache size, fixed instead of "
                                              "profiled; engines with it start together on one GPU")
    max_model_len: int | None = Field(None, ge=16, description="vLLM: context limit; empty = the model's")
    cache_dir: str = Field(str(Path.home() / ".cache" / "jex"), description="Converted-model and Hub cache")
    render: RenderSpec = Field(RenderSpec(), description="Templates, system prompt, chat template, few-shot count")

    @model_validator(mode="after")
    def _profile_fits_kind(self) -> EngineSpec:
        if self.batch_size == 0 and self.kind != "vllm":
            raise ValueError(f"batch_size 0 (one call per shard) is for the audited vLLM engine, whose results do "
                             f"not depend on the batch; {self.kind!r} needs >= 1")
        if self.profile != "audit" and self.kind not in ("hf", "vllm"):
            raise ValueError(f"profile {self.profile!r} needs an audited engine kind (hf or vllm), not {self.kind!r}")
        return self

    def starts_alone(self) -> bool:
        """Whether this engine's start must not overlap another's on the machine: vLLM sizes its KV
        cache by profiling the GPU's free memory, which an engine starting beside it distorts (measured:
        two starting together fail), unless the size is fixed (`kv_cache_memory_gib`)."""
        return self.kind.startswith("vllm") and self.kv_cache_memory_gib is None

    def audited_base(self) -> EngineSpec:
        """The same engine under the plain audit profile (what a speculative profile is proven against)."""
        return self.model_copy(update={"profile": "audit"})

    def loaded_key(self) -> str:
        """Engines are shared by every spec that differs only in what it renders."""
        return self.model_copy(update={"render": RenderSpec()}).model_dump_json()


def engine_fingerprint(spec: EngineSpec) -> dict[str, Any]:
    """The cache-key part of an engine's provenance, without loading the model."""
    from jex.engine.models import resolve_model, weights_sha256

    resolved = resolve_model(spec.model, Path(spec.cache_dir))
    fp: dict[str, Any] = {"kind": spec.kind, "weights_sha256": weights_sha256(resolved.path),
                          "device_type": spec.device.split(":")[0], "renderer": spec.render.digest(),
                          "torch": package_version("torch")}
    if resolved.repo_id:
        fp["hub"] = {"repo": resolved.repo_id, "commit": resolved.commit}
    if spec.dtype:
        fp["dtype"] = spec.dtype
    if spec.profile != "audit":
        fp["profile"] = spec.profile
    if spec.kind.startswith("hf"):
        fp["transformers"] = package_version("transformers")
        if spec.kind == "hf-batched":  # batched numerics depend on the batch shape
            fp["batch_size"] = spec.batch_size
    else:
        fp["vllm"] = package_version("vllm")
        fp["max_num_seqs"] = spec.max_num_seqs
        fp["max_model_len"] = spec.max_model_len
    return fp


def audited_fingerprint(fp: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint of the same engine under the plain audit profile. It also keys every readout
    (fast pass, golden replay) of a speculative profile: speculation changes only generation."""
    return {k: v for k, v in fp.items() if k != "profile"}


def is_loaded(spec: EngineSpec) -> bool:
    """Whether this process already holds the engine `spec` names."""
    return spec.loaded_key() in _ENGINES


def release_engines() -> None:
    """Let go of every engine this process holds (a host that switches engines frees its GPU share)."""
    if not _ENGINES:
        return
    import gc

    _ENGINES.clear()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_engine(spec: EngineSpec) -> Any:
    from jex.engine.factory import make_engine

    key = spec.loaded_key()
    if key not in _ENGINES:
        _ENGINES[key] = make_engine(spec.kind, model=spec.model, device=spec.device, batch_size=spec.batch_size,
                                    cache_dir=Path(spec.cache_dir), max_num_seqs=spec.max_num_seqs,
                                    dtype=spec.dtype, gpu_memory_utilization=spec.gpu_memory_utilization,
                                    max_model_len=spec.max_model_len, profile=spec.profile,
                                    max_num_batched_tokens=spec.max_num_batched_tokens,
                                    kv_cache_memory_gib=spec.kv_cache_memory_gib)
    return _ENGINES[key]


def preload(spec: EngineSpec) -> None:
    """Import the engine's libraries without starting it (`engine.factory.preload`)."""
    from jex.engine.factory import preload as import_engine

    import_engine(spec.kind)
