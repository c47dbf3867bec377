"""Will the model fit? GPU memory of a vLLM engine estimated from the model's `config.json`, before any
machine is rented.

One engine on one GPU gets `gpu_memory_utilization` x the GPU's memory (vLLM's budget, per engine
process). From it go the weights (parameters x bytes of the dtype, or the safetensors index's total
size rescaled to the dtype), the activation peak of one scheduler step and a fixed allowance for the
CUDA context and CUDA graphs; what is left is the KV cache. A model whose weights and overhead exceed
the budget cannot start; a KV cache smaller than 64 sequences of the reason stage's length
(prompt + reason max tokens) starves the invariant engine, which wants large batches
(`docs/engines.md`: the batch-invariance tax falls from ~2x to 1.16x at batch 64).

The weights estimate is checked against the measured H200 models (`bench/results/h200-real-size.json`):
an 8B- and a 14B-shaped model's safetensors bytes (`tests/test_memory_fit.py`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jex.engine_spec import VLLMSettings

GIB = 1 << 30
MIN_REASON_BATCH = 64
"""Sequences the reason stage should fit at once; below it the invariant engine runs at ~2x its tax."""
CONTEXT_OVERHEAD_GIB = 1.5
"""CUDA context, NCCL/cuBLAS workspaces and CUDA graphs of one vLLM engine (not in the profiled peak)."""
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
               "float8": 1, "fp8": 1, "float8_e4m3fn": 1}


class GpuKind(BaseModel):
    """A GPU a machine kind carries: its name and the memory the CUDA driver reports (what vLLM's
    `gpu_memory_utilization` is a share of)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    memory_gib: float = Field(gt=0, description="Total memory as `torch.cuda.mem_get_info` reports it, GiB")


GPU_KINDS = {k.name: k for k in (
    GpuKind(name="H200", memory_gib=139.80),  # 141 GB nominal; torch.cuda.mem_get_info total 150,109,880,320 B
)}
"""The GPU kinds measured here; settings add others (`JEX_INFRA__GPU_KINDS`, name -> GiB)."""


class ModelShape(BaseModel):
    """What memory depends on in a decoder's `config.json` (Llama, Qwen2, Mistral and alike)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    config_dtype: str | None = None
    """`torch_dtype` (or `dtype`) of the config: the weights' dtype on disk."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """The shape of a `config.json`; raises KeyError naming a missing field."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(hidden_size=hidden, num_hidden_layers=int(config["num_hidden_layers"]),
                   num_attention_heads=heads, num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                   config_dtype=config.get("torch_dtype") or config.get("dtype"))

    def parameters(self) -> int:
        """Parameters of a gated-MLP decoder: embeddings (twice unless tied), per layer attention
        (q, k, v, o and their biases when present), MLP (gate, up, down) and two norms, a final norm."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * layer + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Key and value of every layer for one token."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


class FitRequest(BaseModel):
    """One engine's memory question: which model, in which dtype, on which GPU, at which settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    shape: ModelShape
    dtype: str | None = Field(None, description="The engine's weights dtype; None or 'auto': the config's")
    weights_bytes_on_disk: int | None = Field(None, ge=0, description="The safetensors index's total_size, if any")
    gpu: GpuKind
    vllm: VLLMSettings = Field(VLLMSettings(), description="The engine's vLLM knobs (their defaults: the spec's; "
                                                          "an empty max_num_batched_tokens: VLLM_BATCHED_TOKENS)")
    reason_seq_tokens: int = Field(ge=1, description="Prompt + reason max tokens: the longest reason sequence")


class FitEstimate(BaseModel):
    """The answer, in GiB; `fits` is False when weights and overhead exceed the engine's budget."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpu: str
    budget_gib: float
    weights_gib: float
    overhead_gib: float
    kv_cache_gib: float
    kv_bytes_per_token: int
    reason_batch: int
    """Reason sequences of `reason_seq_tokens` the KV cache holds at once."""
    fits: bool
    refusal: str | None
    warning: str | None


def dtype_bytes(dtype: str | None, shape: ModelShape) -> int:
    """Bytes per weight of `dtype` ('auto'/None: the config's; unknown config dtype: 2)."""
    name = (dtype if dtype not in (None, "auto") else shape.config_dtype) or "bfloat16"
    return DTYPE_BYTES.get(str(name).lower().removeprefix("torch."), 2)


def estimate_fit(req: FitRequest) -> FitEstimate:
    """Weights, overhead and KV cache of one vLLM engine on `req.gpu`, and whether it fits (module docstring)."""
    shape, nbytes = req.shape, dtype_bytes(req.dtype, req.shape)
    if req.weights_bytes_on_disk:  # the index counts every tensor as stored: rescale to the engine's dtype
        weights = req.weights_bytes_on_disk * nbytes / dtype_bytes(None, shape)
    else:
        weights = shape.parameters() * nbytes
    tokens = req.vllm.scheduler_tokens()  # one step's activations: hidden states, gated MLP, fp32 logits
    activations = tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size) * nbytes + \
        min(req.vllm.scheduler_seqs(), tokens) * shape.vocab_size * 4
    overhead = activations + CONTEXT_OVERHEAD_GIB * GIB
    budget = req.gpu.memory_gib * req.vllm.gpu_memory_utilization * GIB
    kv = req.vllm.kv_cache_memory_gib * GIB if req.vllm.kv_cache_memory_gib else max(budget - weights - overhead, 0.0)
    per_token = shape.kv_bytes_per_token(nbytes)
    batch = int(kv // (per_token * req.reason_seq_tokens))
    fits = weights + overhead + (kv if req.vllm.kv_cache_memory_gib else 0) <= budget and kv > 0
    g = [round(x / GIB, 1) for x in (budget, weights, overhead, kv)]
    refusal = None if fits else (
        f"the model does not fit: model weights {g[1]} GiB + overhead {g[2]} GiB"
        f"{f' + KV cache {g[3]} GiB' if req.vllm.kv_cache_memory_gib else ''} > usable {g[0]} GiB on {req.gpu.name} "
        f"({req.gpu.memory_gib:g} GiB x gpu_memory_utilization {req.vllm.gpu_memory_utilization:g}); raise "
        f"gpu_memory_utilization, pick a larger GPU kind (JEX_INFRA__GPU_KIND) or a smaller dtype")
    warning = None if not fits or batch >= MIN_REASON_BATCH else (
        f"the KV cache left ({g[3]} GiB on {req.gpu.name}) holds {batch} reason sequences of "
        f"{req.reason_seq_tokens} tokens, below {MIN_REASON_BATCH}: the invariant engine runs slow at small "
        f"batches; raise gpu_memory_utilization or lower reason_max_tokens")
    return FitEstimate(gpu=req.gpu.name, budget_gib=g[0], weights_gib=round(weights / GIB, 2), overhead_gib=g[2],
                       kv_cache_gib=g[3], kv_bytes_per_token=per_token, reason_batch=batch, fits=fits,
                       refusal=refusal, warning=warning)


BESIDE_START_KV_SHARE = 0.5
"""A neighbour may start beside a profiling engine when its whole footprint is at most this share of the KV
cache that engine would get alone (`neighbour_fits_start`)."""


def neighbour_fits_start(shape: ModelShape, *, dtype: str | None, weights_bytes_on_disk: int | None, gpu: GpuKind,
                         engine: VLLMSettings, neighbour: VLLMSettings) -> bool:
    """Whether a second engine of the same model (its KV cache fixed: `neighbour`) may start while `engine`
    sizes its KV cache. vLLM counts every byte the GPU loses from its start to the end of its profiling as its
    own (`non_torch_increase` in vLLM's `memory_profiling`), a neighbour's weights and cache among them: the
    engine's KV cache shrinks by the neighbour's footprint, so that footprint must leave it most of its cache."""
    def fit(vllm: VLLMSettings) -> FitEstimate:
        return estimate_fit(FitRequest(shape=shape, dtype=dtype, weights_bytes_on_disk=weights_bytes_on_disk,
                                       gpu=gpu, vllm=vllm, reason_seq_tokens=1))

    alone, other = fit(engine), fit(neighbour)
    footprint = other.weights_gib + other.overhead_gib + other.kv_cache_gib
    return alone.fits and other.fits and footprint <= BESIDE_START_KV_SHARE * alone.kv_cache_gib
