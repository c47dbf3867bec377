"""The settings audit keyed by what it proves, never passing without power, and the engine's effective
settings read back (issue 54). The whole path through a machine's golden job is in test_machines.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jex.engine.effective import asked_problems
from jex.engine_identity import ArchitectureShape, EffectiveSettings
from jex.engine_spec import EngineSpec, VLLMSettings
from jex.flows.machines.audit import (
    AUDIT_FILE,
    CONTROL_KV_CACHE_GIB,
    SettingsAudit,
    SettingsNotAudited,
    SettingsUnproven,
    control_engine,
    effective_mismatch,
    judge_probe,
    plan_audit,
    stored_audit,
)

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
                "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                "vocab_size": 49152, "tie_word_embeddings": True}


def model_folder(root: Path, weights: bytes, **config) -> Path:
    """A model folder as the audit reads it: its config.json (the shape) and a weights file (not read)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **config}))
    (root / "model.safetensors").write_bytes(weights)
    return root


def shape_of(folder: Path) -> ArchitectureShape:
    from jex.engine.models import architecture_shape

    return architecture_shape(folder)


def plan(tmp_path: Path, folder: Path, **engine):
    spec = EngineSpec(model=str(folder), kind="vllm", device="cuda", **engine)
    from jex.tasks.execution import kernel_settings

    return plan_audit(spec, store_root=tmp_path / "store", gpus=["NVIDIA H100 80GB HBM3"], stack_lock="vllm==0.22.1\n",
                      shape=shape_of(folder), kernel=kernel_settings(spec), prompts=64, tokens=256)


def test_the_audit_key_is_the_architecture_shape_not_the_weights(tmp_path):
    base = model_folder(tmp_path / "base", b"weights of the base")
    tuned = model_folder(tmp_path / "tuned", b"the fine-tune's other weights")
    deeper = model_folder(tmp_path / "deeper", b"weights of the base", num_hidden_layers=32)
    assert shape_of(base) == shape_of(tuned) and shape_of(base).head_dim == 64
    assert plan(tmp_path, base).key == plan(tmp_path, tuned).key
    assert plan(tmp_path, base).key != plan(tmp_path, deeper).key


def test_settings_that_change_batching_or_kernels_are_in_the_key_and_the_width_is_not(tmp_path):
    base = model_folder(tmp_path / "base", b"w")
    key = plan(tmp_path, base).key
    assert plan(tmp_path, base, max_num_batched_tokens=4096).key != key
    assert plan(tmp_path, base, cudagraph_mode="FULL_DECODE_ONLY").key != key
    assert plan(tmp_path, base, dtype="float16").key != key
    assert plan(tmp_path, base, max_num_seqs=64).key == key  # the ladder covers the width: a wider audit serves
    assert plan(tmp_path, base, gpu_memory_utilization=0.5).key == key


def stored(tmp_path: Path, folder: Path, *, engine: dict | None = None, **fields) -> SettingsAudit:
    """A stored audit under the plan's key (what an earlier campaign's probe left)."""
    p = plan(tmp_path, folder, **(engine or {}))
    audit = SettingsAudit(**{"key": p.key, "arm": p.arm, "control": p.control, "gpus": p.gpus,
                             "stack_sha256": p.stack_sha256, "ladder": [1, 8, 16, 32, 64, 128, 256, 512],
                             "passed": True, "powered": True, "verdict": "INVARIANT", "folder": p.folder, **fields})
    Path(p.folder).mkdir(parents=True)
    (Path(p.folder) / AUDIT_FILE).write_text(audit.model_dump_json())
    return audit


def test_a_proven_audit_of_one_model_covers_another_of_its_shape(tmp_path):
    base = model_folder(tmp_path / "base", b"w")
    stored(tmp_path, base)
    got = plan(tmp_path, model_folder(tmp_path / "tuned", b"other"))
    assert got.probe is None and got.stored is not None and got.stored.reused and got.stored.status == "proven"


def test_an_unproven_audit_covers_nothing_and_is_probed_again_with_its_control(tmp_path):
    base = model_folder(tmp_path / "base", b"w")
    stored(tmp_path, base, powered=False)
    got = plan(tmp_path, base)
    assert got.probe is not None and got.probe.control is not None and got.probe.control.kind == "vllm-control"
    assert got.probe.scales == [1, 2, 4]


def test_a_wider_campaign_reuses_the_stored_power_and_probes_only_its_engine(tmp_path):
    base = model_folder(tmp_path / "base", b"w")
    stored(tmp_path, base, scale=2)
    got = plan(tmp_path, base, max_num_seqs=1024)
    assert got.probe is not None and got.probe.control is None and got.probe.scales == [2]
    assert max(got.probe.ladder) == 1024


@pytest.mark.parametrize(("audited_tp", "campaign_tp"), [(1, 2), (2, 1)])
def test_an_audit_at_one_tensor_parallel_size_never_covers_another(tmp_path, audited_tp, campaign_tp):
    base = model_folder(tmp_path / "base", b"w")
    stored(tmp_path, base, engine={"tensor_parallel_size": audited_tp})
    assert plan(tmp_path, base, tensor_parallel_size=audited_tp).probe is None
    got = plan(tmp_path, base, tensor_parallel_size=campaign_tp)
    assert got.probe is not None and got.kernel["tensor_parallel_size"] == campaign_tp
    assert got.probe.control is not None and got.probe.control.tensor_parallel_size == campaign_tp  # control beside it


def test_an_audit_over_several_gpus_says_so_in_its_line():
    audit = SettingsAudit(key="k", arm="vllm-bi", control="vllm-control", gpus=["H100", "H100"], stack_sha256="s",
                          ladder=[1, 8], passed=True, powered=True, verdict="INVARIANT", folder="f",
                          kernel={"engine": "vllm", "tensor_parallel_size": 2})
    assert "'vllm-bi' at tensor_parallel_size 2 on ['H100', 'H100']: PROVEN" in audit.line()
    assert "tensor_parallel_size" not in audit.model_copy(update={"kernel": {"tensor_parallel_size": 1}}).line()


def test_a_stored_failed_audit_refuses_before_any_probe(tmp_path):
    base = model_folder(tmp_path / "base", b"w")
    stored(tmp_path, base, passed=False, verdict="NOT INVARIANT: vllm-bi differ")
    with pytest.raises(SettingsNotAudited, match="not batch invariant"):
        plan(tmp_path, base)


@pytest.fixture(scope="module")
def quiet_probe(tmp_path_factory):
    """A probe on the CPU whose control cannot diverge (it is the invariant engine itself): run at every
    scale, the campaign's engine in this process and the control in its own."""
    from jex.tasks.capture.invariance import InvarianceProbe, probe_engine
    from jex.tasks.execution import get_engine

    out = tmp_path_factory.mktemp("probe")
    probe = InvarianceProbe(arm="hf-bi", control_arm="hf-control", control=EngineSpec(kind="hf"), prompts=2,
                            tokens=2, ladder=[1, 2], repeats=2, reference_prompts=1, scales=[1, 2])
    outcome = probe_engine(get_engine(EngineSpec(kind="hf", batch_size=2)), probe, out)
    return probe, outcome, out


@pytest.mark.slow
def test_a_quiet_control_lengthens_the_probe_to_its_last_scale(quiet_probe):
    probe, outcome, out = quiet_probe
    assert (outcome.scale, outcome.passed, outcome.powered) == (2, True, False)
    assert {p.name for p in out.glob("arm-*.json")} == {"arm-hf-bi.json", "arm-hf-control.json"}


def judged(tmp_path: Path, quiet_probe, mode: str, kernel: dict | None = None):
    from jex.flows.machines.audit import AuditPlan

    probe, _, out = quiet_probe
    folder = tmp_path / "store" / "bakeoff" / "k"
    p = AuditPlan(key="k", folder=str(folder), arm="hf-bi", control="hf-control", gpus=[], stack_sha256="s",
                  shape=ArchitectureShape(architecture="LlamaForCausalLM", layers=30, hidden=576, heads=9, kv_heads=3,
                                          head_dim=64, vocab=49152), kernel=kernel or {"engine": "hf"}, model=None,
                  probe=probe)
    shutil.copytree(out, tmp_path / "probe")
    return judge_probe(p, tmp_path / "probe", mode)  # type: ignore[arg-type]


@pytest.mark.slow
def test_an_unproven_audit_is_refused_where_the_audit_is_always_required(tmp_path, quiet_probe):
    with pytest.raises(SettingsUnproven, match="never diverged, even at 2x"):
        judged(tmp_path, quiet_probe, "always")
    kept = stored_audit(tmp_path / "store", "k")
    assert kept is not None and kept.status == "unproven" and not kept.covers(1)  # stored, covering nothing


@pytest.mark.slow
def test_an_unproven_audit_refuses_an_engine_over_several_gpus_even_in_auto_mode(tmp_path, quiet_probe):
    with pytest.raises(SettingsUnproven, match="tensor_parallel_size 2 runs only where proven"):
        judged(tmp_path, quiet_probe, "auto", kernel={"engine": "vllm", "tensor_parallel_size": 2})


@pytest.mark.slow
def test_an_unproven_audit_lets_an_auto_campaign_run_and_says_so(tmp_path, quiet_probe):
    audit = judged(tmp_path, quiet_probe, "auto")
    assert audit.status == "unproven" and audit.scale == 2
    assert audit.effective is not None  # read back from the campaign's engine
    assert (audit.effective.engine, audit.effective.dtype, audit.effective.batch_invariant) == ("hf", "float32", True)
    assert "UNPROVEN" in audit.line() and "UNDERPOWERED" in audit.verdict


def test_the_effective_settings_are_compared_with_what_was_asked():
    effective = EffectiveSettings(engine="vllm", attention_backend="TRITON_ATTN_VLLM_V1", prefix_caching=False,
                                  dtype="bfloat16", vllm=VLLMSettings(cudagraph_mode="PIECEWISE", max_num_seqs=512))
    asked = {"attention_backend": "TRITON_ATTN", "cudagraph_mode": "FULL_DECODE_ONLY", "prefix_caching": False,
             "dtype": "bfloat16", "max_num_seqs": 512, "max_model_len": None, "enforce_eager": False}
    assert asked_problems(asked, effective) == ["cudagraph_mode: asked 'FULL_DECODE_ONLY', the engine applied "
                                                "'PIECEWISE'"]
    assert asked_problems({**asked, "attention_backend": "FLASH_ATTN", "cudagraph_mode": None}, effective) == [
        "attention_backend: asked 'FLASH_ATTN', the engine applied 'TRITON_ATTN_VLLM_V1'"]


def test_a_machine_whose_engine_ran_otherwise_than_its_audit_is_named():
    audited = EffectiveSettings(engine="vllm", attention_backend="TRITON_ATTN", dtype="bfloat16",
                                vllm=VLLMSettings(cudagraph_mode="FULL_AND_PIECEWISE", max_num_seqs=512))
    audit = SettingsAudit(key="k", arm="vllm-bi", control="vllm-control", gpus=[], stack_sha256="s", ladder=[1, 8],
                          passed=True, powered=True, verdict="v", folder="f", effective=audited)
    same_but_narrower = audited.model_copy(update={"vllm": VLLMSettings(cudagraph_mode="FULL_AND_PIECEWISE",
                                                                      max_num_seqs=64)})
    assert effective_mismatch(audit, same_but_narrower) == []
    lowered = audited.model_copy(update={"vllm": VLLMSettings(cudagraph_mode="PIECEWISE", max_num_seqs=512)})
    assert effective_mismatch(audit, lowered) == ["cudagraph_mode: 'PIECEWISE', audited 'FULL_AND_PIECEWISE'"]


def test_a_campaign_that_changes_only_the_scheduler_width_restores_the_compile_cache(tmp_path):
    from jex.tasks.execution import compile_cache_key

    folder = model_folder(tmp_path / "m", b"w")
    machine = {"gpus": ["NVIDIA H100 80GB HBM3"], "vllm": "0.22.1", "python": "3.12.3"}

    def key(**engine):
        return compile_cache_key(EngineSpec(model=str(folder), kind="vllm", device="cuda", **engine), machine)

    assert key(max_num_seqs=512) == key(max_num_seqs=16)
    assert key(max_num_batched_tokens=4096) != key()  # the token budget shapes the compiled graphs
    assert key(cudagraph_mode="FULL_DECODE_ONLY") != key()


def test_a_fine_tune_restores_its_bases_compile_cache_and_another_shape_does_not(tmp_path):
    from jex.tasks.execution import compile_cache_key

    machine = {"gpus": ["NVIDIA H100 80GB HBM3"], "vllm": "0.22.1", "python": "3.12.3"}

    def key(folder: Path) -> str:
        return compile_cache_key(EngineSpec(model=str(folder), kind="vllm", device="cuda"), machine)

    base = model_folder(tmp_path / "base", b"weights of the base")
    assert key(model_folder(tmp_path / "tuned", b"the fine-tune's other weights")) == key(base)
    assert key(model_folder(tmp_path / "deeper", b"weights of the base", num_hidden_layers=32)) != key(base)


def test_models_of_one_shape_are_served_through_one_link_that_names_one_at_a_time(tmp_path):
    import threading

    from jex.engine.shape_link import served_by_shape

    base = model_folder(tmp_path / "base", b"weights of the base")
    tuned = model_folder(tmp_path / "tuned", b"the fine-tune's other weights")
    deeper = model_folder(tmp_path / "deeper", b"w", num_hidden_layers=32)
    links = tmp_path / "served"
    tuned_served = threading.Event()
    with served_by_shape(base, links) as served:
        assert served.parent == links and served.resolve() == base.resolve()
        with served_by_shape(deeper, links) as other:  # another shape: its own link, no wait
            assert other != served and other.resolve() == deeper.resolve()
        with served_by_shape(base, links) as again:  # the same model (another slot's start): no wait
            assert again == served

        def start_tuned() -> None:
            with served_by_shape(tuned, links) as link:
                assert link == served and link.resolve() == tuned.resolve()
                tuned_served.set()

        waiting = threading.Thread(target=start_tuned)
        waiting.start()
        assert not tuned_served.wait(0.5)  # the base's start still reads through the link
        assert served.resolve() == base.resolve()
    waiting.join(10)
    assert tuned_served.is_set()


def test_a_model_without_a_shape_is_served_by_its_own_path(tmp_path):
    from jex.engine.shape_link import served_by_shape

    folder = tmp_path / "no-config"
    folder.mkdir()
    with served_by_shape(folder, tmp_path / "served") as served:
        assert served == folder


@pytest.mark.slow
def test_a_control_that_fails_leaves_the_audit_unproven_and_says_why(tmp_path):
    from jex.tasks.capture.invariance import InvarianceProbe, probe_engine
    from jex.tasks.execution import get_engine

    broken = EngineSpec(kind="hf-batched", model=str(tmp_path / "no-such-model"))
    probe = InvarianceProbe(arm="hf-bi", control_arm="hf-control", control=broken, prompts=1, tokens=1, ladder=[1, 2],
                            reference_prompts=1, scales=[1, 2])
    outcome = probe_engine(get_engine(EngineSpec(kind="hf", batch_size=2)), probe, tmp_path / "probe")
    assert outcome.passed and outcome.powered is None and outcome.scale == 1  # nothing to lengthen for
    assert outcome.control_error is not None and "exited" in outcome.control_error


def test_an_invariant_arm_that_differs_is_not_invariant_even_with_a_quiet_control():
    from jex.lab.bakeoff import verdict
    from jex.tasks.capture.invariance import ArmResult, RungComparison

    def arm(mismatches: int) -> ArmResult:
        return ArmResult(rungs={"8": RungComparison(mismatches=mismatches, divergent_prompts=int(mismatches > 0),
                                                    first_divergence=None, run_to_run_identical=True, tok_s=1.0,
                                                    tokens=8, seconds=[1.0])})

    assert verdict({"hf-bi": arm(3), "hf-control": arm(0)}, ["hf-bi"], ["hf-control"]).startswith("NOT INVARIANT")
    assert verdict({"hf-bi": arm(0), "hf-control": arm(0)}, ["hf-bi"], ["hf-control"]).startswith("UNDERPOWERED")


def test_a_speculative_engine_is_audited_apart_from_its_base(tmp_path):
    base = model_folder(tmp_path / "base", b"w")
    plain, speculative = plan(tmp_path, base), plan(tmp_path, base, profile="audit-ngram")
    assert speculative.key != plain.key and speculative.arm == "vllm-bi-ngram"


def test_the_vllm_control_fixes_its_kv_cache_so_it_starts_beside_a_campaign_engine_holding_most_of_the_gpu():
    campaign = EngineSpec(kind="vllm", model="m", device="cuda", gpu_memory_utilization=0.9)
    control = control_engine(campaign)
    assert control.kind == "vllm-control" and control.kv_cache_memory_gib == CONTROL_KV_CACHE_GIB
    assert control.gpu_memory_utilization + campaign.gpu_memory_utilization <= 1.0
    assert not control.starts_alone()


def test_the_control_starts_with_the_architecture_inspections_the_campaign_engine_made(tmp_path):
    """vLLM inspects a model architecture once per cache folder (20 s on the H200 when it has no record); the
    control has a cache folder of its own, so it is seeded with the records the machine's engine slots made."""
    from jex.engine.compile_cache import MODELINFOS, cache_dir
    from jex.tasks.capture.invariance import InvarianceProbe, _start_control

    home = tmp_path / "engines"
    made = cache_dir(home, 0) / MODELINFOS / "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    made.parent.mkdir(parents=True)
    made.write_text('{"hash": "h", "modelinfo": {}}')
    probe = InvarianceProbe(arm="vllm-bi", control_arm="vllm-control", control=EngineSpec(kind="hf-batched"),
                            prompts=1, tokens=1, ladder=[1], engine_home=str(home))
    control = _start_control(probe, tmp_path / "probe")  # no probe request here: the process exits at once
    assert control.wait(timeout=120) != 0
    seeded = tmp_path / "probe" / "control-cache" / MODELINFOS / made.name
    assert seeded.read_text() == made.read_text()


def test_seeding_keeps_the_records_a_cache_folder_already_has(tmp_path):
    from jex.engine.compile_cache import MODELINFOS, cache_dir, seed_modelinfos

    home, control = tmp_path / "engines", tmp_path / "control-cache"
    for folder, text in ((cache_dir(home, 0), "slot 0"), (cache_dir(home, 1), "slot 1"), (control, "own")):
        (folder / MODELINFOS).mkdir(parents=True)
        (folder / MODELINFOS / f"{text.replace(' ', '')}.json").write_text(text)
    (cache_dir(home, 1) / MODELINFOS / "own.json").write_text("slot 1's")
    assert seed_modelinfos(control, home) == 2
    assert {p.name: p.read_text() for p in (control / MODELINFOS).iterdir()} == {
        "slot0.json": "slot 0", "slot1.json": "slot 1", "own.json": "own"}
    assert seed_modelinfos(control, home) == 0 and seed_modelinfos(control, tmp_path / "no-machine") == 0
