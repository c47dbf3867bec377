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
    assert extra == [f"vllm=={VLLM_PIN}"] and ENGINE_PINS["vllm"]["vllm"] == VLLM_PIN
    assert f"vllm=={VLLM_PIN}\n" in stack_lock("vllm") and "vllm==" not in stack_lock("hf")
