"""Each concept is declared once, and every list that names it agrees with that declaration."""

from __future__ import annotations

import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = [p for room in ("jex", "engine", "tasks", "lab", "flows", "infra", "overlays", "deployments")
        for p in (ROOT / room).rglob("*.py")]


def files_saying(text: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in CODE if text in p.read_text())


def test_the_store_layout_is_written_down_once():
    assert files_saying('"_SUCCESS.json"') == ["jex/store_layout.py"]
    assert files_saying('"_PROVENANCE.json"') == ["jex/store_layout.py"]
    assert files_saying('"shards-') == ["jex/store_layout.py"]
    assert files_saying('"extracted"') == ["jex/store_layout.py"]


def test_the_campaign_stages_are_one_list():
    from jex.flows.campaign import STAGES
    from jex.flows.retry_stage import retry_stage
    from jex.run_records import STAGE_NAMES, ProofStageName, StageName
    from jex.tasks.records import CampaignSummaries

    assert STAGES == STAGE_NAMES == typing.get_args(StageName)
    assert set(CampaignSummaries.model_fields) == {*STAGE_NAMES, *typing.get_args(ProofStageName)}
    assert typing.get_type_hints(retry_stage.fn)["stage"] == StageName


def test_the_providers_are_one_list():
    from jex.cli import preflight
    from jex.settings import PROVIDER_NAMES, InfraSettings
    from jex.tasks.campaign_spec import MachinesSpec

    assert preflight.PROVIDERS == PROVIDER_NAMES
    for field in (MachinesSpec.model_fields["provider"], InfraSettings.model_fields["provider"]):
        assert typing.get_args(field.annotation) == PROVIDER_NAMES


def test_golden_and_proof_rows_each_come_from_one_constant():
    from jex.settings import GOLDEN_ROWS, PROOF_ROWS
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec
    from jex.tasks.inputs import ProofSampleInputs

    assert MachinesSpec().golden_rows == ProofSampleInputs.model_fields["golden_rows"].default == GOLDEN_ROWS
    assert CampaignSpec().spec_proof_rows == ProofSampleInputs.model_fields["rows"].default == PROOF_ROWS
    assert files_saying("golden_rows: int = Field(64") == []


def test_the_machine_budget_has_one_set_of_names():
    import dataclasses

    from jex.infra.machine import Policy
    from jex.settings import InfraSettings
    from jex.tasks.campaign_spec import MachinesSpec

    budget = {"budget_usd", "budget_hours", "price_per_hour", "heartbeat_timeout_s"}
    assert budget <= set(MachinesSpec.model_fields) & set(InfraSettings.model_fields)
    assert budget <= {f.name for f in dataclasses.fields(Policy)}
    assert files_saying("wall_budget_s") == []


def test_the_machine_stacks_are_the_projects_locks_written_from_its_constraints():
    """A machine's stack comes from lock files the project owns, as `make lock` writes them from
    constraints.txt, never from the orchestrator's installed versions; vLLM's pin agrees everywhere."""
    import tomllib

    from jex.engine.vllm_engine import VLLM_PIN
    from jex.infra.machine import ENGINE_PINS, STACK_LOCKS, render_stack_locks, stack_lock

    rendered = render_stack_locks((ROOT / "constraints.txt").read_text())
    assert {name: (ROOT / "infra" / name).read_text() for name in STACK_LOCKS.values()} == rendered
    assert stack_lock("hf") == rendered["stack-hf.lock"]
    assert stack_lock("vllm") == stack_lock("vllm-control") == rendered["stack-vllm.lock"]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert extra == [f"vllm=={VLLM_PIN}", "jex[cpu]"] and ENGINE_PINS["vllm"]["vllm"] == VLLM_PIN
    assert f"vllm=={VLLM_PIN}\n" in stack_lock("vllm") and "vllm==" not in stack_lock("hf")


def test_a_vllm_knob_is_one_field_and_one_line_of_the_factory():
    """Every vLLM knob is declared once (`VLLMSettings`: one default, one description, keyed or not); the
    engine spec carries it, `jex run` has its flag with its description as help, the fingerprint holds it
    iff it is keyed, an arm may change it, and `engine/factory.py` hands it to vLLM in one line."""
    import inspect

    from jex.cli.run import CAMPAIGN_FIELD_OF_FLAG, GENERATED_FLAGS, run, spec_help
    from jex.engine.factory import vllm_args
    from jex.engine_identity import EngineFingerprint
    from jex.engine_spec import EngineSpec, VLLMSettings
    from jex.lab.arms import ENGINE_SETTINGS

    knobs = VLLMSettings.knobs()
    assert {"max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_gib",
            "max_model_len", "cudagraph_mode"} <= set(knobs)
    assert set(VLLMSettings.keyed_knobs()) == {"max_num_seqs", "max_model_len", "cudagraph_mode",
                                               "tensor_parallel_size"}
    params = inspect.signature(run).parameters
    factory = inspect.getsource(vllm_args)
    for knob in knobs:
        field = VLLMSettings.model_fields[knob]
        assert field.description and EngineSpec.model_fields[knob].description == field.description
        assert EngineSpec.model_fields[knob].default == field.default
        assert CAMPAIGN_FIELD_OF_FLAG[knob] == GENERATED_FLAGS[knob] == f"engine.{knob}" and knob in params
        assert spec_help(f"engine.{knob}").startswith(field.description)
        assert knob in ENGINE_SETTINGS
        assert factory.count(f"knobs.{knob}") + factory.count(f'"{knob}"') >= 1, knob
    vllm_only = {n for n, f in EngineFingerprint.model_fields.items() if (f.description or "").startswith("vLLM only")}
    assert vllm_only == set(VLLMSettings.keyed_knobs())


def test_the_fingerprint_takes_the_keyed_knobs_by_their_mark(monkeypatch, tmp_path):
    from jex.engine import fingerprint
    from jex.engine_spec import VLLM_MAX_NUM_SEQS, EngineSpec, VLLMSettings

    spec = EngineSpec(kind="vllm", max_num_seqs=None, max_model_len=2048, max_num_batched_tokens=4096,
                      gpu_memory_utilization=0.5)
    assert spec.vllm.keyed() == {"max_num_seqs": VLLM_MAX_NUM_SEQS, "max_model_len": 2048, "cudagraph_mode": None,
                                 "tensor_parallel_size": None}  # one GPU: out of the key
    unkeyed = set(VLLMSettings.knobs()) - set(VLLMSettings.keyed_knobs())
    assert unkeyed and not unkeyed & set(spec.vllm.keyed())
    assert "spec.vllm.keyed()" in Path(fingerprint.__file__).read_text()


def test_the_vllm_defaults_are_not_restated():
    """One default per knob: the profile, the memory estimate and the bake-off take theirs from the record
    (the bake-off's and the estimate's own by a named constant), and old flat keys still load."""
    import dataclasses

    from jex.engine.memory import FitRequest
    from jex.engine.vllm_engine import VLLMProfile
    from jex.engine_spec import BAKEOFF_MAX_NUM_SEQS, EngineSpec, VLLMSettings
    from jex.lab.jobs import BakeoffJob

    assert not {f.name for f in dataclasses.fields(VLLMProfile)} & set(VLLMSettings.knobs())
    assert VLLMProfile().settings == VLLMSettings()
    assert not set(FitRequest.model_fields) & set(VLLMSettings.knobs())
    assert BakeoffJob().max_num_seqs == BAKEOFF_MAX_NUM_SEQS
    assert EngineSpec.model_validate({"max_num_seqs": 64}).vllm.max_num_seqs == 64  # a --spec [engine] table
    for literal in ("max_num_seqs: int = 32", "max_num_seqs: int = Field(", "max_num_seqs=256",
                    "gpu_memory_utilization: float = 0.30", "gpu_memory_utilization: float = Field(0.30",
                    "or 8192", "max_num_batched_tokens: int = Field(8192"):
        assert files_saying(literal) == [], literal


def test_the_machine_policy_and_the_budget_take_their_defaults_from_the_settings():
    import dataclasses

    from jex.flows.budget import BudgetSpec
    from jex.infra.machine import POLICY_SETTINGS, Policy
    from jex.infra.reaper import policy_from_settings
    from jex.settings import InfraSettings

    infra = InfraSettings()
    for f in dataclasses.fields(Policy):
        if f.name in InfraSettings.model_fields and f.name != "budget_hours":  # the policy's: no wall cap unless set
            assert f.default == InfraSettings.model_fields[f.name].default, f.name
    assert set(POLICY_SETTINGS) == {f.name for f in dataclasses.fields(Policy)} & set(InfraSettings.model_fields)
    changed = InfraSettings(poll_s=7.0, lease_s=11.0, budget_hours=3.0, price_per_hour=1.0)
    policy = policy_from_settings(changed)
    assert all(getattr(policy, name) == getattr(changed, name) for name in POLICY_SETTINGS)
    budget = BudgetSpec()
    assert (budget.price_per_gpu_hour, budget.budget_hours, budget.budget_usd) == \
        (infra.price_per_hour, infra.budget_hours, infra.budget_usd)
    for literal in ("price_per_hour: float = 3.5", "budget_usd: float = 100.0", "Field(3.5", "Field(72.0",
                    "72 * 3600", "lease_s: float = 900.0"):  # the machine's watchdog (no settings there) aside
        assert set(files_saying(literal)) <= {"jex/settings.py", "infra/watchdog.py"}, literal


def test_the_budget_projection_flags_are_its_records_fields():
    """`jex calibrate`'s flags are generated from `BudgetSpec`: the field's description is the help, its default
    the flag's, its range the check."""
    from typer.testing import CliRunner

    from jex.cli import app
    from jex.cli.run import CALIBRATE_FIELD_OF_FLAG
    from jex.tasks.campaign_spec import BudgetSpec

    shown = CliRunner().invoke(app, ["calibrate", "--help"], env={"COLUMNS": "400"}).output
    for flag, name in CALIBRATE_FIELD_OF_FLAG.items():
        field = BudgetSpec.model_fields[name]
        assert f"--{flag.replace('_', '-')}" in shown and str(field.description) in shown
    refused = CliRunner().invoke(app, ["calibrate", "--coverage", "1.5"])
    assert refused.exit_code == 1 and "--coverage" in refused.output
