"""What an engine actually applied, read back after it started, and where that differs from what was asked.

vLLM resolves several settings itself at start (a CUDA-graph mode the attention backend cannot run is
lowered, chunked prefill follows the scheduler, the dtype follows the checkpoint), so the settings a spec
asked for are not proof of what ran. `vllm_effective` reads them from the started engine's own config
(`LLM.llm_engine.vllm_config`, and the model runner's resolved CUDA-graph mode where the engine core runs
in this process, as the audit profile's `VLLM_ENABLE_V1_MULTIPROCESSING=0` makes it); `hf_effective` is the
HF engine's. `asked_problems` compares them with what the engine was asked for, one line per setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import JsonValue, ValidationError

from jex.engine_identity import EffectiveSettings
from jex.engine_spec import EngineSpec, VLLMSettings


def _name(value: Any) -> str | None:
    """An enum's name, a dtype's short name, a plain value as text; None stays None."""
    if value is None:
        return None
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    return str(value).removeprefix("torch.")


def _get(root: Any, *paths: str) -> Any:
    """The first attribute path (dotted) that resolves on `root`, else None (vLLM moves things between versions)."""
    for path in paths:
        value = root
        for part in path.split("."):
            value = getattr(value, part, None)
            if value is None:
                break
        if value is not None:
            return value
    return None


def _model_runner(llm: Any) -> Any:
    """The in-process engine core's model runner (None with a multiprocess engine core)."""
    return _get(llm, "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner",
                "llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner")


def _attention_backends(runner: Any) -> list[str]:
    """The attention backends the model runner's layers use, by name (sorted, unique)."""
    names: set[str] = set()
    for group in [g for groups in (getattr(runner, "attn_groups", None) or []) for g in groups]:
        backend = getattr(group, "backend", None)
        get_name = getattr(backend, "get_name", None)
        if callable(get_name):
            names.add(str(get_name()))
    return sorted(names)


def vllm_effective(llm: Any) -> EffectiveSettings:
    """The settings a started `vllm.LLM` runs with (a field vLLM does not expose here stays None)."""
    config = _get(llm, "llm_engine.vllm_config")
    runner = _model_runner(llm)
    backends = _attention_backends(runner) if runner is not None else []
    invariant: bool | None
    try:
        from vllm.model_executor.layers import batch_invariant

        invariant = bool(batch_invariant.vllm_is_batch_invariant())
    except (ImportError, AttributeError):
        try:
            import vllm.envs

            invariant = bool(vllm.envs.VLLM_BATCH_INVARIANT)
        except (ImportError, AttributeError):
            invariant = None
    return EffectiveSettings(  # the backend from the layers only: the config holds what was asked, not what ran
        engine="vllm", attention_backend=",".join(backends) or None, vllm=_applied_knobs(config, runner),
        enforce_eager=_get(config, "model_config.enforce_eager"),
        prefix_caching=_get(config, "cache_config.enable_prefix_caching"),
        batch_invariant=invariant,
        dtype=_name(_get(config, "model_config.dtype")),
        kv_cache_dtype=_name(_get(config, "cache_config.cache_dtype")),
        quantization=_name(_get(config, "model_config.quantization")),
        chunked_prefill=_get(config, "scheduler_config.enable_chunked_prefill"),
        tensor_parallel_size=_get(config, "parallel_config.tensor_parallel_size"))


def _applied_knobs(config: Any, runner: Any) -> VLLMSettings | None:
    """vLLM's knobs as the started engine holds them (the CUDA-graph mode as its model runner resolved it);
    None when one that vLLM always sets could not be read, or a value falls outside the knob's declaration."""
    graph_mode = _get(runner, "compilation_config.cudagraph_mode") if runner is not None else None
    kv_bytes = _get(config, "cache_config.kv_cache_memory_bytes")
    read = {"max_num_seqs": _get(config, "scheduler_config.max_num_seqs"),
            "max_num_batched_tokens": _get(config, "scheduler_config.max_num_batched_tokens"),
            "gpu_memory_utilization": _get(config, "cache_config.gpu_memory_utilization"),
            "kv_cache_memory_gib": kv_bytes / 2**30 if kv_bytes else None,
            "max_model_len": _get(config, "model_config.max_model_len"),
            "tensor_parallel_size": _get(config, "parallel_config.tensor_parallel_size") or 1,
            "cudagraph_mode": _name(graph_mode if graph_mode is not None else
                                    _get(config, "compilation_config.cudagraph_mode"))}
    if None in (read["max_num_seqs"], read["gpu_memory_utilization"], read["cudagraph_mode"]):
        return None
    try:
        return VLLMSettings(**read)
    except ValidationError:
        return None


def hf_effective(model: Any, *, batch_invariant: bool) -> EffectiveSettings:
    """The HF engine's: its weights' dtype and its batching (no attention backend or graphs to resolve)."""
    dtype = next((p.dtype for p in model.parameters()), None) if model is not None else None
    return EffectiveSettings(engine="hf", dtype=_name(dtype), batch_invariant=batch_invariant,
                             attention_backend=_name(getattr(getattr(model, "config", None), "_attn_implementation",
                                                             None)))


def asked_problems(asked: Mapping[str, Any], effective: EffectiveSettings) -> list[str]:
    """One line per setting whose effective value differs from the one asked for (`asked`: field -> value;
    a None value is left to the engine and not compared here; a field the engine did not report is not
    compared either, and `EffectiveSettings.unread` names those)."""
    out = []
    for name, want in asked.items():
        if want is None:
            continue
        got = effective.value(name)
        if got is not None and _same(want, got) is False:
            out.append(f"{name}: asked {want!r}, the engine applied {got!r}")
    return out


BACKEND_VERSION_SUFFIX = "_vllm_v1"
"""A backend's name as some vLLM versions report it (`TRITON_ATTN_VLLM_V1` is TRITON_ATTN)."""


def _same(want: Any, got: Any) -> bool:
    """Equal, names compared without case or a `torch.` prefix; a backend reported with a version suffix
    (`TRITON_ATTN_VLLM_V1`) is the one asked."""
    if isinstance(want, str) and isinstance(got, str):
        a, b = want.lower().replace("torch.", ""), got.lower().replace("torch.", "")
        return all(part in (a, a + BACKEND_VERSION_SUFFIX) for part in b.split(","))
    return bool(want == got)


def asked_kernel(spec: EngineSpec) -> dict[str, JsonValue]:
    """The settings an engine of `spec` is asked to run with that change its batching or kernels: what a
    settings audit covers (`flows/machines/audit.py: audit_key`); for vLLM the audit profile's fixed ones
    (attention backend, prefix caching, eager mode, KV-cache dtype, tensor parallel) and the spec's."""
    if spec.kind.startswith("vllm"):
        from jex.engine.factory import vllm_profile

        p = vllm_profile(spec)
        return {"engine": "vllm", "profile": spec.profile, "attention_backend": p.attention_backend,
                "prefix_caching": p.enable_prefix_caching,
                "enforce_eager": p.enforce_eager, "dtype": p.dtype, "kv_cache_dtype": p.kv_cache_dtype,
                "tensor_parallel_size": p.settings.tensor_parallel_size, "cudagraph_mode": p.settings.cudagraph_mode,
                "max_num_batched_tokens": p.settings.max_num_batched_tokens}
    return {"engine": "hf", "profile": spec.profile, "dtype": spec.dtype or "float32",
            "batch_invariant": spec.kind == "hf"}


def vllm_asked(profile: Any) -> dict[str, Any]:
    """What a `VLLMProfile` asks vLLM for, by `EffectiveSettings.value` name (None: left to vLLM): the profile's
    own settings, and every knob as the spec set it (the scheduler width at its default when unset)."""
    knobs = profile.settings.model_dump() | {"max_num_seqs": profile.settings.scheduler_seqs()}
    return {"attention_backend": profile.attention_backend, "prefix_caching": profile.enable_prefix_caching,
            "batch_invariant": profile.batch_invariant, "enforce_eager": profile.enforce_eager,
            "dtype": profile.dtype, **knobs}
