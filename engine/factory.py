"""Engines by name: `hf` (batch-invariant reference), `hf-batched`, `vllm` (audit), `vllm-control`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINE_SPECS = ("hf", "hf-batched", "vllm", "vllm-control")


def make_engine(spec: str, *, model: str | Path | None = None, device: str = "cpu", batch_size: int = 8,
                cache_dir: Path | None = None, max_num_seqs: int = 32, dtype: str | None = None,
                gpu_memory_utilization: float = 0.30, max_model_len: int | None = None, profile: str = "audit",
                max_num_batched_tokens: int | None = None, kv_cache_memory_gib: float | None = None,
                **kw: Any) -> Any:
    """An engine by name; `dtype`, the memory settings and `max_model_len` reach vLLM's profile
    (which refuses what the audit does not allow), `dtype` also the HF engine. `profile` names an audit
    profile; a speculative one (`audit-ngram`) must be proven exact on each run (tasks/capture/spec_proof.py)."""
    from jex.engine.vllm_engine import AUDIT, SPECULATIVE_PROFILES

    if profile != AUDIT and profile not in SPECULATIVE_PROFILES:
        raise ValueError(f"unknown profile {profile!r}; use {AUDIT!r} or one of {tuple(SPECULATIVE_PROFILES)}")
    speculative = SPECULATIVE_PROFILES.get(profile)
    if spec in ("hf", "hf-batched"):
        from jex.engine.hf import DEFAULT_CACHE, HFEngine

        return HFEngine(model, device=device, batch_size=batch_size, batch_invariant=spec == "hf",
                        cache_dir=cache_dir or DEFAULT_CACHE, dtype=dtype or "float32", speculative=speculative,
                        **kw)
    if spec in ("vllm", "vllm-control"):
        from jex.engine.models import HUB_ID, resolve_hub
        from jex.engine.vllm_engine import VLLMEngine, VLLMProfile

        if model is None:
            raise ValueError("the vLLM engine needs --model: a dequantised bf16 model folder or a Hub id")
        if not Path(model).exists() and HUB_ID.match(str(model)):
            model = resolve_hub(str(model)).path
        # three keyword sets, each given only when it applies (a name given twice is still an error)
        by_dtype: dict[str, Any] = {"dtype": dtype} if dtype else {}
        by_profile: dict[str, Any] = {"name": profile, "speculative_config": speculative} if speculative else {}
        by_spec: dict[str, Any] = {"name": "control", "batch_invariant": False} if spec == "vllm-control" else {}
        settings = VLLMProfile(max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
                               max_num_batched_tokens=max_num_batched_tokens,
                               kv_cache_memory_bytes=int(kv_cache_memory_gib * 2**30) if kv_cache_memory_gib else None,
                               max_model_len=max_model_len, **by_dtype, **by_profile, **by_spec)
        return VLLMEngine(model, settings, batch_size=batch_size)
    raise ValueError(f"unknown engine {spec!r}; use one of {ENGINE_SPECS}")


def preload(spec: str) -> None:
    """Import what starting engine `spec` imports (vLLM, torch: tens of seconds on a GPU machine), so
    that a machine's engine host does it before its turn to start an engine, not during it."""
    if spec in ("vllm", "vllm-control"):
        from jex.engine.vllm_engine import VLLMProfile, import_vllm

        import_vllm(VLLMProfile(batch_invariant=spec == "vllm"))
    elif spec in ENGINE_SPECS:
        import torch  # noqa: F401
        import transformers  # noqa: F401
