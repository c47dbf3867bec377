"""The audit profile refuses settings that break batch invariance (no GPU needed)."""

from __future__ import annotations

import pytest

from jex.engine.types import EngineDeadError
from jex.engine.vllm_engine import VLLMEngine, VLLMProfile


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("settings, words", [
    ({"enable_prefix_caching": True}, "prefix caching on"),
    ({"enforce_eager": True}, "1,889 of 3,072"),
    ({"batch_invariant": False}, "VLLM_BATCH_INVARIANT must be 1"),
    ({"attention_backend": "FLASHINFER"}, "TRITON_ATTN"),
    ({"speculative_config": {"method": "ngram"}}, "speculative"),
    ({"dtype": "float16"}, "bf16"),
    ({"cudagraph_mode": "PIECEWISE"}, "cudagraph_mode=PIECEWISE"),
])
def test_audit_profile_refuses(model, settings, words):
    with pytest.raises(EngineDeadError, match="audit profile refuses") as e:
        VLLMEngine(model, VLLMProfile.of(**settings))
    assert words in str(e.value) and "non-audited profile by name" in str(e.value)


def test_gguf_model_is_refused(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(EngineDeadError, match="GGUF kernels"):
        VLLMProfile().check(gguf)


def test_non_audited_profile_passes_the_check_by_name(model):
    VLLMProfile(name="control", batch_invariant=False, enforce_eager=True).check(model)


def test_unknown_profile_name_is_refused(model):
    with pytest.raises(EngineDeadError, match="unknown profile name"):
        VLLMProfile(name="fast").check(model)


def test_default_audit_profile_is_clean(model):
    assert VLLMProfile().violations(model) == []
    assert VLLMProfile().environment() == {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_a_campaigns_cudagraph_mode_reaches_vllm_and_the_engine_key(model):
    """The engine spec names the CUDA-graph mode (a campaign can follow a bake-off that chose it): vLLM's
    compilation config gets it, the audit checks it, and the fingerprint keys it only when it is set, so
    every key of a run on vLLM's default stays what it was."""
    from jex.engine.factory import vllm_profile
    from jex.engine.fingerprint import engine_fingerprint
    from jex.engine_spec import EngineSpec

    fdo = EngineSpec(kind="vllm", model=str(model), cudagraph_mode="FULL_DECODE_ONLY")
    assert vllm_profile(fdo).settings.cudagraph_mode == "FULL_DECODE_ONLY" and vllm_profile(fdo).violations(model) == []
    assert vllm_profile(fdo.model_copy(update={"cudagraph_mode": "PIECEWISE"})).violations(model) == [
        "cudagraph_mode=PIECEWISE: only the default and FULL_DECODE_ONLY were measured invariant"]
    (model / "model.safetensors").write_bytes(b"weights")
    default = engine_fingerprint(fdo.model_copy(update={"cudagraph_mode": None})).key_doc()
    assert "cudagraph_mode" not in default
    assert engine_fingerprint(fdo).key_doc() == {**default, "cudagraph_mode": "FULL_DECODE_ONLY"}


def test_tensor_parallel_reaches_vllm_and_keys_only_above_one_gpu(model):
    """`tensor_parallel_size` is a keyed knob: vLLM's `LLM(...)` gets it, the profile leaves the verdict to the
    settings audit (whose kernel settings name it), and the fingerprint holds it only above 1, so every key of a
    one-GPU engine stays what it was."""
    from jex.engine.effective import asked_kernel
    from jex.engine.factory import vllm_args, vllm_profile
    from jex.engine.fingerprint import engine_fingerprint
    from jex.engine_spec import EngineSpec

    tp2 = EngineSpec(kind="vllm", model=str(model), tensor_parallel_size=2)
    assert vllm_args(tp2.vllm)["tensor_parallel_size"] == 2 and vllm_profile(tp2).violations(model) == []
    assert asked_kernel(tp2)["tensor_parallel_size"] == 2 and asked_kernel(EngineSpec(kind="vllm"))[
        "tensor_parallel_size"] == 1
    (model / "model.safetensors").write_bytes(b"weights")
    one_gpu = engine_fingerprint(tp2.model_copy(update={"tensor_parallel_size": 1})).key_doc()
    assert "tensor_parallel_size" not in one_gpu
    assert engine_fingerprint(tp2).key_doc() == {**one_gpu, "tensor_parallel_size": 2}


def test_the_report_names_the_engines_span_and_a_control_engines_missing_guarantee(model):
    from jex.engine.fingerprint import engine_fingerprint
    from jex.engine_spec import EngineSpec
    from jex.tasks.outputs.report import engine_scope

    (model / "model.safetensors").write_bytes(b"weights")
    tp2 = EngineSpec(kind="vllm", model=str(model), tensor_parallel_size=2)
    assert engine_scope(engine_fingerprint(tp2.model_copy(update={"tensor_parallel_size": 1}))) == ""
    assert engine_scope(engine_fingerprint(tp2)) == " over 2 GPUs (tensor parallel)"
    control = engine_fingerprint(tp2.model_copy(update={"kind": "vllm-control"}))
    assert engine_scope(control) == " over 2 GPUs (tensor parallel) (**control: no batch-invariance guarantee**)"


def test_tensor_parallel_is_a_vllm_setting():
    from pydantic import ValidationError

    from jex.engine_spec import EngineSpec

    with pytest.raises(ValidationError, match="tensor_parallel_size is a vLLM setting; engine 'hf'"):
        EngineSpec(kind="hf", tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        EngineSpec(kind="vllm", tensor_parallel_size=0)


def test_cudagraph_mode_on_an_engine_without_cuda_graphs_is_refused():
    from pydantic import ValidationError

    from jex.engine_spec import EngineSpec

    with pytest.raises(ValidationError, match="cudagraph_mode is a vLLM setting; engine 'hf' has no CUDA graphs"):
        EngineSpec(kind="hf", cudagraph_mode="FULL_DECODE_ONLY")


def _has_cuda_vllm() -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # never import vllm here: batch invariance is set at import
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda_vllm(), reason="needs CUDA and vLLM (pip install 'jex[gpu]'); the H200 "
                    "results are in bench/results/, and the HF engine tests are this path's CPU twin")
def test_vllm_label_readout_is_batch_invariant(tmp_path):
    import os

    from jex.engine.types import ReadoutRequest

    engine = VLLMEngine(os.environ.get("JEX_TEST_VLLM_MODEL", "/tmp/smollm2"))
    reqs = [ReadoutRequest(f"r{i}", engine.chat_prompt(f"What is {i} + {i}?") + "Answer:", ("A", "B"), ("x", "y"))
            for i in range(40)]
    engine.batch_size = 1
    one = [r.raw_logprobs for r in engine.readout(reqs)]
    engine.batch_size = 40
    assert one == [r.raw_logprobs for r in engine.readout(reqs)]
