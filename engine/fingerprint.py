"""The engine fingerprint: what changes the numbers an engine computes, and nothing else.

It is part of every engine stage's cache key. It holds the weights' and the tokenizer's content
hashes, what the engine reads (the render digest), the engine's name and its numerics version, the
dtype, and the settings that change results (batch shape for `hf-batched`, vLLM's scheduler width
and context limit). It never holds library versions or jex's commit: those are provenance, recorded
beside every artifact (`jex/provenance.py`), so upgrading jex or a library never re-keys a capture.
A library upgrade that does change the numbers is caught on every machine by the golden replay
(`tasks/capture/golden.py`: the replay must match the stored golden rows within 1e-4), and jex bumps
`ENGINE_VERSIONS` when it pins an engine library whose numerics differ.

Computed from the spec and the model files without loading the model, so a fully cached campaign
never loads one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import Field, JsonValue

from jex.engine_spec import EngineKind, EngineSpec
from jex.record import Record

ENGINE_VERSIONS: dict[EngineKind, int] = {"hf": 2, "hf-batched": 1, "vllm": 1, "vllm-control": 1}
"""Bump an engine's version by hand when its numerics change (its code, or a pinned library).
hf 2: CPU generation's linear layers in fixed 8-row products (`engine/hf_decode.py`), was batch-1 (M = 1)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
"""The files of a model folder that decide how text becomes token ids (and the chat template)."""


class HubRevision(Record):
    repo: str
    commit: str


class RenderDigest(Record):
    version: str
    sha256: str


class EngineFingerprint(Record):
    """What an engine's numbers depend on. Equal fingerprints on equal inputs give equal bytes."""

    kind: EngineKind
    engine_version: int = Field(description="jex's numerics version of this engine kind (ENGINE_VERSIONS)")
    weights_sha256: str
    tokenizer_sha256: str = Field(description="sha256 over the tokenizer files (TOKENIZER_FILES) present")
    hub: HubRevision | None = None
    device_type: str
    renderer: RenderDigest
    dtype: str | None = None
    profile: str | None = Field(None, description="A speculative profile; None = the plain audit profile")
    batch_size: int | None = Field(None, description="hf-batched only: its numerics depend on the batch shape")
    max_num_seqs: int | None = Field(None, description="vLLM only")
    max_model_len: int | None = Field(None, description="vLLM only")

    def audited(self) -> EngineFingerprint:
        """The same engine under the plain audit profile. It keys every readout (fast pass, golden
        replay) of a speculative profile too: speculation changes only generation."""
        return self.model_copy(update={"profile": None})

    def key_doc(self) -> dict[str, JsonValue]:
        """The fingerprint as it enters a cache key (unset fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


def tokenizer_sha256(folder: Path) -> str:
    """sha256 over the names and contents of the tokenizer files in a model folder."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).hexdigest().encode())
    return h.hexdigest()


def engine_fingerprint(spec: EngineSpec) -> EngineFingerprint:
    """The fingerprint of the engine `spec` names, from its files, without loading the model."""
    from jex.engine.models import resolve_model, weights_sha256

    resolved = resolve_model(spec.model, Path(spec.cache_dir))
    vllm = spec.kind.startswith("vllm")
    return EngineFingerprint(
        kind=spec.kind, engine_version=ENGINE_VERSIONS[spec.kind], weights_sha256=weights_sha256(resolved.path),
        tokenizer_sha256=tokenizer_sha256(resolved.path),
        hub=HubRevision(repo=resolved.repo_id, commit=resolved.commit or "") if resolved.repo_id else None,
        device_type=spec.device.split(":")[0], renderer=RenderDigest(**spec.render.digest()), dtype=spec.dtype,
        profile=None if spec.profile == "audit" else spec.profile,
        batch_size=spec.batch_size if spec.kind == "hf-batched" else None,
        max_num_seqs=spec.max_num_seqs if vllm else None, max_model_len=spec.max_model_len if vllm else None)
