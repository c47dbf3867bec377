"""Engines from the one engine spec: `make_engine(spec)` for every kind (`jex.engine_spec.EngineKind`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from jex.engine.base import TokenizedEngine
from jex.engine_spec import ENGINE_KINDS, EngineKind, EngineSpec, VLLMSettings

if TYPE_CHECKING:
    from jex.engine.vllm_engine import VLLMProfile

SHAPE_LINKS = "served"
"""Under the engine cache folder: the links vLLM is given models through, one per architecture shape
(`engine/shape_link.py`)."""


def make_engine(spec: EngineSpec, **engine_options: Any) -> TokenizedEngine:
    """The engine `spec` names, started. `dtype`, the memory settings and `max_model_len` reach vLLM's
    profile (which refuses what the audit does not allow), `dtype` also the HF engine. A speculative
    profile (`audit-ngram`) must be proven exact on each run (tasks/capture/spec_proof.py).
    `engine_options` reach the engine class as they are (tests, e.g. the HF engine's `stop_check`)."""
    from jex.engine.vllm_engine import SPECULATIVE_PROFILES

    speculative = SPECULATIVE_PROFILES.get(spec.profile)
    if spec.kind == "openai":
        from jex.engine.openai_engine import OpenAIEngine

        return OpenAIEngine(spec, **engine_options)
    if spec.kind in ("hf", "hf-batched"):
        from jex.engine.hf import HFEngine

        return HFEngine(spec.model, device=spec.device, batch_size=spec.requests_per_call(),
                        batch_invariant=spec.kind == "hf", cache_dir=Path(spec.cache_dir),
                        dtype=spec.dtype or "float32", speculative=speculative, **engine_options)
    from jex.engine.models import HUB_ID, resolve_hub
    from jex.engine.vllm_engine import VLLMEngine

    model = spec.model
    if model is None:
        raise ValueError("the vLLM engine needs --model: a dequantised bf16 model folder or a Hub id")
    if not Path(model).exists() and HUB_ID.match(model):
        model = str(resolve_hub(model).path)
    return VLLMEngine(model, vllm_profile(spec), batch_size=spec.requests_per_call(),
                      shape_links=Path(spec.cache_dir) / SHAPE_LINKS, **engine_options)


def vllm_profile(spec: EngineSpec) -> VLLMProfile:
    """The vLLM settings a vLLM-kind spec names (checked by the profile when the engine starts)."""
    from jex.engine.vllm_engine import SPECULATIVE_PROFILES, VLLMProfile

    speculative = SPECULATIVE_PROFILES.get(spec.profile)
    # three keyword sets, each given only when it applies (a name given twice is still an error)
    by_dtype: dict[str, Any] = {"dtype": spec.dtype} if spec.dtype else {}
    by_profile: dict[str, Any] = {"name": spec.profile, "speculative_config": speculative} if speculative else {}
    by_kind: dict[str, Any] = {"name": "control", "batch_invariant": False} if spec.kind == "vllm-control" else {}
    return VLLMProfile(settings=spec.vllm, **by_dtype, **by_profile, **by_kind)


def vllm_args(knobs: VLLMSettings) -> dict[str, Any]:
    """vLLM's `LLM(...)` arguments of the vLLM knobs, one line each (an empty knob is left out: vLLM's own)."""
    args: dict[str, Any] = {
        "max_num_seqs": knobs.scheduler_seqs(),
        "max_num_batched_tokens": knobs.max_num_batched_tokens,
        "gpu_memory_utilization": knobs.gpu_memory_utilization,
        "kv_cache_memory_bytes": int(knobs.kv_cache_memory_gib * 2**30) if knobs.kv_cache_memory_gib else None,
        "max_model_len": knobs.max_model_len,
        "tensor_parallel_size": knobs.tensor_parallel_size,
        "compilation_config": {"cudagraph_mode": knobs.cudagraph_mode} if knobs.cudagraph_mode else None,
    }
    return {k: v for k, v in args.items() if v is not None}


def preload(kind: EngineKind) -> None:
    """Import what starting an engine of `kind` imports (vLLM, torch: tens of seconds on a GPU machine),
    so that a machine's engine host does it before its turn to start an engine, not during it."""
    if kind in ("vllm", "vllm-control"):
        from jex.engine.vllm_engine import VLLMProfile, import_vllm

        import_vllm(VLLMProfile(batch_invariant=kind == "vllm"))
    elif kind == "openai":
        import openai  # noqa: F401
    elif kind in ENGINE_KINDS:
        import torch  # noqa: F401
        import transformers  # noqa: F401
