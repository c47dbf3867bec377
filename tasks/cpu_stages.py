"""CPU stages of the campaign: gate, fold, calibrate, overlay, score; keyed and stored like the rest."""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path
from typing import Any

import polars as pl

from jex.fileio import sha256_file, write_json
from jex.overlays.apply import apply_overlays, reversibility_check
from jex.overlays.rules import OverlayRuleBase
from jex.tasks.keys import stage_key
from jex.tasks.probabilities.calibrate import calibrate
from jex.tasks.probabilities.coverage_gate import coverage_gate, margins
from jex.tasks.probabilities.fold import FoldRule, error_counters, error_rows, fold_counters, fold_predictions
from jex.tasks.scoring.inputs import load_suite_table
from jex.tasks.scoring.reference_audit import bundle_reference, reference_audit
from jex.tasks.scoring.score import score_with_ci
from jex.tasks.store import LocalStore, write_parquet


def _suite(bundle: dict[str, Any]):
    return _suite_table(bundle["bundle"], bundle["sha256"])


@functools.lru_cache(maxsize=4)
def _suite_table(path: str, sha256: str):
    """The scored rows of a bundle, read and verified once per process (keyed by content, not path alone)."""
    return load_suite_table(path)


def _panel(bundle: dict[str, Any], fast: dict[str, Any]) -> pl.DataFrame:
    rows = _suite(bundle).rows
    capture = pl.read_parquet(fast["capture"])
    return rows.join(capture, on="run_id", how="left", maintain_order="left")


def gate_stage(bundle: dict[str, Any], fast: dict[str, Any], store: LocalStore, *, coverage: float,
               per_catalog_cap: float | None = None, sample_every: int | None = None) -> dict[str, Any]:
    """Gate the panel; with `sample_every` = k, only a stratified sample is gated: the questions whose
    crc32(question_id) % k == 0 (about 1/k of every catalog, whole clusters)."""
    key = stage_key("gate", params={"coverage": coverage, "per_catalog_cap": per_catalog_cap,
                                    "sample_every": sample_every}, inputs={"fast_pass": fast["sha256"]})
    sd = store.stage("gate", key)
    if sd.complete:
        return sd.summary()
    panel = _panel(bundle, fast)
    if sample_every:
        keep = [zlib.crc32(q.encode()) % sample_every == 0 for q in panel["question_id"].to_list()]
        panel = panel.filter(pl.Series(keep))
    gated = coverage_gate(panel, coverage=coverage, per_catalog_cap=per_catalog_cap)
    write_parquet(gated, sd.path / "gated.parquet")
    return sd.finish({"stage": "gate", "key": key, "gated": str(sd.path / "gated.parquet"),
                      "sha256": sha256_file(sd.path / "gated.parquet"), "rows": gated.height,
                      "coverage": coverage, "panel_rows": panel.height,
                      "max_margin": gated["margin"].max() if gated.height else None})


def fold_stage(bundle: dict[str, Any], fast: dict[str, Any], gate: dict[str, Any], reason: dict[str, Any],
               store: LocalStore, *, rule: FoldRule, weight: float, draws: int, seed: int) -> dict[str, Any]:
    key = stage_key("fold", params={"rule": rule, "weight": weight, "draws": draws, "seed": seed},
                    inputs={"fast_pass": fast["sha256"], "gate": gate["sha256"], "reason": reason["sha256"]})
    sd = store.stage("fold", key)
    if sd.complete:
        return sd.summary()
    table = _suite(bundle)
    panel = _panel(bundle, fast)
    reasoned = pl.read_parquet(reason["reasoned"])
    gated = pl.read_parquet(gate["gated"])
    folded = fold_predictions(panel, reasoned, gated, rule=rule, weight=weight)
    counters = fold_counters(table.rows, folded, reasoned, table.spec, draws=draws, seed=seed)
    counters["errors"] = error_counters(fast, reason, unmatched=0)
    counters["error_rows"] = error_rows(panel, reasoned)
    counters["rule"] = {"rule": rule, "weight": weight}
    counters["rationale_tokens"] = reason["rationale_tokens"]
    write_parquet(folded, sd.path / "folded.parquet")
    write_json(sd.path / "fold.json", counters)
    return sd.finish({"stage": "fold", "key": key, "folded": str(sd.path / "folded.parquet"),
                      "sha256": sha256_file(sd.path / "folded.parquet"), "fold_json": str(sd.path / "fold.json"),
                      "errors": counters["errors"]})


def calibrate_stage(bundle: dict[str, Any], fold: dict[str, Any], store: LocalStore, *, folds: int) -> dict[str, Any]:
    key = stage_key("calibrate", params={"folds": folds}, inputs={"fold": fold["sha256"]})
    sd = store.stage("calibrate", key)
    if sd.complete:
        return sd.summary()
    rows = _suite(bundle).rows
    folded = pl.read_parquet(fold["folded"]).join(rows.select("run_id", "catalog", "question_id", "gold"),
                                                  on="run_id", how="left", maintain_order="left")
    answered = folded.filter(pl.col("folded_logprobs").is_not_null())
    calibrated, report = calibrate(answered, folds=folds)
    out = folded.join(calibrated.select("run_id", "calibrated_logprobs"), on="run_id", how="left",
                      maintain_order="left")
    write_parquet(out, sd.path / "calibrated.parquet")
    write_json(sd.path / "calibration.json", report)
    return sd.finish({"stage": "calibrate", "key": key, "calibrated": str(sd.path / "calibrated.parquet"),
                      "sha256": sha256_file(sd.path / "calibrated.parquet"),
                      "calibration_json": str(sd.path / "calibration.json")})


def overlay_stage(calibrated: dict[str, Any], store: LocalStore, *, rules: list[OverlayRuleBase],
                  rules_sha256: str | None) -> dict[str, Any]:
    key = stage_key("overlay", params={"rules": [r.record() for r in rules]},
                    inputs={"calibrate": calibrated["sha256"], "rules": rules_sha256 or "none"})
    sd = store.stage("overlay", key)
    if sd.complete:
        return sd.summary()
    base = pl.read_parquet(calibrated["calibrated"]).with_columns(
        stage=pl.when(pl.col("folded")).then(pl.lit("fold")).otherwise(pl.lit("fast_pass")),
        probs=pl.col("calibrated_logprobs").list.eval(pl.element().exp()))
    reversibility_check(base, apply_overlays(base, [])[0])
    frame, applied = apply_overlays(base, rules)
    predictions = frame.select("run_id", "choice", probs=pl.col("calibrated_logprobs").list.eval(pl.element().exp()),
                               stage="stage")
    if "abstain" in frame.columns:  # only when a rule set it: runs without one keep their bytes
        predictions = predictions.with_columns(frame["abstain"])
    write_parquet(predictions, sd.path / "predictions.parquet")
    return sd.finish({"stage": "overlay", "key": key, "predictions": str(sd.path / "predictions.parquet"),
                      "sha256": sha256_file(sd.path / "predictions.parquet"), "applied": applied})


def score_stage(bundle: dict[str, Any], overlay: dict[str, Any], fold: dict[str, Any], store: LocalStore, *,
                draws: int, seed: int) -> dict[str, Any]:
    key = stage_key("score", params={"draws": draws, "seed": seed},
                    inputs={"bundle": bundle["sha256"], "predictions": overlay["sha256"], "fold": fold["sha256"]})
    sd = store.stage("score", key)
    if sd.complete:
        return sd.summary()
    table = _suite(bundle)
    preds = pl.read_parquet(overlay["predictions"]).select(pl.exclude("stage"))  # run_id, choice, probs[, abstain]
    folded = pl.read_parquet(fold["folded"])
    policy = score_with_ci(table.rows, preds, table.spec, draws=draws, seed=seed)
    baseline = score_with_ci(table.rows, folded.select("run_id", choice="fast_choice",
                                                       probs=pl.col("logprobs").list.eval(pl.element().exp())),
                             table.spec, draws=draws, seed=seed)
    reference = bundle_reference(bundle["bundle"], bundle["sha256"])
    agreement = None
    if reference is not None:
        pre = folded.select("run_id", pre_margin=margins(folded["logprobs"]))
        fast = folded.select("run_id", choice="fast_choice", probs=pl.col("logprobs").list.eval(pl.element().exp()))
        final = pl.read_parquet(overlay["predictions"]).select("run_id", "choice", "probs")
        policy["reference_audit"] = reference_audit(reference, table.rows, fast=fast.join(pre, on="run_id"),
                                                    final=final.join(pre, on="run_id", how="left"))
        agreement = policy["reference_audit"]["final"]["argmax_agreement"]
    write_json(sd.path / "score.json", policy)
    write_json(sd.path / "baseline_score.json", baseline)
    return sd.finish({"stage": "score", "key": key, "score_json": str(sd.path / "score.json"),
                      "baseline_json": str(sd.path / "baseline_score.json"), "full": policy["full"],
                      "baseline_full": baseline["full"], "sha256": sha256_file(sd.path / "score.json"),
                      "reference_agreement": agreement, "reference": reference is not None})


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())
