"""Will it fit? The memory pre-flight (`engine/memory.py`, `jex/cli/preflight.py`): weights estimated from
`config.json` as measured on the H200, a model too big for the machine's GPU refused before anything
starts with the numbers, a small KV cache warned about, the CPU default not estimated. Configs only, no
weights: runs on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jex.cli import app
from jex.cli.preflight import model_fits
from jex.engine.memory import GIB, GPU_KINDS, FitRequest, GpuKind, ModelShape, estimate_fit
from jex.engine_spec import EngineSpec, VLLMSettings

ROOT = Path(__file__).resolve().parent.parent
LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
"""Meta-Llama-3-8B's config.json dims."""
QWEN_2_5_14B = {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
                "num_key_value_heads": 8, "intermediate_size": 13824, "vocab_size": 152064,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
"""Qwen2.5-14B's config.json dims."""
VLLM_ON_CUDA = EngineSpec(kind="vllm", device="cuda", gpu_memory_utilization=0.9)


pytestmark = pytest.mark.usefixtures("no_user_settings")


def model_dir(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("shape", ["8b", "14b"])
def test_the_weights_estimate_is_the_measured_h200_models_size(shape):
    """`bench/results/h200-real-size.json`: the 8B and 14B shapes (SmolLM2 vocabulary) saved as bf16."""
    measured = json.loads((ROOT / "bench/results/h200-real-size.json").read_text())[shape]["model"]
    dims = {"8b": LLAMA_3_8B, "14b": {**QWEN_2_5_14B, "model_type": "llama"}}[shape]
    fit = estimate_fit(FitRequest(shape=ModelShape.from_config({**dims, "vocab_size": 49152}), gpu=GPU_KINDS["H200"],
                                  vllm=VLLMSettings(gpu_memory_utilization=0.85), reason_seq_tokens=150))
    assert abs(fit.weights_gib * GIB / measured["bytes"] - 1) < 0.01


def test_llama_3_8b_and_qwen_2_5_14b_weigh_15_and_27_5_gib_in_bf16():
    weights = [estimate_fit(FitRequest(shape=ModelShape.from_config(c), gpu=GPU_KINDS["H200"], reason_seq_tokens=150,
                                       vllm=VLLMSettings(gpu_memory_utilization=0.85))).weights_gib
               for c in (LLAMA_3_8B, QWEN_2_5_14B)]
    assert [round(w, 1) for w in weights] == [15.0, 27.5]


def test_a_model_too_big_for_the_gpu_kind_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("JEX_INFRA__GPU_KINDS", '{"TINY": 12}')
    monkeypatch.setenv("JEX_INFRA__GPU_KIND", "TINY")
    model = model_dir(tmp_path / "llama-3-8b", LLAMA_3_8B)
    result = CliRunner().invoke(app, ["run", "--model", str(model), "--engine", "vllm", "--device", "cuda",
                                      "--gpu-memory-utilization", "0.9", "--out", str(tmp_path / "runs")])
    assert result.exit_code != 0
    line = result.output.strip().splitlines()[-1]
    assert "model weights 15.0 GiB" in line and "usable 10.8 GiB on TINY" in line, result.output
    assert not (tmp_path / "runs").exists()


def test_a_model_that_fits_passes_without_a_warning(tmp_path):
    model = model_dir(tmp_path / "llama-3-8b", LLAMA_3_8B)
    engine = VLLM_ON_CUDA.model_copy(update={"model": str(model)})
    assert model_fits(engine, gpu_kind="H200", gpu_kinds={}, reason_max_tokens=437) is None


def test_a_kv_cache_below_64_reason_sequences_is_warned_about(tmp_path):
    """20 GiB x 0.9 = 18 GiB: 15 GiB of weights, 2.2 GiB overhead, 0.8 GiB of KV cache at 128 KiB a token:
    13 sequences of 86 + 437 tokens."""
    model = model_dir(tmp_path / "llama-3-8b", LLAMA_3_8B)
    engine = VLLM_ON_CUDA.model_copy(update={"model": str(model)})
    warning = model_fits(engine, gpu_kind="SMALL", gpu_kinds={"SMALL": 20.0}, reason_max_tokens=437)
    assert warning is not None and "below 64" in warning and "on SMALL" in warning


def test_the_cpu_default_is_not_estimated():
    """Not even the GPU kind is looked up: an unknown one would be refused."""
    assert model_fits(EngineSpec(), gpu_kind="NO-SUCH-GPU", gpu_kinds={}, reason_max_tokens=48) is None


def test_an_unknown_gpu_kind_is_refused_by_its_setting(tmp_path):
    from jex.errors import InputError

    engine = VLLM_ON_CUDA.model_copy(update={"model": str(model_dir(tmp_path / "m", LLAMA_3_8B))})
    with pytest.raises(InputError, match="JEX_INFRA__GPU_KIND.*unknown GPU kind 'B300'"):
        model_fits(engine, gpu_kind="B300", gpu_kinds={}, reason_max_tokens=48)


SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16"}
H100 = GpuKind(name="H100", memory_gib=79.19)  # torch.cuda.mem_get_info total on the bench's H100 80GB HBM3


@pytest.mark.parametrize(("config", "beside"), [(SMOLLM2_135M, True), (LLAMA_3_8B, False)])
def test_the_audit_control_starts_beside_the_campaign_engine_only_where_it_leaves_it_most_of_its_cache(config, beside):
    """vLLM counts what a neighbour allocates during its start as its own: the 8B's control (15 GiB of weights)
    would leave the campaign's engine at 0.3 of an H100 no KV cache, so it starts after it."""
    from jex.engine.memory import neighbour_fits_start
    from jex.flows.machines.audit import control_engine

    campaign = EngineSpec(kind="vllm", device="cuda")
    assert neighbour_fits_start(ModelShape.from_config(config), dtype="bfloat16", weights_bytes_on_disk=None, gpu=H100,
                                engine=campaign.vllm, neighbour=control_engine(campaign).vllm) is beside


def test_the_audit_control_of_an_hf_engine_always_starts_beside_it():
    from jex.flows.machines.audit import control_engine
    from jex.tasks.capture.invariance import control_beside_start

    campaign = EngineSpec(kind="hf", batch_size=2)
    assert control_beside_start(campaign, control_engine(campaign))
