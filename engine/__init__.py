"""Inference only: a narrow protocol over our own request and result types.

No Prefect, SSH or S3 in here. `hf.HFEngine` is the reference (CPU or GPU, transformers);
`vllm_engine.VLLMEngine` is the production engine under the audit profile. Both import their heavy
libraries lazily, so `engine.types` and `engine.render` load anywhere.
"""

from jex.engine.types import (
    ContextRefusal,
    Engine,
    EngineDeadError,
    EngineError,
    FinishReason,
    GenerateRequest,
    Generation,
    NextTokenRequest,
    NextTokenStats,
    Readout,
    ReadoutMode,
    ReadoutRequest,
)

__all__ = ["ContextRefusal", "Engine", "EngineDeadError", "EngineError", "FinishReason", "Generation",
           "GenerateRequest", "NextTokenRequest", "NextTokenStats", "Readout", "ReadoutMode", "ReadoutRequest"]
