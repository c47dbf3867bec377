"""The engine's identity records: what an engine's numbers depend on (`EngineFingerprint`), with the
render digest and the Hub revision it holds. In the core, beside the engine spec (`engine_spec.py`), so
every room reads them from here: the stage inputs and summaries (`jex.tasks`), the fleet and its
`machines.json` (`jex.flows`), the report. Computing one from a spec and the model files is the engine
room's (`engine/fingerprint.py: engine_fingerprint`, with `ENGINE_VERSIONS` and the tokenizer's hash).

It is part of every engine stage's cache key (`key_doc`). It holds the weights' and the tokenizer's
content hashes, what the engine reads (the render digest), the engine's name and its numerics version,
the dtype, and the settings that change results (batch shape for `hf-batched`, vLLM's scheduler width
and context limit). It never holds library versions or jex's commit: those are provenance, recorded
beside every artifact (`jex/provenance.py`), so upgrading jex or a library never re-keys a capture.
"""

from __future__ import annotations

from pydantic import Field, JsonValue

from jex.engine_spec import EngineKind, VLLMSettings
from jex.record import Record

KERNEL_KNOBS = ("cudagraph_mode", "max_num_batched_tokens")
"""The vLLM knobs that change which kernels run at which shapes: what an audit's verdict depends on."""


class HubRevision(Record):
    """The Hub repository and commit a model folder was resolved from."""

    repo: str
    commit: str


class RenderDigest(Record):
    """`RenderSpec.digest()`: the renderer's version and the sha256 of every render setting."""

    version: str
    sha256: str


class EngineFingerprint(Record):
    """What an engine's numbers depend on. Equal fingerprints on equal inputs give equal bytes."""

    kind: EngineKind
    engine_version: int = Field(description="jex's numerics version of this engine kind (ENGINE_VERSIONS)")
    weights_sha256: str | None = Field(None, description="None: a served model (its weights are the server's)")
    tokenizer_sha256: str | None = Field(None, description="sha256 over the tokenizer files (TOKENIZER_FILES) "
                                                           "present; None: a served model")
    hub: HubRevision | None = None
    device_type: str
    renderer: RenderDigest
    dtype: str | None = None
    profile: str | None = Field(None, description="A speculative profile; None = the plain audit profile")
    batch_size: int | None = Field(None, description="hf-batched only: its numerics depend on the batch shape")
    max_num_seqs: int | None = Field(None, description="vLLM only")
    max_model_len: int | None = Field(None, description="vLLM only")
    cudagraph_mode: str | None = Field(None, description="vLLM only; None = vLLM's default")
    tensor_parallel_size: int | None = Field(None, description="vLLM only; None = 1 (one GPU per engine)")
    endpoint: str | None = Field(None, description="openai only: the server's scheme://host:port")
    served_model: str | None = Field(None, description="openai only: the model id as the server's /v1/models "
                                                       "reports it")
    served_revision: str | None = Field(None, description="openai only: the revision (or root) the server reports "
                                                          "for it, if any")

    def audited(self) -> EngineFingerprint:
        """The same engine under the plain audit profile. It keys every readout (fast pass, golden
        replay) of a speculative profile too: speculation changes only generation."""
        return self.model_copy(update={"profile": None})

    def key_doc(self) -> dict[str, JsonValue]:
        """The fingerprint as it enters a cache key (unset fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


__all__ = ["EngineFingerprint", "HubRevision", "RenderDigest"]


class ArchitectureShape(Record):
    """The shapes a model's kernels run at: what a batch-invariance audit depends on besides the GPU, the
    stack and the engine settings, and not the weights' values (a fine-tune shares its base's shape, so one
    audit covers both). Read from the model folder's `config.json` (`engine/models.py: architecture_shape`)."""

    architecture: str = Field(description="The config's first `architectures` entry, or its `model_type`")
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int | None = None
    vocab: int
    tied_embeddings: bool = False


class EffectiveSettings(Record):
    """What a started engine runs with, read back from it (`engine/effective.py`), not what was asked: the
    settings that decide its kernels and batching. A field the engine did not expose is None."""

    engine: str = Field(description="hf or vllm")
    attention_backend: str | None = None
    enforce_eager: bool | None = None
    prefix_caching: bool | None = None
    batch_invariant: bool | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = Field(None, description="The checkpoint's quantization as the engine applied it")
    chunked_prefill: bool | None = None
    tensor_parallel_size: int | None = None
    vllm: VLLMSettings | None = Field(None, description="vLLM's knobs as it applied them (the CUDA-graph mode it "
                                                        "resolved among them); None: not all could be read")

    def value(self, name: str) -> JsonValue:
        """A setting by name: one of this record's, or one of vLLM's knobs (None: not read)."""
        if name in VLLMSettings.knobs() and name not in EffectiveSettings.model_fields:  # its own field: as read
            return None if self.vllm is None else getattr(self.vllm, name)
        return getattr(self, name)

    def kernel_doc(self) -> dict[str, JsonValue]:
        """The settings an audit's verdict depends on: batching and kernels (of vLLM's knobs `KERNEL_KNOBS`;
        not the scheduler's width, which the audit's ladder covers, nor memory or the context limit)."""
        doc = self.model_dump(mode="json", exclude={"vllm"})
        doc |= {k: self.value(k) for k in KERNEL_KNOBS}
        return {k: v for k, v in doc.items() if v is not None}

    def unread(self) -> list[str]:
        return [name for name, value in self if value is None]
