"""The engine fingerprint, computed: what changes the numbers an engine computes, and nothing else.

The record (`EngineFingerprint`, with its `RenderDigest` and `HubRevision`) is the core's
(`jex/engine_identity.py`, where every room reads it from); here it is computed from an engine spec and
the model files (`engine_fingerprint`), with the engines' numerics versions (`ENGINE_VERSIONS`) and the
tokenizer's content hash. A library upgrade that does change the numbers is caught on every machine by
the golden replay (`tasks/capture/golden.py`: the replay must match the stored golden rows within 1e-4),
and jex bumps `ENGINE_VERSIONS` when it pins an engine library whose numerics differ.

Computed from the spec and the model files without loading the model, so a fully cached campaign
never loads one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from jex.engine_identity import EngineFingerprint, HubRevision, RenderDigest
from jex.engine_spec import EngineKind, EngineSpec

ENGINE_VERSIONS: dict[EngineKind, int] = {"hf": 2, "hf-batched": 1, "vllm": 1, "vllm-control": 1, "openai": 1}
"""Bump an engine's version by hand when its numerics change (its code, or a pinned library).
hf 2: CPU generation's linear layers in fixed 8-row products (`engine/hf_decode.py`), was batch-1 (M = 1)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
"""The files of a model folder that decide how text becomes token ids (and the chat template)."""


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

    if spec.is_served():  # no weights here: the server's identity as it reports it (one request, once per process)
        from jex.engine.openai_engine import served_fingerprint

        return served_fingerprint(spec)
    resolved = resolve_model(spec.model, Path(spec.cache_dir))
    vllm = spec.kind.startswith("vllm")
    return EngineFingerprint(
        kind=spec.kind, engine_version=ENGINE_VERSIONS[spec.kind], weights_sha256=weights_sha256(resolved.path),
        tokenizer_sha256=tokenizer_sha256(resolved.path),
        hub=HubRevision(repo=resolved.repo_id, commit=resolved.commit or "") if resolved.repo_id else None,
        device_type=spec.device.split(":")[0], renderer=RenderDigest(**spec.render.digest()), dtype=spec.dtype,
        profile=None if spec.profile == "audit" else spec.profile,
        batch_size=spec.requests_per_call() if spec.kind == "hf-batched" else None,
        **(spec.vllm.keyed() if vllm else {}))  # the vLLM knobs marked keyed (`VLLMSettings`), by their mark
