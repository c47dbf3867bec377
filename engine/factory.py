"""Engines by name: `hf` (batch-invariant reference), `hf-batched`, `vllm` (audit), `vllm-control`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINE_SPECS = ("hf", "hf-batched", "vllm", "vllm-control")


def make_engine(spec: str, *, model: str | Path | None = None, device: str = "cpu", batch_size: int = 8,
                cache_dir: Path | None = None, max_num_seqs: int = 32, **kw: Any) -> Any:
    if spec in ("hf", "hf-batched"):
        from engine.hf import DEFAULT_CACHE, HFEngine

        return HFEngine(model, device=device, batch_size=batch_size, batch_invariant=spec == "hf",
                        cache_dir=cache_dir or DEFAULT_CACHE, **kw)
    if spec in ("vllm", "vllm-control"):
        from engine.vllm_engine import VLLMEngine, VLLMProfile

        if model is None:
            raise ValueError("the vLLM engine needs --model: a dequantised bf16 model folder")
        profile = VLLMProfile(max_num_seqs=max_num_seqs, **({"name": "control", "batch_invariant": False}
                                                            if spec == "vllm-control" else {}))
        return VLLMEngine(model, profile, batch_size=batch_size)
    raise ValueError(f"unknown engine {spec!r}; use one of {ENGINE_SPECS}")
