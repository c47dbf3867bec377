"""The per-sample record of a run (samples.parquet) and `jex show`, checked against the stages' own artifacts.

One main-job run (36 sample rows, in-process) is shared by the session (`main_job_run` in conftest).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from jex.cli import app
from jex.tasks.campaign_spec import CampaignSpec, load_spec
from jex.tasks.outputs.samples import SAMPLES_SCHEMA, read_samples, resolve_prompt_ref, sha256_text, write_samples
from jex.tasks.records import CampaignSummaries, FinishedCampaign

pytestmark = pytest.mark.slow


def summaries(run_dir: Path) -> FinishedCampaign:
    """The stage summaries the flow handed the report step, read back from the store."""
    stages = json.loads((run_dir / "stages.json").read_text())
    return CampaignSummaries.model_validate(
        {k: json.loads((Path(v["folder"]) / "_SUCCESS.json").read_text()) for k, v in stages.items()}).finished()


def spec_of(run_dir: Path) -> CampaignSpec:
    return load_spec(run_dir)


def by_id(frame: pl.DataFrame) -> dict[str, dict]:
    return {r["run_id"]: r for r in frame.iter_rows(named=True)}


def test_samples_record_equals_the_stage_artifacts_row_by_row(main_job_run):
    from jex.tasks.bundle.reading import bundle_rows
    from jex.tasks.capture.engine_calls import CaptureRow, question_prompts, reason_prompts
    from jex.tasks.capture.stages import fewshot_pool
    from jex.tasks.execution.engine_pool import get_engine
    from jex.tasks.store import LocalStore

    s, spec = summaries(main_job_run), spec_of(main_job_run)
    samples = read_samples(main_job_run)
    assert dict(samples.schema) == SAMPLES_SCHEMA
    store = LocalStore(spec.store)
    bundle = bundle_rows(s.bundle, store)
    assert samples["run_id"].to_list() == bundle["run_id"].to_list()  # every suite row, in suite order
    capture = by_id(pl.read_parquet(s.fast_pass.capture))
    gated = by_id(pl.read_parquet(s.gate.gated))
    reasoned = by_id(pl.read_parquet(s.reason.reasoned))
    folded = by_id(pl.read_parquet(s.fold.folded))
    preds = by_id(pl.read_parquet(s.overlay.predictions))
    assert 0 < len(gated) < len(capture)
    engine_spec = spec.engine
    engine = get_engine(engine_spec)  # the real engine the stages used: its renderer, its readout
    rows = [CaptureRow(r["run_id"], r["prompt"], tuple(r["labels"]), tuple(r["options"]), r["gold"], r["catalog"],
                      r["question_id"]) for r in bundle.iter_rows(named=True)]
    question = {q.run_id: q.prompt for q in question_prompts(engine, rows, engine_spec.render,
                                                             fewshot_pool(s.bundle, store, engine_spec))}
    thinking = [r for r in rows if r.run_id in gated]
    reason = dict(zip([r.run_id for r in thinking], reason_prompts(engine, thinking, engine_spec.render), strict=True))
    metadata = dict(pl.read_parquet(sorted((store.root / "bundle" / s.bundle.key / "extracted" / "rows")
                                           .glob("*.parquet"))).select("run_id", "metadata").iter_rows())
    for b, r in zip(bundle.iter_rows(named=True), samples.iter_rows(named=True), strict=True):
        rid = r["run_id"]
        assert r["metadata"] == metadata[rid]
        assert (r["catalog"], r["question_id"], r["options"], r["labels"], r["gold"]) == \
            (b["catalog"], b["question_id"], b["options"], b["labels"], b["gold"])
        assert r["prompt"] == question[rid] and r["prompt_sha256"] == sha256_text(question[rid])
        assert r["prompt_missing"] is None and r["prompt_ref"] is None
        assert r["label_logprobs"] == capture[rid]["logprobs"] and r["label_mass"] == capture[rid]["label_mass"]
        assert r["fast_refusal"] == capture[rid]["refusal"] and r["fast_choice"] == folded[rid]["fast_choice"]
        assert r["gated"] == (rid in gated) == folded[rid]["gated"]
        if rid in gated:
            assert r["gate_margin"] == gated[rid]["margin"] and r["reason_prompt"] == reason[rid]
            got = (r["rationale"], r["rationale_token_ids"], r["finish_reason"], r["post_logprobs"])
            assert got == (reasoned[rid]["rationale"], reasoned[rid]["token_ids"], reasoned[rid]["finish_reason"],
                           reasoned[rid]["post_logprobs"])
            assert r["rationale_tokens"] == len(reasoned[rid]["token_ids"]) > 0
        else:
            assert r["rationale"] is None and r["post_logprobs"] is None and r["reason_prompt"] is None
        assert (r["folded"], r["folded_logprobs"]) == (folded[rid]["folded"], folded[rid]["folded_logprobs"])
        assert (r["choice"], r["final_probs"], r["decided_by"]) == \
            (preds[rid]["choice"], preds[rid]["probs"], preds[rid]["stage"])
        assert r["correct"] == (preds[rid]["choice"] == b["gold"]) and r["scored"]
    # the recorded prompt is what the model read: reading it again gives the capture's log-probs
    from jex.engine.types import ReadoutMode, ReadoutRequest

    picked = samples.head(2).to_dicts()
    again = engine.readout([ReadoutRequest(r["run_id"], r["prompt"], tuple(r["labels"]), tuple(r["options"]))
                            for r in picked], ReadoutMode.LABEL_SLOT)
    assert [list(a.logprobs) for a in again] == [r["label_logprobs"] for r in picked]
    score = json.loads((main_job_run / "score.json").read_text())
    assert int(samples["correct"].sum()) == sum(c["correct"] for c in score["catalogs"].values())


def test_compact_samples_keep_the_hash_and_point_at_the_text(main_job_run, tmp_path):
    full = read_samples(main_job_run)
    write_samples(tmp_path, summaries(main_job_run), spec_of(main_job_run), prompts="sha256")
    compact = read_samples(tmp_path)
    assert compact["prompt"].null_count() == compact.height
    assert compact["prompt_sha256"].to_list() == full["prompt_sha256"].to_list()
    row = compact.filter(pl.col("gated")).row(0, named=True)
    text, reason = resolve_prompt_ref(row["prompt_ref"])
    original = full.filter(pl.col("run_id") == row["run_id"]).row(0, named=True)
    assert (text, reason) == (original["prompt"], original["reason_prompt"])
    assert compact.drop("prompt", "reason_prompt", "prompt_ref").equals(full.drop("prompt", "reason_prompt",
                                                                                  "prompt_ref"))


def test_prompt_is_null_with_a_reason_when_the_tokenizer_is_not_here(main_job_run, tmp_path):
    spec = spec_of(main_job_run)
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"model": str(tmp_path / "no-such-model")})})
    write_samples(tmp_path, summaries(main_job_run), spec)
    samples = read_samples(tmp_path)
    assert samples["prompt"].null_count() == samples.height and samples["prompt_sha256"].null_count() == samples.height
    assert samples["prompt_missing"].unique().to_list() == [samples["prompt_missing"][0]]
    assert "no-such-model" in samples["prompt_missing"][0] and "not available here" in samples["prompt_missing"][0]
    assert samples["label_logprobs"].to_list() == read_samples(main_job_run)["label_logprobs"].to_list()


def test_show_prints_only_the_wrong_rows_of_a_catalog(main_job_run):
    samples = read_samples(main_job_run)
    wrong = samples.filter(~pl.col("correct"))
    catalog = wrong["catalog"][0]
    expected = wrong.filter(pl.col("catalog") == catalog)["run_id"].to_list()
    result = CliRunner().invoke(app, ["show", str(main_job_run), "--catalog", catalog, "--wrong", "--prompt"])
    assert result.exit_code == 0, result.output
    shown = [line.split()[0] for line in result.output.splitlines() if line and not line.startswith(" ")][:-1]
    assert shown == expected
    assert "WRONG" in result.output and "prompt (what the engine read):" in result.output
    assert f"{len(expected)} of {samples.height} rows shown" in result.output


def test_show_limits_and_names_an_unknown_catalog(main_job_run):
    result = CliRunner().invoke(app, ["show", str(main_job_run), "--limit", "3"])
    assert result.exit_code == 0 and "3 of 36 rows shown" in result.output
    bad = CliRunner().invoke(app, ["show", str(main_job_run), "--catalog", "nope"])
    assert bad.exit_code == 1 and "no catalog 'nope' in this run" in bad.output
    missing = CliRunner().invoke(app, ["show", str(main_job_run.parent)])
    assert missing.exit_code == 1 and "no samples.parquet in this run folder" in missing.output


def test_results_table_ends_with_the_run_folder_and_json_holds_the_same_figures(main_job_run, capsys):
    import json

    from jex.cli.results import print_results

    print_results(main_job_run, "table")
    table = capsys.readouterr().out
    assert table.strip().splitlines()[-1] == str(main_job_run)
    assert "full index" in table and "95% CI" in table
    print_results(main_job_run, "quiet")
    assert capsys.readouterr().out.strip() == str(main_job_run)
    print_results(main_job_run, "json")
    doc = json.loads(capsys.readouterr().out)
    score = json.loads((main_job_run / "score.json").read_text())
    assert doc["full"] == score["full"] and {c["catalog"] for c in doc["catalogs"]} == set(score["catalogs"])


def test_parity_against_a_finished_run_meets_its_readouts_and_its_post_rationale_answers(main_job_run, tmp_path):
    """`jex parity --reference RUN`: one live engine against the run's capture and its rationales, rendered
    as the run rendered them and as long as they were allowed to be: the same engine agrees on every row,
    token for token (batch invariance: the run read them in shards, parity reads them alone)."""
    from jex.tasks.campaign_spec import CampaignSpec, sample_suite_dir

    spec = CampaignSpec.model_validate_json((main_job_run / "campaign.json").read_text())
    out = tmp_path / "parity"
    result = CliRunner().invoke(app, ["parity", "--suite", sample_suite_dir(spec), "--reference", str(main_job_run),
                                      "--reason-rows", "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "parity.json").read_text())
    readout, reasoned = doc["readout"], doc["reasoned"]
    assert (readout["common"], readout["flips"], readout["max_abs_dp"]) == (36, 0, 0.0)
    assert (reasoned["rows"], reasoned["identical_rationales"], reasoned["mismatches"]) == (3, 3, [])
    reasoned_ids = set(pl.read_parquet(summaries(main_job_run).reason.reasoned)["run_id"].to_list())
    assert pl.read_parquet(out / "parity-mismatches.parquet").height == 0 and len(reasoned_ids) >= 3
    assert "after the rationale 0 of 3 choices differ, 3 rationales identical" in result.output


def test_diff_lists_exactly_the_rows_whose_predictions_differ(main_job_run, tmp_path):
    """The main job against a run of the same bundle without reasoning (coverage 0: the fast pass's store
    reused): `jex diff` lists exactly the rows whose predictions differ, per catalog and which way."""
    from jex.flows.campaign import campaign
    from jex.tasks.campaign_spec import CampaignSpec

    spec = CampaignSpec.model_validate_json((main_job_run / "campaign.json").read_text())
    other = Path(campaign(spec.model_copy(update={"coverage": 0.0, "name": "no-reasoning",
                                                  "out": str(tmp_path / "runs")})))
    result = CliRunner().invoke(app, ["diff", str(main_job_run), str(other), "--json", "-o", str(tmp_path / "d.pq")])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    a, b = (pl.read_parquet(r / "predictions.parquet").select("run_id", "choice") for r in (main_job_run, other))
    both = a.join(b, on="run_id", suffix="_b")
    expected = set(both.filter(pl.col("choice") != pl.col("choice_b"))["run_id"].to_list())
    assert expected and {r["run_id"] for r in doc["rows_differing"]} == expected
    assert sum(c["differing"] for c in doc["catalogs"].values()) == doc["differing"] == len(expected)
    gold = dict(zip(*pl.read_parquet(main_job_run / "samples.parquet").select("run_id", "gold"), strict=True))
    for r in doc["rows_differing"]:
        want = "fixed" if r["choice_b"] == gold[r["run_id"]] else "broken" if r["choice_a"] == gold[r["run_id"]] \
            else "changed"
        assert r["way"] == want and r["decided_by_a"] != "fast_pass" or r["decided_by_b"] != "fast_pass"
    assert pl.read_parquet(tmp_path / "d.pq")["run_id"].to_list() == [r["run_id"] for r in doc["rows_differing"]]


def test_diff_refuses_runs_of_different_bundles_in_one_line(main_job_run, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(main_job_run, other)
    stages = json.loads((other / "stages.json").read_text())
    stages["bundle"]["key"] = "0" * 32  # as if it had read another bundle
    (other / "stages.json").write_text(json.dumps(stages))
    result = CliRunner().invoke(app, ["diff", str(main_job_run), str(other)])
    assert result.exit_code == 1 and "the runs read different bundles" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
