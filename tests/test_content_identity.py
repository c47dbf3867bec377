"""A capture's identity comes from its content: upgrading jex or a library re-runs nothing, while a
change to what the engine computes re-runs exactly the stages downstream of it (slow: real campaigns
with the embedded model on the default `local` provider)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jex.sample_suite import write_sample_suite
from jex.tasks.execution.engine_pool import CALLS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The session's Prefect test API."""


@pytest.fixture(scope="module")
def first_run(harness, tmp_path_factory):
    """One campaign on the default provider; returns its spec, run folder and stage keys."""
    from jex.flows.campaign import campaign
    from jex.tasks.campaign_spec import CampaignSpec

    root = tmp_path_factory.mktemp("identity")
    spec = CampaignSpec(name="id", suite=str(write_sample_suite(root / "suite", rows=18, seed=9)), coverage=0.2,
                        reason_max_tokens=4, bootstrap_draws=20, fast_shard_rows=9, reason_shard_rows=4,
                        store=str(root / "store"), out=str(root))
    assert spec.machines.provider == "local"
    run_dir = Path(campaign(spec))
    return spec, run_dir, _keys(run_dir), (run_dir / "predictions.parquet").read_bytes()


def _keys(run_dir: Path) -> dict[str, str]:
    return {k: v["key"] for k, v in json.loads((run_dir / "stages.json").read_text()).items()}


def _engine_calls(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "engine_calls.json").read_text())["calls"]


def test_an_upgrade_of_jex_and_its_libraries_reruns_no_engine_stage(first_run, monkeypatch):
    """The bundle is rebuilt under another jex version, commit and library versions: the same bytes, so
    the same keys downstream, 0 engine calls and byte-identical predictions."""
    import jex
    from jex import provenance
    from jex.flows.campaign import campaign

    spec, run_dir, keys, predictions = first_run
    monkeypatch.setattr(jex, "__version__", "99.0.0")
    monkeypatch.setattr(provenance, "git_commit", lambda: {"commit": "f" * 40, "dirty": False})
    monkeypatch.setattr(provenance, "package_versions",
                        lambda: {"polars": "99.0", "torch": "99.0", "transformers": "99.0", "vllm": None})
    CALLS.clear()
    again = Path(campaign(spec, redo=["bundle"]))
    assert again == run_dir and _keys(again) == keys
    assert _engine_calls(again) == {"fast_pass": 0, "reason": 0} and not CALLS
    assert (again / "predictions.parquet").read_bytes() == predictions
    bundle_provenance = json.loads((Path(json.loads((again / "stages.json").read_text())["bundle"]["folder"])
                                    / "_PROVENANCE.json").read_text())
    assert bundle_provenance["jex"]["version"] == "99.0.0" and bundle_provenance["packages"]["polars"] == "99.0"


DOWNSTREAM = {"fast_pass", "gate", "reason", "fold", "calibrate", "overlay", "score"}


def test_a_change_to_what_the_engine_reads_reruns_exactly_the_stages_downstream(first_run):
    """The engine stages re-run; a CPU stage re-runs when an input's bytes changed; the bundle never.
    (Weights, tokenizer, dtype and batch invariance reach the key the same way: tests/test_stage_inputs.py.)"""
    from jex.flows.campaign import campaign

    spec, _, keys, _ = first_run
    engine = spec.engine.model_copy(update={"render": spec.engine.render.model_copy(
        update={"system_prompt": "Answer briefly."})})
    changed = spec.model_copy(update={"engine": engine, "machines": spec.machines.model_copy(
        update={"provider": "inprocess"})})
    new_keys = _keys(Path(campaign(changed)))
    rerun = {stage for stage in keys if new_keys[stage] != keys[stage]}
    assert {"fast_pass", "reason"} <= rerun <= DOWNSTREAM
