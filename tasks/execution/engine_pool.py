"""Engines for the stages: one per spec per process, loaded only when a stage really runs.

A stage's cache key needs the engine's fingerprint (`jex.engine.fingerprint`), computed from the
spec and the model files without loading the model, so a fully cached campaign never loads one.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from pydantic import JsonValue

from jex.engine.base import TokenizedEngine
from jex.engine.vllm_engine import VLLM_PIN  # noqa: F401 - the flows' worker stack pins it
from jex.engine_identity import ArchitectureShape
from jex.engine_spec import EngineSpec

CALLS: Counter[str] = Counter()
"""Engine calls per stage in this process (tests use it to prove what a retry recomputed)."""
_ENGINES: dict[str, TokenizedEngine] = {}


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


def release_engine(spec: EngineSpec) -> None:
    """Let go of the engine `spec` names (a dead one: the next stage that needs it starts a new one)."""
    if _ENGINES.pop(spec.loaded_key(), None) is not None:
        import gc

        gc.collect()


def get_engine(spec: EngineSpec) -> TokenizedEngine:
    """This process's engine for `spec`, started on first use."""
    from jex.engine.factory import make_engine

    key = spec.loaded_key()
    if key not in _ENGINES:
        _ENGINES[key] = make_engine(spec)
    return _ENGINES[key]


def preload(spec: EngineSpec) -> None:
    """Import the engine's libraries without starting it (`engine.factory.preload`)."""
    from jex.engine.factory import preload as import_engine

    import_engine(spec.kind)


def compile_cache_key(engine: EngineSpec, machine: Mapping[str, JsonValue]) -> str:
    """The store key of an engine's compile cache on a kind of machine (`machine`: its GPU models, vLLM
    and Python): what compiled code depends on, so the engine fingerprint without its renderer and the
    scheduler's width, the model's architecture shape in place of its files, and the scheduler's token budget.
    vLLM keys its compiled graphs itself and compiles what its key says differs: a campaign that changes only
    the scheduler's width, or a fine-tune of the base that compiled (served through the same shape's link,
    `engine/shape_link.py`), restores the cache."""
    from jex.engine.fingerprint import engine_fingerprint
    from jex.tasks.keys import stage_key

    fp = engine_fingerprint(engine).key_doc()
    for identity in ("renderer", "max_num_seqs", "weights_sha256", "tokenizer_sha256", "hub"):
        fp.pop(identity, None)
    return stage_key("compile_cache", {"engine": fp, "shape": model_shape(engine).model_dump(mode="json"),
                                       "max_num_batched_tokens": engine.max_num_batched_tokens,
                                       "machine": dict(machine)})


def model_shape(engine: EngineSpec) -> ArchitectureShape:
    """The kernel shapes of the engine's model (its `config.json`, resolved as the engine would load it)."""
    from jex.engine.models import architecture_shape, resolve_model

    return architecture_shape(resolve_model(engine.model, Path(engine.cache_dir)).path)


def kernel_settings(engine: EngineSpec) -> dict[str, JsonValue]:
    """The settings the engine is asked to run with that change its batching or kernels (what an audit covers)."""
    from jex.engine.effective import asked_kernel

    return asked_kernel(engine)
