"""Speculative decoding only with a per-run exactness proof; the early-exit checkpoint probe."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from jex.engine.types import EngineDeadError
from jex.engine.vllm_engine import NGRAM, VLLMProfile
from jex.engine_identity import EngineFingerprint, RenderDigest
from jex.tasks.capture.spec_proof import proof_sample, prove
from jex.tasks.records import RationaleTokens, ReasonSummary


def test_speculation_is_refused_under_the_audit_name_and_allowed_only_under_its_own(tmp_path):
    with pytest.raises(EngineDeadError, match="speculative decoding is not part of the audited path"):
        VLLMProfile(speculative_config=NGRAM).check(tmp_path)
    VLLMProfile(name="audit-ngram", speculative_config=NGRAM).check(tmp_path)  # allowed
    with pytest.raises(EngineDeadError, match="keeps every other audit setting.*enforce_eager"):
        VLLMProfile(name="audit-ngram", speculative_config=NGRAM, enforce_eager=True).check(tmp_path)
    with pytest.raises(EngineDeadError, match="speculates by 'ngram'"):
        VLLMProfile(name="audit-ngram", speculative_config={"method": "eagle"}).check(tmp_path)


def test_proof_sample_takes_the_gated_golden_rows_then_each_catalog_in_turn():
    gated = pl.DataFrame({"run_id": ["a1", "a2", "a3", "b1", "b2", "g1"],
                          "catalog": ["a", "a", "a", "b", "b", "a"]})
    assert proof_sample(gated, golden_ids=["g1", "zz"], rows=4) == ["a1", "a2", "b1", "g1"]  # in gate order
    assert proof_sample(gated, golden_ids=["g1"], rows=0) == ["g1"]  # the golden rows, whatever `rows` says


FP = EngineFingerprint(kind="hf", engine_version=1, weights_sha256="cd" * 32, tokenizer_sha256="ef" * 32,
                       device_type="cpu", renderer=RenderDigest(version="jex-render/2", sha256="01" * 32))


def _reasoned(path: Path, tokens: dict[str, list[int]]) -> ReasonSummary:
    pl.DataFrame({"run_id": list(tokens), "token_ids": list(tokens.values())},
                 schema={"run_id": pl.String, "token_ids": pl.List(pl.Int64)}).write_parquet(path)
    return ReasonSummary(key=path.stem, sha256=path.stem, reasoned=str(path), rows=len(tokens), shards=1,
                         rationale_tokens=RationaleTokens(mean=0.0, max=0, hit_max_tokens=0), engine=FP,
                         compute_seconds=2.0)


def test_the_proof_names_the_first_differing_row_and_token(tmp_path):
    spec = _reasoned(tmp_path / "s.parquet", {"r1": [5, 6, 7], "r2": [1, 2, 3, 4], "r3": [9]})
    same = _reasoned(tmp_path / "b1.parquet", {"r1": [5, 6, 7], "r2": [1, 2, 3, 4]})
    proof = prove(spec, same, profile="audit-ngram")
    assert (proof.exact, proof.rows_checked, proof.tokens_compared, proof.first_difference) == (True, 2, 7, None)
    off = _reasoned(tmp_path / "b2.parquet", {"r1": [5, 6, 7], "r2": [1, 2, 8, 4]})
    proof = prove(spec, off, profile="audit-ngram")
    assert not proof.exact and proof.rows_differing == 1
    assert proof.first_difference.model_dump() == {"run_id": "r2", "token_index": 2, "speculative_token": 3,
                                                    "base_token": 8}
    shorter = _reasoned(tmp_path / "b3.parquet", {"r1": [5, 6]})
    assert prove(spec, shorter, profile="audit-ngram").first_difference.speculative_token == 7


def test_bakeoff_counts_speculative_tokens_identical_to_the_audited_arm_and_the_speed_up():
    from jex.lab.bakeoff import speculation
    from jex.tasks.capture.invariance import ArmResult, RungComparison

    def arm(tokens, tok_s):
        return ArmResult(rungs={"1": RungComparison(
            mismatches=0, divergent_prompts=0, first_divergence=None, run_to_run_identical=True, tok_s=tok_s,
            tokens=sum(map(len, tokens)), seconds=[1.0], token_ids=tokens)})

    out = speculation({"vllm-bi": arm([[1, 2, 3], [4, 5]], 100.0), "vllm-bi-ngram": arm([[1, 2, 3], [4, 6]], 50.0)})
    r = out["vllm-bi-ngram"].rungs["1"]
    assert (r.tokens_identical, r.tokens, r.prompts_identical, r.speedup) == (4, 5, 1, 0.5)
    assert out["vllm-bi-ngram"].exact is False


def test_hf_next_token_rank_and_logprob_match_a_plain_forward(embedded_model_dir):
    import torch

    from jex.engine.hf import HFEngine
    from jex.engine.types import NextTokenRequest

    engine = HFEngine(embedded_model_dir)
    prompt = engine.chat_prompt("Name a colour.")
    cont = tuple(engine.encode("Blue"))
    eos = engine.tokenizer.eos_token_id
    stats = engine.next_token([NextTokenRequest("x", prompt, cont, (eos,))])[0]
    with torch.inference_mode():
        logits = engine.model(torch.tensor([engine.encode(prompt) + list(cont)])).logits[0, -1].double()
    lp = torch.log_softmax(logits, -1)
    assert stats.logprobs[0] == pytest.approx(float(lp[eos]), abs=1e-4)  # masked vs plain forward (FACTS.md)
    assert stats.ranks[0] == int((lp > lp[eos]).sum()) + 1


# --- campaigns (slow) ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    from jex.sample_suite import write_sample_suite

    return write_sample_suite(tmp_path_factory.mktemp("spec") / "suite", rows=18, seed=3)


def _campaign(suite, out: Path, **engine):
    from jex.engine_spec import EngineSpec
    from jex.flows.campaign import run_campaign
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    spec = CampaignSpec(name="spec", suite=str(suite), coverage=0.34, reason_max_tokens=8, bootstrap_draws=50,
                        engine=EngineSpec(**engine), spec_proof_rows=4, store=str(out / "store"), out=str(out),
                        machines=MachinesSpec(provider="inprocess"))
    return run_campaign(spec)


@pytest.mark.slow
def test_an_exact_speculative_profile_is_kept_with_its_proof_in_the_report(tiny_suite, tmp_path, prefect_harness):
    run = _campaign(tiny_suite, tmp_path, profile="audit-ngram")
    proof = json.loads((run / "spec_proof.json").read_text())
    # every gated row of an 18-row suite is a golden row (the first 64), so all of them are proven
    assert (proof["exact"], proof["fell_back"], proof["rows_differing"]) == (True, False, 0)
    assert proof["rows_checked"] >= 4
    assert proof["tokens_compared"] > 0
    assert "**Exact**: the speculative rationales are kept." in (run / "report.md").read_text()
    stages = json.loads((run / "stages.json").read_text())
    reason = json.loads((Path(stages["reason"]["folder"]) / "_SUCCESS.json").read_text())
    assert reason["engine"]["profile"] == "audit-ngram"


@pytest.mark.slow
def test_a_perturbed_speculative_engine_fails_the_proof_and_the_campaign_falls_back(tiny_suite, tmp_path,
                                                                                   prefect_harness, monkeypatch):
    import dataclasses

    import jex.tasks.capture.stages as engine_stages
    from jex.tasks.execution.engine_pool import get_engine

    class PerturbOneToken:
        """A test double: the speculative engine, except that one generated token is changed."""

        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def generate(self, requests):
            gens = self.engine.generate(requests)
            g = gens[0]
            return [dataclasses.replace(g, token_ids=(g.token_ids[0] + 1, *g.token_ids[1:])), *gens[1:]]

    monkeypatch.setattr(engine_stages, "get_engine",
                        lambda spec: PerturbOneToken(get_engine(spec)) if spec.profile != "audit" else get_engine(spec))
    run = _campaign(tiny_suite, tmp_path, profile="audit-ngram")
    proof = json.loads((run / "spec_proof.json").read_text())
    assert (proof["exact"], proof["fell_back"]) == (False, True)
    assert proof["first_difference"]["token_index"] == 0
    assert "Not exact: the reason stage was recomputed with the audited base profile" in (run / "report.md").read_text()
    stages = json.loads((run / "stages.json").read_text())
    reason = json.loads((Path(stages["reason"]["folder"]) / "_SUCCESS.json").read_text())
    assert reason["engine"]["profile"] is None  # the rationales the campaign used are the audited base's


@pytest.mark.slow
def test_early_exit_probe_reports_the_gate_and_every_checkpoint(tiny_suite, tmp_path, prefect_harness):
    from typer.testing import CliRunner

    from jex.cli import app

    result = CliRunner().invoke(app, ["probe", "early-exit", "--suite", str(tiny_suite), "--rows", "3", "--every",
                                      "4", "--max-tokens", "12", "-o", str(tmp_path / "probe"), "--tau", "0",
                                      "--tau", "1000", "--k", "1", "--provider", "inprocess"])
    assert result.exit_code == 0, result.output
    probe = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert [c["tokens"] for c in probe["checkpoints"]] == [4, 8, 12]
    last = probe["checkpoints"][-1]  # no rationale is longer than 12 tokens: cutting there changes nothing
    assert (last["agreement_with_full"], last["flips"], last["accuracy"]) == (1.0, 0, probe["full_accuracy"])
    assert probe["gate_checkpoints"] == sum(c["still_thinking"] for c in probe["checkpoints"])
    assert 0 <= probe["gate_fire_rate"] <= 1
    assert (tmp_path / "probe" / "probe.png").stat().st_size > 1000
    assert not (tmp_path / "probe" / "machines.json").exists()  # in this process (on a machine: test_lab_jobs.py)
    never = probe["stable_margin"][1]  # no margin exceeds 1000 log-odds: every row keeps its whole rationale
    assert [(e["tau"], e["k"]) for e in probe["stable_margin"]] == [(0.0, 1), (1000.0, 1)]
    assert (never["exited"], never["tokens_saved"], never["accuracy"]) == (0, 0, probe["full_accuracy"])


@pytest.mark.slow
def test_a_speculative_campaign_on_local_machines_proves_itself_and_reports_machine_seconds(
        tiny_suite, tmp_path, prefect_harness, monkeypatch):
    """The default provider (`local`): the proof and the speculative stage are two machine jobs whose keys
    both sides compute alike, and the seconds the machines spent come back into the stage summaries."""
    import sys

    from jex.engine_spec import EngineSpec
    from jex.flows.campaign import run_campaign
    from jex.lab.experiment_report import stage_summaries
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    for k, v in {"JEX_INFRA__STATE_DIR": str(tmp_path / "infra"), "JEX_INFRA__POLL_S": "0.3",
                 "JEX_INFRA__WORKER_PYTHON": sys.executable}.items():
        monkeypatch.setenv(k, v)
    spec = CampaignSpec(name="spec-local", suite=str(tiny_suite), coverage=0.12, reason_max_tokens=4,
                        bootstrap_draws=20, engine=EngineSpec(profile="audit-ngram"), spec_proof_rows=1,
                        store=str(tmp_path / "store"), out=str(tmp_path),
                        machines=MachinesSpec(provider="local", golden_rows=2))
    run = run_campaign(spec)
    proof = json.loads((run / "spec_proof.json").read_text())
    assert (proof["exact"], proof["fell_back"]) == (True, False) and proof["tokens_compared"] > 0
    assert proof["speculative_tokens_per_s"] > 0 and proof["base_tokens_per_s"] > 0  # seconds came back
    s = stage_summaries(run)
    assert s.fast_pass.computed_shards == [] and s.fast_pass.computed_rows == 18  # computed there, merged here
    stages = json.loads((run / "stages.json").read_text())
    (machine,) = json.loads((run / "machines.json").read_text())["machines"]
    jobs = {j["job"]: j for j in machine["jobs"]}
    assert set(jobs) == {"golden", "fast_pass", "reason", f"reason-{stages['spec_proof']['key'][:8]}"}
    for name, summary in (("fast_pass", s.fast_pass), ("reason", s.reason)):
        assert 0 < summary.compute_seconds <= jobs[name]["seconds"], name  # the machine's, within its job's time
    proved = json.loads((Path(stages["spec_proof"]["folder"]) / "_SUCCESS.json").read_text())
    assert proved["engine"]["profile"] is None and proved["engine_start_seconds"] > 0  # the base engine's own start
    calls = json.loads((run / "engine_calls.json").read_text())["calls"]
    assert calls["fast_pass"] == 1 and calls["reason"] == 2  # the speculative stage and the proof


def test_on_machines_the_proof_and_the_fallback_are_jobs_of_their_own_keyed_alike_on_both_sides(tmp_path,
                                                                                               monkeypatch):
    """The fleet's view of a speculative campaign's three reason jobs (no machine started): the audited
    base's jobs carry the fleet's measured fingerprint made audited, a machine reading the job file computes
    the key the orchestrator expects, and no two keys share a job name (a job's folder on the machine)."""
    from jex.engine_spec import EngineSpec
    from jex.flows.machines.fleet import GpuFleet
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.inputs import EngineJob, ReasonInputs
    from jex.tasks.records import BundleSummary, GateSummary

    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(tmp_path / "infra"))
    fleet = GpuFleet(MachinesSpec(provider="local"), campaign="c", store=str(tmp_path / "store"), echo=lambda s: None)
    fleet.engine = EngineSpec(profile="audit-ngram")
    fleet.engine_fp = FP.model_copy(update={"profile": "audit-ngram"})
    bundle = BundleSummary(key="b", sha256="b" * 64, bundle="b.tar.gz", rows=18)
    gated, sample = (GateSummary(key=k, sha256=k * 64, gated=f"{k}.parquet", rows=2) for k in ("g", "s"))

    def job(gate, engine):
        return fleet._measured(EngineJob(inputs=ReasonInputs(bundle=bundle, gate=gate, engine=engine, max_tokens=4),
                                         store=str(tmp_path / "store")))

    speculative, proof, fallback = job(gated, fleet.engine), job(sample, fleet.engine.audited_base()), \
        job(gated, fleet.engine.audited_base())
    assert speculative.inputs.engine_fp.profile == "audit-ngram"
    assert proof.inputs.engine_fp == fallback.inputs.engine_fp == fleet.engine_fp.audited()
    keys = [j.inputs.key() for j in (speculative, proof, fallback)]
    assert len(set(keys)) == 3
    for j in (speculative, proof, fallback):  # what `jex stage run --args` reads on the machine
        assert EngineJob.model_validate_json(j.with_paths(store="store", bundle="in/b").model_dump_json()) \
            .inputs.key() == j.inputs.key()
    names = [fleet._job_name("reason", k) for k in keys]
    assert names == ["reason", f"reason-{keys[1][:8]}", f"reason-{keys[2][:8]}"]
    assert fleet._job_name("reason", keys[0]) == "reason"
